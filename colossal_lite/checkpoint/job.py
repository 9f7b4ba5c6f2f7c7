"""What a training job's checkpoint carries about the job itself, so that ``--resume``,
``colossal-lite generate``, ``eval`` and ``export`` rebuild it from the directory alone.

``colossal-lite train`` saves ``extra=job_extra(settings, config_path)``: the plain config
the run's settings were parsed from (``Settings.to_dict``: its ``_base_`` chain resolved;
the file is not run again) and the path it came from, as plain data (``files.plain``: a
value a checkpoint cannot hold as data is named when the job starts). No communication.

A checkpoint is data; the modules its config names in ``imports`` are imported (as the
config file that named them did), looked up on ``sys.path`` and in the saved config's
folder -- never in the checkpoint directory, nor in a relative folder it names.
"""
from __future__ import annotations

import os
import sys
from typing import Optional

from ..config import ConfigError, Settings, load_config
from .files import COMMON, plain, read, resolve


def job_extra(settings: Settings, config_path: Optional[str] = None, **more) -> dict:
    """The ``extra`` a job's checkpoint holds: ``{'config': plain config, 'config_path': abs
    path or None, **more}``."""
    path = os.path.abspath(os.fspath(config_path)) if config_path else None
    return plain(dict(config=settings.to_dict(), config_path=path, **more), 'the job config')


def saved_extra(ckpt_dir: str):
    """The ``extra`` of a complete checkpoint directory (read as data on any rank, no
    collective; ``files.resolve`` finds one a crash left at ``ckpt_dir.old-<uuid>``)."""
    file = os.path.join(resolve(ckpt_dir), COMMON)
    common = read(file)
    if not isinstance(common, dict) or 'extra' not in common:
        raise ValueError(f'{file} is not the common state of a checkpoint (no extra)')
    return common['extra']


def job_settings(ckpt_dir: str) -> Settings:
    """The settings of the job that wrote ``ckpt_dir`` (parsed from the config it carries)."""
    extra = saved_extra(ckpt_dir)
    if not isinstance(extra, dict) or not isinstance(extra.get('config'), dict):
        raise ConfigError(f'{ckpt_dir} was not written by colossal-lite train (its extra holds '
                          f'no job config)')
    path = extra.get('config_path')
    folder = os.path.dirname(path) if isinstance(path, str) else ''
    if extra['config'].get('imports') and _config_folder(folder, ckpt_dir) \
            and folder not in sys.path:
        sys.path.append(folder)  # the config's own modules, as load_config does for a file
    return load_config(dict(extra['config'])).settings


def _config_folder(folder: str, ckpt_dir: str) -> bool:
    """Whether the saved config's folder may be searched for its ``imports``: an absolute
    path outside the checkpoint (whose files are data, never imported)."""
    if not os.path.isabs(folder):
        return False
    ckpt = os.path.realpath(resolve(ckpt_dir))
    inside = os.path.commonpath([os.path.realpath(folder), ckpt]) == ckpt
    return not inside
