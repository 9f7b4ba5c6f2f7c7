"""The cost model: memory per device and step time of one candidate plan.

A :class:`Candidate` is one layout the runtime can execute (pipeline P with schedule,
chunks V, partition and M micro-batches; data D; tensor mode with size t and depth;
ZeRO stage; activation checkpointing of every block or none). :func:`evaluate` gives its
:class:`Estimate`: per pipeline stage the memory and the time of one micro-batch, then
the step time. Formulas (docs/planner.md has them with their sources):

* parameters per rank: ``formulas.params`` summed over the stage's layers (``model_spec``);
* memory = the step's peak of live tensor bytes, without the torch runtime
  (docs/planner.md): ``memory.rank_memory`` per pipeline rank, the states a step starts
  from plus the larger of its two peaks -- at the last backward's start (activations of
  the micro-batches in flight of the schedule: GPipe M, 1F1B P - r, zero bubble
  min(M, P), interleaved (P-1-r)*2 + (V-1)*P + 1 chunk micro-batches; the loss head's
  buffers; earlier gradients) or with the gradients complete (their reduction buffers),
  each term a named buffer (``memory.py``, tested against the allocator's record);
  ``terms['model_data']`` the states live after a step (``MODEL_DATA_BYTES``, tested
  equal to real runs), ``terms['memory_buffers']`` the ``RankMemory`` of every rank;
* compute: a block of a family and size the profile timed (``family_blocks``): its
  measured seconds at the micro-batch's FLOPs (piecewise linear between the timed batches,
  the fitted seconds per FLOP beyond them, at least the serial block's / t), collectives
  included, its forward the timed forward's share; the first and last parts add the
  family's measured ``rest`` (embedding, head, loss beyond their FLOPs) per micro-batch at
  its tokens; else block FLOPs / t /
  ``flops`` + the per-block overhead (backward 2x forward, a recompute 1x) and
  tensor communication: ``ModelShape.block_comm_bytes`` (``formulas.block_bytes``
  generalized to the block's layers: GQA, gated MLP, RMSNorm, no biases, 1D's replicated
  kv gradients) per block and micro-batch through the profile's α-β of the family's
  collective (a recompute repeats the forward half);
* stage boundaries: one p2p of the activation shard per micro-batch and direction (1D:
  a 1/t slice of the replicated activation, then an all_gather over the t ranks);
* gradient sync: ``formulas.gradient_sync_bytes`` over the data group, each call at the
  profile's α-β of that collective timed right after a backward (``data_sync_time``;
  ``collectives``' α-β plus the skew below where it has none); without a pipeline
  all but the last 25 MiB bucket overlap the last micro-batch's backward (``exposed_sync``:
  both slowed 1.3x while they overlap, as Galvatron-BMW measures), exposed after the
  pipeline flush with one; ZeRO-3 pays a
  latency per chunk and call (``zero3_chunks``: the runtime's chunk search), its
  prefetched all_gathers overlapping the previous chunk's compute (``zero3_exposed``);
* oversubscription ``s = ranks / cores`` of the profile (> 1: ranks time-share cores, and
  the measured block times carry it): a pipeline takes ``max(M * T, schedule time / s)``,
  the ranks waiting in the bubble freeing their cores for the computing ones;
* skew (``sync_skew_time``): ranks that time-share cores finish a phase at different
  times; each synchronizing point on the critical path (the gradient sync and ZeRO-1/2's
  weight all_gather after the step where not timed in a step, each pipeline boundary
  the first micro-batch crosses forward and backward, one per later micro-batch) adds
  the profile's measured ``sync_skew_s``;
* step = pipeline time (bubble per schedule) + exposed gradient sync + skew + the AdamW step on
  the local (ZeRO: sharded) parameters and tensors (``optimizer_time``: per element and per
  tensor stepped, ``compute['adam_s_per_param']`` and ``['adam_s_per_tensor']``).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import List, Optional, Sequence, Tuple

import colossal_lite.auto.offload as offload
import colossal_lite.formulas as formulas

from ..config import ParallelLayout
from ..config.schedules import SCHEDULES
from ..pipeline.partition import cut
from ..zero.chunk.search import search_chunk_size
from .cluster import ClusterProfile
from .memory import (DP_BUCKET_BYTES, RNG_STATE_BYTES, ZERO_BUCKET_BYTES, block_kept,
                     mlp_gradient_bytes, rank_memory)
from .model_spec import ModelShape, kv_replicated, layer_params, splits_sequence, tensor_numels
from .profile import family_block_seconds, family_entry, family_forward_share, family_rest_seconds

OVERLAP_SLOWDOWN = 1.3
# fp32 AdamW, bytes per local parameter as (whole, per 1/D shard), by ZeRO stage, live
# after a step (weights, gradients -- ZeRO: the gradient shard -- and Adam moments;
# tested equal to real builds). The peak's buffers are ``memory.py``'s.
MODEL_DATA_BYTES = {0: (16, 0), 1: (4, 16), 2: (4, 16), 3: (0, 16)}
# (op, calls per block) of each family's tensor-parallel traffic (calls: latency terms) for
# GPT's block: 4 matmul calls and 2 norms (``tensor_calls`` scales them to other blocks)
# Ulysses: 3 all_to_alls forward (q, the stacked k and v, the output) and 3 backward over
# its U ranks; its ring (R > 1) as the sequence ring's 6 over R (``ulysses_time``)
TENSOR_OPS = {'1d': ('all_reduce', 6), '2d': ('broadcast', 30), '2.5d': ('broadcast', 30),
              '3d': ('all_gather', 60), 'sequence': ('p2p', 6), 'ulysses': ('all_to_all', 6)}


@dataclass(frozen=True)
class Candidate:
    """One executable layout (see the module doc); ``layout`` a ``ParallelLayout`` with data."""

    layout: object
    microbatches: int
    schedule: str = '1f1b'
    chunks: int = 1
    partition: str = 'uniform'
    zero: int = 0
    checkpoint: bool = False
    placement: str = 'device'          # ZeRO-3 chunk placement: 'device', 'cpu' or 'static'
    device_fraction: float = 1.0       # 'static': the share of chunks homed on the device
    offload_optimizer: bool = False    # ZeRO-1/2: fp32 slices and moments on the host

    @property
    def stages(self) -> int:
        return self.layout.pipeline * self.chunks

    def describe(self) -> str:
        l = self.layout
        mode = l.mode or 'none'
        if l.mode == '2.5d':
            mode += f' d={l.depth}'
        if l.mode == 'ulysses' and l.ring > 1:
            mode += f' R={l.ring}'
        parts = [f'D={l.data}' + (f' E={l.expert}' if getattr(l, 'expert', 1) > 1 else ''),
                 f'P={l.pipeline}', f't={l.tensor}({mode})', f'M={self.microbatches}']
        if l.pipeline > 1:
            parts.append(self.schedule + (f' V={self.chunks}' if self.chunks > 1 else '')
                         + f' {self.partition}')
        parts.append(f'zero={self.zero}' if self.zero else 'no zero')
        parts.append('ckpt' if self.checkpoint else 'no ckpt')
        if self.placement != 'device':   # shown only when not the default (offload.py)
            parts.append(self.placement + (f' f={self.device_fraction:g}'
                                           if self.placement == 'static' else ''))
        if self.offload_optimizer:
            parts.append('offload optimizer')
        return ' '.join(parts)


@dataclass
class Estimate:
    """Predicted step time (s) and per-stage memory (bytes per device) of a candidate, with
    the terms that make them up."""

    candidate: Candidate
    step_time: float
    memory: List[float]
    stage_time: List[float]
    terms: dict = field(default_factory=dict)

    @property
    def peak_memory(self) -> float:
        return max(self.memory)


def stage_ranges(shape: ModelShape, stages: int, partition: str, layout=None) -> List[range]:
    """The block ranges the runtime cuts for ``partition`` ('uniform' or 'parameters':
    ``pipeline/partition.cut`` with ``transformer_weights``' parameter counts)."""
    if stages == 1:
        return [range(shape.layers)]
    if partition == 'uniform':
        return cut('uniform', shape.layers, stages)
    if partition != 'parameters':
        raise NotImplementedError(f"the planner predicts partitions 'uniform' and 'parameters', "
                                  f"got {partition!r}")
    serial = ParallelLayout(1, 1, None, 1, 1)
    block = layer_params(shape.block_layers(), None, serial)  # GPT: (4 + 2r) h^2 + (9 + r) h
    first = layer_params(shape.first_layers(), None, serial)
    last = layer_params(shape.last_layers(False), None, serial)
    if shape.tied_head:  # the tied head counted as model_zoo's GPT counts it (its vocab matrix)
        last += shape.vocab * shape.hidden
    return cut('parameters', shape.layers, stages, block, first, last)


@lru_cache(maxsize=4096)
def part_params(shape: ModelShape, layout, pipelined: bool) -> Tuple[int, int, int]:
    """Elements one rank holds of a block, of the first part and of the last part."""
    return (layer_params(shape.block_layers(), layout.mode, layout),
            layer_params(shape.first_layers(), layout.mode, layout),
            layer_params(shape.last_layers(pipelined), layout.mode, layout))


@lru_cache(maxsize=4096)
def dense_block_params(shape: ModelShape, layout) -> int:
    """Elements one rank holds of a dense block (an MoE model's first ``first_dense``)."""
    return layer_params(shape.dense_block_layers(), layout.mode, layout)


def rank_dense_blocks(shape: ModelShape, ranges: Sequence[range], p: int) -> List[int]:
    """Per pipeline rank, how many of its blocks are dense (an MoE model's first
    ``first_dense``; for a dense model, all)."""
    return [shape.dense_blocks([i for s, r in enumerate(ranges) if s % p == rank for i in r])
            for rank in range(p)]


def moe_layer_time(cluster: ClusterProfile, shape: ModelShape, layout, tokens: float,
                   elem: int = 4) -> Tuple[float, float, float]:
    """(forward seconds, backward seconds, all_to_all buffer bytes per rank) of one MoE
    layer's expert-parallel traffic on a replica micro-batch of ``tokens`` tokens (this
    rank routes ``N`` of them: all under 1D, ``1/t`` in the sequence modes), uniform
    routing (``ModelShape.moe_uniform_off_rows``: ``N k (E-1)/E`` rows leave and as many
    arrive): over the E ranks of EXPERT (``t`` apart), forward the counts all_to_all
    (``8 X`` bytes) and the dispatch and combine all_to_alls (``h elem`` per row each),
    backward the two transposed ones: ``5 α + β (8 X + 2 h elem (S_off + R_off))``
    (``ModelShape.moe_all_to_all_bytes``); and in the forward the statistics all_reduce
    of ``[X]`` int64 over DATA (SEQUENCE_DP in the sequence modes). Expert tensor
    parallelism's TENSOR all_reduces are in the block's tensor bytes
    (``ModelShape.block_comm_bytes``)."""
    moe = shape.moe
    if moe is None:
        return 0.0, 0.0, 0.0
    t, e = layout.tensor, getattr(layout, 'expert', 1)
    seq = splits_sequence(layout.mode)
    routed = tokens / (t if seq else 1)
    forward = backward = nbytes = 0.0
    if e > 1:
        off = shape.moe_uniform_off_rows(routed, e)
        nbytes = shape.moe_all_to_all_bytes(off, off, elem)
        rows = shape.hidden * elem * 2 * off        # one direction's dispatch + combine
        alpha, _ = cluster.alpha_beta('all_to_all', e, cluster.placement(t, e))
        pair = cluster.group_time('all_to_all', rows, t, e) + alpha   # two calls
        forward += cluster.group_time('all_to_all', 8 * moe.experts, t, e) + pair
        backward += pair
    stride, size = (1, layout.data * t) if seq else (t, layout.data)
    forward += cluster.group_time('all_reduce', 8 * moe.experts, stride, size)
    return forward, backward, nbytes


def rank_parts(ranges: Sequence[range], p: int, v: int) -> List[Tuple[int, int, int, int]]:
    """Per pipeline rank: (blocks, stages, holds the first part 0/1, holds the last 0/1)."""
    key = (tuple((r.start, r.stop) for r in ranges), p, v)
    if key not in _RANK_PARTS:
        out = []
        for rank in range(p):
            stages = [s for s in range(p * v) if s % p == rank]
            out.append((sum(len(ranges[s]) for s in stages), len(stages),
                        int(0 in stages), int(p * v - 1 in stages)))
        _RANK_PARTS[key] = out
    return _RANK_PARTS[key]


_RANK_PARTS: dict = {}


def in_flight(schedule: str, p: int, m: int, v: int, rank: int) -> float:
    """Micro-batches whose activations a pipeline rank holds at its peak, in whole-stage units
    (the schedule table, ``config/schedules.py``; interleaved chunk micro-batches count 1/V)."""
    return SCHEDULES[schedule].in_flight(p, m, v, rank)


def model_state_bytes(params: float, zero: int, data: int) -> float:
    """fp32 weights, gradients and Adam moments of ``params`` local elements by ZeRO stage,
    live after a step (``MODEL_DATA_BYTES``)."""
    whole, sharded = MODEL_DATA_BYTES[zero]
    return params * whole + params * sharded / data


def block_memory(shape: ModelShape, layout, micro: float, checkpoint: bool, elem: int = 4
                 ) -> Tuple[float, float]:
    """(bytes one block keeps per in-flight micro-batch, transient bytes at its backward),
    from ``memory.py``: the saved activations and causal mask (``block_kept``) and the
    MLP's gradient transient; checkpointed, the block input (split t ways unless 1D) and
    the saved RNG state, the transient the recomputed block's activations."""
    kept = block_kept(shape, layout, micro, elem)
    if checkpoint:
        split = 1 if layout.mode in (None, '1d') else layout.tensor
        return micro * shape.seq * shape.hidden * elem / split + RNG_STATE_BYTES, kept
    return kept, mlp_gradient_bytes(shape, layout, micro, elem)


@lru_cache(maxsize=65536)
def block_comm_bytes(shape: ModelShape, layout, micro: float, elem: int = 4) -> float:
    """``shape.block_comm_bytes`` of one block and micro-batch of ``micro`` samples."""
    ring = layout.ring_size if layout.mode == 'ulysses' else 1
    return shape.block_comm_bytes(layout.mode, layout.tensor, micro, layout.depth, elem, ring)


def tensor_calls(shape: ModelShape, layout) -> float:
    """Collective calls of one block's tensor-parallel traffic: ``TENSOR_OPS``' count for
    GPT's 6 units (4 matmul calls, 2 norms) scaled to the block's units, plus the k and v
    gradient all_reduces (and their biases') where 1D replicates the kv heads."""
    if layout.mode is None:
        return 0
    _, calls = TENSOR_OPS[layout.mode]
    if layout.mode == 'sequence':   # the ring's exchanges: as many whatever the matmuls
        return calls
    if layout.mode == 'ulysses':    # the all_to_alls, and the ring's exchanges when R > 1
        return calls * (2 if layout.ring_size > 1 else 1)
    units = len(shape.block_calls) + 2
    extra = (2 + 2 * shape.qkv_bias) if kv_replicated(layout.mode, layout.tensor,
                                                       shape.kv_heads) else 0
    if shape.moe is not None and shape.moe.expert_tensor(layout.mode, layout.tensor) > 1:
        extra += 2   # expert tensor parallelism: the rows' all_reduce forward and backward
    return calls * units / 6 + extra


def _tensor_time(cluster: ClusterProfile, layout, nbytes: float, calls: float) -> float:
    """Seconds of a block's tensor-parallel traffic: ``calls`` latencies of the family's
    collective over its group (t ranks for 1D/sequence, a grid side q for 2D/2.5D/3D, the
    groups spanning the t consecutive tensor ranks) plus β times the bytes."""
    if layout.mode is None or layout.tensor == 1 or nbytes <= 0:
        return 0.0
    op, _ = TENSOR_OPS[layout.mode]
    t = layout.tensor
    size = layout.tensor_grid if layout.mode in ('2d', '2.5d', '3d') else t
    size = max(size, 2)
    alpha, _ = cluster.alpha_beta(op, size, cluster.placement(t // size, size))
    return (calls - 1) * alpha + cluster.group_time(op, nbytes, t // size, size)


def ulysses_time(cluster: ClusterProfile, shape: ModelShape, layout, micro: float,
                 nbytes: Optional[float] = None) -> float:
    """Seconds of one block's Ulysses traffic, forward + backward, on ``micro`` samples
    (``ModelShape.ulysses_comm_bytes``): the all_to_alls over the U consecutive ranks of
    ULYSSES, 6 calls (q, the stacked k and v, the output; forward and backward), ``6 α +
    β · bytes`` at the all_to_all's α-β over U; with R > 1 the ring's sends over the R ranks
    of SEQUENCE_RING (U apart), 6 calls of p2p as the sequence ring's, ``6 α + β · bytes``.
    ``nbytes`` (the block's ``block_comm_bytes``, another element size) rescales both."""
    ring = layout.ring_size
    u = layout.tensor // ring
    a2a, ring_bytes = shape.ulysses_comm_bytes(layout.tensor, ring, micro)
    if nbytes is not None and a2a + ring_bytes > 0:
        scale = nbytes / (a2a + ring_bytes)
        a2a, ring_bytes = a2a * scale, ring_bytes * scale
    out = 0.0
    if a2a > 0:
        alpha, _ = cluster.alpha_beta('all_to_all', u, cluster.placement(1, u))
        out += 5 * alpha + cluster.group_time('all_to_all', a2a, 1, u)
    if ring_bytes > 0:
        alpha, _ = cluster.alpha_beta('p2p', ring, cluster.placement(u, ring))
        out += 5 * alpha + cluster.group_time('p2p', ring_bytes, u, ring)
    return out


def oversubscription(cluster: ClusterProfile) -> float:
    """How many times slower a rank computes with every rank busy than alone: the profile's
    ``compute['ranks'] / compute['cores']`` (ranks timed at once over the cores they
    shared, ``profile.measure``) when above 1, else 1 (a device per rank: GPUs, hand-written
    profiles). The measured block times (``family_blocks``) carry this slowdown."""
    ranks, cores = cluster.compute.get('ranks'), cluster.compute.get('cores')
    if not ranks or not cores:
        return 1.0
    return max(1.0, float(ranks) / float(cores))


def parts_overhead(cluster: ClusterProfile, layout, hidden: int, tokens: float = 0.0
                   ) -> float:
    """Forward + backward seconds per micro-batch of ``tokens`` of the first and last parts
    (embedding, head, loss) beyond their FLOPs: the family's measured ``rest``
    (``family_blocks``, the 1-block model minus its block at a small vocabulary: dispatch
    and the vocab-parallel collectives' latencies; the timed width nearest ``hidden``,
    ``profile.family_rest_seconds``), 0 without one."""
    t = layout.tensor if layout.mode else 1
    entry = family_entry(cluster.compute, layout.mode, t, hidden)
    return family_rest_seconds(entry, tokens) if entry else 0.0


def block_time(shape: ModelShape, cluster: ClusterProfile, layout, tokens: float,
               comm_bytes: float) -> Tuple[float, float, float]:
    """(forward seconds, backward seconds, forward + backward tensor-communication seconds)
    of one block on ``tokens`` tokens of a replica micro-batch. A profile that timed real blocks of
    this family and size (``compute['family_blocks']``, ``profile.measure_families``; the
    timed width nearest the model's, ``profile.family_entry``) gives the whole block,
    collectives included, at its 3 * FLOPs (``profile.family_block_seconds``: the timed
    points, beyond them the fitted ``seconds_per_flop``, at least the serial block's / t;
    split by the timed forward's share, ``profile.family_forward_share``; communication
    0); otherwise FLOPs / t / ``flops`` plus
    ``compute['block_overhead_s'] / 3`` and the α-β time of ``comm_bytes``."""
    t = layout.tensor if layout.mode else 1
    flops = shape.block_flops(tokens)
    entry = family_entry(cluster.compute, layout.mode, t, shape.hidden)
    if entry is not None:
        per_flop = entry['seconds_per_flop']
        serial = family_entry(cluster.compute, None, 1, shape.hidden)
        if serial is not None and t > 1:  # a rank's FLOP share runs no faster than serial
            per_flop = max(per_flop, serial['seconds_per_flop'] / t)
        whole = family_block_seconds(entry, 3 * flops, per_flop)
        forward = whole * family_forward_share(entry, 3 * flops)
        return forward, whole - forward, 0.0
    overhead = float(cluster.compute.get('block_overhead_s', 0.0))
    whole = shape.replicated_flops(tokens, layout.mode, t)   # MoE under 1D: router, ...
    forward = ((flops - whole) / t + whole) / cluster.flops + overhead / 3
    if layout.mode == 'ulysses':   # two collectives over two groups (all_to_all, ring)
        return forward, 2 * forward, ulysses_time(cluster, shape, layout, tokens / shape.seq,
                                                  comm_bytes)
    return forward, 2 * forward, _tensor_time(cluster, layout, comm_bytes,
                                              tensor_calls(shape, layout))


def evaluate(shape: ModelShape, cluster: ClusterProfile, cand: Candidate, batch: int,
             elem: int = 4, ranges: Optional[Sequence[range]] = None) -> Estimate:
    """Memory per device (per stage) and step time of ``cand`` for a global ``batch``."""
    return evaluate_zero_stages(shape, cluster, cand, (cand.zero,), batch, elem, ranges)[0]


def evaluate_zero_stages(shape: ModelShape, cluster: ClusterProfile, cand: Candidate,
                         zeros: Sequence[int], batch: int, elem: int = 4,
                         ranges: Optional[Sequence[range]] = None) -> List[Estimate]:
    """:func:`evaluate` of ``cand`` with each ZeRO stage of ``zeros`` (the pipeline part,
    shared by all of them, is computed once)."""
    l = cand.layout
    p, d, t, m, v = l.pipeline, l.data, l.tensor, cand.microbatches, cand.chunks
    micro = batch / d / m                       # samples per replica micro-batch
    tokens = micro * shape.seq
    ranges = ranges or stage_ranges(shape, p * v, cand.partition)
    block_params, first_params, last_params = part_params(shape, l, p * v > 1)
    kept = block_kept(shape, l, micro, elem)

    f_head = shape.head_flops(micro) / t / cluster.flops
    part_fixed = parts_overhead(cluster, l, shape.hidden, tokens) / 2  # per part, fwd + bwd
    comm_block = block_comm_bytes(shape, l, micro, elem)
    f_block, b_block, c_block = block_time(shape, cluster, l, tokens, comm_block)
    recompute = (f_block + 0.5 * c_block) if cand.checkpoint else 0.0
    act_shard = tokens * shape.hidden * elem / (t if l.mode else 1)
    p2p = cluster.group_time('p2p', act_shard, d * t, 2) if p > 1 else 0.0
    if p > 1 and l.mode == '1d' and t > 1:  # 1D sends a 1/t slice, gathered on arrival
        p2p += cluster.group_time('all_gather', tokens * shape.hidden * elem, 1, t)

    fwd, bwd, params_rank, rank_shapes = [], [], [], []
    f_one, b_one = f_block + c_block / 2, b_block + c_block / 2 + recompute
    # an MoE model: its blocks are MoE blocks (the expert-parallel traffic on top), but
    # for the first ``first_dense``, dense blocks (their own parameters and time)
    f_moe, b_moe, moe_bytes = moe_layer_time(cluster, shape, l, tokens, elem)
    f_one, b_one = f_one + f_moe, b_one + b_moe + (f_moe if cand.checkpoint else 0.0)
    dense_rank = ([0] * p if shape.moe is None or not shape.moe.first_dense
                  else rank_dense_blocks(shape, ranges, p))
    expert_block = shape.expert_params(l.mode, t, getattr(l, 'expert', 1))
    if any(dense_rank):
        dense = shape.dense
        dense_params = dense_block_params(shape, l)
        f_d, b_d, c_d = block_time(dense, cluster, l, tokens,
                                   block_comm_bytes(dense, l, micro, elem))
        f_dense = f_d + c_d / 2
        b_dense = b_d + c_d / 2 + ((f_d + 0.5 * c_d) if cand.checkpoint else 0.0)
    else:
        dense_params = f_dense = b_dense = 0.0
    experts_rank = []
    parts = rank_parts(ranges, p, v)
    for rank, (n_blocks, n_stages, first, last) in enumerate(parts):
        n_dense = dense_rank[rank]
        params_rank.append((n_blocks - n_dense) * block_params + n_dense * dense_params
                           + first * first_params + last * last_params)
        experts_rank.append((n_blocks - n_dense) * expert_block)
        fwd.append((n_blocks - n_dense) * f_one + n_dense * f_dense + last * f_head
                   + (first + last) * part_fixed / 3 + p2p * n_stages)
        bwd.append((n_blocks - n_dense) * b_one + n_dense * b_dense + last * 2 * f_head
                   + (first + last) * part_fixed * 2 / 3 + p2p * n_stages)
        held = in_flight(cand.schedule, p, m, v, rank)
        rank_shapes.append(dict(blocks=n_blocks, held=held, last=bool(last),
                                after_backward=m > held, schedule=cand.schedule, rank=rank))
    stage_time = [f + b for f, b in zip(fwd, bwd)]
    slow = max(stage_time)
    pipe = SCHEDULES[cand.schedule].pipeline_time(p, m, v, slow, max(fwd))  # the table's bubble
    if p > 1:
        # oversubscribed cores: ranks waiting in the bubble free their cores, so the
        # schedule's path runs at the alone speed, bounded by the cores' total work
        pipe = max(m * slow, pipe / oversubscription(cluster))
    most = max(n for n, _, _, _ in parts)
    shared = dict(compute=m * most * (f_block + b_block + (f_block if cand.checkpoint
                                                           else 0.0)),
                  tensor_comm=m * most * c_block * (1.5 if cand.checkpoint else 1.0),
                  pipeline=pipe, bubble=pipe - m * slow, block_compute=f_block + b_block,
                  block_forward=f_block,
                  block_comm=c_block, tensor_bytes_per_block=comm_block, p2p=p2p,
                  params=params_rank, activations_per_block=kept,
                  expert_params=experts_rank,
                  moe=dict(all_to_all_bytes_per_layer=moe_bytes, forward_s=f_moe,
                           backward_s=b_moe, layers=shape.moe_layers),
                  expert_comm=m * max(n - nd for (n, _, _, _), nd in zip(parts, dense_rank))
                  * (f_moe + b_moe + (f_moe if cand.checkpoint else 0.0)))
    out = []
    for zero in zeros:
        this = offload.normalized(cand if zero == cand.zero else replace(cand, zero=zero))
        buffers = [rank_memory(shape, l, params=n, micro=micro, microbatches=m, zero=zero,
                               checkpoint=cand.checkpoint, elem=elem, expert_params=x, **rs)
                   for n, x, rs in zip(params_rank, experts_rank, rank_shapes)]
        memory = [b.peak for b in buffers]
        data_whole, data_sharded = MODEL_DATA_BYTES[zero]
        d_e = d // getattr(l, 'expert', 1)     # EXPERT_DATA: an expert shard's replicas
        model_data = [n * data_whole + (n - x) * data_sharded / d + x * data_sharded / d_e
                      for n, x in zip(params_rank, experts_rank)]
        chunks = zero3_chunks(shape, d) if zero == 3 else 1
        heavy = max(range(p), key=lambda r: params_rank[r])
        sync = _gradient_sync(cluster, l, this, params_rank[heavy], elem, chunks,
                              experts_rank[heavy])
        if zero == 3:
            exposed = zero3_exposed(cluster, l, m, max(params_rank) * elem, chunks, fwd[0],
                                    bwd[0])
        elif p == 1 and zero in (0, 2):
            exposed = exposed_sync(sync, bwd[0], max(params_rank) * elem)
        else:
            exposed = sync
        optimizer = optimizer_time(cluster, shape, params_rank, parts, p * v > 1, zero, d,
                                   chunks)
        skew = sync_skew_time(cluster, l, zero, p * v, m)
        terms = dict(shared, gradient_sync=sync, exposed_sync=exposed, model_data=model_data,
                     optimizer=optimizer, memory_buffers=buffers, sync_skew=skew)
        est = Estimate(this, pipe + exposed + optimizer + skew, memory, stage_time, terms)
        out.append(offload.apply(est, shape, cluster, elem) if offload.is_offloaded(this)
                   else est)
    return out


def sync_skew_time(cluster: ClusterProfile, layout, zero: int, stages: int,
                   microbatches: int = 1) -> float:
    """Seconds ranks that time-share cores lose waiting for each other where a step's
    critical path meets a synchronizing call after compute: the profile's
    ``compute['sync_skew_s']`` (``profile.sync_skew``; 0 in profiles without it: a device
    per rank) times the points -- over a data group of 2 or more, the gradient sync after
    the last backward (data parallelism and ZeRO-1/2) and ZeRO-1/2's all_gather of the
    updated weights after the optimizer step, each unless the profile timed that call in a
    step (``step_sync_entry``: its time carries the wait; ZeRO-3's per-chunk calls are
    priced whole by ``zero3_exposed``); in a pipeline, each stage boundary the first
    micro-batch crosses forward and backward (``2 (stages - 1)``) and one more for each
    later micro-batch (the last stage waits on its forward or the first on its returning
    gradient: ``microbatches - 1``). A tensor family's own calls are in its timed blocks."""
    skew = float(cluster.compute.get('sync_skew_s', 0.0))
    if not skew:
        return 0.0
    group = layout.data * (layout.tensor if splits_sequence(layout.mode) else 1)
    points = 2 * (stages - 1) + (microbatches - 1 if stages > 1 else 0)
    if group > 1 and zero in (0, 1, 2):  # unless timed in a step (``data_sync_time``)
        ops = ('reduce_scatter', 'all_gather') if zero else ('all_reduce',)
        points += sum(step_sync_entry(cluster, op, group) is None for op in ops)
    return skew * points


def exposed_sync(sync: float, backward: float, grad_bytes: float,
                 bucket_bytes: int = DP_BUCKET_BYTES) -> float:
    """Seconds of a gradient sync of ``sync`` seconds not hidden behind the last micro-batch's
    ``backward``: the gradients go in ``k = ceil(grad_bytes / bucket_bytes)`` buckets, each
    started when its last gradient is ready, so the last bucket's share ``sync / k`` always
    follows the backward; the earlier ``(k - 1) / k`` overlap it, both slowed
    ``OVERLAP_SLOWDOWN``x while they do."""
    k = max(1, -(-int(grad_bytes) // bucket_bytes))
    early = sync * (k - 1) / k
    return (sync - early + max(0.0, early - backward)
            + (OVERLAP_SLOWDOWN - 1) * min(early, backward))


def optimizer_time(cluster: ClusterProfile, shape: ModelShape, params_rank: Sequence[float],
                   parts, pipelined: bool, zero: int, data: int, chunks: int) -> float:
    """Seconds of the AdamW step on the busiest rank: ``compute['adam_s_per_param']`` per
    element it updates (ZeRO: its 1/D) plus ``compute['adam_s_per_tensor']`` per tensor it
    steps (torch's per-tensor loop on CPU): without ZeRO every local parameter tensor,
    ZeRO-1/2 one flat slice per ``ZERO_BUCKET_BYTES`` bucket, ZeRO-3 one per chunk."""
    per_param = float(cluster.compute.get('adam_s_per_param', 0.0))
    per_tensor = float(cluster.compute.get('adam_s_per_tensor', 0.0))
    block, first, last = part_tensors(shape, pipelined)
    out = 0.0
    for n, (blocks, _, has_first, has_last) in zip(params_rank, parts):
        if zero == 0:
            tensors = blocks * block + has_first * first + has_last * last
        elif zero == 3:
            tensors = chunks
        else:
            tensors = -(-int(n) * 4 // ZERO_BUCKET_BYTES)
        out = max(out, per_param * n / (data if zero else 1) + per_tensor * tensors)
    return out


@lru_cache(maxsize=256)
def part_tensors(shape: ModelShape, pipelined: bool) -> Tuple[int, int, int]:
    """Parameter tensors of a block, of the first part and of the last part (a tensor
    parallel rank holds a shard of each: the same count)."""
    return (len(tensor_numels(shape.block_layers())), len(tensor_numels(shape.first_layers())),
            len(tensor_numels(shape.last_layers(pipelined))))


def zero3_exposed(cluster: ClusterProfile, layout, microbatches: int, nbytes: float,
                  chunks: int, forward: float, backward: float,
                  group: Optional[Tuple[int, int]] = None) -> float:
    """Seconds ZeRO-3's traffic adds to a step (``nbytes`` of local parameters in ``chunks``
    chunks): each chunk's reduce_scatter per micro-step, exposed; and per pass (the forward
    and the backward of each micro-batch, ``forward`` / ``backward`` seconds) one all_gather
    ``g`` per chunk, prefetched one chunk ahead (``zero.prefetch``): the first waits whole,
    each later one overlaps the compute of the chunk before it (``pass / chunks``), both
    slowed ``OVERLAP_SLOWDOWN``x while they overlap."""
    stride, size = group or (layout.tensor, layout.data)   # (stride, size) of the group
    one = nbytes / chunks
    gather = cluster.group_time('all_gather', one, stride, size)
    scatter = microbatches * chunks * cluster.group_time('reduce_scatter', one, stride, size)

    def exposed(compute: float) -> float:
        per_chunk = compute / chunks
        return gather + (chunks - 1) * (max(0.0, gather - per_chunk)
                                        + (OVERLAP_SLOWDOWN - 1) * min(gather, per_chunk))
    return scatter + microbatches * (exposed(forward) + exposed(backward))


@lru_cache(maxsize=256)
def zero3_chunks(shape: ModelShape, data: int) -> int:
    """Chunks chunk ZeRO (ZeRO-3) packs the model's parameters into: the runtime's
    ``search_chunk_size`` over the parameter tensors (serial sizes, in model order: 1D splits
    them about evenly, which keeps the count) for a data group of ``data``. Each chunk is one
    all_gather per forward and per backward and one reduce_scatter per micro-step."""
    return search_chunk_size(shape.model_numels(), dp_sizes=(data,)).chunks


def _gradient_sync(cluster: ClusterProfile, layout, cand: Candidate, params: float,
                   elem: int, chunks: int = 1, expert_params: float = 0.0) -> float:
    """Seconds of the data-parallel gradient traffic (``formulas.gradient_sync_bytes``) of
    the heaviest stage, over the data group (stride t, size D; sequence mode: D*t); ZeRO-3
    moves it in ``chunks`` calls per all_gather / reduce_scatter (``zero3_exposed`` with no
    compute to hide behind). Of an MoE model's ``params``, the ``expert_params`` are summed
    (and ZeRO-sharded) over EXPERT_DATA instead (``gradient_handler.gradient_axis``): D / E
    ranks ``E t`` apart (sequence modes: the D t / E ranks of expert_data x tensor), the same
    collectives on their own buckets."""
    d, t, e = layout.data, layout.tensor, getattr(layout, 'expert', 1)
    group = (1, d * t) if splits_sequence(layout.mode) else (t, d)
    if not expert_params or e == 1:   # EXPERT_DATA = DATA: every gradient in one sync
        return _sync_over(cluster, cand, params, elem, chunks, *group)
    expert_group = (1, d * t // e) if splits_sequence(layout.mode) else (e * t, d // e)
    return (_sync_over(cluster, cand, params - expert_params, elem, chunks, *group)
            + _sync_over(cluster, cand, expert_params, elem, chunks, *expert_group))


def _sync_over(cluster: ClusterProfile, cand: Candidate, params: float, elem: int,
               chunks: int, stride: int, size: int) -> float:
    """:func:`_gradient_sync` of ``params`` elements over a group of ``size`` ranks
    ``stride`` apart."""
    if size == 1 or params <= 0:
        return 0.0
    n = formulas.gradient_sync_bytes(cand.zero, int(params), cand.microbatches, elem)
    one = params * elem
    if cand.zero == 0:
        return data_sync_time(cluster, 'all_reduce', n, stride, size)
    if cand.zero == 3:  # every call per chunk, none hidden behind compute
        return zero3_exposed(cluster, None, cand.microbatches, one, chunks, 0.0, 0.0,
                             group=(stride, size))
    rs_calls = {1: 1, 2: cand.microbatches}[cand.zero]
    return (rs_calls * data_sync_time(cluster, 'reduce_scatter', one, stride, size)
            + data_sync_time(cluster, 'all_gather', one, stride, size))


def step_sync_entry(cluster: ClusterProfile, op: str, size: int):
    """``compute['step_sync'][op][str(size)]`` -- (α, β) of ``op`` over a data group of
    ``size`` ranks timed right after a backward (``profile.measure_families``) -- or None
    where the profile has no such timing (hand-written profiles: a device per rank)."""
    return cluster.compute.get('step_sync', {}).get(op, {}).get(str(size))


def data_sync_time(cluster: ClusterProfile, op: str, nbytes: float, stride: int,
                   size: int) -> float:
    """Seconds of a data-group gradient sync call of ``nbytes``: the profile's in-step α-β
    (:func:`step_sync_entry`: on ranks time-sharing cores, the collective after compute
    costs more than alone) where it has one for this group size, else the collective's
    α-β (``ClusterProfile.group_time``; :func:`sync_skew_time` then adds the skew)."""
    entry = step_sync_entry(cluster, op, size)
    if entry is None or nbytes <= 0:
        return cluster.group_time(op, nbytes, stride, size)
    return float(entry[0]) + float(entry[1]) * nbytes
