"""torch autocast: ``fp16=dict(mode='torch')``.

Weights stay fp32; forward and loss run under ``torch.autocast``: bf16 on CPU
(CPU autocast's supported low precision), ``fp16.dtype`` (default float16) on
CUDA. With float16 on CUDA a ``torch.amp.GradScaler`` scales the loss; after its
``unscale_`` the inf/nan flag is made global (MAX all_reduce over GLOBAL, written
back into the scaler's per-device flags) so every rank skips or steps together,
also when only one rank's tensor-parallel shard overflowed.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..context import global_context as gpc
from .base import FullPrecision, found_inf_anywhere


def autocast_dtype(dtype: torch.dtype, device_type: str) -> torch.dtype:
    """The dtype ``fp16=dict(mode='torch', dtype=...)`` autocasts to on ``device_type``:
    bfloat16 on the CPU, ``dtype`` elsewhere."""
    return torch.bfloat16 if device_type == 'cpu' else dtype


class TorchAmp(FullPrecision):
    name = 'torch'

    def __init__(self, model, optimizer, dtype: torch.dtype = torch.float16,
                 scaler_kwargs: Optional[dict] = None, use_scaler: Optional[bool] = None):
        """``use_scaler=None``: a GradScaler exactly for float16 on CUDA (True forces one,
        e.g. to exercise the overflow path on CPU)."""
        super().__init__(model, optimizer)
        self.device_type = gpc.device.type
        self.dtype = autocast_dtype(dtype, self.device_type)
        if use_scaler is None:
            use_scaler = self.device_type == 'cuda' and self.dtype == torch.float16
        self.scaler = None
        if use_scaler:
            self.scaler = torch.amp.GradScaler(self.device_type, **(scaler_kwargs or {}))

    def autocast(self):
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, loss):
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def unscale(self) -> bool:
        if self.scaler is None:
            return False
        self.scaler.unscale_(self.optimizer)
        flags = self.scaler._per_optimizer_states[id(self.optimizer)]['found_inf_per_device']
        found = found_inf_anywhere(any(f.item() > 0 for f in flags.values()))
        for f in flags.values():
            f.fill_(1.0 if found else 0.0)
        return found

    def step(self):
        if self.scaler is None:
            self.optimizer.step()
        else:
            self.scaler.step(self.optimizer)

    def update(self, found_inf: bool):
        if self.scaler is not None:  # reads the (global) flags unscale() left
            self.scaler.update()

    @property
    def loss_scale(self) -> float:
        return float(self.scaler.get_scale()) if self.scaler is not None else 1.0

    def state_dict(self) -> dict:
        return {'scaler': self.scaler.state_dict()} if self.scaler is not None else {}

    def load_state_dict(self, state: dict):
        if self.scaler is not None and 'scaler' in state:
            self.scaler.load_state_dict(state['scaler'])
