"""Engine: the model, optimizer, criterion and every per-step policy of the config.

One optimizer update over M = ``num_microbatches`` micro-batches is::

    engine.zero_grad()
    engine.execute_schedule(batch_or_iterator)   # forward + loss + backward of all M
    engine.step()                                # sync, unscale, clip, optimizer step

or, by hand, one micro-batch at a time (both paths share the micro-step count)::

    for micro_batch in M micro-batches:
        engine.zero_grad()                       # clears grads at the start of a cycle only
        out = engine(inputs); loss = engine.criterion(out, labels)
        engine.backward(loss)                    # backward of loss / M; no sync before the last
        engine.step()                            # acts on the M-th call only (returns True):
        # 1. data-parallel all-reduce of gradients (bucketed, overlapped with the last backward)
        # 2. amp.unscale(): skip on every rank if any rank saw inf/nan (naive/torch-fp16)
        # 3. clip to clip_grad_norm with the serial model's norm   4. optimizer step
        # 5. loss-scale update

What a micro-step's backward accumulates into the gradients (S = the AMP loss scale,
1 without a scaler):

* ``backward(loss)``: the gradient of ``S * loss / M``;
* ``backward_by_grad(output, output_grad)``: the vector-Jacobian product of
  ``output_grad`` as given, neither divided by M nor multiplied by S: on a pipeline
  stage the incoming gradient comes from the next stage's backward and already
  carries both (every stage must use the same S). ``step()`` divides by S once.

Mixture of experts (only when the model holds ``colossal_lite.nn.MoE`` layers: nothing
runs otherwise): before every backward the layers' ``aux_loss_scale`` is set to ``S / M``,
the factor by which that backward's gradient exceeds the gradient of the plain
mean-over-tokens loss, so the router's auxiliary losses enter the gradient exactly as
``mean over micro-batches of (loss + aux + z)`` would (docs/moe.md, "The engine"); after
an applied optimizer step every layer's balancing bias is updated from the step's
counts (``MoE.update_balance_bias``); a step skipped for inf/nan drops the counts.
"""
from __future__ import annotations

import contextlib

from typing import Any, Optional, Sequence, Union

import torch

from ..amp import FullPrecision
from ..config.checks import positive_int
from ..config.pipeline import resolve_microbatches
from ..nn.moe import moe_layers, set_aux_loss_scale
from .clip import clip_grad_norm
from .gradient_handler import GradientReducer
from .schedule import NonPipelineSchedule

Tensors = Union[torch.Tensor, Sequence[torch.Tensor]]




def _as_tuple(obj: Tensors) -> tuple:
    return (obj,) if torch.is_tensor(obj) or obj is None else tuple(obj)


class Engine:
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 criterion: Optional[torch.nn.Module] = None,
                 gradient_handler: Optional[GradientReducer] = None,
                 amp: Optional[FullPrecision] = None, clip_grad_norm: float = 0.0,
                 num_microbatches: Optional[int] = None,
                 schedule: Optional[NonPipelineSchedule] = None, *,
                 gradient_accumulation: Optional[int] = None):
        """``num_microbatches`` (M, default 1): micro-batches per optimizer step;
        ``gradient_accumulation`` is an alias of it."""
        self._num_microbatches = resolve_microbatches(num_microbatches, gradient_accumulation)
        self._model, self._optimizer, self._criterion = model, optimizer, criterion
        self.gradient_handler = gradient_handler
        self.amp = amp or FullPrecision(model, optimizer)
        self.clip_grad_norm = float(clip_grad_norm or 0.0)
        self.schedule = schedule or NonPipelineSchedule()
        self._micro_step = 0             # backward calls in the current cycle
        self.global_step = 0             # cycles completed (updates attempted)
        self.last_grad_norm: Optional[float] = None
        self.overflow = False            # whether the last update was skipped for inf/nan
        self.moe_layers = moe_layers(model)  # MoE layers: aux-loss scale, balancing bias

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
    def num_microbatches(self) -> int:
        """M: micro-batches (backward calls) per optimizer step."""
        return self._num_microbatches

    @property
    def gradient_accumulation(self) -> int:
        """Alias of :attr:`num_microbatches`."""
        return self._num_microbatches

    @property
    def loss_scale(self) -> float:
        return self.amp.loss_scale

    @property
    def at_boundary(self) -> bool:
        """Whether the next ``step()`` ends the cycle of M micro-steps."""
        return self._micro_step >= self._num_microbatches

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

    def _begin_micro_step(self, what: str):
        """Count one micro-step; arm the data-parallel sync when it is the M-th."""
        if self.at_boundary:
            raise RuntimeError(f'{what}() called {self._micro_step + 1} times without step(); '
                               f'num_microbatches is {self._num_microbatches}')
        self._micro_step += 1
        if self.gradient_handler is not None:
            self.gradient_handler.prepare(sync=self.at_boundary)

    def backward(self, loss: torch.Tensor):
        """Backward of ``loss / M`` (times the AMP loss scale); the data-parallel sync
        starts (overlapped) only in the backward of the M-th micro-step."""
        self._begin_micro_step('backward')
        if self._num_microbatches > 1:
            loss = loss / self._num_microbatches
        self.scale_auxiliary_losses()
        # a model may ask for a context around its backward (auto/graph counts collectives)
        with getattr(self._model, 'backward_context', contextlib.nullcontext)():
            self.amp.backward(loss)

    def backward_by_grad(self, output: Tensors, output_grad: Tensors):
        """Backward from ``output`` (a tensor or a sequence) given the gradient of the
        step's objective with respect to it (same structure; None gradients and outputs
        without grad are skipped). ``output_grad`` is used as given: not divided by M,
        not multiplied by the loss scale (it already carries both).
        Counted as one micro-step, like ``backward``."""
        outputs, grads = _as_tuple(output), _as_tuple(output_grad)
        if len(outputs) != len(grads):
            raise ValueError(f'backward_by_grad got {len(outputs)} outputs and '
                             f'{len(grads)} gradients')
        if self.amp.name == 'apex':
            raise NotImplementedError("backward_by_grad is not supported with fp16 mode 'apex' "
                                      "(apex unscales inside its own loss backward)")
        pairs = [(o, g.to(o.dtype)) for o, g in zip(outputs, grads)
                 if g is not None and o.requires_grad]
        self._begin_micro_step('backward_by_grad')
        self.scale_auxiliary_losses()
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])

    @property
    def backward_scale(self) -> float:
        """``S / M``: the factor a micro-step's backward gradient carries relative to the
        gradient of the plain (mean over the micro-batch's tokens) loss."""
        return self.amp.loss_scale / self._num_microbatches

    def scale_auxiliary_losses(self):
        """Give the MoE layers' auxiliary losses the gradient ``S / M`` (the loss's own
        factor) in the backward that follows; no-op without MoE layers. The pipeline
        runtime calls it before a step's backwards."""
        if self.moe_layers:
            set_aux_loss_scale(self._model, self.backward_scale)

    def _update_balance(self):
        """After the cycle: the MoE balancing biases step with the optimizer (or drop the
        counts of a skipped step)."""
        for layer in self.moe_layers:
            if self.overflow:
                layer.discard_balance_counts()
            else:
                layer.update_balance_bias()

    def count_schedule_microbatches(self):
        """Record a whole step's M micro-steps run by a schedule that drove backward itself
        (the pipeline runtime); ``step()`` may follow."""
        if self._micro_step:
            raise RuntimeError(f'{self._micro_step} backward call(s) were made before the '
                               f'schedule ran; call engine.step() first')
        self._micro_step = self._num_microbatches

    def step(self) -> bool:
        """Apply the update at the end of the cycle of M micro-steps; True when this call
        did (the update may still be skipped for overflow: see ``engine.overflow``)."""
        if self._micro_step == 0:
            raise RuntimeError('step() called without engine.backward(loss) since the last step; '
                               'use engine.backward (not loss.backward) so the engine can '
                               'count micro-steps and synchronize gradients')
        if not self.at_boundary:
            return False
        if self.gradient_handler is not None:
            self.gradient_handler.synchronize()
        self.schedule.synchronize_gradients(self)
        self.overflow = self.amp.unscale()
        if not self.overflow:
            if self.clip_grad_norm > 0:
                self.last_grad_norm = clip_grad_norm(self.amp.grad_parameters(),
                                                     self.clip_grad_norm)
            self.amp.step()
        self.amp.update(self.overflow)
        if self.moe_layers:
            self._update_balance()
        self._micro_step = 0
        self.global_step += 1
        return True

    def zero_grad(self):
        """Clear gradients, unless a cycle of micro-steps is in progress."""
        if self._micro_step == 0:
            self.amp.zero_grad()

    def discard_accumulation(self):
        """Drop a partial cycle (its gradients and micro-step count)."""
        self._micro_step = 0
        self.amp.zero_grad()
        for layer in self.moe_layers:
            layer.discard_balance_counts()

    def execute_schedule(self, data_iter_or_batch: Any, forward_only: bool = False,
                         return_loss: bool = True, return_output: bool = False,
                         num_microbatches: Optional[int] = None):
        """All M micro-batches of one step (a batch split into M, or M batches of an
        iterator) through the schedule -> ``(output, labels, loss)``: the micro-batches'
        outputs (detached) and labels concatenated along dim 0 (None unless
        ``return_output``) and the mean of their losses (detached; None unless
        ``return_loss``). Without ``forward_only`` each micro-batch runs ``backward``;
        ``step()`` follows. ``num_microbatches`` may differ from M only with
        ``forward_only`` (e.g. 1: a test batch as one micro-batch). Raises
        ``StopIteration`` (nothing computed) when an iterator has fewer batches."""
        num = self._schedule_microbatches(forward_only, num_microbatches)
        return self.schedule.run(self, data_iter_or_batch, num, forward_only=forward_only,
                                 return_loss=return_loss, return_output=return_output)

    def _schedule_microbatches(self, forward_only: bool, num_microbatches: Optional[int]) -> int:
        num = self._num_microbatches if num_microbatches is None else positive_int(
            num_microbatches, 'num_microbatches')
        if forward_only:
            return num
        if num != self._num_microbatches:
            raise ValueError(f'a training schedule runs the engine\'s num_microbatches = '
                             f'{self._num_microbatches} micro-batches, got {num}; another '
                             f'count is only for forward_only=True')
        if self._micro_step:
            raise RuntimeError(f'execute_schedule runs all {num} micro-batches of a step, but '
                               f'{self._micro_step} backward call(s) of this step were already '
                               f'made; call engine.step() first')
        return num

    def state_dict(self) -> dict:
        """Full model weights (serial keys; collective over the shard groups) and step state."""
        return {'model': self._model.state_dict(), 'global_step': self.global_step,
                'amp': self.amp.state_dict()}
