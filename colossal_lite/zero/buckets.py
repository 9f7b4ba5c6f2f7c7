"""Flat buckets: the unit that low-level ZeRO shards over the data-parallel group.

A :class:`FlatBucket` holds consecutive parameters (local tensor-parallel shards) of
one optimizer param group, one dtype, one ``placement.grad_sum`` (reduce group DATA or
SEQUENCE_DP; EXPERT_DATA for expert parameters, whose shards differ across EXPERT) and one
tuple of tensor-parallel cut modes; a weight tied across pipeline
stages (EMBEDDING in its ``grad_sum``) is alone in its bucket. Its flat form is the
parameters concatenated (``numel`` elements) and zero-padded to ``D * shard_numel``
(D = reduce-group size); data-parallel rank r owns elements
``[r * shard_numel, (r + 1) * shard_numel)``:

* ``master``: an fp32 ``nn.Parameter`` of ``shard_numel`` elements, this rank's slice of
  the flat weights (on the CPU with ``offload_optimizer``); the user's optimizer steps it,
  so its state has the same size. ``master.grad`` is this rank's slice of the
  reduce-scattered (data-parallel averaged) flat gradient.
* ``master.placement`` cuts it over the parameters' tensor modes and then the reduce
  group (and keeps their ``grad_sum``), so :func:`colossal_lite.engine.clip.grad_norm`
  sums each element of the serial model's gradient once.
"""
from __future__ import annotations

import itertools
from typing import Dict, Iterable, List, Sequence, Set, Tuple

import torch
import torch.distributed as dist

from ..communication import collective as C
from ..context import ParallelMode, ProcessGroupAxis, global_context as gpc
from ..engine.gradient_handler import data_parallel_axis, is_expert_parameter
from ..tensor import param_placement, set_placement
from ..tensor.placement import Placement


def reduce_axis(param: torch.Tensor) -> ProcessGroupAxis:
    """The group that sums ``param``'s gradient: EXPERT_DATA for an expert parameter, else
    its placement's ``grad_sum`` mode, else the data-parallel axis (plain torch parameters,
    or a one-rank group). EMBEDDING (a weight held by the first and the last pipeline stage)
    is summed separately, on the slices."""
    if is_expert_parameter(param):
        return gpc.axis(ParallelMode.EXPERT_DATA)
    modes = [m for m in param_placement(param).grad_sum if m != ParallelMode.EMBEDDING]
    if len(modes) > 1:
        raise NotImplementedError(f'ZeRO shards a gradient over one group, but this parameter '
                                  f'is summed over {[m.name for m in modes]}')
    return gpc.axis(modes[0]) if modes else data_parallel_axis()


class FlatBucket:
    """Parameters flattened together; this rank owns one contiguous slice (module docstring)."""

    def __init__(self, params: Sequence[torch.nn.Parameter], axis: ProcessGroupAxis,
                 group_index: int, master_device: torch.device):
        self.params = list(params)
        self.axis, self.group_index = axis, group_index
        self.numels = [p.numel() for p in self.params]
        self.offsets = [0, *itertools.accumulate(self.numels)][:-1]
        self.numel = sum(self.numels)
        self.shard_numel = -(-self.numel // axis.size)
        self.padded_numel = self.shard_numel * axis.size
        self.start = axis.rank * self.shard_numel
        shard = self.flatten([p.detach() for p in self.params])
        shard = shard[self.start:self.start + self.shard_numel]
        self.master = torch.nn.Parameter(shard.to(master_device, torch.float32, copy=True))
        placement = param_placement(self.params[0])
        self.grad_sum = placement.grad_sum
        modes = [mode for _, mode in placement.cuts] + [axis.mode]
        set_placement(self.master, Placement((self.padded_numel,), tuple((0, m) for m in modes),
                                             grad_sum=self.grad_sum))

    @property
    def tied_across_stages(self) -> bool:
        """A weight held by the first and the last pipeline stage (alone in its bucket, so
        both stages' slices line up): its gradient slice is also summed over EMBEDDING."""
        return ParallelMode.EMBEDDING in self.grad_sum

    @property
    def dtype(self) -> torch.dtype:
        """The parameters' dtype (read live: naive fp16 casts the model after the masters
        are built)."""
        return self.params[0].dtype

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    # ------------------------------------------------------------------ flat <-> params
    def flatten(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """The padded flat form of per-parameter tensors (None = zeros), in the bucket dtype."""
        parts = [t.reshape(-1) if t is not None else torch.zeros(n, dtype=self.dtype,
                                                                  device=self.device)
                 for t, n in zip(tensors, self.numels)]
        pad = self.padded_numel - self.numel
        if pad:
            parts.append(torch.zeros(pad, dtype=parts[0].dtype, device=parts[0].device))
        return torch.cat(parts)

    def views(self, flat: torch.Tensor) -> List[torch.Tensor]:
        """Per-parameter views (local shapes) of a padded flat tensor."""
        return [flat[o:o + n].view(p.shape)
                for p, o, n in zip(self.params, self.offsets, self.numels)]

    def gather(self, shard: torch.Tensor, async_op: bool = False):
        """The padded flat tensor from every rank's ``shard`` (one all_gather over the
        reduce group, ``padded_numel`` elements)."""
        return C.all_gather(shard.to(self.device), self.axis, async_op=async_op)

    def own(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a padded flat tensor."""
        return flat[self.start:self.start + self.shard_numel]

    # ------------------------------------------------------------------ gradients
    def reduce_scatter_grads(self, scale: float) -> 'C.Pending':
        """Start the reduce-scatter of the parameters' ``.grad`` times ``scale`` (zeros where
        a parameter has none); the result is this rank's shard, in the bucket dtype."""
        flat = self.flatten([p.grad for p in self.params]).mul_(scale)
        return C.reduce_scatter(flat, self.axis, async_op=True)

    def add_grad(self, shard: torch.Tensor):
        """Accumulate a reduce-scattered shard (a fresh buffer) into ``master.grad``."""
        shard = shard.to(self.master.device, torch.float32)
        if self.master.grad is None:
            self.master.grad = shard
        else:
            self.master.grad.add_(shard)


def _bucket_key(param: torch.Tensor, group_index: int) -> Tuple:
    placement = param_placement(param)
    modes = tuple(mode for _, mode in placement.cuts)
    alone = id(param) if ParallelMode.EMBEDDING in placement.grad_sum else None
    return group_index, param.dtype, reduce_axis(param).mode, placement.grad_sum, modes, alone


def build_buckets(param_groups: Sequence[Iterable[torch.nn.Parameter]], bucket_bytes: int,
                  master_device: torch.device) -> List[FlatBucket]:
    """Buckets of at most ``bucket_bytes`` (one parameter may exceed it) over every param
    group, parameters in reverse order (roughly the order backward produces gradients)."""
    seen, ordered = set(), []
    for index, params in enumerate(param_groups):
        for p in params:
            if id(p) in seen:
                raise ValueError('a parameter appears twice in the optimizer\'s param groups')
            seen.add(id(p))
            if p.requires_grad:
                ordered.append((p, index))
    open_buckets: Dict[Tuple, List[torch.nn.Parameter]] = {}
    sizes: Dict[Tuple, int] = {}
    closed: List[Tuple[Tuple, List[torch.nn.Parameter]]] = []
    for p, index in reversed(ordered):
        key = _bucket_key(p, index)
        nbytes = p.numel() * p.element_size()
        if key in open_buckets and sizes[key] + nbytes > bucket_bytes:
            closed.append((key, open_buckets.pop(key)))
        if key not in open_buckets:
            open_buckets[key], sizes[key] = [], 0
        open_buckets[key].append(p)
        sizes[key] += nbytes
    closed.extend(open_buckets.items())
    return [FlatBucket(params, reduce_axis(params[0]), key[0], master_device)
            for key, params in closed]



def agree_on_gradients(buckets: Sequence[FlatBucket], local: Set[int]) -> Set[int]:
    """The ids of the buckets' parameters that had a gradient this step on any rank of their
    bucket's reduce group (``local``: those that had one here): as in the serial model,
    which sees every replica's rows. One all_reduce (MAX) of one flag per parameter over
    each reduce group. A weight tied across pipeline stages counts as having one (its
    slices are summed over EMBEDDING, zeros where a stage had none)."""
    by_axis: Dict[ParallelMode, List[FlatBucket]] = {}
    for b in buckets:
        by_axis.setdefault(b.axis.mode, []).append(b)
    out: Set[int] = set()
    for group in by_axis.values():
        params = [(p, b.tied_across_stages) for b in group for p in b.params]
        flags = torch.tensor([float(tied or id(p) in local) for p, tied in params],
                             device=group[0].device)
        flags = C.all_reduce(flags, group[0].axis, op=dist.ReduceOp.MAX)
        out.update(id(p) for (p, _), flag in zip(params, flags.tolist()) if flag > 0)
    return out
