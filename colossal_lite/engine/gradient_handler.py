"""Data-parallel gradient synchronization.

Contract with the layer families: after ``backward`` every parameter's local
gradient is the gradient of the *local replica's* loss with respect to its
local shard, complete over the tensor-parallel group -- except in sequence
mode, where each rank's gradient covers only its sub-sequence. So:

* data parallelism: ``g <- sum_DATA(g / data_size)`` (replicas see different
  batches and each loss is a mean over its batch);
* sequence mode: ``g <- sum_SEQUENCE_DP(g / data_size)`` (the SEQUENCE part of the
  sum completes the gradient, the DATA part averages replicas);
* expert parameters (placement cut over EXPERT, or EXPERT_DATA in its ``grad_sum``):
  ``g <- sum_EXPERT_DATA(g / data_size)``. The all_to_all backward of the MoE layer already
  put into an expert's local gradient the tokens of the E ranks of its EXPERT group, so the
  sum over EXPERT_DATA (expert_data, and the tensor axis in the sequence modes) covers every
  replica once; the scale is 1/data_size as for dense gradients, applied even where
  EXPERT_DATA is one rank (data == E).

Gradients are flattened into buckets of ``bucket_bytes`` (one dtype per bucket),
so the collective count is ceil(total_bytes / bucket_bytes) per dtype.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Tuple

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..communication import collective as C
from ..config.families import family
from ..context import ParallelMode, ProcessGroupAxis, global_context as gpc
from ..tensor import param_placement

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024


def data_parallel_axis() -> ProcessGroupAxis:
    """The group over which gradients are summed: SEQUENCE_DP where the tensor family splits
    the sequence (modes 'sequence', 'ulysses'), else DATA."""
    if family(gpc.tensor_mode).splits_sequence:
        return gpc.axis(ParallelMode.SEQUENCE_DP)
    return gpc.axis(ParallelMode.DATA)


def is_expert_parameter(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s placement makes it an expert parameter: cut over EXPERT, or its
    gradient summed over EXPERT_DATA."""
    placement = param_placement(tensor)
    return (ParallelMode.EXPERT_DATA in placement.grad_sum
            or any(mode is ParallelMode.EXPERT for _, mode in placement.cuts))


def gradient_axis(tensor: torch.Tensor) -> ProcessGroupAxis:
    """The group that sums ``tensor``'s gradient and over which its replicas are broadcast:
    EXPERT_DATA for an expert parameter, else :func:`data_parallel_axis`."""
    if is_expert_parameter(tensor):
        return gpc.axis(ParallelMode.EXPERT_DATA)
    return data_parallel_axis()


def by_gradient_axis(tensors: Iterable[torch.Tensor]
                     ) -> List[Tuple[ProcessGroupAxis, List[torch.Tensor]]]:
    """``tensors`` split by :func:`gradient_axis` (order kept inside each part): the dense
    part first, then the expert part (the same order on every rank); empty parts dropped."""
    dense, expert = data_parallel_axis(), gpc.axis(ParallelMode.EXPERT_DATA)
    parts: Dict[ParallelMode, List[torch.Tensor]] = {dense.mode: [], expert.mode: []}
    for t in tensors:
        parts[gradient_axis(t).mode].append(t)
    return [(axis, parts[axis.mode]) for axis in (dense, expert) if parts[axis.mode]]


def buckets(tensors: List[torch.Tensor], bucket_bytes: int) -> List[List[torch.Tensor]]:
    """Consecutive same-dtype tensors grouped up to ``bucket_bytes`` each."""
    out: List[List[torch.Tensor]] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if out and out[-1][0].dtype == t.dtype and size + nbytes <= bucket_bytes:
            out[-1].append(t)
            size += nbytes
        else:
            out.append([t])
            size = nbytes
    return out


def allreduce_gradients(parameters: Iterable[torch.nn.Parameter],
                        bucket_bytes: int = DEFAULT_BUCKET_BYTES):
    """Synchronize ``.grad`` of ``parameters`` across data-parallel replicas (see module doc):
    one all_reduce per bucket over DATA (SEQUENCE_DP) for dense gradients, over EXPERT_DATA
    for expert gradients."""
    if data_parallel_axis().size == 1:
        return
    scale = 1.0 / gpc.get_world_size(ParallelMode.DATA)
    with_grad = [p for p in parameters if p.grad is not None]
    for axis, params in by_gradient_axis(with_grad):
        for bucket in buckets([p.grad for p in params], bucket_bytes):
            # divide before summing, so half-precision sums stay in range as in the serial model
            flat = C.all_reduce(_flatten_dense_tensors(bucket).mul_(scale), axis, inplace=True)
            for grad, synced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                grad.copy_(synced)


def broadcast_parameters(module: torch.nn.Module, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
    """Copy local rank 0's parameters and buffers to every data-parallel replica.

    One broadcast per same-dtype bucket over :func:`gradient_axis` (sharded parameters are
    broadcast shard by shard: the group only varies replicas): DATA (SEQUENCE_DP) for dense
    tensors, EXPERT_DATA for expert parameters (whose shards differ across EXPERT)."""
    if data_parallel_axis().size == 1:
        return
    seen, tensors = set(), []
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            tensors.append(t)
    with torch.no_grad():
        for axis, part in by_gradient_axis(tensors):
            if axis.size == 1:
                continue
            for bucket in buckets([t.data for t in part], bucket_bytes):
                flat = C.broadcast(_flatten_dense_tensors(bucket), axis, src=0, inplace=True)
                for t, synced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                    t.copy_(synced)


class GradientReducer:
    """Bucketed data-parallel gradient all-reduce that overlaps backward.

    Same result as :func:`allreduce_gradients` (``g <- sum_axis(g / data_size)``, the axis
    of each bucket DATA / SEQUENCE_DP, or EXPERT_DATA for expert parameters).
    Parameters are bucketed in reverse registration order (roughly the order
    backward produces their gradients), ``bucket_bytes`` per bucket and one
    dtype and one axis each. With ``overlap=True`` a post-accumulate-grad hook marks each
    parameter ready; once every parameter of a bucket is ready its gradients are
    flattened and an async all_reduce starts while backward goes on.
    :meth:`synchronize` (before the optimizer step) starts the buckets that never
    filled, in bucket order, waits for all of them, scales and copies back.

    Gradient accumulation: :meth:`prepare` ``(sync=False)`` before a micro-step's
    backward disarms the hooks, so nothing is communicated until the last
    micro-step. A parameter whose gradient changes after its bucket started
    (a weight used again later in backward) marks the bucket stale; it is
    reduced again synchronously. Parameters without a gradient contribute zeros
    and keep ``grad = None``.
    """

    sums_tied_stages = False  # the pipeline schedule sums EMBEDDING after this handler

    def __init__(self, parameters: Iterable[torch.nn.Parameter],
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, overlap: bool = True):
        self.axis = data_parallel_axis()
        self.scale = 1.0 / gpc.get_world_size(ParallelMode.DATA)
        seen, params = set(), []
        for p in parameters:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
        self.buckets, self.bucket_axes = [], []
        for axis, part in by_gradient_axis(params[::-1]):
            for bucket in buckets(part, bucket_bytes):
                self.buckets.append(bucket)
                self.bucket_axes.append(axis)
        self._bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.overlap = overlap and self.axis.size > 1
        self._handles = []
        if self.overlap:
            self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]
        self._armed = False
        self._reset()

    def _reset(self):
        self._ready = [set() for _ in self.buckets]
        self._pending = {}
        self._stale = set()

    def prepare(self, sync: bool):
        """Call before backward: ``sync`` says whether this backward ends an accumulation."""
        self._armed = sync and self.overlap
        self._reset()

    def _on_grad(self, param):
        if not self._armed:
            return
        index = self._bucket_of[id(param)]
        if index in self._pending:
            self._stale.add(index)
            return
        self._ready[index].add(id(param))
        if len(self._ready[index]) == len(self.buckets[index]):
            self._launch(index)

    def _launch(self, index: int):
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.buckets[index]]
        flat = _flatten_dense_tensors(grads).mul_(self.scale)  # divide before summing: fp16 range
        self._pending[index] = C.all_reduce(flat, self.bucket_axes[index], async_op=True,
                                            inplace=True)

    def synchronize(self):
        """Finish the all-reduce of every bucket (see class docstring); once per optimizer step."""
        if self.axis.size == 1:
            return
        for index in range(len(self.buckets)):
            if index in self._stale:
                self._pending.pop(index).wait()
            if index not in self._pending:
                self._launch(index)
        for index, bucket in enumerate(self.buckets):
            flat = self._pending[index].wait()
            for p, synced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                if p.grad is not None:
                    p.grad.copy_(synced)
        self._armed = False
        self._reset()

    def remove_hooks(self):
        for handle in self._handles:
            handle.remove()
        self._handles = []
