"""The precision strategy interface the Engine drives, and the full-precision strategy.

An Engine step is, for every strategy::

    with amp.autocast(): out = model(*amp.cast_inputs(args)); loss = criterion(out, ...)
    amp.backward(loss)                 # loss (possibly scaled) -> model .grad
    <data-parallel gradient sync on the model's .grad>
    found_inf = amp.unscale()          # gradients the optimizer will read, inf/nan on any rank
    if not found_inf: clip(amp.grad_parameters()); amp.step()
    amp.update(found_inf)              # loss-scale bookkeeping
"""
from __future__ import annotations

import contextlib
from typing import Any, List

import torch
import torch.distributed as dist

from ..communication import collective as C
from ..context import ParallelMode, global_context as gpc


def found_inf_anywhere(local_found: bool) -> bool:
    """True on every rank when any rank saw inf/nan: one MAX all_reduce of a flag over GLOBAL."""
    flag = torch.tensor([1.0 if local_found else 0.0], device=gpc.device)
    return bool(C.all_reduce(flag, ParallelMode.GLOBAL, op=dist.ReduceOp.MAX).item() > 0)


def has_inf_or_nan(tensors) -> bool:
    """Whether any of ``tensors`` holds inf or nan (one host sync)."""
    flags = [torch.logical_not(torch.isfinite(t).all()) for t in tensors]
    return bool(torch.stack(flags).any().item()) if flags else False


def cast_floating(obj: Any, dtype: torch.dtype) -> Any:
    """Cast floating-point tensors in (nested tuples/lists/dicts of) ``obj`` to ``dtype``."""
    if torch.is_tensor(obj):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (tuple, list)):
        return type(obj)(cast_floating(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: cast_floating(v, dtype) for k, v in obj.items()}
    return obj


class FullPrecision:
    """No mixed precision: plain backward and optimizer step."""

    name = 'fp32'

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def autocast(self):
        return contextlib.nullcontext()

    def cast_inputs(self, obj):
        return obj

    def backward(self, loss: torch.Tensor):
        loss.backward()

    def unscale(self) -> bool:
        return False

    def grad_parameters(self) -> List[torch.Tensor]:
        """The tensors whose ``.grad`` the optimizer reads (clipping acts on them)."""
        return [p for group in self.optimizer.param_groups for p in group['params']]

    def step(self):
        self.optimizer.step()

    def update(self, found_inf: bool):
        pass

    def zero_grad(self):
        self.model.zero_grad(set_to_none=True)
        self.optimizer.zero_grad(set_to_none=True)

    @property
    def loss_scale(self) -> float:
        return 1.0

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict):
        pass
