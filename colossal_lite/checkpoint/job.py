"""What a training job's checkpoint carries about the job itself, so that ``--resume``,
``colossal-lite generate``, ``eval`` and ``export`` rebuild it from the directory alone.

``colossal-lite train`` saves ``extra=job_extra(settings, config_path)``: the plain config
the run's settings were parsed from (``Settings.to_dict``: its ``_base_`` chain resolved;
the file is not run again) and the path it came from. No communication.
"""
from __future__ import annotations

import os
import sys
from typing import Optional

import torch

from ..config import ConfigError, Settings, load_config

COMMON = 'common.pt'


def job_extra(settings: Settings, config_path: Optional[str] = None, **more) -> dict:
    """The ``extra`` a job's checkpoint holds: ``{'config': plain config, 'config_path': abs
    path or None, **more}``."""
    path = os.path.abspath(os.fspath(config_path)) if config_path else None
    return dict(config=settings.to_dict(), config_path=path, **more)


def saved_extra(ckpt_dir: str):
    """The ``extra`` of a complete checkpoint directory (read on any rank, no collective)."""
    common = os.path.join(os.fspath(ckpt_dir), COMMON)
    if not os.path.isfile(common):
        raise FileNotFoundError(f'{ckpt_dir} is not a complete checkpoint (no {COMMON})')
    return torch.load(common, weights_only=False)['extra']


def job_settings(ckpt_dir: str) -> Settings:
    """The settings of the job that wrote ``ckpt_dir`` (parsed from the config it carries)."""
    extra = saved_extra(ckpt_dir)
    if not isinstance(extra, dict) or 'config' not in extra:
        raise ConfigError(f'{ckpt_dir} was not written by colossal-lite train (its extra holds '
                          f'no job config)')
    folder = os.path.dirname(extra.get('config_path') or '')
    if extra['config'].get('imports') and folder and folder not in sys.path:
        sys.path.append(folder)  # the config's own modules, as load_config does for a file
    return load_config(dict(extra['config'])).settings
