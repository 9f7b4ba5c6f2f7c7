"""Data-parallel gradient synchronization.

Contract with the layer families: after ``backward`` every parameter's local
gradient is the gradient of the *local replica's* loss with respect to its
local shard, complete over the tensor-parallel group -- except in sequence
mode, where each rank's gradient covers only its sub-sequence. So:

* data parallelism: ``g <- sum_DATA(g) / data_size`` (replicas see different
  batches and each loss is a mean over its batch);
* sequence mode: ``g <- sum_SEQUENCE_DP(g) / data_size`` (the SEQUENCE part of the
  sum completes the gradient, the DATA part averages replicas).

Gradients are flattened into buckets of ``bucket_bytes`` (one dtype per bucket),
so the collective count is ceil(total_bytes / bucket_bytes) per dtype.
"""
from __future__ import annotations

from typing import Iterable, List

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..communication import collective as C
from ..context import ParallelMode, ProcessGroupAxis, global_context as gpc

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024


def data_parallel_axis() -> ProcessGroupAxis:
    """The group over which gradients are summed: SEQUENCE_DP in sequence mode, else DATA."""
    if gpc.tensor_mode == 'sequence':
        return gpc.axis(ParallelMode.SEQUENCE_DP)
    return gpc.axis(ParallelMode.DATA)


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
    """Synchronize ``.grad`` of ``parameters`` across data-parallel replicas (see module doc)."""
    axis = data_parallel_axis()
    if axis.size == 1:
        return
    scale = 1.0 / gpc.get_world_size(ParallelMode.DATA)
    grads = [p.grad for p in parameters if p.grad is not None]
    for bucket in buckets(grads, bucket_bytes):
        flat = C.all_reduce(_flatten_dense_tensors(bucket), axis, inplace=True)
        flat.mul_(scale)
        for grad, synced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            grad.copy_(synced)
