"""The search: every executable layout for N devices, each costed by ``cost.evaluate``.

1. :func:`layouts` -- every ``ParallelLayout`` with ``data * pipeline * tensor = N`` (and,
   for an MoE model, every expert degree E dividing the data size and the experts,
   :func:`expert_options`; no 2D/2.5D/3D, which split the hidden vector MoE routes) whose
   tensor family splits the model and the batch (the size rules ``colossal-lite train``
   checks, ``job._check_rule``), pipeline P <= layers; tensor modes 1D, 2D, 2.5D, 3D, the
   sequence ring and Ulysses (:func:`ring_options`: pure, R = 1, and the ring x Ulysses
   hybrids 1 < R < t). A layout whose sizes the rules refuse is skipped with the rule's
   message (:func:`layout_choices`; ``SearchResult.skipped``), e.g. Ulysses where U does
   not divide the heads;
2. for each: micro-batch counts M, schedules (1F1B, GPipe, zero bubble, interleaved V=2),
   partitions ('uniform', 'parameters'), ZeRO stages (3 only without pipeline, serial or
   1D tensor: what the chunk engine runs), checkpointing of all blocks or none;
3. a ZeRO-3 or ZeRO-1/2 candidate that does not fit is also costed offloaded
   (``offload.variants``: chunk placements 'cpu' and 'static', ``offload_optimizer``), from
   its device estimate; with one data replica, where ZeRO on the device only adds work,
   its stages are costed offloaded only (``offload.offload_only_stages``);
4. the fastest candidate that fits the memory wins (:func:`search`).

Per-layer choices (a checkpoint flag per block, an explicit pipeline cut) are searched for
the chosen layout only and written into its config (``planner.per_layer_choices``): :func:`dp_layers`
(Galvatron-BMW's dynamic program over (layer, memory budget), cross-checked against
:func:`exhaustive_layers`) and :func:`bmw_partition` (memory-balanced cut moved toward
time balance while memory fits).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import colossal_lite.auto.offload as offload

from ..config import ConfigError, ParallelLayout
from ..config.checks import integer_root
from ..config.families import family
from ..config.layout import EXPERT_TENSOR_MODES
from ..config.job import DataSection, JobSpec, ModelSection, TrainSection
from ..job.checks import check_rule
from ..models import SizeRule
from .cluster import ClusterProfile
from .cost import Candidate, Estimate, evaluate_zero_stages, stage_ranges
from .model_spec import ModelShape
from .zero_stages import runtime_zero_stages

SCHEDULES = ('1f1b', 'gpipe', 'zero_bubble', 'interleaved')


def divisors(n: int) -> List[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def tensor_options(t: int) -> List[Tuple[Optional[str], int]]:
    """(mode, depth) of every tensor family that runs on t ranks."""
    if t == 1:
        return [(None, 1)]
    out = [('1d', 1), ('sequence', 1), ('ulysses', 1)]
    if integer_root(t, 2):
        out.append(('2d', 1))
    for dep in divisors(t):
        if dep > 1 and integer_root(t // dep, 2) and t // dep > 1:
            out.append(('2.5d', dep))
    if integer_root(t, 3):
        out.append(('3d', 1))
    return out


def ring_options(mode: Optional[str], t: int) -> List[int]:
    """The ring degrees R of tensor mode ``mode`` on t ranks (``parallel.tensor.ring``):
    Ulysses every R dividing t with U = t / R >= 2 (R = 1 pure Ulysses, 1 < R < t the
    ring x Ulysses hybrid; R = t would be the ring alone: mode 'sequence'); 1 otherwise."""
    if mode != 'ulysses':
        return [1]
    return [r for r in divisors(t) if r < t]


def job_spec(shape: ModelShape, batch: int):
    """A ``job.JobSpec`` for the planner's model and batch (what ``check_layout`` reads):
    text of ``seq`` tokens, or images (``traits.inputs``)."""
    data = (DataSection('hf', seq_len=shape.seq) if shape.traits.inputs == 'tokens'
            else DataSection('digits'))
    return JobSpec(model=ModelSection(shape.kind, shape.preset), options=shape.opts, data=data,
                   train=TrainSection(global_batch_size=batch))


def splits_ok(spec, layout: ParallelLayout) -> bool:
    """The size rules of ``check_layout`` (without its meta build): heads, hidden, vocabulary,
    sequence, image against the tensor family's splits."""
    return split_error(spec, layout) is None


def split_error(spec, layout: ParallelLayout) -> Optional[str]:
    """The message of the first size rule of ``check_layout`` ``layout`` breaks (heads, kv
    heads, hidden, vocabulary, sequence, image against the tensor family's splits), then of
    the entry's own ``check(options, layout)`` (e.g. Llama's ``model.moe`` against
    ``parallel.expert`` and the expert width against 1D); None when it keeps them all."""
    fam = family(layout.mode)
    rules = list(spec.entry.size_rules(spec.options))
    if spec.is_text:
        rules.append(SizeRule('data.seq_len', spec.data.seq_len, 'sequence'))
    try:
        for rule in rules:
            check_rule(rule, layout, fam)
        if spec.entry.check is not None:
            spec.entry.check(spec.options, layout)
    except ConfigError as err:
        return str(err)
    return None


def expert_options(shape: ModelShape, layout: ParallelLayout) -> List[int]:
    """The expert-parallel degrees E of ``layout`` (``parallel.expert``): for an MoE model
    every E dividing both the data size and the experts (expert groups carved out of the
    data axis); 1 for a dense model."""
    if shape.moe is None:
        return [1]
    return [e for e in divisors(layout.data) if shape.moe.experts % e == 0]


def layout_choices(shape: ModelShape, devices: int, batch: int
                   ) -> Iterator[Tuple[ParallelLayout, Optional[str]]]:
    """Every layout of ``devices`` ranks with a pipeline no deeper than the layers and a
    data degree dividing the batch, each with None when the model's sizes allow it, else
    the size rule's message (why the search skips it)."""
    spec = job_spec(shape, batch)
    for p in divisors(devices):
        if p > shape.layers:
            continue
        for t in divisors(devices // p):
            d = devices // p // t
            if batch % d:
                continue
            for mode, depth in tensor_options(t):
                for ring in ring_options(mode, t):
                    layout = ParallelLayout(p, t, mode, depth, d, ring=ring)
                    if shape.moe is not None and mode not in EXPERT_TENSOR_MODES:
                        yield layout, (f"an MoE layer needs each token's hidden vector "
                                       f"whole; tensor mode {mode!r} splits it (MoE runs "
                                       f"with {EXPERT_TENSOR_MODES})")
                        continue
                    for expert in expert_options(shape, layout):
                        if expert > 1:
                            layout = ParallelLayout(p, t, mode, depth, d, ring=ring,
                                                    expert=expert)
                        yield layout, split_error(spec, layout)


def layouts(shape: ModelShape, devices: int, batch: int) -> Iterator[ParallelLayout]:
    """Every layout of ``devices`` ranks the model's sizes allow (module doc, step 1)."""
    for layout, why in layout_choices(shape, devices, batch):
        if why is None:
            yield layout


def microbatch_options(layout: ParallelLayout, batch: int, limit: int = 64) -> List[int]:
    """M (powers of two and multiples of P) with each replica's micro-batch split by the
    family's ``batch_split``."""
    per_replica = batch // layout.data
    split = family(layout.mode).batch_split(layout)
    cands = {2 ** k for k in range(8)} | {layout.pipeline * k for k in (1, 2, 4, 8)}
    return sorted(m for m in cands if m <= min(limit, per_replica) and per_replica % m == 0
                  and (per_replica // m) % split == 0)


def candidates(shape: ModelShape, layout: ParallelLayout, batch: int) -> Iterator[Candidate]:
    """Every executable candidate of ``layout`` (module doc, step 2)."""
    for cand, zeros in candidate_groups(shape, layout, batch):
        for zero in zeros:
            yield Candidate(layout, cand.microbatches, cand.schedule, cand.chunks,
                            cand.partition, zero, cand.checkpoint)


def candidate_groups(shape: ModelShape, layout: ParallelLayout, batch: int
                     ) -> Iterator[Tuple[Candidate, Tuple[int, ...]]]:
    """The candidates of ``layout`` as (candidate with ZeRO 0, the ZeRO stages it runs with)."""
    p = layout.pipeline
    # one replica: ZeRO shards nothing on the device (offload.offload_only_stages)
    zeros = runtime_zero_stages(layout) if layout.data > 1 else (0,)
    for m in microbatch_options(layout, batch):
        scheds = [('1f1b', 1)] if p == 1 else []
        if p > 1:
            scheds = [(s, 1) for s in ('1f1b', 'zero_bubble') if m >= p] + [('gpipe', 1)]
            if m >= p and m % p == 0 and shape.layers >= 2 * p:
                scheds.append(('interleaved', 2))
        parts = ['uniform'] if p == 1 else ['uniform', 'parameters']
        for (sched, v), part, ckpt in itertools.product(scheds, parts, (False, True)):
            yield Candidate(layout, m, sched, v, part, 0, ckpt), zeros


@dataclass
class SearchResult:
    """The fastest fitting estimate first; ``feasible`` sorted by step time; ``rejected``
    counts the candidates that do not fit; ``evaluated`` how many were costed; ``skipped``
    the layouts the model's sizes refuse, each with the size rule's message."""

    feasible: List[Estimate]
    infeasible: List[Estimate]
    evaluated: int
    budget: float
    skipped: List[Tuple[ParallelLayout, str]] = field(default_factory=list)

    @property
    def best(self) -> Optional[Estimate]:
        return self.feasible[0] if self.feasible else None


def search(shape: ModelShape, cluster: ClusterProfile, devices: int, batch: int,
           memory_bytes: Optional[float] = None, keep_infeasible: int = 20) -> SearchResult:
    """Cost every candidate of every layout; feasible = peak memory <= budget."""
    budget = cluster.memory_bytes if memory_bytes is None else memory_bytes
    feasible, infeasible, skipped, count = [], [], [], 0
    ranges_cache: Dict[Tuple[int, str], List[range]] = {}
    for layout, why in layout_choices(shape, devices, batch):
        if why is not None:
            skipped.append((layout, why))
            continue
        hosted = offload.offload_only_stages(layout)
        for cand, zeros in candidate_groups(shape, layout, batch):
            key = (cand.stages, cand.partition)
            if key not in ranges_cache:
                ranges_cache[key] = stage_ranges(shape, cand.stages, cand.partition)
            for est in evaluate_zero_stages(shape, cluster, cand, zeros + hosted, batch,
                                            ranges=ranges_cache[key]):
                if est.candidate.zero not in hosted:
                    count += 1
                    (feasible if est.peak_memory <= budget else infeasible).append(est)
                if est.peak_memory > budget:   # only then can offloading matter
                    for var in offload.variants(est, shape, cluster):
                        count += 1
                        (feasible if var.peak_memory <= budget else infeasible).append(var)
    feasible.sort(key=lambda e: (e.step_time, e.peak_memory))
    infeasible.sort(key=lambda e: e.peak_memory)
    return SearchResult(feasible, infeasible[:keep_infeasible], count, budget, skipped)


# ---------------------------------------------------------------------------- per-layer DP
def dp_layers(options: Sequence[Sequence[Tuple[float, float]]], budget: float,
              quantum: Optional[float] = None) -> Tuple[float, List[int]]:
    """Galvatron-BMW's dynamic program: choose one ``(time, memory)`` option per layer to
    minimize total time with total memory <= ``budget``. Memory is counted in units of
    ``quantum`` (rounded up; default budget / 1024). Returns (time, chosen option per layer);
    (inf, []) when nothing fits. O(layers x units x options)."""
    quantum = quantum or budget / 1024 or 1.0
    units = int(math.floor(budget / quantum + 1e-9))
    inf = math.inf
    best = [0.0] + [inf] * units   # best[u]: min time using exactly <= u units so far
    best = [0.0] * (units + 1)
    choice: List[List[int]] = []
    for opts in options:
        new = [inf] * (units + 1)
        pick = [-1] * (units + 1)
        cost = [(t, int(math.ceil(mem / quantum - 1e-9))) for t, mem in opts]
        for u in range(units + 1):
            for k, (t, need) in enumerate(cost):
                if need <= u and best[u - need] + t < new[u]:
                    new[u], pick[u] = best[u - need] + t, k
        best = new
        choice.append(pick)
    if best[units] == inf:
        return inf, []
    # walk back: at each layer, the option chosen for the remaining units
    picks, u = [], units
    for layer in range(len(options) - 1, -1, -1):
        k = choice[layer][u]
        picks.append(k)
        u -= int(math.ceil(options[layer][k][1] / quantum - 1e-9))
    return best[units], picks[::-1]


def exhaustive_layers(options: Sequence[Sequence[Tuple[float, float]]], budget: float,
                      quantum: Optional[float] = None) -> Tuple[float, List[int]]:
    """Every combination of :func:`dp_layers`' options, with the same memory rounding."""
    quantum = quantum or budget / 1024 or 1.0
    units = int(math.floor(budget / quantum + 1e-9))
    best, arg = math.inf, []
    for combo in itertools.product(*[range(len(o)) for o in options]):
        need = sum(int(math.ceil(options[i][k][1] / quantum - 1e-9)) for i, k in enumerate(combo))
        time = sum(options[i][k][0] for i, k in enumerate(combo))
        if need <= units and time < best - 1e-12:
            best, arg = time, list(combo)
    return best, arg


# ---------------------------------------------------------------------------- partition
def bmw_partition(start: Sequence[int], fits: Callable[[List[range]], bool],
                  stage_time: Callable[[List[range]], List[float]]) -> List[range]:
    """Galvatron-BMW's bi-objective cut: from the memory-balanced cut (``start``: blocks per
    stage), move one boundary block at a time to a neighbouring stage, taking the move that
    best lowers the stage times sorted slowest first (moves that keep them equal walk a
    plateau, each cut visited once), while the cut still ``fits`` in memory; the best cut seen."""
    sizes = list(start)
    stages = len(sizes)

    def ranges(sz):
        out, first = [], 0
        for n in sz:
            out.append(range(first, first + n))
            first += n
        return out
    def key(sz):  # the slowest stage first, then the next slowest: balance breaks ties
        return sorted(stage_time(ranges(sz)), reverse=True)
    current = best_key = key(sizes)
    best_sizes, seen = list(sizes), {tuple(sizes)}
    for _ in range(sum(sizes) * stages):  # plateaus of equal keys are walked, never revisited
        moves = []
        for src in range(stages):
            for dst in (src - 1, src + 1):
                if not 0 <= dst < stages or sizes[src] <= 1:
                    continue
                trial = list(sizes)
                trial[src] -= 1
                trial[dst] += 1
                if tuple(trial) in seen:
                    continue
                new = key(trial)
                if new <= current and fits(ranges(trial)):
                    moves.append((new, trial))
        if not moves:
            break
        current, sizes = min(moves)
        seen.add(tuple(sizes))
        if current < best_key:
            best_key, best_sizes = current, list(sizes)
    return ranges(best_sizes)
