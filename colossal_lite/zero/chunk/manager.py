"""The ChunkManager: builds the chunks and moves them through their states.

Collectives (all over a chunk's reduce group, the data-parallel axis ``data_parallel_axis()``):

* :meth:`access`: one all_gather of the chunk (``capacity`` elements, the parameters' dtype)
  when a tensor in it is about to compute and the chunk is not gathered;
* :meth:`on_grad`: each gradient is written into its parameter's slot of the gathered
  buffer (no longer needed as weights); once every tensor of a chunk has its gradient, one
  async reduce_scatter of that buffer times 1/D (``capacity`` elements), waited for in
  :meth:`flush` (the handler's ``synchronize``), so it overlaps the rest of backward; the
  result is added into the chunk's ``master.grad``.

Every rank runs the same modules in the same order, so the collectives line up.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ...communication import collective as C
from ..buckets import _bucket_key, reduce_axis
from .chunk import Chunk, TensorState as S
from .placement import DeviceLedger, build_placement


def pack(params: Sequence[Tuple[torch.nn.Parameter, int]], capacity_elems: int,
         dp_size: int) -> List[Tuple[list, int]]:
    """``[(params, capacity), ...]``: parameters in the given (first-use) order packed into
    chunks of ``capacity_elems`` elements per key (dtype, reduce group, tensor cuts, param
    group); a parameter larger than that gets a chunk of its own, rounded up to a multiple of
    ``dp_size``."""
    open_: Dict[tuple, list] = {}
    fill: Dict[tuple, int] = {}
    out: List[Tuple[list, int]] = []
    for p, group in params:
        key = _bucket_key(p, group)
        n = p.numel()
        if n > capacity_elems:
            out.append(([p], -(-n // dp_size) * dp_size))
            continue
        if key in open_ and fill[key] + n > capacity_elems:
            out.append((open_.pop(key), capacity_elems))
        if key not in open_:
            open_[key], fill[key] = [], 0
        open_[key].append(p)
        fill[key] += n
    out.extend((ps, capacity_elems) for ps in open_.values())
    return out


class ChunkManager:
    """Chunks of the model's parameters, their gathers, releases and gradient reduction."""

    def __init__(self, params: Sequence[Tuple[torch.nn.Parameter, int]], capacity_elems: int,
                 settings, device: torch.device, scale: float):
        if not params:
            raise ValueError('ZeRO stage 3 needs at least one parameter that requires grad')
        axis = reduce_axis(params[0][0])
        self.capacity, self.scale, self.device = capacity_elems, scale, device
        groups = {id(p): g for p, g in params}
        limit = settings.device_memory_limit
        if limit is None and device.type == 'cuda':   # the free memory at start
            limit = torch.cuda.mem_get_info(device)[0]
        self.ledger = DeviceLedger(limit)
        packed = pack(params, capacity_elems, axis.size)
        # the policy decides where each master lives, which the chunk needs at construction
        self.policy = build_placement(settings, [_Probe(i) for i in range(len(packed))],
                                      self.ledger, device)
        self.chunks: List[Chunk] = [
            Chunk(i, ps, cap, reduce_axis(ps[0]), groups[id(ps[0])],
                  self.policy.master_device(self.policy.chunks[i]))
            for i, (ps, cap) in enumerate(packed)]
        self.policy.chunks = list(self.chunks)
        self.chunk_of: Dict[int, Chunk] = {id(p): c for c in self.chunks for p in c.params}
        for chunk in self.chunks:
            chunk.detach_params()
        self.policy.settle()
        self._pending: List[Tuple[Chunk, 'C.Pending']] = []
        self.access_log: Optional[List[int]] = None   # set by the tracer during warm-up
        self.gathers = 0

    # ------------------------------------------------------------------ gather / release
    def chunks_of(self, params) -> List[Chunk]:
        seen, out = set(), []
        for p in params:
            c = self.chunk_of.get(id(p))
            if c is not None and c.index not in seen:
                seen.add(c.index)
                out.append(c)
        return out

    @torch.no_grad()
    def access(self, chunk: Chunk):
        """Gather ``chunk`` (no-op when gathered): the parameters become views into it."""
        if chunk.full is not None:
            return
        if self.access_log is not None:
            self.access_log.append(chunk.index)
        pinned = getattr(self.policy, 'pinned', set())
        pinned.add(chunk.index)
        try:
            shard = self.policy.shard_for_gather(chunk)
            self.ledger.alloc(chunk.full_bytes, f'gathered chunk {chunk.index}')
            full = C.all_gather(shard, chunk.axis)
            if full is shard:  # a one-rank group hands its input back
                full = shard.clone()
            self.policy.after_gather(chunk)
        finally:
            pinned.discard(chunk.index)
        chunk.attach(full)
        self.gathers += 1

    def release(self, chunk: Chunk):
        """Drop the gathered buffer (still accounted while it serves as the gradient buffer)."""
        if chunk.full is None:
            return
        holds_grads = chunk.grad_full is chunk.full
        chunk.detach_params()
        if not holds_grads:
            self.ledger.free(chunk.full_bytes)

    # ------------------------------------------------------------------ forward
    def pre_forward(self, params):
        """Gather; FREE/HOLD tensors to COMPUTE (a forward recomputed inside backward, under
        activation checkpointing, finds its tensors already COMPUTE)."""
        for chunk in self.chunks_of(params):
            self.access(chunk)
            chunk.move([p for p in params if self.chunk_of.get(id(p)) is chunk
                        and chunk.state(p) is not S.COMPUTE], S.COMPUTE)

    def post_forward(self, params):
        for chunk in self.chunks_of(params):
            chunk.move([p for p in params if self.chunk_of.get(id(p)) is chunk], S.HOLD)
            if chunk.all_in(S.HOLD):
                self.release(chunk)

    # ------------------------------------------------------------------ backward
    def pre_backward(self, params):
        for chunk in self.chunks_of(params):
            self.access(chunk)
            mine = [p for p in params if self.chunk_of.get(id(p)) is chunk
                    and chunk.state(p) is S.HOLD]
            chunk.move(mine, S.COMPUTE)

    @torch.no_grad()
    def on_grad(self, param: torch.nn.Parameter):
        """``param``'s gradient was accumulated (every use of it in this backward is done):
        write it into the parameter's own slot of the gathered buffer, which becomes the
        chunk's gradient buffer (storage reuse: no second buffer); when every tensor of the
        chunk is done, start its reduce."""
        chunk = self.chunk_of[id(param)]
        if chunk.full is None:
            raise RuntimeError(f'chunk {chunk.index}: a gradient arrived while the chunk was '
                               f'released')
        chunk.grad_full = chunk.full
        chunk.write_grad(param, param.grad)
        param.grad = None
        if chunk.state(param) is S.HOLD:   # a gradient without the pre-backward (e.g. no module)
            chunk.move([param], S.COMPUTE)
        chunk.move([param], S.HOLD_AFTER_BWD)
        if chunk.all_in(S.HOLD_AFTER_BWD):
            self.release(chunk)
            self._reduce(chunk)

    def _reduce(self, chunk: Chunk):
        chunk.move(chunk.params, S.READY_FOR_REDUCE)
        flat = chunk.grad_full
        chunk.zero_slots_without_grad()
        flat.mul_(self.scale)
        self._pending.append((chunk, C.reduce_scatter(flat, chunk.axis, async_op=True)))

    def _finish(self, chunk: Chunk, pending):
        shard = pending.wait()
        nbytes = chunk.shard_numel * chunk.grad_full.element_size()
        self.ledger.alloc(nbytes, f'the gradient shard of chunk {chunk.index}')
        self.policy.grad_to_master(chunk, shard)
        self.ledger.free(nbytes)
        self._drop_grad(chunk)

    def _drop_grad(self, chunk: Chunk):
        chunk.grad_full = None
        chunk.with_grad.clear()
        self.ledger.free(chunk.full_bytes)

    def flush(self):
        """Reduce every chunk holding gradients (missing ones count as zeros), wait for every
        reduce-scatter: the masters' gradients are complete. Same order on every rank."""
        for chunk in self.chunks:
            if chunk.grad_full is not None and not chunk.any_in(S.READY_FOR_REDUCE):
                for p in chunk.params:  # no gradient this pass: counts as zeros
                    if chunk.state(p) in (S.FREE, S.HOLD):
                        chunk.move([p], S.COMPUTE)
                    if chunk.state(p) is S.COMPUTE:
                        chunk.move([p], S.HOLD_AFTER_BWD)
                self.release(chunk)
                self._reduce(chunk)
        for chunk, pending in self._pending:
            self._finish(chunk, pending)
        self._pending = []

    def begin_pass(self):
        """Before a forward: finish the previous pass's reductions, tensors back to FREE."""
        self.flush()
        for chunk in self.chunks:
            self.release(chunk)
            chunk.move(chunk.params, S.FREE)

    # ------------------------------------------------------------------ whole model
    def gather_all(self):
        for chunk in self.chunks:
            self.access(chunk)

    def release_all(self):
        for chunk in self.chunks:
            self.release(chunk)

    def discard(self):
        for _, pending in self._pending:
            pending.wait()
        self._pending = []
        for chunk in self.chunks:
            self.release(chunk)
            if chunk.grad_full is not None:
                self._drop_grad(chunk)
            chunk.move(chunk.params, S.FREE)


class _Probe:
    """A chunk's index before the chunk exists (the policy places by index)."""

    def __init__(self, index: int):
        self.index = index
