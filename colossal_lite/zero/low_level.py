"""Low-level ZeRO (stages 1 and 2) wired into the Engine's protocol.

:func:`build_low_level_zero` turns ``zero=dict(stage=1|2, ...)`` and the user's (elementwise)
optimizer into the two objects the Engine drives (``docs/zero.md``):

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

from typing import Tuple

import torch

from ..amp import DynamicGradScaler, FullPrecision, NaiveAmp, build_amp
from ..amp.base import found_inf_anywhere, has_inf_or_nan
from ..config import AmpSettings, ZeroSettings
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


def build_low_level_zero(settings: ZeroSettings, amp: AmpSettings, model: torch.nn.Module,
                         optimizer: torch.optim.Optimizer
                         ) -> Tuple[FullPrecision, ShardedGradientReducer]:
    """``(amp, gradient_handler)`` for ZeRO stage 1 or 2 (``model`` already on its device
    and equal on every replica)."""
    zero = ZeroOptimizer(optimizer, model, settings.stage, settings.bucket_bytes,
                         overlap=settings.overlap, offload=settings.offload_optimizer)
    return zero_amp(amp, model, zero), zero.reducer


def zero_amp(amp: AmpSettings, model: torch.nn.Module, zero) -> FullPrecision:
    """The precision strategy over a ZeRO optimizer (stages 1-3): :class:`ZeroNaiveAmp` for
    ``mode='naive'``, else the usual strategy of ``amp`` built on ``zero``."""
    if amp.mode == 'naive':
        scaler = DynamicGradScaler(**{k: amp.scaler[k] for k in _SCALER_KEYS if k in amp.scaler})
        return ZeroNaiveAmp(model, zero, getattr(torch, amp.dtype), scaler)
    return build_amp(amp.as_dict(), model, zero)
