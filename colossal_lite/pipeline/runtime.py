"""One runtime for every pipeline schedule: it executes this rank's generated action list.

:class:`PipelineSchedule` is the Engine's schedule when ``parallel.pipeline`` > 1. For one
step of M micro-batches it builds (once per M, then cached) the lowered action lists of
``schedules.py`` -- checked by the simulator before anything runs -- and executes this
rank's list in order:

* ``F s.m``: stage ``s`` forward of micro-batch ``m`` (``model(*inputs, stage_input=x,
  stage=s)``); on the last stage also the loss ``criterion(output, labels)`` (a model with
  ``returns_loss``, a graph plan's stages, returns the loss itself);
* ``B s.m``: backward -- from ``loss * S / M`` on the last stage (S: the AMP loss scale,
  the same on every rank), else from the stage output and the gradient received from
  stage s+1. Under a split backward (zero bubble) ``B`` computes only the gradient of the
  stage input and ``W`` the weight gradients from the gradients B left at each weight's op
  (``split_backward.py``);
* ``SEND_*`` / ``RECV_*``: :class:`~colossal_lite.pipeline.p2p.StageLink` messages.

Every rank passes the same micro-batches (inputs and labels): a stage reads what it needs
(stage 0 the ids, every stage a mask, the last the labels). The step's loss (mean over
micro-batches) is broadcast from the last stage over PIPELINE, so every rank returns it;
outputs are returned on last-stage ranks only. With ``record_timeline`` set, ``timeline``
holds the last step's ``(action, start, end)`` (``time.perf_counter``) for this rank. Data-parallel gradient sync runs in
``engine.step()`` (not overlapped with the pipeline's backward); there, too, the gradient
of a weight held by the first and the last stage (placement ``grad_sum`` containing
EMBEDDING) is summed over the EMBEDDING group.
"""
from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..communication import collective as C
from ..config.pipeline import PipelineSettings
from ..context import ParallelMode, current_context
from ..engine.schedule import call_with, concat, detached, micro_batches, to_device
from ..tensor.placement import param_placement
from .actions import RECV_B, RECV_F, SEND_B, SEND_F, Action, B, F, PipeShape, W
from .p2p import BACKWARD, FORWARD, StageLink, input_signature, message_key, release_points
from .schedules import build_schedule, lower
from .simulator import simulate
from .split_backward import SplitBackward


def forward_only_actions(shape: PipeShape) -> Dict[int, List[Action]]:
    """Forwards only, each rank in (micro-batch, stage) order: a topological order of the
    forward dependencies on every rank, hence deadlock-free (checked by the simulator)."""
    orders = {r: [Action(F, s, m) for m in range(shape.microbatches) for s in shape.stages_of(r)]
              for r in range(shape.ranks)}
    lowered = lower(shape, orders)
    simulate(shape, lowered, forward_only=True)
    return lowered


def _call_stage(engine, inputs, stage_input, stage: int):
    kwargs = {'stage_input': stage_input, 'stage': stage}
    if isinstance(inputs, dict):
        return engine(**inputs, **kwargs)
    if isinstance(inputs, (tuple, list)):
        return engine(*inputs, **kwargs)
    return engine(inputs, **kwargs)


class PipelineSchedule:
    """Runs a step's micro-batches through this rank's stages (module doc)."""

    def __init__(self, settings: PipelineSettings):
        self.settings = settings
        ctx = current_context()
        self.rank = ctx.axis(ParallelMode.PIPELINE).rank
        self.size = ctx.axis(ParallelMode.PIPELINE).size
        if self.size != settings.size:
            raise ValueError(f'pipeline settings say size {settings.size}, the launched '
                             f'PIPELINE group has {self.size} ranks')
        self._actions: Dict[Tuple[int, bool], Tuple[List[Action], Dict]] = {}
        self.link = StageLink(settings.stages)
        self.record_timeline = False  # set True to keep the last step's action timings
        self.timeline: List[Tuple[Action, float, float]] = []

    def actions(self, microbatches: int, forward_only: bool) -> Tuple[List[Action], Dict]:
        """This rank's action list and its send-release points (``p2p.release_points``)."""
        key = (microbatches, forward_only)
        if key not in self._actions:
            shape = PipeShape(self.size, self.settings.chunks, microbatches)
            if forward_only:
                lists = forward_only_actions(shape)
            else:
                lists = build_schedule(self.settings.schedule, self.size, microbatches,
                                       self.settings.chunks)
            self._actions[key] = (lists[self.rank], release_points(shape, lists, self.rank))
        return self._actions[key]

    # ------------------------------------------------------------------ the step
    def run(self, engine, data: Any, num_microbatches: int, forward_only: bool = False,
            return_loss: bool = True, return_output: bool = False):
        model = engine.model
        if not getattr(model, 'stages', None) or model.stages[0].count != self.settings.stages:
            raise ValueError(f'pipeline parallelism needs a model built for this layout '
                             f'(a StagedModel cut into {self.settings.stages} stages), got '
                             f'{type(model).__name__}')
        if engine.criterion is None and (return_loss or not forward_only) \
                and not getattr(model, 'returns_loss', False):
            raise ValueError('execute_schedule needs a criterion to compute the loss; '
                             'pass one to initialize() or use return_loss=False')
        micro = [to_device(mb, current_context().device)
                 for mb in micro_batches(data, num_microbatches)]
        run = _StepRun(engine, micro, self.settings.stages, forward_only, return_output,
                       split=self.settings.schedule == 'zero_bubble', link=self.link)
        if not forward_only and engine.gradient_handler is not None:
            engine.gradient_handler.prepare(sync=False)  # synced in engine.step()
        if not forward_only:
            engine.scale_auxiliary_losses()  # MoE aux losses: gradient S / M, as the loss's
        timeline = [] if self.record_timeline else None
        with torch.set_grad_enabled(not forward_only and torch.is_grad_enabled()):
            actions, releases = self.actions(num_microbatches, forward_only)
            for index, action in enumerate(actions):
                start = time.perf_counter()
                run.execute(action)
                if index in releases:
                    self.link.release(releases[index])
                if timeline is not None:
                    timeline.append((action, start, time.perf_counter()))
        self.link.wait_sends()
        if timeline is not None:
            self.timeline = timeline
        if not forward_only:
            engine.count_schedule_microbatches()
        loss = self._step_loss(run) if return_loss else None
        outputs = concat(run.outputs) if return_output and run.outputs else None
        labels = concat([mb[1] for mb in micro]) if return_output and run.outputs else None
        return outputs, labels, loss

    def _step_loss(self, run: '_StepRun') -> torch.Tensor:
        """The mean micro-batch loss, broadcast from the last stage to every pipeline rank."""
        last_rank = (self.settings.stages - 1) % self.size
        value = (torch.stack(run.losses).float().mean() if run.losses
                 else torch.zeros((), dtype=torch.float32))
        value = value.reshape(1).to(current_context().device)
        return C.broadcast(value, ParallelMode.PIPELINE, src=last_rank).reshape(())

    # ------------------------------------------------------- engine.step() hook
    def synchronize_gradients(self, engine):
        """Sum the gradients of weights held by the first and last stage over EMBEDDING
        (a graph plan's model sums those of its weights held by several stages itself)."""
        stage_sum = getattr(engine.model, 'synchronize_stage_gradients', None)
        if stage_sum is not None:
            stage_sum()
            return
        axis = current_context().axis(ParallelMode.EMBEDDING)
        if axis.size == 1 or getattr(engine.gradient_handler, 'sums_tied_stages', False):
            return  # ZeRO's reducer sums the tied weight's gradient slice itself
        for p in engine.model.parameters():
            if ParallelMode.EMBEDDING in param_placement(p).grad_sum:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                C.all_reduce(p.grad, axis, inplace=True)


class _StepRun:
    """The tensors of one step in flight on this rank, keyed by (stage, micro-batch)."""

    def __init__(self, engine, micro, stages: int, forward_only: bool, return_output: bool,
                 split: bool, link: StageLink):
        self.engine, self.micro, self.split, self.link = engine, micro, split, link
        self.signatures = [input_signature(inputs) for inputs, _ in micro]
        self.first = [self.signatures.index(sig) for sig in self.signatures]
        self.last = stages - 1
        self.forward_only, self.return_output = forward_only, return_output
        self.received: Dict[Tuple[int, int, int], torch.Tensor] = {}
        self.inputs: Dict[Tuple[int, int], Optional[torch.Tensor]] = {}
        self.targets: Dict[Tuple[int, int], Tuple[torch.Tensor, Optional[torch.Tensor]]] = {}
        self.input_grads: Dict[Tuple[int, int], torch.Tensor] = {}
        self.losses: List[torch.Tensor] = []
        self.outputs: List[Any] = []
        self.scale = engine.loss_scale / engine.num_microbatches
        self.params = [p for p in engine.model.parameters() if p.requires_grad]
        self.returns_loss = getattr(engine.model, 'returns_loss', False)

    def execute(self, a: Action):
        key, m = (a.stage, a.microbatch), a.microbatch
        message = (self.signatures[m], self.first[m])
        if a.kind == RECV_F:
            self.received[(FORWARD,) + key] = self.link.recv(message_key(a), *message)
        elif a.kind == RECV_B:
            self.received[(BACKWARD,) + key] = self.link.recv(message_key(a), *message)
        elif a.kind == SEND_F:
            self.link.send(self.targets[key][0], message_key(a), *message)
            if self.forward_only:
                del self.targets[key]
        elif a.kind == SEND_B:
            self.link.send(self.input_grads.pop(key), message_key(a), *message)
        elif a.kind == F:
            self.forward(*key)
        elif a.kind == B:
            self.backward(*key)
        elif a.kind == W:
            self.weight_backward(*key)
        else:
            raise ValueError(f'unknown pipeline action {a!r}')

    def forward(self, stage: int, m: int):
        inputs, labels = self.micro[m]
        x = None
        if stage > 0:
            x = self.received.pop((FORWARD, stage, m))
            if torch.is_grad_enabled() and x.is_floating_point():
                x.requires_grad_(True)
        out = _call_stage(self.engine, inputs, x, stage)
        self.inputs[(stage, m)] = x
        if stage < self.last:
            self.targets[(stage, m)] = (out, None)
            return
        if self.return_output:
            self.outputs.append(detached(out))
        loss = None
        if self.returns_loss:       # a graph plan's last stage computes the loss itself
            loss = out
        elif self.engine.criterion is not None:
            with self.engine.autocast():
                loss = call_with(self.engine.criterion, (out,), labels)
        if loss is not None:
            self.losses.append(loss.detach())
            if not self.forward_only:
                self.targets[(stage, m)] = (loss * self.scale, None)

    def _target(self, stage: int, m: int):
        out, grad = self.targets[(stage, m)]
        if stage < self.last:
            grad = self.received.pop((BACKWARD, stage, m))
            grad = grad.to(out.dtype)
        return out, grad

    def backward(self, stage: int, m: int):
        out, grad = self._target(stage, m)
        x = self.inputs[(stage, m)]
        if self.split:  # input gradient now, weight gradients in W
            split = SplitBackward(out, grad, x, self.params)
            gx = split.input_grad()
            self.targets[(stage, m)] = split
            if gx is not None:
                self.input_grads[(stage, m)] = gx
            return
        torch.autograd.backward(out, grad)
        del self.targets[(stage, m)]
        self.inputs.pop((stage, m))
        if x is not None and x.requires_grad:
            self.input_grads[(stage, m)] = x.grad

    def weight_backward(self, stage: int, m: int):
        self.inputs.pop((stage, m))
        self.targets.pop((stage, m)).weight_grad()
