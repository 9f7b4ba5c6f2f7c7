"""Engine: the model, optimizer, criterion and every per-step policy of the config.

One optimizer update with gradient accumulation N is::

    engine.zero_grad()                       # clears grads at the start of a cycle only
    for micro_batch in N micro-batches:
        out = engine(inputs); loss = engine.criterion(out, labels)   # or execute_schedule
        engine.backward(loss)                # backward of loss / N; no sync before the last
    engine.step()                            # on the N-th call only (returns True):
        # 1. data-parallel all-reduce of gradients (bucketed, overlapped with the last backward)
        # 2. amp.unscale(): skip on every rank if any rank saw inf/nan (naive/torch-fp16)
        # 3. clip to clip_grad_norm with the serial model's norm   4. optimizer step
        # 5. loss-scale update

``zero_grad`` and ``step`` may be called every micro-step: they act only at the
start and end of an accumulation cycle, so single-device loops work unchanged.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from ..amp import FullPrecision
from .clip import clip_grad_norm
from .gradient_handler import GradientReducer
from .schedule import NonPipelineSchedule


class Engine:
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 criterion: Optional[torch.nn.Module] = None,
                 gradient_handler: Optional[GradientReducer] = None,
                 amp: Optional[FullPrecision] = None, clip_grad_norm: float = 0.0,
                 gradient_accumulation: int = 1, schedule: Optional[NonPipelineSchedule] = None):
        if int(gradient_accumulation) < 1:
            raise ValueError(f'gradient_accumulation must be >= 1, got {gradient_accumulation}')
        self._model, self._optimizer, self._criterion = model, optimizer, criterion
        self.gradient_handler = gradient_handler
        self.amp = amp or FullPrecision(model, optimizer)
        self.clip_grad_norm = float(clip_grad_norm or 0.0)
        self.gradient_accumulation = int(gradient_accumulation)
        self.schedule = schedule or NonPipelineSchedule()
        self._micro_step = 0             # backward calls in the current accumulation cycle
        self.global_step = 0             # accumulation cycles completed (updates attempted)
        self.last_grad_norm: Optional[float] = None
        self.overflow = False            # whether the last update was skipped for inf/nan

    # --------------------------------------------------------------- accessors
    @property
    def model(self) -> torch.nn.Module:
        return self._model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._optimizer

    @property
    def criterion(self):
        return self._criterion

    @property
    def loss_scale(self) -> float:
        return self.amp.loss_scale

    @property
    def at_boundary(self) -> bool:
        """Whether the next ``step()`` ends an accumulation cycle."""
        return self._micro_step >= self.gradient_accumulation

    def train(self):
        self._model.train()

    def eval(self):
        self._model.eval()

    def autocast(self):
        return self.amp.autocast()

    # ------------------------------------------------------------------ compute
    def forward(self, *args, **kwargs) -> Any:
        args, kwargs = self.amp.cast_inputs(args), self.amp.cast_inputs(kwargs)
        with self.amp.autocast():
            return self._model(*args, **kwargs)

    __call__ = forward

    def backward(self, loss: torch.Tensor):
        """Backward of ``loss / gradient_accumulation``; the data-parallel sync starts
        (overlapped) only in the backward that ends the accumulation cycle."""
        if self._micro_step >= self.gradient_accumulation:
            raise RuntimeError(f'backward() called {self._micro_step + 1} times without step(); '
                               f'gradient_accumulation is {self.gradient_accumulation}')
        self._micro_step += 1
        if self.gradient_handler is not None:
            self.gradient_handler.prepare(sync=self.at_boundary)
        if self.gradient_accumulation > 1:
            loss = loss / self.gradient_accumulation
        self.amp.backward(loss)

    def step(self) -> bool:
        """Apply the update at the end of an accumulation cycle; True when this call did
        (the update may still be skipped for overflow: see ``engine.overflow``)."""
        if self._micro_step == 0:
            raise RuntimeError('step() called without engine.backward(loss) since the last step; '
                               'use engine.backward (not loss.backward) so the engine can '
                               'count micro-steps and synchronize gradients')
        if not self.at_boundary:
            return False
        if self.gradient_handler is not None:
            self.gradient_handler.synchronize()
        self.overflow = self.amp.unscale()
        if not self.overflow:
            if self.clip_grad_norm > 0:
                self.last_grad_norm = clip_grad_norm(self.amp.grad_parameters(),
                                                     self.clip_grad_norm)
            self.amp.step()
        self.amp.update(self.overflow)
        self._micro_step = 0
        self.global_step += 1
        return True

    def zero_grad(self):
        """Clear gradients, unless an accumulation cycle is in progress."""
        if self._micro_step == 0:
            self.amp.zero_grad()

    def discard_accumulation(self):
        """Drop a partial accumulation cycle (its gradients and micro-step count)."""
        self._micro_step = 0
        self.amp.zero_grad()

    def execute_schedule(self, data_iter_or_batch: Any, forward_only: bool = False,
                         return_loss: bool = True, return_output: bool = False):
        """Run one batch through the schedule: ``(output, label, loss)`` (None where not asked)."""
        return self.schedule.run(self, data_iter_or_batch, forward_only=forward_only,
                                 return_loss=return_loss, return_output=return_output)

    def state_dict(self) -> dict:
        """Full model weights (serial keys; collective over the shard groups) and step state."""
        return {'model': self._model.state_dict(), 'global_step': self.global_step,
                'amp': self.amp.state_dict()}
