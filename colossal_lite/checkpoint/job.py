"""What a training job's checkpoint carries about the job itself, so that ``--resume``,
``colossal-lite generate``, ``eval`` and ``export`` rebuild it from the directory alone.

``colossal-lite train`` saves ``extra=job_extra(config_path)``: the config's top-level
names (its ``_base_`` chain resolved, plain data) and the path it came from. No
communication.
"""
from __future__ import annotations

import os
import sys

import torch

from ..config import Config, ConfigError, _read_config_file, load_config

COMMON = 'common.pt'


def job_extra(config_path: str, **more) -> dict:
    """The ``extra`` a job's checkpoint holds: ``{'config': names, 'config_path': abs path,
    **more}``."""
    path = os.path.abspath(os.fspath(config_path))
    return dict(config=_read_config_file(path), config_path=path, **more)


def saved_extra(ckpt_dir: str):
    """The ``extra`` of a complete checkpoint directory (read on any rank, no collective)."""
    common = os.path.join(os.fspath(ckpt_dir), COMMON)
    if not os.path.isfile(common):
        raise FileNotFoundError(f'{ckpt_dir} is not a complete checkpoint (no {COMMON})')
    return torch.load(common, weights_only=False)['extra']


def job_config(ckpt_dir: str) -> Config:
    """The validated config of the job that wrote ``ckpt_dir``."""
    extra = saved_extra(ckpt_dir)
    if not isinstance(extra, dict) or 'config' not in extra:
        raise ConfigError(f'{ckpt_dir} was not written by colossal-lite train (its extra holds '
                          f'no job config)')
    folder = os.path.dirname(extra.get('config_path', ''))
    if extra['config'].get('imports') and folder and folder not in sys.path:
        sys.path.append(folder)  # the config's own modules, as load_config does for a file
    return load_config(dict(extra['config']))
