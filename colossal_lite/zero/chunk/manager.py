"""The ChunkManager: builds the chunks and moves them through their states.

Collectives (all over a chunk's reduce group: the data-parallel axis ``data_parallel_axis()``,
or EXPERT_DATA for a chunk of expert parameters -- ``buckets.reduce_axis``):

* :meth:`access`: one all_gather of the chunk (``capacity`` elements, the parameters' dtype)
  when a tensor in it is about to compute and the chunk is not gathered;
* :meth:`before_grad`: one all_gather of the chunk when a gradient arrives while it is
  released (no module hook re-gathered it);
* :meth:`on_grad`: each gradient is written into its parameter's slot of the gathered
  buffer (no longer needed as weights); once every tensor of a chunk has its gradient, one
  async reduce_scatter of that buffer times 1/D (``capacity`` elements), waited for in
  :meth:`flush` (the handler's ``synchronize``), so it overlaps the rest of backward; the
  result is added into the chunk's ``master.grad``.

* :meth:`repack` (once, after the warm-up step, in first-use order): one all_gather per old
  chunk and re-sharded tensor (masters, Adam moments) over the reduce group.

A chunk whose tensors all hold after forward stays gathered (idle) until room is needed:
before a gather, idle chunks beyond ``zero.keep_gathered`` are released, the one used
farthest in the future first (:class:`~.forecast.Forecast` over the previous training
pass's chunk uses: Belady), and the device budget releases idle chunks before it evicts
anything else. So a chunk used again soon (the token embedding tied to the LM head, the
last blocks of forward that open backward) is not gathered twice. Idle chunks are released
when the gradients are complete (:meth:`flush`), before the optimizer changes the masters.

Every rank runs the same modules in the same order, so the collectives line up (the keep
and release decisions depend only on that order and on the configuration).
"""
from __future__ import annotations

import itertools
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ...communication import collective as C
from ...engine.gradient_handler import data_parallel_axis
from ..buckets import _bucket_key, reduce_axis
from .chunk import Chunk, TensorState as S
from .forecast import Forecast
from .placement import DeviceLedger, build_placement


def pack(params: Sequence[Tuple[torch.nn.Parameter, int]], capacity_elems: int,
         dp_size: int, numels: Optional[Dict[int, int]] = None) -> List[Tuple[list, int]]:
    """``[(params, elements), ...]``: parameters in the given (first-use) order packed
    greedily into chunks of at most ``capacity_elems`` elements per key (dtype, reduce
    group, tensor cuts, param group); a parameter larger than that gets a chunk of its own.
    Each chunk is sized to its content rounded up to a multiple of ``dp_size`` (padding
    < ``dp_size`` elements per chunk). ``numels``: ``id(param) -> elements`` (for
    parameters whose storage is swapped out), else ``param.numel()``."""
    def numel(p):
        return p.numel() if numels is None else numels[id(p)]

    def sized(ps):
        return ps, -(-sum(numel(p) for p in ps) // dp_size) * dp_size

    open_: Dict[tuple, list] = {}
    fill: Dict[tuple, int] = {}
    out: List[Tuple[list, int]] = []
    for p, group in params:
        key = _bucket_key(p, group)
        n = numel(p)
        if n > capacity_elems:
            out.append(sized([p]))
            continue
        if key in open_ and fill[key] + n > capacity_elems:
            out.append(sized(open_.pop(key)))
        if key not in open_:
            open_[key], fill[key] = [], 0
        open_[key].append(p)
        fill[key] += n
    out.extend(sized(ps) for ps in open_.values())
    return out


class ChunkManager:
    """Chunks of the model's parameters, their gathers, releases and gradient reduction."""

    def __init__(self, params: Sequence[Tuple[torch.nn.Parameter, int]], capacity_elems: int,
                 settings, device: torch.device, scale: float,
                 init_shard: Optional[Callable[[list, int], torch.Tensor]] = None):
        """``init_shard(params, elements)``: this rank's fp32 shard of a new chunk, for
        parameters that hold no values yet (built on meta: ``lazy.init_shard``)."""
        if not params:
            raise ValueError('ZeRO stage 3 needs at least one parameter that requires grad')
        # every chunk a multiple of the largest reduce group (EXPERT_DATA divides it)
        self.dp_size = data_parallel_axis().size
        self.capacity, self.scale, self.device = capacity_elems, scale, device
        groups = {id(p): g for p, g in params}
        limit = settings.device_memory_limit
        if limit is None and device.type == 'cuda':   # the free memory at start
            limit = torch.cuda.mem_get_info(device)[0]
        self.ledger = DeviceLedger(limit)
        self.groups = groups
        self.shapes = {id(p): p.shape for p, _ in params}
        self.numels = {id(p): p.numel() for p, _ in params}
        packed = pack(params, capacity_elems, self.dp_size)
        # the policy decides where each master lives, which the chunk needs at construction
        self.policy = build_placement(settings, [_Probe(i) for i in range(len(packed))],
                                      self.ledger, device)
        self.chunks: List[Chunk] = []
        self._form(packed, None if init_shard is None else
                   [init_shard(ps, size) for ps, size in packed])
        self._pending: List[Tuple[Chunk, 'C.Pending']] = []
        self.access_log: Optional[List[int]] = None   # set by the tracer during warm-up
        self.gathers = 0
        self.keep_gathered, self.prefetch = settings.keep_gathered, settings.prefetch
        self._inflight: Dict[int, tuple] = {}   # chunk index -> (shard, pending all_gather)
        self.forecast = Forecast()          # chunk uses of the last pass with a backward
        self._uses: List[int] = []          # this pass's chunk uses (repeats collapsed)
        self._backward_seen = False
        self.had_grad: set = set()          # ids of the parameters with a gradient this step
        self.ledger.evictors.insert(0, self._evict_idle)

    def _form(self, packed, shards: Optional[List[torch.Tensor]] = None):
        """Build the chunks of ``packed`` (``[(params, elements)]``; their masters from
        ``shards``, else from the parameters' values) in place of the current ones (the
        policy already sized for them), and account the shards it homes on the device."""
        self.chunks[:] = [
            Chunk(i, ps, size, reduce_axis(ps[0]), self.groups[id(ps[0])],
                  self.policy.master_device(self.policy.chunks[i]),
                  None if shards is None else shards[i], [self.shapes[id(p)] for p in ps],
                  self.device)
            for i, (ps, size) in enumerate(packed)]
        self.policy.chunks = list(self.chunks)
        self.chunk_of: Dict[int, Chunk] = {id(p): c for c in self.chunks for p in c.params}
        for chunk in self.chunks:
            chunk.detach_params()
        self.policy.settle()

    def plan(self, ordered: Sequence[torch.nn.Parameter]) -> List[Tuple[list, int]]:
        """The packing of the parameters in ``ordered`` (every chunked parameter once)."""
        return pack([(p, self.groups[id(p)]) for p in ordered], self.capacity,
                    self.dp_size, self.numels)

    @torch.no_grad()
    def repack(self, packed: List[Tuple[list, int]],
               shards: Dict[str, List[Optional[torch.Tensor]]]) -> Dict[str, List[torch.Tensor]]:
        """Re-form the chunks as ``packed`` (only between passes: every chunk released).
        ``shards``: per name (``'master'`` required, e.g. also Adam's moments), one shard per
        current chunk (None: none on any rank); returns the same tensors cut for the new
        chunks (fp32, zero where nothing was given). Collective: one all_gather of each
        given shard's chunk over the reduce group, at most one gathered chunk alive."""
        self.release_idle()
        old = list(self.chunks)
        if any(c.full is not None or c.grad_full is not None for c in old) or self._pending:
            raise RuntimeError('chunks can be re-packed only between passes')
        where = {id(p): (k, o) for k, (ps, _) in enumerate(packed)
                 for p, o in zip(ps, itertools.accumulate([0] + [self.numels[id(q)] for q in ps]))}
        axes = [reduce_axis(ps[0]) for ps, _ in packed]   # a parameter keeps its reduce group
        sizes = [size // axis.size for (_, size), axis in zip(packed, axes)]
        for chunk in old:   # the old shards homed on the device leave the ledger
            if self.policy.on_device(chunk):
                self.ledger.free(16 * chunk.shard_numel)
        self.policy.reset([_Probe(i) for i in range(len(packed))])
        devices = [self.policy.master_device(c) for c in self.policy.chunks]
        out: Dict[str, List[torch.Tensor]] = {}
        for name, per_chunk in shards.items():
            new = [torch.zeros(s, dtype=torch.float32, device=dev)
                   for s, dev in zip(sizes, devices)]
            for chunk, shard in zip(old, per_chunk):
                if shard is None:
                    continue
                full = chunk.gather(shard.detach())
                for p, o, n in zip(chunk.params, chunk.offsets, chunk.numels):
                    k, o2 = where[id(p)]
                    rank = axes[k].rank
                    lo, hi = max(o2, rank * sizes[k]), min(o2 + n, (rank + 1) * sizes[k])
                    if lo < hi:
                        new[k][lo - rank * sizes[k]:hi - rank * sizes[k]].copy_(
                            full[o + lo - o2:o + hi - o2])
                del full
            out[name] = new
        self._form(packed, out['master'])
        self.forecast.clear()        # the chunk indices changed
        self._uses, self._backward_seen = [], False
        return out

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
        """Gather ``chunk`` (no-op when gathered; waits for it when prefetched): the
        parameters become views into it."""
        if chunk.full is not None:
            return
        if chunk.index in self._inflight:
            self._land(chunk)
            return
        self._land(chunk, *self._launch(chunk, async_op=False))

    def _launch(self, chunk: Chunk, async_op: bool):
        """Start ``chunk``'s all_gather (idle chunks beyond ``keep_gathered`` released
        first); the shard stays pinned in the policy's cache until :meth:`_land`."""
        if self.access_log is not None:
            self.access_log.append(chunk.index)
        idle = self._idle()
        while len(idle) > self.keep_gathered:
            self._release_farthest(idle)
        pinned = getattr(self.policy, 'pinned', set())
        pinned.add(chunk.index)
        try:
            shard = self.policy.shard_for_gather(chunk)
            self.ledger.alloc(chunk.full_bytes, f'gathered chunk {chunk.index}')
            out = C.all_gather(shard, chunk.axis, async_op=async_op)
        except BaseException:
            pinned.discard(chunk.index)
            raise
        if async_op:
            self._inflight[chunk.index] = (shard, out)
        return shard, out

    def _land(self, chunk: Chunk, shard=None, out=None):
        if out is None:   # prefetched: wait for it
            shard, pending = self._inflight.pop(chunk.index)
            out = pending.wait()
        if out is shard:  # a one-rank group hands its input back
            out = shard.clone()
        self.policy.after_gather(chunk)
        getattr(self.policy, 'pinned', set()).discard(chunk.index)
        chunk.attach(out)
        self.gathers += 1

    def _prefetch(self):
        """Start the all_gather of the next chunks this pass will use that are neither
        gathered nor on their way (at most ``zero.prefetch`` in flight), from the forecast;
        within the pass only (the optimizer step changes the weights), and only where the
        device budget holds them without evicting anything but idle chunks."""
        if not self.prefetch:
            return
        for index in self.forecast.ahead():
            if len(self._inflight) >= self.prefetch:
                return
            chunk = self.chunks[index]
            if chunk.full is not None or index in self._inflight:
                continue
            if not self._fits(chunk):
                return
            self._launch(chunk, async_op=True)

    def _fits(self, chunk: Chunk) -> bool:
        if self.ledger.limit is None:
            return True
        idle = sorted(self._idle(), key=lambda c: self.forecast.next_use(c.index))
        spare = sum(c.full_bytes for c in idle[self.keep_gathered:])
        copy = 0 if self.policy.on_device(chunk) else chunk.payload_bytes
        return self.ledger.used - spare + chunk.full_bytes + copy <= self.ledger.limit

    def drain(self):
        """Land every prefetched gather (a pass ended before using it)."""
        for index in list(self._inflight):
            self._land(self.chunks[index])

    def _use(self, chunk: Chunk):
        if not self._uses or self._uses[-1] != chunk.index:
            self._uses.append(chunk.index)
            self.forecast.use(chunk.index)

    def _idle(self) -> List[Chunk]:
        """Gathered chunks no tensor computes in and no gradient fills."""
        return [c for c in self.chunks if c.full is not None and c.grad_full is None
                and c.all_in(S.HOLD, S.FREE)]

    def _release_farthest(self, idle: List[Chunk]):
        victim = max(idle, key=lambda c: self.forecast.next_use(c.index))
        idle.remove(victim)
        self.release(victim)

    def _evict_idle(self, nbytes: int) -> bool:
        """The ledger's first evictor: release the idle chunk used farthest in the future."""
        idle = self._idle()
        if not idle:
            return False
        self._release_farthest(idle)
        return True

    def release_idle(self):
        self.drain()
        for chunk in self._idle():
            self.release(chunk)

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
            self._use(chunk)
            self.access(chunk)
            chunk.move([p for p in params if self.chunk_of.get(id(p)) is chunk
                        and chunk.state(p) is not S.COMPUTE], S.COMPUTE)
        self._prefetch()

    def post_forward(self, params):
        """COMPUTE -> HOLD; a chunk whose tensors all hold stays gathered, idle (module
        docstring), or is released at once with ``keep_gathered=0``."""
        for chunk in self.chunks_of(params):
            chunk.move([p for p in params if self.chunk_of.get(id(p)) is chunk], S.HOLD)
            if chunk.all_in(S.HOLD) and not self.keep_gathered:
                self.release(chunk)

    # ------------------------------------------------------------------ backward
    def pre_backward(self, params):
        self._backward_seen = True
        for chunk in self.chunks_of(params):
            self._use(chunk)
            self.access(chunk)
            mine = [p for p in params if self.chunk_of.get(id(p)) is chunk
                    and chunk.state(p) is S.HOLD]
            chunk.move(mine, S.COMPUTE)
        self._prefetch()

    def before_grad(self, param: torch.nn.Parameter):
        """A tensor hook on ``param`` (runs before autograd accumulates its gradient): a
        gradient that arrives without its module's pre-backward (e.g. an output the module
        hooks cannot see) finds its chunk released; gather it (the other tensors' weights
        are then valid for their own backward) so the gradient can land."""
        self._backward_seen = True
        chunk = self.chunk_of[id(param)]
        self._use(chunk)
        self.access(chunk)
        self._prefetch()

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
        self.had_grad.add(id(param))
        param.grad = None
        if chunk.state(param) in (S.FREE, S.HOLD):   # no pre-backward reached it (before_grad)
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
        self.release_idle()   # the optimizer may change the masters next

    def begin_pass(self):
        """Before a forward: finish the previous pass's reductions, tensors back to FREE;
        the finished pass's chunk uses become the forecast if it ran a backward."""
        self.flush()
        for chunk in self.chunks:
            self.release(chunk)
            chunk.move(chunk.params, S.FREE)
        if self._backward_seen:
            self.forecast.set_order(self._uses)
        self._uses, self._backward_seen = [], False

    def begin_backward(self):
        """Pipeline: before the backward of one micro-batch (others' forwards ran since its
        own): finish the previous reductions, release, every tensor FREE -> HOLD (as after
        that micro-batch's forward)."""
        self.begin_pass()
        for chunk in self.chunks:
            chunk.move(chunk.params, S.HOLD)

    # ------------------------------------------------------------------ whole model
    def gather_all(self):
        for chunk in self.chunks:
            self.access(chunk)

    def release_all(self):
        self.drain()
        for chunk in self.chunks:
            self.release(chunk)

    def discard(self):
        self.drain()
        for _, pending in self._pending:
            pending.wait()
        self._pending = []
        self.had_grad = set()
        for chunk in self.chunks:
            self.release(chunk)
            if chunk.grad_full is not None:
                self._drop_grad(chunk)
            chunk.move(chunk.params, S.FREE)


class _Probe:
    """A chunk's index before the chunk exists (the policy places by index)."""

    def __init__(self, index: int):
        self.index = index
