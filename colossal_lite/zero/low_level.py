"""Low-level ZeRO (stages 1 and 2) wired into the Engine's protocol.

:func:`build_low_level_zero` turns ``zero=dict(stage=1|2, ...)`` and the user's Adam/AdamW
into the two objects the Engine drives (``docs/zero.md``):

* the gradient handler, a :class:`~colossal_lite.zero.reducer.ShardedGradientReducer`
  (``prepare(sync)`` / ``synchronize()``: bucketed reduce-scatter into the fp32 slices);
* the precision strategy, built on the :class:`~colossal_lite.zero.optimizer.ZeroOptimizer`
  instead of the user's optimizer: full precision and ``fp16=dict(mode='torch')`` are the
  usual strategies (the GradScaler unscales the slices' gradients, the inf/nan flag is
  made global, the step is skipped on every rank); ``mode='naive'`` is
  :class:`ZeroNaiveAmp` (half-precision model, the ZeRO slices are its fp32 masters).

Clipping needs nothing new: the Engine clips ``amp.grad_parameters()``, the slices,
whose placements cut them over the tensor modes and the reduce group, so
``engine/clip.py`` computes the serial model's norm from them.
"""
from __future__ import annotations

from typing import Mapping, Optional, Tuple

import torch

from ..amp import DynamicGradScaler, FullPrecision, NaiveAmp, build_amp
from ..amp.base import found_inf_anywhere, has_inf_or_nan
from .config import ZeroSettings, parse_zero
from .optimizer import ZeroOptimizer
from .reducer import ShardedGradientReducer

_SCALER_KEYS = ('initial_scale', 'growth_factor', 'backoff_factor', 'growth_interval',
                'hysteresis', 'min_scale', 'max_scale')


class ZeroNaiveAmp(NaiveAmp):
    """Naive fp16/bf16 under ZeRO: the model is cast to ``dtype`` after the ZeRO fp32 slices
    were taken from its fp32 weights; backward scales the loss by S (NaiveAmp's), the
    half-precision gradients are reduce-scattered, :meth:`unscale` divides the fp32 slices'
    gradients by S and agrees on inf/nan over every rank; the ZeRO step all-gathers the
    updated slices into the half-precision parameters."""

    def __init__(self, model: torch.nn.Module, optimizer: ZeroOptimizer, dtype: torch.dtype,
                 scaler: DynamicGradScaler):
        FullPrecision.__init__(self, model, optimizer)
        self.dtype, self.scaler = dtype, scaler
        model.to(dtype)

    def unscale(self) -> bool:
        inv = 1.0 / self.scaler.scale
        grads = [p.grad.mul_(inv) for p in self.grad_parameters() if p.grad is not None]
        return found_inf_anywhere(has_inf_or_nan(grads))

    grad_parameters = FullPrecision.grad_parameters
    step = FullPrecision.step
    zero_grad = FullPrecision.zero_grad


def build_low_level_zero(settings: ZeroSettings, fp16: Optional[Mapping], model: torch.nn.Module,
                         optimizer: torch.optim.Optimizer
                         ) -> Tuple[FullPrecision, ShardedGradientReducer]:
    """``(amp, gradient_handler)`` for ZeRO stage 1 or 2 (``model`` already on its device
    and equal on every replica)."""
    zero = ZeroOptimizer(optimizer, model, settings.stage, settings.bucket_bytes,
                         overlap=settings.overlap, offload=settings.offload_optimizer)
    return zero_amp(fp16, model, zero), zero.reducer


def zero_amp(fp16: Optional[Mapping], model: torch.nn.Module, zero) -> FullPrecision:
    """The precision strategy over a ZeRO optimizer (stages 1-3): :class:`ZeroNaiveAmp` for
    ``mode='naive'``, else the usual strategy of ``fp16`` built on ``zero``."""
    if (fp16 or {}).get('mode') == 'naive':
        scaler = DynamicGradScaler(**{k: fp16[k] for k in _SCALER_KEYS if k in fp16})
        return ZeroNaiveAmp(model, zero, getattr(torch, fp16.get('dtype', 'float16')), scaler)
    return build_amp(fp16, model, zero)


def check_zero(cfg: Mapping) -> Optional[ZeroSettings]:
    """The ``zero`` section's settings (None without one); raises for bad values
    (ConfigError) and for what is not built (NotImplementedError). No communication."""
    settings = parse_zero(cfg.get('zero'))
    if settings is None:
        return None
    if settings.stage == 3:
        from .chunk.engine import check_chunk_zero
        check_chunk_zero(cfg)
        return settings
    if (cfg.get('fp16') or {}).get('mode') == 'apex':
        raise NotImplementedError("fp16 mode 'apex' is not supported with ZeRO (apex amp keeps "
                                  "its own unsharded master weights); use mode 'torch' or 'naive'")
    return settings


def apply_zero(cfg: Mapping, model: torch.nn.Module, optimizer: torch.optim.Optimizer
               ) -> Optional[Tuple[FullPrecision, ShardedGradientReducer]]:
    """``(amp, gradient_handler)`` when the config has a ``zero`` section, else None."""
    settings = check_zero(cfg)
    if settings is None:
        return None
    if settings.stage == 3:
        from .chunk.engine import build_chunk_zero
        return build_chunk_zero(settings, cfg, model, optimizer)
    return build_low_level_zero(settings, cfg.get('fp16'), model, optimizer)
