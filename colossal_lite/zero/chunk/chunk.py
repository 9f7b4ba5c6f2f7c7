"""A chunk: consecutive parameters packed into one fixed-size flat buffer, sharded over the
data-parallel group, with a state per tensor and an explicit table of legal transitions.

Layout (D = data-parallel size, ``capacity`` elements, a multiple of D): the parameters
(local tensor-parallel shards, one dtype) lie at ``offsets`` in a flat buffer of
``padded_numel = capacity`` elements (zero padding after the last one); data-parallel rank
r owns elements ``[r * shard_numel, (r + 1) * shard_numel)``:

* ``master``: an fp32 ``nn.Parameter`` of ``shard_numel`` elements, this rank's shard (on
  the device or the CPU, as the placement policy decides); the optimizer steps it,
  ``master.grad`` is this rank's slice of the reduce-scattered, data-parallel averaged
  gradient. Its ``placement`` cuts it over the tensor modes and the reduce group, so
  ``engine/clip.py`` computes the serial norm (as for low-level ZeRO's buckets).
* ``full``: the gathered buffer (one all_gather of ``capacity`` elements over the reduce
  group) while some tensor in it computes; the parameters are views into it, and hold
  empty storage otherwise.
* ``grad_full``: the chunk's gradient buffer while backward fills it: the gathered buffer
  itself, each parameter's gradient written over its weights once that gradient is
  complete (storage reuse); one reduce_scatter of it (times 1/D) gives the shard's gradient.

Tensor states (one per parameter, for one forward/backward pass)::

    FREE --pre-forward--> COMPUTE --post-forward--> HOLD
    HOLD --pre-forward (reused, tied)--> COMPUTE,  HOLD --pre-backward--> COMPUTE
    COMPUTE --gradient accumulated--> HOLD_AFTER_BWD
    HOLD_AFTER_BWD --every tensor of the chunk is done--> READY_FOR_REDUCE
    HOLD, HOLD_AFTER_BWD, READY_FOR_REDUCE --next pass--> FREE
    FREE --a pipeline stage starts the backward of an earlier micro-batch--> HOLD

Anything else raises :class:`IllegalTransition`.
"""
from __future__ import annotations

import enum
import itertools
from typing import Dict, Iterable, List, Optional, Sequence

import torch

from ...context import ProcessGroupAxis
from ...tensor import param_placement, set_placement
from ...tensor.placement import Placement
from ..buckets import FlatBucket


class TensorState(enum.Enum):
    FREE = 'free'
    COMPUTE = 'compute'
    HOLD = 'hold'
    HOLD_AFTER_BWD = 'hold_after_bwd'
    READY_FOR_REDUCE = 'ready_for_reduce'


S = TensorState
LEGAL: Dict[TensorState, frozenset] = {
    S.FREE: frozenset({S.COMPUTE, S.FREE, S.HOLD}),
    S.COMPUTE: frozenset({S.HOLD, S.HOLD_AFTER_BWD}),
    S.HOLD: frozenset({S.COMPUTE, S.FREE}),
    S.HOLD_AFTER_BWD: frozenset({S.READY_FOR_REDUCE, S.FREE}),
    S.READY_FOR_REDUCE: frozenset({S.FREE}),
}


class IllegalTransition(RuntimeError):
    """A tensor asked to move between two states the table does not connect."""


class Chunk(FlatBucket):
    """Parameters in one fixed-capacity flat buffer (module docstring). Reuses
    :class:`~colossal_lite.zero.buckets.FlatBucket`'s flat <-> parameter views, gathers and
    gradient accumulation; adds the capacity, the tensor states and the gathered buffer."""

    def __init__(self, index: int, params: Sequence[torch.nn.Parameter], capacity: int,
                 axis: ProcessGroupAxis, group_index: int, master_device: torch.device,
                 shard: Optional[torch.Tensor] = None,
                 shapes: Optional[Sequence[torch.Size]] = None,
                 device: Optional[torch.device] = None):
        self.index = index
        self.params = list(params)
        self.axis, self.group_index = axis, group_index
        # ``shapes``: the parameters' shapes when their storage is swapped out (re-packing)
        self.shapes = list(shapes) if shapes is not None else [p.shape for p in self.params]
        self.numels = [s.numel() for s in self.shapes]
        self.offsets = [0, *itertools.accumulate(self.numels)][:-1]
        self.numel = sum(self.numels)
        if capacity < self.numel or capacity % axis.size:
            raise ValueError(f'chunk capacity {capacity} must hold {self.numel} elements and '
                             f'be divisible by the data-parallel size {axis.size}')
        # ``device``: where gathered chunks live (the parameters may still be on meta)
        self._dtype, self._device = self.params[0].dtype, device or self.params[0].device
        self.padded_numel = capacity
        self.shard_numel = capacity // axis.size
        self.start = axis.rank * self.shard_numel
        if shard is None:   # this rank's slice of the parameters' current values
            shard = self.own(self.flatten([p.detach() for p in self.params]))
        if shard.numel() != self.shard_numel:
            raise ValueError(f'chunk {index}: a shard of {shard.numel()} elements was given, '
                             f'the chunk needs {self.shard_numel}')
        self.master = torch.nn.Parameter(shard.to(master_device, torch.float32, copy=True))
        placement = param_placement(self.params[0])
        self.grad_sum = placement.grad_sum
        modes = [mode for _, mode in placement.cuts] + [axis.mode]
        set_placement(self.master, Placement((capacity,), tuple((0, m) for m in modes),
                                             grad_sum=self.grad_sum))
        self.states: Dict[int, TensorState] = {id(p): S.FREE for p in self.params}
        self.full = None
        self.grad_full = None
        self.with_grad: set = set()

    # the parameters' data is swapped out while released, so dtype/device are kept here
    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def elsize(self) -> int:
        return torch.empty((), dtype=self._dtype).element_size()

    @property
    def full_bytes(self) -> int:
        """Bytes of the gathered buffer (which becomes the gradient buffer)."""
        return self.padded_numel * self.elsize

    @property
    def payload_bytes(self) -> int:
        """Bytes of this rank's shard in the parameters' dtype (what is gathered)."""
        return self.shard_numel * self.elsize

    def set_dtype(self, dtype: torch.dtype):
        """Mixed precision: the parameters (and gathered chunks) become ``dtype``; the
        master stays fp32. Only while released."""
        if self.full is not None:
            raise RuntimeError(f'chunk {self.index}: cannot change dtype while gathered')
        self._dtype = dtype
        self.detach_params()

    # ------------------------------------------------------------------ states
    def state(self, param) -> TensorState:
        return self.states[id(param)]

    def move(self, params: Iterable[torch.Tensor], new: TensorState):
        """Every tensor of ``params`` to ``new``; raises on an illegal transition."""
        for p in params:
            old = self.states[id(p)]
            if new not in LEGAL[old]:
                raise IllegalTransition(f'chunk {self.index}: a tensor of shape {tuple(p.shape)} '
                                        f'cannot go from {old.name} to {new.name}')
            self.states[id(p)] = new

    def all_in(self, *states: TensorState) -> bool:
        return all(s in states for s in self.states.values())

    def any_in(self, *states: TensorState) -> bool:
        return any(s in states for s in self.states.values())

    # ------------------------------------------------------------------ data
    def attach(self, full: torch.Tensor):
        """Make the parameters views into the gathered buffer ``full``."""
        self.full = full
        for p, view in zip(self.params, self.views(full)):
            p.data = view

    def detach_params(self):
        """Drop the gathered buffer; the parameters keep empty storage."""
        self.full = None
        for p in self.params:
            p.data = torch.empty(0, dtype=self._dtype, device=self._device)

    def views(self, flat: torch.Tensor) -> List[torch.Tensor]:
        return [flat[o:o + n].view(s) for s, o, n in zip(self.shapes, self.offsets, self.numels)]

    def write_grad(self, param: torch.Tensor, grad: torch.Tensor):
        """Write one parameter's gradient over its weights in ``grad_full`` (the gathered
        buffer, reused: the weights are no longer needed once the gradient is complete)."""
        i = next(k for k, p in enumerate(self.params) if p is param)
        self.grad_full[self.offsets[i]:self.offsets[i] + self.numels[i]].copy_(grad.reshape(-1))
        self.with_grad.add(id(param))

    def zero_slots_without_grad(self):
        """Zero the slots still holding weights (parameters without a gradient this pass)
        and the padding, before the buffer is reduced as gradients."""
        for p, o, n in zip(self.params, self.offsets, self.numels):
            if id(p) not in self.with_grad:
                self.grad_full[o:o + n].zero_()
        self.grad_full[self.numel:].zero_()
