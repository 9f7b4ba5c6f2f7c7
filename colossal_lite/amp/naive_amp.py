"""Naive mixed precision: fp16/bf16 model weights, fp32 master weights in the optimizer.

* ``__init__``: every optimizer parameter p gets an fp32 master copy m (same
  :class:`ShardSpec`, so clipping sees the layout); the optimizer's groups are
  re-pointed to the masters; then the model is cast to ``dtype``.
* forward: floating inputs are cast to ``dtype``; the model computes in ``dtype``
  (the losses upcast logits to fp32).
* backward: ``(S * loss).backward()`` with S the dynamic loss scale, so the model's
  half-precision gradients are S times the true ones (data-parallel sync runs on them).
* :meth:`unscale`: ``m.grad = fp32(p.grad) / S``; the step is skipped on every rank
  when any rank's unscaled gradients hold inf/nan (:func:`found_inf_anywhere`).
* :meth:`step`: optimizer step on the fp32 masters, then ``p <- dtype(m)``.
  A skipped step touches neither masters, model weights nor optimizer state.
"""
from __future__ import annotations

from typing import List

import torch

from ..tensor import param_placement, set_placement
from .base import FullPrecision, cast_floating, found_inf_anywhere, has_inf_or_nan
from .grad_scaler import DynamicGradScaler


class NaiveAmp(FullPrecision):
    name = 'naive'

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 dtype: torch.dtype = torch.float16, scaler: DynamicGradScaler = None):
        super().__init__(model, optimizer)
        if any(optimizer.state.values()):
            raise ValueError("fp16 mode 'naive' needs an optimizer that has not stepped yet "
                             "(its state would refer to the fp32 model weights)")
        self.dtype = dtype
        self.scaler = scaler or DynamicGradScaler()
        self.pairs = []
        masters = {}
        for group in optimizer.param_groups:
            new_params = []
            for p in group['params']:
                if id(p) not in masters:
                    master = torch.nn.Parameter(p.detach().clone().float(),
                                                requires_grad=p.requires_grad)
                    set_placement(master, param_placement(p))
                    masters[id(p)] = master
                    self.pairs.append((p, master))
                new_params.append(masters[id(p)])
            group['params'] = new_params
        model.to(dtype)

    def cast_inputs(self, obj):
        return cast_floating(obj, self.dtype)

    def backward(self, loss: torch.Tensor):
        (loss.float() * self.scaler.scale).backward()

    def unscale(self) -> bool:
        inv = 1.0 / self.scaler.scale
        grads = []
        for p, master in self.pairs:
            if p.grad is None:
                master.grad = None
                continue
            master.grad = p.grad.detach().float().mul_(inv)
            grads.append(master.grad)
        return found_inf_anywhere(has_inf_or_nan(grads))

    def grad_parameters(self) -> List[torch.Tensor]:
        return [master for _, master in self.pairs]

    def step(self):
        self.optimizer.step()
        with torch.no_grad():
            for p, master in self.pairs:
                p.copy_(master)

    def update(self, found_inf: bool):
        self.scaler.update(found_inf)

    def zero_grad(self):
        self.model.zero_grad(set_to_none=True)
        for _, master in self.pairs:
            master.grad = None

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def state_dict(self) -> dict:
        return {'scaler': self.scaler.state_dict()}

    def load_state_dict(self, state: dict):
        self.scaler.load_state_dict(state['scaler'])
