"""Measure this machine into a :class:`~colossal_lite.auto.cluster.ClusterProfile` (seconds).

* α-β: each collective (all_reduce, all_gather, reduce_scatter, all_to_all; broadcast and
  reduce too) at group sizes 2 (consecutive ranks: the PARALLEL_1D groups of a 4-rank
  world with 1D tensor size 2) and 4 (GLOBAL) on local gloo processes
  (``launcher.run_ranks``), timed over a few message sizes; :func:`fit_alpha_beta`
  fits ``t = alpha + beta * bytes`` by least squares; p2p as half a send/recv ping-pong
  between the two ranks of a pair. One machine is one node: every entry is ``intra``.
* compute: forward and backward of one model_zoo ``TransformerLayer`` at a few batch sizes
  on each of the 4 ranks at once (one thread each, as training runs); ``flops`` = the block
  FLOPs (``ModelShape.block_flops``, backward 2x) / measured time, median over ranks.
* ``compute['sync_skew_s']``: what a small all_reduce over every rank costs after the same
  compute on each, beyond the slowest rank's compute and the all_reduce alone
  (:func:`sync_skew`): ranks time-sharing cores reach a synchronizing call at different
  times (0 or absent: a device per rank).
* ``compute['step_sync']``: α-β of the data-parallel gradient syncs (all_reduce; ZeRO's
  reduce_scatter and all_gather) over data groups of 2 and 4 ranks, each timed right
  after the backward of a real model (``measure_families``, :func:`step_sync_points`):
  from the last rank's backward end to the sync's end. Inside a step a collective over
  ranks that time-share cores costs more than timed alone after a barrier.
* ``compute['ranks']`` / ``compute['cores']``: the ranks timed at once and the cores they
  shared (``os.sched_getaffinity``): more ranks than cores time-share them, so a block
  timed with every rank busy (``family_blocks``) is ``ranks / cores`` times slower than
  one running alone (the cost model's oversubscription, ``cost.oversubscription``).

``python -m colossal_lite.auto.profile [--rounds R] out.json`` writes the JSON (R rounds:
every entry the median of R whole measurements, :func:`median_tree`); ``out.json
--combine A.json B.json ...`` measures nothing and writes the median over every round of profiles
measured at other times (:func:`combine`). ``out.json --ranks 8 --base A.json`` writes A for 8 local
ranks: the collectives measured again on 8 (groups of 2, 4 and 8), the FLOP rate scaled to
the cores' share (:func:`with_ranks`).
"""
from __future__ import annotations

import math
import os
import statistics
import sys
import time
from typing import Dict, List, Sequence, Tuple

import torch

import colossal_lite.communication as comm

from ..context import ParallelMode
from ..context import global_context as gpc
from ..engine.gradient_handler import data_parallel_axis
from ..launcher import run_ranks
from ..models import get_model, load_entry_points, registered_models
from .cluster import ClusterProfile, load_profile
from .model_spec import ModelShape

OPS = ('all_reduce', 'all_gather', 'reduce_scatter', 'all_to_all', 'broadcast', 'reduce')
SIZES = (1 << 8, 1 << 12, 1 << 16, 1 << 20, 1 << 22)   # buffer bytes: small calls fix alpha
REPEATS = 5
BLOCK_BATCHES = (1, 2, 4, 8)
STEP_SYNC_OPS = ('all_reduce', 'reduce_scatter', 'all_gather')   # a step's data-group syncs


def fit_alpha_beta(nbytes: Sequence[float], seconds: Sequence[float]) -> Tuple[float, float]:
    """Least-squares ``seconds = alpha + beta * nbytes`` in relative error (each point
    weighted by 1 / its time, so the small calls that set alpha count as much as the large
    ones that set beta); alpha clipped at 0, beta at a tiny positive value (a noisy fit never
    predicts negative time)."""
    if len(nbytes) != len(seconds) or len(nbytes) < 2:
        raise ValueError(f'fit needs >= 2 (size, time) pairs of equal length, got '
                         f'{len(nbytes)} sizes and {len(seconds)} times')
    w = [1.0 / max(float(s), 1e-12) for s in seconds]
    a = torch.tensor([[wi, wi * float(n)] for wi, n in zip(w, nbytes)], dtype=torch.float64)
    y = torch.tensor([wi * float(s) for wi, s in zip(w, seconds)],
                     dtype=torch.float64).unsqueeze(1)
    sol = torch.linalg.lstsq(a, y).solution.squeeze(1)
    return max(0.0, float(sol[0])), max(1e-15, float(sol[1]))


def _one(op: str, elems: int, axis) -> None:
    x = torch.ones(elems)
    if op == 'all_reduce':
        comm.all_reduce(x, axis)
    elif op == 'all_gather':
        comm.all_gather(x[: elems // axis.size], axis)
    elif op == 'reduce_scatter':
        comm.reduce_scatter(x, axis)
    elif op == 'all_to_all':
        comm.all_to_all(x.view(axis.size, -1), axis, 0, 0)
    elif op == 'broadcast':
        comm.broadcast(x, axis)
    else:
        comm.reduce(x, axis)


def _group_modes() -> List[ParallelMode]:
    """The groups whose collectives are timed: the pair (PARALLEL_1D), DATA where it is a
    size of its own (world / 2 > 2), and the world."""
    modes, sizes = [], set()
    for mode in (ParallelMode.PARALLEL_1D, ParallelMode.DATA, ParallelMode.GLOBAL):
        size = gpc.get_world_size(mode)
        if size > 1 and size not in sizes:
            modes.append(mode)
            sizes.add(size)
    return modes


def _time_collectives(rank: int, sizes: Sequence[int], repeats: int,
                      compute: bool = True) -> Dict[str, dict]:
    """On every rank: one block's timings (every rank computing at once, as in training;
    skipped without ``compute``), then the median seconds of each op per (group size,
    buffer bytes)."""
    torch.set_num_threads(1)
    comm.barrier()
    out: Dict[str, dict] = {}
    if compute:
        per_tensor, per_param = measure_adam()
        out.update(block=measure_block(), adam_s_per_param=per_param,
                   adam_s_per_tensor=per_tensor)
    for mode in _group_modes():
        axis = gpc.axis(mode)
        for op in OPS:
            for nbytes in sizes:
                elems = nbytes // 4
                _one(op, elems, axis)  # warm-up
                times = []
                for _ in range(repeats):
                    comm.barrier(mode)
                    start = time.perf_counter()
                    _one(op, elems, axis)
                    times.append(time.perf_counter() - start)
                out.setdefault(op, {}).setdefault(str(axis.size), []).append(
                    (nbytes, statistics.median(times)))
    axis = gpc.axis(ParallelMode.PARALLEL_1D)
    for nbytes in sizes:  # p2p: a ping-pong between the two ranks of a pair, half of it
        x = torch.ones(nbytes // 4)
        times = []
        for i in range(repeats + 1):
            comm.barrier(ParallelMode.PARALLEL_1D)
            start = time.perf_counter()
            if axis.rank == 0:
                comm.send(x, axis, 1)
                comm.recv(x, axis, 1)
            else:
                comm.recv(x, axis, 0)
                comm.send(x, axis, 0)
            if i:
                times.append((time.perf_counter() - start) / 2)
        out.setdefault('p2p', {}).setdefault('2', []).append((nbytes, statistics.median(times)))
    out['skew'] = _time_skew(repeats * 4)
    return out


def _time_skew(repeats: int, elems: int = 1024) -> Dict[str, List[float]]:
    """Per repeat on this rank: a small all_reduce over every rank after a barrier
    (``bare``), and after the same fixed compute on every rank (``compute``: its seconds;
    ``total``: barrier to the all_reduce's end), as a training step's synchronizing
    collective follows its forward/backward."""
    axis = gpc.axis(ParallelMode.GLOBAL)
    x, a = torch.ones(elems), torch.full((128, 128), 0.01)
    out: Dict[str, List[float]] = {'bare': [], 'compute': [], 'total': []}
    for i in range(repeats + 1):
        comm.barrier()
        start = time.perf_counter()
        comm.all_reduce(x, axis)
        bare = time.perf_counter() - start
        comm.barrier()
        start = time.perf_counter()
        y = a
        for _ in range(40):
            y = torch.tanh(y @ a)
        mid = time.perf_counter()
        comm.all_reduce(x, axis)
        if i:
            out['bare'].append(bare)
            out['compute'].append(mid - start)
            out['total'].append(time.perf_counter() - start)
    return out


def sync_skew(per_rank: Sequence[Dict[str, List[float]]]) -> float:
    """Seconds a synchronizing collective after compute costs beyond the slowest rank's
    compute and the collective alone (``_time_skew`` of every rank): the median over
    repeats of (the last rank's end - the slowest compute) minus the median bare
    collective (slowest rank), at least 0. Ranks time-sharing cores finish a phase at
    different times and the collective waits for the one the scheduler ran last."""
    repeats = range(len(per_rank[0]['total']))
    after = statistics.median(max(r['total'][i] for r in per_rank)
                              - max(r['compute'][i] for r in per_rank) for i in repeats)
    bare = statistics.median(max(r['bare'][i] for r in per_rank) for i in repeats)
    return max(0.0, after - bare)


def measure_ranks(sizes: Sequence[int] = SIZES, repeats: int = REPEATS, world: int = 4,
                  compute: bool = True
                  ) -> Tuple[Dict[str, Dict[str, Dict[str, list]]], List[dict]]:
    """(``collectives`` table of a profile: op -> str(p) -> {'intra': [alpha, beta]},
    every rank's block timings, none without ``compute``) on ``world`` local ranks: groups of
    2, world / 2 and world."""
    config = dict(parallel=dict(tensor=dict(size=2, mode='1d')))
    results = run_ranks(_time_collectives, world, config, tuple(sizes), repeats, compute,
                        timeout=300 * max(1, world // 4))
    table: Dict[str, Dict[str, Dict[str, list]]] = {}
    for op in OPS + ('p2p',):
        for p, points in results[0][op].items():
            # the slowest rank's time per size: a collective ends when its last rank does
            worst = [max(r[op][p][i][1] for r in results) for i in range(len(points))]
            alpha, beta = fit_alpha_beta([n for n, _ in points], worst)
            table.setdefault(op, {})[p] = {'intra': [alpha, beta]}
    if not compute:
        return table, []
    skew = sync_skew([r['skew'] for r in results])
    return table, [dict(r['block'], adam_s_per_param=r['adam_s_per_param'],
                        adam_s_per_tensor=r['adam_s_per_tensor'], sync_skew_s=skew)
                   for r in results]


ADAM_SHAPES = ((4, 1 << 20), (16, 1 << 18), (64, 1 << 14), (256, 1 << 14))  # (tensors, elems)


def measure_adam(shapes: Sequence[Tuple[int, int]] = ADAM_SHAPES, repeats: int = 7
                 ) -> Tuple[float, float]:
    """(seconds per tensor, seconds per element) of a ``torch.optim.AdamW`` step: timed on
    each (tensors, elements) of ``shapes`` (the median of ``repeats``) and fitted by least
    squares in relative error, ``t = per_tensor * tensors + per_element * elements`` (torch's
    per-tensor loop on CPU costs about as much as a few thousand elements)."""
    rows, times = [], []
    for tensors, elems in shapes:
        weights = [torch.nn.Parameter(torch.zeros(elems // tensors)) for _ in range(tensors)]
        for w in weights:
            w.grad = torch.ones_like(w)
        opt = torch.optim.AdamW(weights, lr=1e-3)
        opt.step()  # allocates the moments
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            opt.step()
            samples.append(time.perf_counter() - start)
        rows.append((tensors, elems))
        times.append(statistics.median(samples))
    w = [1.0 / t for t in times]
    a = torch.tensor([[wi * n, wi * e] for wi, (n, e) in zip(w, rows)], dtype=torch.float64)
    y = torch.tensor([wi * t for wi, t in zip(w, times)], dtype=torch.float64).unsqueeze(1)
    per_tensor, per_elem = torch.linalg.lstsq(a, y).solution.squeeze(1).tolist()
    return max(0.0, per_tensor), max(1e-15, per_elem)


def profile_kind() -> str:
    """The registered model whose blocks the profile times: the one entry registered with
    ``profile=True`` (``colossal_lite.models.ModelEntry``; entry points loaded first)."""
    load_entry_points()
    kinds = [k for k in registered_models() if get_model(k).profile]
    if len(kinds) != 1:
        raise ValueError(f'the profile times the blocks of the one model registered with '
                         f'profile=True; found {kinds or "none"}')
    return kinds[0]


def _profile_model(kind: str = None, **options):
    """The profile's model (``kind``, default :func:`profile_kind`) built with ``options``."""
    return get_model(kind or profile_kind()).builder(**options)


def measure_block(hidden: int = 128, heads: int = 4, seq: int = 64,
                  batches: Sequence[int] = BLOCK_BATCHES, repeats: int = 5, warmup: int = 2,
                  kind: str = None) -> dict:
    """Forward / backward seconds of one serial pre-LN block at each batch size (the fastest
    of ``repeats`` after ``warmup``: on a shared machine noise only adds time), and
    ``fit_alpha_beta`` of forward + backward against the FLOPs: ``overhead`` (seconds a
    block costs whatever its size: Python, dispatch, small kernels) and ``flops`` (the
    rate of the FLOP-proportional part). ``kind``: the model whose block is timed (default
    :func:`profile_kind`)."""
    kind = kind or profile_kind()
    torch.manual_seed(0)
    model = _profile_model(kind, vocab_size=256, max_positions=seq, hidden=hidden, heads=heads,
                           layers=1, dropout=0.0)
    shape = ModelShape(kind, None, (('hidden', hidden), ('heads', heads), ('layers', 1)), seq)
    block = getattr(model, shape.names.blocks)['0']   # its one block
    fwd, bwd, flop_counts = [], [], []
    for b in batches:
        x = torch.randn(b, seq, hidden, requires_grad=True)
        f_times, b_times = [], []
        for i in range(repeats + warmup):
            start = time.perf_counter()
            y = block(x)
            mid = time.perf_counter()
            y.sum().backward()
            end = time.perf_counter()
            if i >= warmup:
                f_times.append(mid - start)
                b_times.append(end - mid)
        fwd.append(min(f_times))
        bwd.append(min(b_times))
        flop_counts.append(3 * shape.block_flops(b * seq))
    overhead, per_flop = fit_alpha_beta(flop_counts, [f + b for f, b in zip(fwd, bwd)])
    return dict(hidden=hidden, heads=heads, seq=seq, batches=list(batches), forward_s=fwd,
                backward_s=bwd, flops=1.0 / per_flop, overhead=overhead)


# Ulysses (stop 35): untimed, its FLOPs + all_to_all α-β priced it 1.3 - 1.9x too fast against
# the timed families on held-out shapes; a Ulysses x ring layout on t ranks takes the Ulysses
# block of t ranks (``family_entry``)
FAMILY_LAYOUTS = ((None, 1), ('1d', 2), ('1d', 4), ('2d', 4), ('sequence', 2), ('sequence', 4),
                  ('ulysses', 2), ('ulysses', 4))
# the profile model's options (ModelEntry.profile: the options such a model takes)
FAMILY_MODEL = dict(vocab_size=256, max_positions=64, hidden=128, heads=4, dropout=0.0)
FAMILY_HIDDENS = (64, 128)   # block widths timed: the cost model takes the nearest (log scale)
FAMILY_BATCHES = (2, 4, 8, 16)   # samples per data replica (2D splits it by q = 2)
FAMILY_REPEATS = 11


def _family_shape(hidden: int = FAMILY_MODEL['hidden']):
    """The ``ModelShape`` of one ``FAMILY_MODEL`` block at width ``hidden`` (s = 64)."""
    return ModelShape(profile_kind(), None,
                      tuple(sorted(dict(FAMILY_MODEL, hidden=hidden, layers=1).items())), 64)


def _time_family(rank: int, hiddens: Sequence[int], batches: Sequence[int], repeats: int
                 ) -> Dict[str, List[float]]:
    """Forward + backward seconds of a 1- and a 2-block profile model (:func:`profile_kind`;
    ``FAMILY_MODEL`` at each of ``hiddens``) built for the launched layout, per
    ``'hidden,layers,batch'`` (``batch`` samples per data replica): ``repeats`` timings
    after a warm-up, every rank stepping at once after a barrier, the 1- and 2-block models
    alternated so that both see the same load; ``'forward:hidden,layers,batch'`` the
    forward's share of the same runs. With a data-parallel group
    (``gradient_handler.data_parallel_axis``) of 2 or more, each backward is followed by
    one of the step's gradient syncs (``STEP_SYNC_OPS`` in turn) over the model's gradient
    elements (``'elems:hidden,layers'``): ``'sync:op:hidden,layers,batch'`` ->
    ``[backward end, sync end]`` per repeat, seconds from the barrier; ``'sync_group'`` the
    group's size."""
    torch.set_num_threads(1)
    axis = data_parallel_axis()
    out: Dict[str, List[float]] = {'sync_group': axis.size}
    for hidden in hiddens:
        torch.manual_seed(0)
        models = {layers: _profile_model(layers=layers, **dict(FAMILY_MODEL, hidden=hidden))
                  for layers in (1, 2)}
        elems = {layers: sum(p.numel() for p in model.parameters()) // axis.size * axis.size
                 for layers, model in models.items()}
        for layers, n in elems.items():
            out[f'elems:{hidden},{layers}'] = n
        for b in batches:  # a data replica's b samples (its tensor ranks all see them)
            ids = torch.randint(0, FAMILY_MODEL['vocab_size'], (b, 64),
                                generator=torch.Generator().manual_seed(b))
            for i in range(repeats + 1):
                for layers, model in models.items():
                    comm.barrier()
                    start = time.perf_counter()
                    loss = model(ids).float().sum()
                    mid = time.perf_counter()
                    loss.backward()
                    end = time.perf_counter()
                    if i:
                        out.setdefault(f'{hidden},{layers},{b}', []).append(end - start)
                        out.setdefault(f'forward:{hidden},{layers},{b}', []).append(
                            mid - start)
                    if axis.size == 1:
                        continue
                    if not i:  # warm-up: every op once
                        for op in STEP_SYNC_OPS:
                            _one(op, elems[layers], axis)
                        continue
                    op = STEP_SYNC_OPS[(i - 1) % len(STEP_SYNC_OPS)]
                    _one(op, elems[layers], axis)
                    out.setdefault(f'sync:{op}:{hidden},{layers},{b}', []).append(
                        [end - start, time.perf_counter() - start])
    return out


def step_sync_points(per_rank: Sequence[Dict[str, list]]) -> Dict[str, List[list]]:
    """``{op: [[gradient bytes, seconds], ...]}`` from every rank's ``_time_family``: per
    timed (width, blocks, batch) the median over repeats of (the last rank's sync end - the
    last rank's backward end) -- the sync once every rank is ready; the wait for the
    slowest rank is its compute, which the block timings carry."""
    points: Dict[str, List[list]] = {}
    for key in per_rank[0]:
        if not key.startswith('sync:'):
            continue
        _, op, rest = key.split(':')
        hidden, layers, _ = rest.split(',')
        nbytes = 4 * per_rank[0][f'elems:{hidden},{layers}']
        samples = range(len(per_rank[0][key]))
        seconds = statistics.median(max(r[key][k][1] for r in per_rank)
                                    - max(r[key][k][0] for r in per_rank) for k in samples)
        points.setdefault(op, []).append([nbytes, max(seconds, 1e-6)])
    return points


def measure_families(layouts=FAMILY_LAYOUTS, batches: Sequence[int] = FAMILY_BATCHES,
                     repeats: int = FAMILY_REPEATS, world: int = 4,
                     hiddens: Sequence[int] = FAMILY_HIDDENS
                     ) -> Tuple[Dict[str, Dict[str, dict]], Dict[str, Dict[str, list]]]:
    """(family table, step-sync table). Per tensor family and size t on ``world`` local
    ranks (``launcher.run_ranks``; data = world / t): one real block's forward + backward,
    tensor-parallel collectives included, as the difference of a 2-block and a 1-block
    model (per repeat the slowest rank, the median over repeats), at 2 to 16 samples per
    replica and each width of ``hiddens`` (``forward_s``: its forward's part, the same
    difference), fitted by
    :func:`fit_alpha_beta` against the block's FLOPs: ``overhead`` (seconds per block and
    micro-batch whatever its size: Python, dispatch, the collectives' latencies) and
    ``seconds_per_flop``; and ``rest``: the 1-block model minus its block (embedding, head,
    loss) at the smallest batch. ``{mode or 'none': {str(t): {...}}}``, the entry of the
    widest block with ``by_hidden``: ``{str(hidden): entry}`` (:func:`family_entry`).
    The step-sync table ``{op: {str(p): [alpha, beta]}}``: each of ``STEP_SYNC_OPS`` over
    a data-parallel group of p ranks right after a backward (:func:`step_sync_points` of
    every family with one, fitted by :func:`fit_alpha_beta` per group size): what a step's
    gradient sync costs, which on ranks time-sharing cores is more than the collective
    timed alone (``collectives``)."""
    table: Dict[str, Dict[str, dict]] = {}
    sync_points: Dict[str, Dict[str, list]] = {}
    for mode, t in layouts:
        parallel = dict(data=world // t)
        if mode:
            parallel['tensor'] = dict(size=t, mode=mode)
        per_rank = run_ranks(_time_family, world, dict(parallel=parallel),
                             tuple(hiddens), tuple(batches), repeats, timeout=600)
        group = str(per_rank[0]['sync_group'])
        for op, points in step_sync_points(per_rank).items():
            sync_points.setdefault(op, {}).setdefault(group, []).extend(points)
        by_hidden = {}
        for hidden in hiddens:
            def median_slowest(layers, b, part=''):  # repeats line up (a barrier each)
                key = f'{part}{hidden},{layers},{b}'
                return statistics.median(max(r[key][i] for r in per_rank)
                                         for i in range(repeats))
            shape = _family_shape(hidden)
            flops = [3 * shape.block_flops(b * 64) for b in batches]  # per replica
            one = [median_slowest(1, b) for b in batches]
            block = [max(median_slowest(2, b) - o, 1e-6) for b, o in zip(batches, one)]
            forward = [max(median_slowest(2, b, 'forward:') - median_slowest(1, b, 'forward:'),
                           1e-6) for b in batches]
            overhead, per_flop = fit_alpha_beta(flops, block)
            by_hidden[str(hidden)] = dict(
                overhead=overhead, seconds_per_flop=per_flop, block_s=block,
                batches=list(batches), rest=max(0.0, one[0] - block[0]), per_replica=True,
                one_s=one, flops=flops, tokens=[b * 64 for b in batches], forward_s=forward)
        widest = by_hidden[str(max(hiddens))]
        table.setdefault(mode or 'none', {})[str(t)] = dict(widest, by_hidden=by_hidden)
    step_sync = {op: {p: list(fit_alpha_beta([n for n, _ in pts], [s for _, s in pts]))
                      for p, pts in groups.items()} for op, groups in sync_points.items()}
    return table, step_sync


def family_entry(compute: dict, mode, t: int, hidden: int):
    """The profile's timing of a ``mode`` block on t ranks (``compute['family_blocks']``)
    for blocks of width ``hidden``: the timed width nearest on a log scale (``by_hidden``),
    or the one entry a profile without widths has; None when the family was not timed."""
    entry = compute.get('family_blocks', {}).get(mode or 'none', {}).get(str(t))
    if entry is None or 'by_hidden' not in entry:
        return entry
    widths = sorted(entry['by_hidden'], key=lambda w: abs(math.log(int(w) / hidden)))
    return entry['by_hidden'][widths[0]]


def _interpolate(xs: Sequence[float], ys: Sequence[float], x: float,
                 slope: float = 0.0) -> float:
    """``ys`` at ``x``: piecewise linear between the points ``(xs, ys)`` (xs ascending), and
    beyond them the nearest end continued with ``slope``."""
    if x <= xs[0]:
        return ys[0] + slope * (x - xs[0])
    if x >= xs[-1]:
        return ys[-1] + slope * (x - xs[-1])
    i = next(k for k in range(1, len(xs)) if x <= xs[k])
    w = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
    return ys[i - 1] + w * (ys[i] - ys[i - 1])


def nondecreasing(ys: Sequence[float]) -> List[float]:
    """The non-decreasing sequence nearest ``ys`` in least squares (pool adjacent
    violators): a run of timed points that falls is replaced by its mean."""
    pools: List[List[float]] = []            # [mean, count]
    for y in ys:
        pools.append([float(y), 1])
        while len(pools) > 1 and pools[-2][0] > pools[-1][0]:
            (m2, n2), (m1, n1) = pools.pop(), pools.pop()
            pools.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [m for m, n in pools for _ in range(int(n))]


def family_block_seconds(entry: dict, flops: float, per_flop: float = None) -> float:
    """Forward + backward seconds of one block of ``flops`` (forward FLOPs x 3) from a
    family entry: between the timed batches the measured points (piecewise linear in FLOPs,
    no least-squares line through noisy points), made non-decreasing (:func:`nondecreasing`:
    more samples never take less time, so a point below a smaller batch's is noise), beyond
    them continued at ``per_flop`` (default the fitted ``seconds_per_flop``); entries
    without the points (older profiles): the fit ``overhead + per_flop * flops``."""
    per_flop = entry['seconds_per_flop'] if per_flop is None else per_flop
    if 'flops' not in entry:
        return entry['overhead'] + per_flop * flops
    return max(1e-6, _interpolate(entry['flops'], nondecreasing(entry['block_s']), flops,
                                  per_flop))


def family_forward_share(entry: dict, flops: float) -> float:
    """The forward's share of a timed block's seconds at ``flops`` (``forward_s`` over
    ``block_s``, interpolated, held at the ends, within [0.2, 0.6]: a difference of noisy
    times), 1/3 for entries without it (backward = 2x forward, as FLOPs count)."""
    if 'forward_s' not in entry or 'flops' not in entry:
        return 1.0 / 3.0
    share = [min(0.6, max(0.2, f / b)) for f, b in zip(entry['forward_s'], entry['block_s'])]
    return _interpolate(entry['flops'], share, flops)


def family_rest_seconds(entry: dict, tokens: float) -> float:
    """The entry's ``rest`` (the 1-block model minus its block: embedding, head, loss) at a
    micro-batch of ``tokens``, interpolated over the timed batches (held at the ends); the
    smallest batch's for entries without the points."""
    if 'one_s' not in entry:
        return float(entry.get('rest', 0.0))
    rest = [max(0.0, one - block) for one, block in zip(nondecreasing(entry['one_s']),
                                                        nondecreasing(entry['block_s']))]
    return _interpolate(entry['tokens'], rest, tokens)


def refit_family_blocks(table: Dict[str, Dict[str, dict]], world: int = 4
                        ) -> Dict[str, Dict[str, dict]]:
    """``table`` with every entry measured before ``per_replica`` (each rank then ran
    ``data = world / t`` replicas' samples, ``data * b``, while the fit counted ``b``)
    refitted against the FLOPs of the samples it ran; entries marked ``per_replica`` as
    they are. For profiles stored before the fix (``planner_accuracy --reanalyse``)."""
    shape = _family_shape()
    out: Dict[str, Dict[str, dict]] = {}
    for mode, sizes in table.items():
        for t, entry in sizes.items():
            entry = dict(entry)
            if not entry.get('per_replica'):
                data = world // int(t)
                flops = [3 * shape.block_flops(b * data * 64) for b in entry['batches']]
                entry['overhead'], entry['seconds_per_flop'] = fit_alpha_beta(
                    flops, entry['block_s'])
                entry['batches'] = [b * data for b in entry['batches']]
                entry['per_replica'] = True
            out.setdefault(mode, {})[t] = entry
    return out


def median_tree(trees: Sequence):
    """The element-wise median of JSON trees of one structure (profiles measured at
    different times): numbers -> their median (integers: the lower median), lists and dicts
    -> per element / key (a key over the trees that have it: rounds measured before an
    entry existed add nothing to it), anything else (names, flags) -> the first tree's. A
    profile is a few minutes of ranks time-sharing cores; its entries move by 20 - 40 %
    between runs, and the median of a few runs is what the cost model should see."""
    first = trees[0]
    if isinstance(first, bool) or first is None or isinstance(first, str):
        return first
    if all(isinstance(t, int) and not isinstance(t, bool) for t in trees):
        return statistics.median_low(trees)          # counts stay integers
    if isinstance(first, (int, float)):
        return statistics.median(float(t) for t in trees)
    if isinstance(first, (list, tuple)):
        if any(len(t) != len(first) for t in trees):
            raise ValueError(f'cannot combine lists of lengths {[len(t) for t in trees]}')
        return [median_tree([t[i] for t in trees]) for i in range(len(first))]
    if isinstance(first, dict):
        keys = list(first) + [k for t in trees[1:] for k in t if k not in first]
        return {k: median_tree([t[k] for t in trees if k in t]) for k in dict.fromkeys(keys)}
    raise TypeError(f'cannot combine a {type(first).__name__} in a profile tree')


def measure(name: str = 'this machine', sizes: Sequence[int] = SIZES,
            repeats: int = REPEATS, rounds: int = 1) -> ClusterProfile:
    """A profile of this machine: 4 local ranks on one node (module doc); ``flops`` is the
    median of the 4 ranks' block FLOP rates, measured while all 4 compute. With ``rounds``
    > 1 the whole measurement runs that many times, one after the other, and every entry
    is the median of the rounds (:func:`median_tree`); ``compute['rounds']`` keeps each
    round's profile."""
    if rounds < 1:
        raise ValueError(f'a profile needs at least 1 round, got rounds={rounds}')
    if rounds > 1:
        return combine([measure(name, sizes, repeats).to_json() for _ in range(rounds)], name)
    collectives, blocks = measure_ranks(sizes, repeats)
    families, step_sync = measure_families()
    return ClusterProfile(name=name, devices=4, devices_per_node=4,
                          memory_bytes=float(os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')) / 4,
                          flops=statistics.median(b['flops'] for b in blocks),
                          collectives=collectives,
                          compute={'blocks_per_rank': blocks, 'adam_s_per_param':
                                   statistics.median(b['adam_s_per_param'] for b in blocks),
                                   'adam_s_per_tensor':
                                   statistics.median(b['adam_s_per_tensor'] for b in blocks),
                                   'block_overhead_s':
                                   statistics.median(b['overhead'] for b in blocks),
                                   'sync_skew_s': blocks[0]['sync_skew_s'],
                                   'family_blocks': families, 'step_sync': step_sync,
                                   'ranks': 4, 'cores': len(os.sched_getaffinity(0))},
                          sources={'all': 'measured by colossal_lite.auto.profile (gloo, '
                                          'forked local processes, CPU)'})


def with_ranks(base: ClusterProfile, world: int, sizes: Sequence[int] = SIZES,
               repeats: int = REPEATS) -> ClusterProfile:
    """``base`` for ``world`` local ranks on this one node: its collectives measured again
    with ``world`` ranks running at once (groups of 2, world / 2 and world); its FLOP rate
    scaled by ``base ranks / world`` where ``world`` ranks time-share fewer cores (each gets
    that share of the cores ``base`` measured with), its other compute entries kept (the
    family block times keep ``base``'s oversubscription: this profile is for the graph
    planner, whose compute is ``flops``)."""
    collectives, _ = measure_ranks(sizes, repeats, world, compute=False)
    data = base.to_json()
    flops = base.flops
    ranks, cores = base.compute.get('ranks'), base.compute.get('cores')
    if ranks and cores and world > cores:
        flops *= float(ranks) / world
        data['compute'] = dict(data['compute'], ranks=world)
    data.update(name=f"{base.name}, collectives on {world} ranks", devices=world,
                devices_per_node=world, collectives=collectives, flops=flops)
    data['sources'] = dict(data.get('sources', {}), collectives=(
        f'measured by colossal_lite.auto.profile on {world} forked local processes (gloo, CPU)'))
    return ClusterProfile.from_json(data)


def combine(profiles: Sequence[dict], name: str = 'this machine (combined)') -> ClusterProfile:
    """One profile from profiles measured at different times (``to_json`` dicts, or results
    files holding one under ``'profile'``): every entry the median over all their rounds
    (``compute['rounds']`` of a multi-round profile, else the profile itself). Rounds an
    hour apart see more of the machine's states than rounds a minute apart."""
    runs = []
    for data in profiles:
        data = data.get('profile', data)
        runs += data.get('compute', {}).get('rounds') or [data]
    if not runs:
        raise ValueError('combine needs at least one profile, got none')
    combined = median_tree(runs)
    combined['compute']['rounds'] = runs
    combined['name'] = name
    return ClusterProfile.from_json(combined)


def main(argv: List[str] = None) -> int:
    import argparse
    import json
    parser = argparse.ArgumentParser(prog='python -m colossal_lite.auto.profile',
                                     description='measure this machine into a cluster profile')
    parser.add_argument('out', nargs='?', default='cluster_profile.json',
                        help='the profile JSON to write (before --combine)')
    parser.add_argument('--rounds', type=int, default=1,
                        help='whole measurements; every entry the median of the rounds')
    parser.add_argument('--combine', nargs='+', metavar='PROFILE_JSON',
                        help='measure nothing: the median over every round of these profiles')
    parser.add_argument('--ranks', type=int, default=None,
                        help='with --base: measure the collectives again on this many ranks')
    parser.add_argument('--base', metavar='PROFILE_JSON',
                        help='with --ranks: the profile whose compute entries are kept')
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if (args.ranks is None) != (args.base is None):
        parser.error('--ranks and --base go together')
    if args.ranks is not None and args.ranks < 4:
        parser.error(f'--ranks must be at least 4, got {args.ranks}')
    start = time.perf_counter()
    if args.ranks is not None:
        profile = with_ranks(load_profile(args.base), args.ranks)
    elif args.combine:
        sources = []
        for path in args.combine:
            with open(path) as f:
                sources.append(json.load(f))
        profile = combine(sources)
    else:
        profile = measure(rounds=args.rounds)
    profile.save(args.out)
    world = str(profile.devices)
    alpha, beta = profile.collectives['all_reduce'][world]['intra']
    print(f'wrote {args.out} in {time.perf_counter() - start:.1f} s: flops {profile.flops:.3g}/s, '
          f'all_reduce p={world} alpha {alpha * 1e6:.1f} us, 1/beta {1 / beta / 1e9:.2f} GB/s')
    return 0


if __name__ == '__main__':
    sys.exit(main())
