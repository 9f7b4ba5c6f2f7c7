"""Gradient reduce-scatter of low-level ZeRO, overlapped with backward.

Each :class:`~colossal_lite.zero.buckets.FlatBucket`'s gradients are flattened
(padded), multiplied by 1/DATA-size (before the sum, so half-precision sums stay in
range, as the plain data-parallel handler does) and reduce-scattered over the
bucket's reduce group: every rank receives its ``shard_numel`` slice, which is added
into ``bucket.master.grad`` (fp32). The parameters' ``.grad`` are freed once their
bucket is sent. Bytes per bucket: one reduce_scatter of ``padded_numel`` elements.

* stage 2 (``accumulate_locally=False``): hooks are armed on every micro-step, a bucket
  starts (async) as soon as every parameter in it has its gradient, and gradients that
  arrived after their bucket left (or whose bucket never filled) are sent at the next
  flush point (the next micro-step's :meth:`prepare`, or :meth:`synchronize`). So
  accumulation over micro-steps happens in the fp32 shard: the full gradient never
  outlives one micro-step.
* stage 1 (``accumulate_locally=True``): micro-steps before the last accumulate full
  local ``.grad`` with no communication; hooks are armed only in the last micro-step's
  backward.

With ``overlap=False`` no hooks are registered: every bucket goes at the flush points.
Under pipeline parallelism a weight held by the first and the last stage has a bucket of
its own; :meth:`synchronize` sums its fp32 gradient slice over EMBEDDING (one all_reduce
of ``shard_numel`` elements), and the pipeline schedule skips its own EMBEDDING sum (``sums_tied_stages``).
Every rank must produce gradients for the same parameters (so all ranks start the same
buckets in the same order). A parameter without a gradient counts as zeros in its bucket's
sum; :meth:`params_with_grad` says which had one (on some rank: :meth:`synchronize` agrees
on it, one all_reduce of one flag per parameter), so the optimizer skips the others as
the serial one does.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Set, Tuple

import torch

from ..communication import collective as C
from ..communication.collective import Pending
from ..context import ParallelMode, global_context as gpc
from .buckets import FlatBucket, agree_on_gradients


class ShardedGradientReducer:
    """The Engine's gradient handler under ZeRO-1/2 (``prepare(sync)`` / ``synchronize()``)."""

    sums_tied_stages = True  # the pipeline schedule leaves the EMBEDDING sum to synchronize()

    def __init__(self, buckets: Sequence[FlatBucket], accumulate_locally: bool,
                 overlap: bool = True):
        self.buckets = list(buckets)
        self.accumulate_locally = accumulate_locally
        self.overlap = overlap
        self.scale = 1.0 / gpc.get_world_size(ParallelMode.DATA)
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b.params}
        self._ready = [set() for _ in self.buckets]
        self._pending: List[Tuple[int, Pending]] = []
        self._armed = False
        self._sent: Set[int] = set()                  # had a gradient here this step
        self._with_grad: Optional[Set[int]] = None    # ... on some rank (synchronize)
        self._handles = []
        if overlap:
            self._handles = [p.register_post_accumulate_grad_hook(self._on_grad)
                             for b in self.buckets for p in b.params]

    def prepare(self, sync: bool):
        """Before a micro-step's backward; ``sync``: it is the last of the step."""
        if not self.accumulate_locally:
            self._flush()
        self._armed = self.overlap and (sync or not self.accumulate_locally)

    def synchronize(self):
        """Send what is left, wait for every reduce-scatter, sum the slices of weights tied
        across pipeline stages over EMBEDDING: ``master.grad`` is complete."""
        self._flush()
        self._armed = False
        for bucket in self.buckets:
            if bucket.tied_across_stages:
                if bucket.master.grad is None:
                    bucket.master.grad = torch.zeros_like(bucket.master)
                summed = C.all_reduce(bucket.master.grad.to(bucket.device),
                                      ParallelMode.EMBEDDING)
                bucket.master.grad.copy_(summed)
        self._with_grad = agree_on_gradients(self.buckets, self._sent)

    def params_with_grad(self) -> Optional[Set[int]]:
        """ids of the parameters that had a gradient this step on some rank of their reduce
        group (None before :meth:`synchronize`)."""
        return self._with_grad

    def discard(self):
        """Finish the collectives in flight (every rank started them) and drop their results."""
        for _, pending in self._pending:
            pending.wait()
        self._pending = []
        self._ready = [set() for _ in self.buckets]
        self._sent, self._with_grad = set(), None

    def _on_grad(self, param):
        if not self._armed:
            return
        index = self._bucket_of[id(param)]
        self._ready[index].add(id(param))
        if len(self._ready[index]) == len(self.buckets[index].params):
            self._launch(index)

    def _launch(self, index: int):
        bucket = self.buckets[index]
        self._pending.append((index, bucket.reduce_scatter_grads(self.scale)))
        for p in bucket.params:
            if p.grad is not None:
                self._sent.add(id(p))
            p.grad = None
        self._ready[index] = set()

    def _flush(self):
        for index, bucket in enumerate(self.buckets):
            if any(p.grad is not None for p in bucket.params):
                self._launch(index)
        for index, pending in self._pending:
            self.buckets[index].add_grad(pending.wait())
        self._pending = []
        self._ready = [set() for _ in self.buckets]

    def remove_hooks(self):
        for handle in self._handles:
            handle.remove()
        self._handles = []
