"""Measure this machine into a :class:`~colossal_lite.auto.cluster.ClusterProfile` (seconds).

* α-β: each collective (all_reduce, all_gather, reduce_scatter, all_to_all; broadcast and
  reduce too) at group sizes 2 (consecutive ranks: the PARALLEL_1D groups of a 4-rank
  world with 1D tensor size 2) and 4 (GLOBAL) on forked local gloo processes
  (``testing.run_distributed``), timed over a few message sizes; :func:`fit_alpha_beta`
  fits ``t = alpha + beta * bytes`` by least squares. One machine is one node: every entry
  is ``intra``.
* compute: forward and backward of one model_zoo ``TransformerLayer`` at a few batch sizes
  on each of the 4 ranks at once (one thread each, as training runs); ``flops`` = the block
  FLOPs (``ModelShape.block_flops``, backward 2x) / measured time, median over ranks.

``python -m colossal_lite.auto.profile out.json`` writes the JSON.
"""
from __future__ import annotations

import statistics
import sys
import time
from typing import Dict, List, Sequence, Tuple

import torch

from .cluster import ClusterProfile

OPS = ('all_reduce', 'all_gather', 'reduce_scatter', 'all_to_all', 'broadcast', 'reduce')
SIZES = (1 << 14, 1 << 17, 1 << 20, 1 << 22)   # buffer bytes
REPEATS = 5


def fit_alpha_beta(nbytes: Sequence[float], seconds: Sequence[float]) -> Tuple[float, float]:
    """Least-squares ``seconds = alpha + beta * nbytes``; alpha clipped at 0, beta at a tiny
    positive value (a noisy fit never predicts negative time)."""
    if len(nbytes) != len(seconds) or len(nbytes) < 2:
        raise ValueError(f'fit needs >= 2 (size, time) pairs of equal length, got '
                         f'{len(nbytes)} sizes and {len(seconds)} times')
    a = torch.tensor([[1.0, float(n)] for n in nbytes], dtype=torch.float64)
    y = torch.tensor([float(s) for s in seconds], dtype=torch.float64).unsqueeze(1)
    sol = torch.linalg.lstsq(a, y).solution.squeeze(1)
    return max(0.0, float(sol[0])), max(1e-15, float(sol[1]))


def _one(op: str, elems: int, axis) -> None:
    from .. import communication as comm
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


def _time_collectives(rank: int, sizes: Sequence[int], repeats: int) -> Dict[str, dict]:
    """On every rank: one block's timings (every rank computing at once, as in training),
    then the median seconds of each op per (group size, buffer bytes)."""
    torch.set_num_threads(1)
    from ..context import ParallelMode, global_context as gpc
    from .. import communication as comm
    comm.barrier()
    out: Dict[str, dict] = {'block': measure_block()}
    for mode in (ParallelMode.PARALLEL_1D, ParallelMode.GLOBAL):
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
    return out


def measure_ranks(sizes: Sequence[int] = SIZES, repeats: int = REPEATS
                  ) -> Tuple[Dict[str, Dict[str, Dict[str, list]]], List[dict]]:
    """(``collectives`` table of a profile: op -> str(p) -> {'intra': [alpha, beta]},
    every rank's block timings)."""
    from ..testing import run_distributed
    config = dict(parallel=dict(tensor=dict(size=2, mode='1d')))
    results = run_distributed(_time_collectives, 4, config, tuple(sizes), repeats, timeout=300)
    table: Dict[str, Dict[str, Dict[str, list]]] = {}
    for op in OPS:
        for p, points in results[0][op].items():
            # the slowest rank's time per size: a collective ends when its last rank does
            worst = [max(r[op][p][i][1] for r in results) for i in range(len(points))]
            alpha, beta = fit_alpha_beta([n for n, _ in points], worst)
            table.setdefault(op, {})[p] = {'intra': [alpha, beta]}
    return table, [r['block'] for r in results]


def measure_block(hidden: int = 128, heads: int = 4, seq: int = 64,
                  batches: Sequence[int] = (2, 4, 8), repeats: int = 5, warmup: int = 2) -> dict:
    """Forward / backward seconds of one serial pre-LN block at each batch size (the fastest
    of ``repeats`` after ``warmup``: on a shared machine noise only adds time), and the FLOP
    rate they imply (median over the batch sizes)."""
    from model_zoo.blocks import TransformerLayer
    from .model_spec import ModelShape
    torch.manual_seed(0)
    block = TransformerLayer(hidden, heads, 4, 0.0, causal=True)
    shape = ModelShape('gpt', None, (('hidden', hidden), ('heads', heads), ('layers', 1)), seq)
    fwd, bwd, rates = [], [], []
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
        rates.append(3 * shape.block_flops(b * seq) / (fwd[-1] + bwd[-1]))
    return dict(hidden=hidden, heads=heads, seq=seq, batches=list(batches), forward_s=fwd,
                backward_s=bwd, flops=statistics.median(rates))


def measure(name: str = 'this machine', sizes: Sequence[int] = SIZES,
            repeats: int = REPEATS) -> ClusterProfile:
    """A profile of this machine: 4 local ranks on one node (module doc); ``flops`` is the
    median of the 4 ranks' block FLOP rates, measured while all 4 compute."""
    import psutil
    collectives, blocks = measure_ranks(sizes, repeats)
    return ClusterProfile(name=name, devices=4, devices_per_node=4,
                          memory_bytes=float(psutil.virtual_memory().total) / 4,
                          flops=statistics.median(b['flops'] for b in blocks),
                          collectives=collectives, compute={'blocks_per_rank': blocks},
                          sources={'all': 'measured by colossal_lite.auto.profile (gloo, '
                                          'forked local processes, CPU)'})


def main(argv: List[str] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    path = argv[0] if argv else 'cluster_profile.json'
    start = time.perf_counter()
    profile = measure()
    profile.save(path)
    alpha, beta = profile.collectives['all_reduce']['4']['intra']
    print(f'wrote {path} in {time.perf_counter() - start:.1f} s: flops {profile.flops:.3g}/s, '
          f'all_reduce p=4 alpha {alpha * 1e6:.1f} us, 1/beta {1 / beta / 1e9:.2f} GB/s')
    return 0


if __name__ == '__main__':
    sys.exit(main())
