"""Mixed precision: torch autocast, naive fp16/bf16 with fp32 masters, NVIDIA apex when present.

:func:`build_amp` turns the config's ``fp16`` section into the strategy object the
Engine drives (see ``base.py`` for the protocol and ``docs/amp.md`` for formulas).
"""
from __future__ import annotations

from typing import Mapping, Optional

import torch

from .apex_amp import ApexAmp, apex_amp_module
from .base import FullPrecision, found_inf_anywhere
from .grad_scaler import DynamicGradScaler
from .naive_amp import NaiveAmp
from .torch_amp import TorchAmp

# fp16 config keys -> torch.amp.GradScaler arguments (mode 'torch' with float16 on CUDA)
_TORCH_SCALER_KEYS = {'initial_scale': 'init_scale', 'growth_factor': 'growth_factor',
                      'backoff_factor': 'backoff_factor', 'growth_interval': 'growth_interval'}
_SCALER_KEYS = ('initial_scale', 'growth_factor', 'backoff_factor', 'growth_interval',
                'hysteresis', 'min_scale', 'max_scale')


def build_amp(fp16: Optional[Mapping], model: torch.nn.Module,
              optimizer: torch.optim.Optimizer) -> FullPrecision:
    """The strategy for ``fp16`` (None: full precision). Naive mode casts ``model`` and
    re-points ``optimizer`` to fp32 master weights."""
    if not fp16:
        return FullPrecision(model, optimizer)
    mode = fp16.get('mode')
    dtype = getattr(torch, fp16.get('dtype', 'float16'))
    if mode == 'torch':
        return TorchAmp(model, optimizer, dtype, scaler_kwargs={
            _TORCH_SCALER_KEYS[k]: fp16[k] for k in _TORCH_SCALER_KEYS if k in fp16})
    if mode == 'naive':
        scaler = DynamicGradScaler(**{k: fp16[k] for k in _SCALER_KEYS if k in fp16})
        return NaiveAmp(model, optimizer, dtype, scaler)
    if mode == 'apex':
        return ApexAmp(model, optimizer)
    raise ValueError(f"fp16.mode must be 'torch', 'naive' or 'apex', got {mode!r}")


__all__ = ['ApexAmp', 'DynamicGradScaler', 'FullPrecision', 'NaiveAmp', 'TorchAmp',
           'apex_amp_module', 'build_amp', 'found_inf_anywhere']
