"""Long context: the online-softmax zigzag ring (issue 24) vs the ring self-attention it replaced.

    python benchmarks/long_context.py [--quick]

``new``: ``colossal_lite.nn.sequence.ring_attention`` (online softmax, zigzag chunks: rank r
holds chunks r and 2P-1-r of 2P). ``old``: ``benchmarks/_old_ring.py``, the pre-issue-24
ring kept only as this baseline (contiguous blocks; it materialises the ``[b*n, s/P, s]``
scores and probabilities on every rank). Both are the attention core alone, causal, fp32,
on local ``q, k, v [b, s/P, n*d]``; ranks are launched by ``colossal_lite.testing.
run_distributed`` (gloo, fork, one thread per rank). Sections (each written to the JSON
with its method):

1. ``memory``: the allocator peak per rank of one forward + backward
   (``colossal_lite.testing.memory.peak_allocated``: torch's CPU allocator record under the
   profiler; bytes allocated during the call above what was live before it -- so q, k, v
   and the output gradient, made before, are not in it; out, dq, dk, dv and every
   temporary are), max over ranks, s = 4K..32K, P = 1, 2, 4, 8; also the bytes autograd
   saves for backward (``saved_tensors_hooks``). A point runs only when its predicted
   total over the P ranks (the previous length's peak scaled by s^2, plus a per-process
   baseline) stays under ``min(RAM_CAP_GIB, MemAvailable - RAM_MARGIN_GIB)``: the machine
   is shared with other engineers' jobs; a skipped point records its prediction and why.
   Fits: log peak = alpha log s + beta log P + c per variant (linear in s/P: alpha = 1,
   beta = -1; s^2/P: alpha = 2, beta = -1), and the exponent in s at each P.
2. ``longest``: the longest s, a multiple of 256, whose forward + backward of the
   new ring fits ``budget_mib`` per rank (32 MiB: small enough that the boundary at P = 8
   stays short enough to time on 2 cores; peak + the inputs q, k, v, dO), P = 1, 2, 4, 8:
   bracketed around the point predicted from the sweep's fit ``a (s/P)^2 + c s/P`` at
   that P and bisected, every point measured (the longest fits, the next does not).
3. ``balance``: per-rank attention compute time, causal, P = 4, zigzag vs contiguous.
   Primary: every rank's forward + backward run one after another in ONE process (a
   stand-in axis with rank r of P, the ring's ``ring_exchange`` replaced by one that
   returns its tensor at once -- no communication, no waiting: the time is exactly that
   rank's block math, the same chunk pairs ``record_blocks`` sees), alternated rounds,
   median per rank, max/mean. Secondary: a real 4-rank run, each rank's main-thread CPU
   time (``time.thread_time``: excludes time blocked in gloo waits and gloo's own threads).
4. ``speed``: tokens/s (b*s / step time) of new vs old at s = 4K, P = 4, forward +
   backward, alternated rounds (``_common.time_alternated``), a step's time the max over
   ranks, medians and the median of per-round ratios.
5. ``torch_context_parallel``: ``torch.distributed.tensor.experimental.context_parallel``
   around ``F.scaled_dot_product_attention`` at s = 4K, P = 4 on CPU/gloo (default and MATH
   SDPA backends); the exception text when it does not run.

Variants go through :func:`attention_variant` (the hook; ``'ulysses'`` -- Ulysses over all
P ranks, no ring -- is timed in ``speed`` next to the rings whenever ``from
colossal_lite.nn.sequence import ulysses_attention`` imports and it equals serial attention
in section 0, which checks every variant's output and gradients at a small length).

Writes ``results/long_context.json`` (``--quick``: a smoke run with small lengths, written
to ``results/long_context_quick.json``).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import math
import os
import platform
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks import _old_ring  # noqa: E402
from benchmarks._common import environment, print_table, ratio_summary, time_alternated, write_json  # noqa: E402,E501
from colossal_lite.context import ParallelMode, ProcessGroupAxis, global_context as gpc  # noqa: E402,E501
from colossal_lite.nn.sequence import SequenceLayout, chunk_pairs, record_blocks, ring_attention  # noqa: E402,E501
from colossal_lite.nn.sequence import ring as ring_module  # noqa: E402
from colossal_lite.testing import run_distributed  # noqa: E402
from colossal_lite.testing.memory import peak_allocated  # noqa: E402

MIB, GIB = 2 ** 20, 2 ** 30
FULL = dict(
    worlds=(1, 2, 4, 8), seqs=(4096, 8192, 16384, 32768),
    memory_shape=dict(batch=1, heads=1, head_dim=64),
    budget_mib=32, grid=(512, 2 ** 16),
    balance=dict(world=4, seq=8192, batch=1, heads=1, head_dim=64, rounds=25, real_rounds=3),
    speed=dict(world=4, seq=4096, batch=1, heads=4, head_dim=64, rounds=9),
    check_seq=256, ratio_at=(16384, 4))
QUICK = dict(
    worlds=(1, 2, 4), seqs=(512, 1024),
    memory_shape=dict(batch=1, heads=1, head_dim=64),
    budget_mib=8, grid=(128, 2 ** 13),
    balance=dict(world=4, seq=1024, batch=1, heads=1, head_dim=64, rounds=2, real_rounds=1),
    speed=dict(world=4, seq=1024, batch=1, heads=4, head_dim=64, rounds=2),
    check_seq=64, ratio_at=(1024, 4))
RAM_CAP_GIB = 16.0       # never plan a point needing more (the 24 GiB machine is shared)
RAM_MARGIN_GIB = 4.0     # and leave this much of MemAvailable to everyone else
RANK_BASE_GIB = 0.4      # resident memory of one launched rank before any tensor (torch, gloo)
TIMEOUT_S = 1500


def sequence_config(world: int) -> dict:
    return dict(parallel=dict(tensor=dict(mode='sequence', size=world)))


# ================================================================== the variants (HOOK)
def ulysses_available() -> bool:
    try:
        from colossal_lite.nn.sequence import ulysses_attention  # noqa: F401
    except ImportError:
        return False
    return True


def attention_variant(variant: str, axis: ProcessGroupAxis, head_dim: int, causal: bool = True,
                      zigzag: bool = True):
    """HOOK -- ``(layout, fn)`` for ``variant`` on this rank of ``axis``: ``fn(q, k, v)`` takes
    this rank's ``[b, s/P, n*d]`` blocks (cut from the full tensors by ``layout.local``)
    and returns its ``[b, s/P, n*d]`` output, differentiable.

    * ``'new'``: the library's ring (online softmax; zigzag chunks unless ``zigzag=False``);
    * ``'old'``: the pre-issue-24 ring (``benchmarks/_old_ring.py``; contiguous blocks);
    * ``'ulysses'``: ``colossal_lite.nn.sequence.ulysses_attention`` with all P ranks of
      ``axis`` as its Ulysses group (U = P) and no ring (R = 1: a one-rank layout), on
      contiguous blocks (rank u holds block u). Timed in ``speed`` whenever it imports
      (:func:`ulysses_available`); add it to ``MEMORY_VARIANTS`` to measure its memory.
      A ring x Ulysses hybrid (R > 1) would be another variant here.
    """
    if variant == 'new':
        layout = SequenceLayout(axis, zigzag)
        return layout, lambda q, k, v: ring_attention(q, k, v, head_dim, layout, causal=causal)
    if variant == 'old':
        layout = SequenceLayout(axis, zigzag=False)
        return layout, lambda q, k, v: _old_ring.ring_attention(q, k, v, head_dim, axis,
                                                                causal=causal)
    if variant == 'ulysses':
        from colossal_lite.nn.sequence import ulysses_attention
        layout = SequenceLayout(axis, zigzag=False)
        no_ring = SequenceLayout(ProcessGroupAxis.serial(axis.mode))
        return layout, lambda q, k, v: ulysses_attention(q, k, v, head_dim, axis, no_ring,
                                                         causal=causal)
    raise ValueError(f'unknown attention variant {variant!r}')


MEMORY_VARIANTS = ('old', 'new')


def speed_variants():
    return ('new', 'old') + (('ulysses',) if ulysses_available() else ())


def local_inputs(batch: int, s_local: int, heads: int, head_dim: int, seed: int):
    """Random q, k, v (leaves that require grad) and the output gradient, ``[b, s/P, n*d]``."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(batch, s_local, heads * head_dim, generator=g) for _ in range(4))
    return [t.requires_grad_() for t in (q, k, v)], dout


def fwd_bwd(fn, qkv, dout, saved=None):
    """One forward + backward; ``saved`` (a dict) receives the storages autograd saves."""
    for t in qkv:
        t.grad = None
    hooks = contextlib.nullcontext()
    if saved is not None:
        def pack(t):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    with hooks:
        out = fn(*qkv)
    out.backward(dout)


# ================================================================== 0. both rings equal serial
def _check_worker(rank, seq, shape, variants):
    """Max relative difference of each variant's output and input gradients from serial SDPA
    (or the exception text of a variant that fails)."""
    from colossal_lite.nn.functional import attention
    from colossal_lite.testing import max_rel_diff
    axis = gpc.axis(ParallelMode.SEQUENCE)
    b, n, d = shape['batch'], shape['heads'], shape['head_dim']
    full, dout = local_inputs(b, seq, n, d, seed=7)
    ref = attention(*full, d, causal=True)
    ref.backward(dout)
    diffs = {}
    for variant in variants:
        try:
            layout, fn = attention_variant(variant, axis, d)
            local = [layout.local(t.detach()).clone().requires_grad_() for t in full]
            out = fn(*local)
            out.backward(layout.local(dout))
        except Exception as err:   # noqa: BLE001 -- a variant being written may not run yet
            diffs[variant] = f'{type(err).__name__}: {err}'
            continue
        diffs[variant] = max([max_rel_diff(out.detach(), layout.local(ref.detach()))]
                             + [max_rel_diff(t.grad, layout.local(f.grad))
                                for t, f in zip(local, full)])
    return diffs


# ================================================================== 1. memory
def _memory_worker(rank, points, shape):
    axis = gpc.axis(ParallelMode.SEQUENCE)
    b, n, d = shape['batch'], shape['heads'], shape['head_dim']
    for variant in {v for v, _ in points}:                    # warm-up: lazy init outside
        _, fn = attention_variant(variant, axis, d)
        qkv, dout = local_inputs(b, 16, n, d, seed=rank)
        fwd_bwd(fn, qkv, dout)
    del fn, qkv, dout
    return [dict(variant=variant, seq=seq,
                 **_one_peak(attention_variant(variant, axis, d)[1],
                             *local_inputs(b, seq // axis.size, n, d, seed=rank)))
            for variant, seq in points]


def _one_peak(fn, qkv, dout) -> dict:
    saved = {}
    t0 = time.perf_counter()
    peak = peak_allocated([lambda: fwd_bwd(fn, qkv, dout, saved)])[0]
    return dict(peak_bytes=peak, input_bytes=sum(t.numel() * t.element_size()
                                                 for t in qkv + [dout]),
                saved_bytes=sum(saved.values()), seconds_under_profiler=time.perf_counter() - t0)


def measure_memory(world, points, shape):
    """Per point: the max over ranks of each number (all ranks are alike here)."""
    if not points:
        return []
    per_rank = run_distributed(_memory_worker, world, sequence_config(world), points, shape,
                               timeout=TIMEOUT_S, collective_timeout=TIMEOUT_S)
    rows = []
    for i, (variant, seq) in enumerate(points):
        row = dict(variant=variant, seq=seq, world=world)
        for key in ('peak_bytes', 'input_bytes', 'saved_bytes', 'seconds_under_profiler'):
            row[key] = max(r[i][key] for r in per_rank)
        row['peak_bytes_per_rank'] = [r[i]['peak_bytes'] for r in per_rank]
        rows.append(row)
    return rows


def mem_available_gib() -> float:
    with open('/proc/meminfo') as f:
        for line in f:
            if line.startswith('MemAvailable:'):
                return int(line.split()[1]) * 1024 / GIB
    return 0.0


def memory_sweep(cfg):
    """Every (variant, s, P) of the grid that fits; a skipped one records why."""
    rows, skipped = [], []
    for world in cfg['worlds']:
        last = {}
        for seq in cfg['seqs']:
            points = []
            for variant in MEMORY_VARIANTS:
                if seq % (2 * world):
                    continue
                if variant in last:        # predicted: the previous length's peak times (s/s')^2
                    s0, peak0 = last[variant]
                    pred_rank = peak0 * (seq / s0) ** 2
                    pred_total = world * (pred_rank / GIB + RANK_BASE_GIB)
                    allowed = min(RAM_CAP_GIB, mem_available_gib() - RAM_MARGIN_GIB)
                    if pred_total > allowed:
                        skipped.append(dict(
                            variant=variant, seq=seq, world=world,
                            predicted_peak_bytes_per_rank=pred_rank,
                            predicted_total_gib=pred_total, allowed_gib=allowed,
                            why=f'predicted {pred_total:.1f} GiB over the {world} ranks (peak at '
                                f's={s0} x (s/{s0})^2 + {RANK_BASE_GIB} GiB per process) > '
                                f'{allowed:.1f} GiB allowed = min({RAM_CAP_GIB} GiB cap, '
                                f'MemAvailable - {RAM_MARGIN_GIB} GiB) on the shared '
                                f'{total_ram_gib():.0f} GiB machine'))
                        continue
                points.append((variant, seq))
            for row in measure_memory(world, points, cfg['memory_shape']):
                rows.append(row)
                last[row['variant']] = (row['seq'], row['peak_bytes'])
                print(f"  memory P={world} s={seq} {row['variant']}: peak "
                      f"{row['peak_bytes'] / MIB:.1f} MiB/rank", flush=True)
    return rows, skipped


def power_fit(rows, worlds=None):
    """log peak = alpha log s + beta log P + c (least squares) over ``rows``."""
    rows = [r for r in rows if worlds is None or r['world'] in worlds]
    if len(rows) < 3 or len({r['world'] for r in rows}) < 2:
        return None
    x = torch.tensor([[math.log(r['seq']), math.log(r['world']), 1.0] for r in rows],
                     dtype=torch.float64)
    y = torch.tensor([math.log(r['peak_bytes']) for r in rows], dtype=torch.float64)
    coef = torch.linalg.lstsq(x, y.unsqueeze(1)).solution.squeeze(1)
    return dict(alpha_seq=float(coef[0]), beta_world=float(coef[1]),
                max_abs_log_residual=float((x @ coef - y).abs().max()),
                points=len(rows), worlds=sorted({r['world'] for r in rows}))


def seq_exponent(rows):
    """Slope of log peak against log s (least squares) at one P."""
    if len(rows) < 2:
        return None
    xs = [math.log(r['seq']) for r in rows]
    ys = [math.log(r['peak_bytes']) for r in rows]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((a - mx) * (b - my) for a, b in zip(xs, ys)) / sum((a - mx) ** 2 for a in xs)


def quad_fit(rows):
    """a, c of ``peak = a (s/P)^2 + c (s/P)`` (least squares) and the largest relative residual."""
    xs = torch.tensor([[(r['seq'] / r['world']) ** 2, r['seq'] / r['world']] for r in rows],
                      dtype=torch.float64)
    ys = torch.tensor([float(r['peak_bytes']) for r in rows], dtype=torch.float64)
    coef = torch.linalg.lstsq(xs, ys.unsqueeze(1)).solution.squeeze(1)
    return dict(a=float(coef[0]), c=float(coef[1]),
                max_rel_residual=float(((xs @ coef - ys).abs() / ys).max()))


# ================================================================== 2. longest sequence
GRID_STEP = 256   # the longest-sequence search's resolution (divisible by 2P for P <= 8)


def seq_grid(lo, hi):
    """Every multiple of GRID_STEP in [lo, hi]."""
    return list(range(-(-lo // GRID_STEP) * GRID_STEP, hi + 1, GRID_STEP))


def longest_sequences(cfg, sweep_rows):
    budget = cfg['budget_mib'] * MIB
    grid = seq_grid(*cfg['grid'])
    out = {}
    for world in cfg['worlds']:
        cands = [s for s in grid if s % (2 * world) == 0]
        known = {r['seq']: r['peak_bytes'] + r['input_bytes'] for r in sweep_rows
                 if r['variant'] == 'new' and r['world'] == world}
        fit = quad_fit([r for r in sweep_rows if r['variant'] == 'new' and r['world'] == world])

        def predicted(s):
            x = s / world
            return fit['a'] * x * x + fit['c'] * x

        fitting = [s for s in cands if predicted(s) <= budget]
        measured_here = []

        def fits(i):
            s = cands[i]
            if s not in known:
                for row in measure_memory(world, [('new', s)], cfg['memory_shape']):
                    known[row['seq']] = row['peak_bytes'] + row['input_bytes']
                    measured_here.append(row)
            return known[s] <= budget

        # bracket [lo fits, hi does not] around the prediction, then bisect on the grid
        guess = cands.index(fitting[-1]) if fitting else 0
        lo, hi, width = guess, guess + 1, 1
        while lo > 0 and not fits(lo):
            hi, lo, width = lo, max(0, lo - 2 * width), 2 * width
        while hi < len(cands) and fits(hi):
            lo, hi, width = hi, min(len(cands), hi + 2 * width), 2 * width
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        i = lo
        s_max = cands[i] if fits(i) else None
        nxt = cands[i + 1] if i + 1 < len(cands) else None
        out[str(world)] = dict(
            longest_seq=s_max, predicted_from_fit=fitting[-1] if fitting else None, fit=fit,
            bytes_at_longest=known.get(s_max), next_seq=nxt, bytes_at_next=known.get(nxt),
            measured_in_search=[dict(seq=r['seq'], bytes=r['peak_bytes'] + r['input_bytes'])
                                for r in measured_here])
        print(f'  longest P={world}: {s_max} (budget {cfg["budget_mib"]} MiB)', flush=True)
    return out


# ================================================================== 3. balance
class _Ready:
    def __init__(self, tensor):
        self.tensor = tensor

    def wait(self):
        return self.tensor


@contextlib.contextmanager
def no_exchange():
    """The ring's ``ring_exchange`` returns its own tensor at once (shapes as a real
    exchange): one process runs any rank's block math with no communication or waiting."""
    real = ring_module.ring_exchange

    def instant(tensor, axis, shift=1, async_op=False):
        return _Ready(tensor) if async_op else tensor
    ring_module.ring_exchange = instant
    try:
        yield
    finally:
        ring_module.ring_exchange = real


def _balance_serial_worker(rank, bal):
    """Every rank's forward + backward, one after another in this one process."""
    world, seq, d = bal['world'], bal['seq'], bal['head_dim']
    runs, pairs = {}, {}
    for zigzag in (True, False):
        for r in range(world):
            axis = ProcessGroupAxis(ParallelMode.SEQUENCE, None, tuple(range(world)), r, world)
            _, fn = attention_variant('new', axis, d, causal=True, zigzag=zigzag)
            qkv, dout = local_inputs(bal['batch'], seq // world, bal['heads'], d, seed=r)
            key = f"{'zigzag' if zigzag else 'contiguous'}/rank{r}"
            runs[key] = (lambda fn=fn, qkv=qkv, dout=dout: fwd_bwd(fn, qkv, dout))
            with no_exchange(), record_blocks() as blocks:
                runs[key]()
            layout = SequenceLayout(axis, zigzag)
            listed = chunk_pairs(layout, True)
            recorded = sorted((a, b) for phase, a, b in blocks if phase == 'forward')
            assert recorded == sorted(listed), (key, recorded, listed)
            unit = 1 if layout.is_zigzag else 4        # work in (s/2P)^2 units
            pairs[key] = dict(chunk_pairs=listed, work_units=unit * len(listed))
    cpu = {}
    with no_exchange():
        wall = time_alternated(runs, repeats=bal['rounds'], steps=1, warmup=1, cpu_times=cpu)
    return dict(wall=wall, cpu=cpu, pairs=pairs)


def _balance_real_worker(rank, bal):
    """A real P-rank run: this rank's main-thread CPU time of forward + backward."""
    axis = gpc.axis(ParallelMode.SEQUENCE)
    out = {}
    for zigzag in (True, False):
        _, fn = attention_variant('new', axis, bal['head_dim'], causal=True, zigzag=zigzag)
        qkv, dout = local_inputs(bal['batch'], bal['seq'] // axis.size, bal['heads'],
                                 bal['head_dim'], seed=rank)
        fwd_bwd(fn, qkv, dout)
        times = []
        for _ in range(bal['real_rounds']):
            t0 = time.thread_time()
            fwd_bwd(fn, qkv, dout)
            times.append(time.thread_time() - t0)
        out['zigzag' if zigzag else 'contiguous'] = statistics.median(times)
    return out


def max_over_mean(values):
    return max(values) / statistics.fmean(values)


def balance(cfg):
    bal = cfg['balance']
    world = bal['world']
    load_before = os.getloadavg()
    serial = run_distributed(_balance_serial_worker, 1, sequence_config(1), bal,
                             timeout=TIMEOUT_S, collective_timeout=TIMEOUT_S)[0]
    real = run_distributed(_balance_real_worker, world, sequence_config(world), bal,
                           timeout=TIMEOUT_S, collective_timeout=TIMEOUT_S)
    res = dict(config=bal, layouts={}, load_average_before_after=[load_before, os.getloadavg()])
    for name in ('zigzag', 'contiguous'):
        keys = [f'{name}/rank{r}' for r in range(world)]
        wall = [statistics.median(serial['wall'][k]) for k in keys]
        fastest = [min(serial['wall'][k]) for k in keys]
        per_round = [max_over_mean([serial['wall'][k][i] for k in keys])
                     for i in range(bal['rounds'])]
        cpu = [statistics.median(serial['cpu'][k]) for k in keys]
        units = [serial['pairs'][k]['work_units'] for k in keys]
        real_cpu = [r[name] for r in real]
        res['layouts'][name] = dict(
            median_s_per_rank=wall, max_over_mean=max_over_mean(wall),
            min_s_per_rank=fastest, min_max_over_mean=max_over_mean(fastest),
            median_of_per_round_max_over_mean=statistics.median(per_round),
            cpu_s_per_rank=cpu, cpu_max_over_mean=max_over_mean(cpu),
            work_units_per_rank=units, work_max_over_mean=max_over_mean(units),
            chunk_pairs_per_rank=[serial['pairs'][k]['chunk_pairs'] for k in keys],
            real_run_thread_cpu_s_per_rank=real_cpu,
            real_run_thread_cpu_max_over_mean=max_over_mean(real_cpu),
            rounds_s_per_rank={k: serial['wall'][k] for k in keys})
        print(f"  balance {name}: max/mean {res['layouts'][name]['max_over_mean']:.3f} "
              f"(work {res['layouts'][name]['work_max_over_mean']:.3f}, real-run thread CPU "
              f"{res['layouts'][name]['real_run_thread_cpu_max_over_mean']:.3f})", flush=True)
    res['method'] = (
        'Primary (median_s_per_rank, max_over_mean): in ONE process, for each layout and each '
        'rank r of P, ring_attention forward+backward on a stand-in axis (rank r of P, no '
        'process group) with colossal_lite.nn.sequence.ring.ring_exchange replaced by an '
        'instant stand-in that returns its own tensor -- so the time is exactly rank r\'s '
        'block math (the chunk pairs record_blocks sees, asserted equal to chunk_pairs), '
        'with no communication and no waiting; all (layout, rank) runs alternated in rounds '
        '(order reversed every other round), median per rank, one thread (min_*: the fastest '
        'round per rank instead; median_of_per_round_*: max/mean within each round, then the '
        'median over rounds). work_units: chunk '
        'pairs in (s/2P)^2 units (a contiguous block is 4). Secondary (real_run_*): a real '
        'P-rank gloo run, each rank\'s main-thread CPU time (time.thread_time) of forward+'
        'backward, which excludes time blocked in gloo waits and gloo\'s threads but is '
        'inflated by P ranks sharing 2 cores (cache, frequency).')
    return res


# ================================================================== 4. speed
def _speed_worker(rank, sp, variants):
    axis = gpc.axis(ParallelMode.SEQUENCE)
    runs = {}
    for variant in variants:
        _, fn = attention_variant(variant, axis, sp['head_dim'])
        qkv, dout = local_inputs(sp['batch'], sp['seq'] // axis.size, sp['heads'],
                                 sp['head_dim'], seed=rank)
        runs[variant] = (lambda fn=fn, qkv=qkv, dout=dout: fwd_bwd(fn, qkv, dout))
    cpu = {}
    wall = time_alternated(runs, repeats=sp['rounds'], steps=1, warmup=1, cpu_times=cpu)
    return dict(wall=wall, cpu=cpu)


def speed(cfg, variants):
    sp = cfg['speed']
    per_rank = run_distributed(_speed_worker, sp['world'], sequence_config(sp['world']), sp,
                               variants, timeout=TIMEOUT_S, collective_timeout=TIMEOUT_S)
    rounds = sp['rounds']
    # a step ends when the slowest rank ends: per round, the max over ranks
    wall = {v: [max(r['wall'][v][i] for r in per_rank) for i in range(rounds)] for v in variants}
    cpu = {v: [max(r['cpu'][v][i] for r in per_rank) for i in range(rounds)] for v in variants}
    summary = ratio_summary(wall, 'new', 'old')
    tokens = sp['batch'] * sp['seq']
    res = dict(config=sp, variants=list(variants), times_s=wall, cpu_times_s=cpu,
               tokens_per_s={v: tokens / t for v, t in summary['median_s_per_step'].items()},
               speedup_new_over_old=1 / summary['ratio_ours_over_theirs'],
               per_round_speedup_new_over_old=[1 / x for x in summary['per_round_ratios']],
               cpu_speedup_new_over_old=1 / ratio_summary(cpu, 'new', 'old')[
                   'ratio_ours_over_theirs'],
               method='forward+backward of the attention core (causal, fp32), steps=1 per '
                      'round, rounds alternated with the order reversed every other round; '
                      "a round's time = max over ranks; speedup = median of per-round "
                      'old/new time ratios; tokens/s = b*s / median step time')
    if 'ulysses' in variants:
        res['speedup_ulysses_over_new_ring'] = 1 / ratio_summary(wall, 'ulysses', 'new')[
            'ratio_ours_over_theirs']
    print('  speed: ' + ', '.join(f'{v} {t:.0f} tok/s' for v, t in res['tokens_per_s'].items())
          + f"; new/old {res['speedup_new_over_old']:.2f}x", flush=True)
    return res


# ================================================================== 5. torch's context parallel
def _torch_cp_worker(rank, sp):
    import torch.nn.functional as F
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel
    world = gpc.get_world_size(ParallelMode.SEQUENCE)
    b, n, d, s = sp['batch'], sp['heads'], sp['head_dim'], sp['seq']
    g = torch.Generator().manual_seed(0)
    out = {}
    for backend in ('default', 'math'):
        try:
            mesh = DeviceMesh('cpu', list(range(world)))
            q, k, v = (torch.randn(b, n, s, d, generator=g) for _ in range(3))
            kernel = sdpa_kernel([SDPBackend.MATH]) if backend == 'math' \
                else contextlib.nullcontext()
            with kernel, context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
                local = [t.detach().requires_grad_() for t in (q, k, v)]  # the rank's shards
                t0 = time.perf_counter()
                o = F.scaled_dot_product_attention(*local, is_causal=True)
                o.sum().backward()
                out[backend] = dict(runs=True, seconds=time.perf_counter() - t0,
                                    local_shape=list(local[0].shape))
        except Exception as err:   # noqa: BLE001 -- the exception text is the result
            out[backend] = dict(runs=False, exception=f'{type(err).__name__}: {err}',
                                where=traceback.format_exc().strip().splitlines()[-3:])
    return out


def torch_context_parallel(cfg):
    sp = cfg['speed']
    per_rank = run_distributed(_torch_cp_worker, sp['world'], sequence_config(sp['world']), sp,
                               timeout=TIMEOUT_S, collective_timeout=TIMEOUT_S)
    res = dict(seq=sp['seq'], world=sp['world'], shape=dict(batch=sp['batch'], heads=sp['heads'],
                                                            head_dim=sp['head_dim']),
               call='with context_parallel(DeviceMesh("cpu", ranks), buffers=[q, k, v], '
                    'buffer_seq_dims=[2, 2, 2]): F.scaled_dot_product_attention(q, k, v, '
                    'is_causal=True).sum().backward()  (q, k, v: [b, n, s, d])',
               backends=per_rank[0], runs=any(r['runs'] for r in per_rank[0].values()))
    for name, r in per_rank[0].items():
        print(f"  torch context_parallel ({name} SDPA): "
              f"{'runs' if r['runs'] else r['exception'][:150]}", flush=True)
    return res


# ================================================================== report
def total_ram_gib() -> float:
    return os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / GIB


def code_state() -> dict:
    """The commit and whether the files measured had uncommitted changes (read-only git)."""
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*argv):
        try:
            return subprocess.run(['git', *argv], cwd=root, capture_output=True, text=True,
                                  timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None
    return dict(commit=git('rev-parse', 'HEAD'),
                uncommitted_in_nn_sequence=git('status', '--porcelain', '--',
                                               'colossal_lite/nn/sequence'))


def machine() -> dict:
    model = platform.processor()
    with contextlib.suppress(OSError):
        with open('/proc/cpuinfo') as f:
            for line in f:
                if line.startswith('model name'):
                    model = line.split(':', 1)[1].strip()
                    break
    return dict(cpu_model=model, cpus=os.cpu_count(), ram_gib=round(total_ram_gib(), 1),
                os=platform.platform(), note='CPU only, gloo; shared with other engineers\' jobs')


def claims(cfg, mem, fits, longest, bal, spd, cp):
    s_at, p_at = cfg['ratio_at']
    pick = {(r['variant'], r['seq'], r['world']): r['peak_bytes'] for r in mem}
    out = {}
    new_fit = fits['new_P>=2']
    out['new_peak_linear_in_s_over_P'] = dict(
        target='new ring peak grows linearly in s/P: alpha_seq <= 1.2 (P >= 2, zigzag)',
        measured=new_fit and dict(alpha_seq=new_fit['alpha_seq'],
                                  beta_world=new_fit['beta_world']),
        passed=bool(new_fit and new_fit['alpha_seq'] <= 1.2))
    old_fit = fits['old']
    out['old_peak_s2_over_P'] = dict(
        target='old ring peak grows as s^2/P: alpha_seq in [1.8, 2.2], beta_world in [-1.2, -0.8]',
        measured=old_fit and dict(alpha_seq=old_fit['alpha_seq'], beta_world=old_fit['beta_world']),
        passed=bool(old_fit and 1.8 <= old_fit['alpha_seq'] <= 2.2
                    and -1.2 <= old_fit['beta_world'] <= -0.8))
    new_b, old_b = pick.get(('new', s_at, p_at)), pick.get(('old', s_at, p_at))
    ratio = new_b / old_b if new_b and old_b else None
    out[f'new_over_old_peak_at_s{s_at}_P{p_at}'] = dict(
        target='<= 1/8 = 0.125', measured=ratio, new_bytes=new_b, old_bytes=old_b,
        passed=bool(ratio is not None and ratio <= 1 / 8),
        same_ratio_at_other_P={str(w): pick[('new', s_at, w)] / pick[('old', s_at, w)]
                               for w in cfg['worlds']
                               if ('new', s_at, w) in pick and ('old', s_at, w) in pick})
    worlds = [w for w in cfg['worlds'] if longest[str(w)]['longest_seq']]
    steps = {f'P{a}->P{b}': longest[str(b)]['longest_seq'] / longest[str(a)]['longest_seq']
             for a, b in zip(worlds, worlds[1:])}
    out['longest_doubles_with_P'] = dict(
        target=f'longest s within {cfg["budget_mib"]} MiB/rank at least doubles per doubling of P',
        measured={str(w): longest[str(w)]['longest_seq'] for w in cfg['worlds']},
        growth=steps, grid_step=GRID_STEP,
        tolerance=f'growth >= 2 (1 - {GRID_STEP}/s) at the smaller P: the search rounds '
                  f'each longest s down to a multiple of {GRID_STEP}',
        passed=bool(steps) and all(
            x >= 2 * (1 - GRID_STEP / longest[k.split('->')[0][1:]]['longest_seq'])
            for k, x in steps.items()) and len(worlds) == len(cfg['worlds']))
    zz = bal['layouts']['zigzag']['max_over_mean']
    out['zigzag_balance'] = dict(
        target='causal per-rank compute time max/mean <= 1.05 (zigzag), P=4', measured=zz,
        contiguous=bal['layouts']['contiguous']['max_over_mean'],
        contiguous_work_model=bal['layouts']['contiguous']['work_max_over_mean'],
        passed=zz <= 1.05)
    out['speed_new_over_old'] = dict(
        target=f">= 1.5x tokens/s at s={cfg['speed']['seq']}, P={cfg['speed']['world']}",
        measured=spd['speedup_new_over_old'], passed=spd['speedup_new_over_old'] >= 1.5)
    out['torch_context_parallel_runs_on_cpu_gloo'] = dict(
        target='informational: whether it runs', measured=cp['runs'], passed=None)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--quick', action='store_true', help='a smoke run: small lengths, P<=4')
    args = parser.parse_args()
    cfg = QUICK if args.quick else FULL
    started = time.perf_counter()
    print('0. the variants vs serial attention', flush=True)
    variants = speed_variants()
    shape = {k: cfg['speed'][k] for k in ('batch', 'heads', 'head_dim')}
    per_rank = run_distributed(_check_worker, 4, sequence_config(4), cfg['check_seq'], shape,
                               variants, timeout=TIMEOUT_S, collective_timeout=TIMEOUT_S)
    check = {}
    for v in variants:
        errors = [r[v] for r in per_rank if isinstance(r[v], str)]
        check[v] = errors[0] if errors else max(r[v] for r in per_rank)
    variants = tuple(v for v in variants if not isinstance(check[v], str) and check[v] < 1e-4)
    print(f'  max rel diff vs serial, P=4: {check}; timed: {variants}', flush=True)
    print('1. memory sweep', flush=True)
    mem, skipped = memory_sweep(cfg)
    fits = {'new_P>=2': power_fit([r for r in mem if r['variant'] == 'new'],
                                  [w for w in cfg['worlds'] if w >= 2]),
            'new_all_P': power_fit([r for r in mem if r['variant'] == 'new']),
            'old': power_fit([r for r in mem if r['variant'] == 'old'])}
    quadratic = {v: {str(w): quad_fit(rows) for w in cfg['worlds']
                     if len(rows := [r for r in mem if r['variant'] == v and r['world'] == w]) >= 2}
                 for v in MEMORY_VARIANTS}
    exponents = {v: {str(w): seq_exponent([r for r in mem if r['variant'] == v
                                           and r['world'] == w]) for w in cfg['worlds']}
                 for v in MEMORY_VARIANTS}
    print('2. longest sequence within the budget (new ring)', flush=True)
    longest = longest_sequences(cfg, mem)
    print('3. causal balance', flush=True)
    bal = balance(cfg)
    print('4. speed', flush=True)
    spd = speed(cfg, variants)
    print('5. torch context_parallel', flush=True)
    cp = torch_context_parallel(cfg)
    result = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'),
        quick=args.quick, machine=machine(), environment=environment(),
        torch=torch.__version__, code=code_state(),
        correctness_max_rel_diff_vs_serial_P4=dict(
            seq=cfg['check_seq'], shape=shape, causal=True, max_rel_diff=check,
            note='output, dq, dk, dv of each variant vs serial attention (SDPA), fp32; '
                 'a variant is timed only when < 1e-4'),
        memory=dict(shape=cfg['memory_shape'], causal=True, dtype='float32', points=mem,
                    skipped=skipped, fits=fits, exponent_in_seq_per_world=exponents,
                    quadratic_fit_per_world=quadratic,
                    quadratic_fit_note='peak = a (s/P)^2 + c (s/P) bytes at each P (least '
                                       'squares); with b = n = 1 fp32, a = 4 x the number of '
                                       '(s/P)^2 fp32 matrices alive at the peak',
                    method='allocator peak (colossal_lite.testing.memory.peak_allocated: '
                           'torch CPU allocator record under the profiler) of one '
                           'forward+backward of the attention core above what was live '
                           'before it (q, k, v, dO excluded: input_bytes), max over ranks; '
                           'saved_bytes: distinct storages autograd saves in the forward; '
                           f'skip rule: predicted total > min({RAM_CAP_GIB} GiB, MemAvailable '
                           f'- {RAM_MARGIN_GIB} GiB)'),
        longest=dict(budget_mib_per_rank=cfg['budget_mib'], grid=f'multiples of {GRID_STEP}',
                     counted='peak of forward+backward + input_bytes (q, k, v, dO)',
                     by_world=longest),
        balance=bal, speed=spd, torch_context_parallel=cp,
        ulysses=dict(imported=ulysses_available(), timed='ulysses' in variants,
                     note="hook: attention_variant('ulysses') in this file (U = P = 4, R = 1, "
                          "contiguous blocks); timed in speed when it imports and equals "
                          "serial"),
        runtime_s=None)
    result['claims'] = claims(cfg, mem, fits, longest, bal, spd, cp)
    result['runtime_s'] = time.perf_counter() - started
    name = 'long_context_quick' if args.quick else 'long_context'   # --quick never overwrites
    path = write_json(name, result)

    print(f"\nattention peak MiB per rank (forward+backward), b={cfg['memory_shape']['batch']} "
          f"n={cfg['memory_shape']['heads']} d={cfg['memory_shape']['head_dim']}, causal fp32")
    rows = [['P', 'variant'] + [f's={s}' for s in cfg['seqs']] + ['exp. in s']]
    for w in cfg['worlds']:
        for v in MEMORY_VARIANTS:
            cells = []
            for s in cfg['seqs']:
                hit = [r for r in mem if (r['variant'], r['seq'], r['world']) == (v, s, w)]
                cells.append(f"{hit[0]['peak_bytes'] / MIB:.1f}" if hit else 'skip')
            e = exponents[v][str(w)]
            rows.append([str(w), v] + cells + [f'{e:.2f}' if e is not None else '-'])
    print_table(rows)
    print(f"longest s within {cfg['budget_mib']} MiB/rank (new ring): "
          + ', '.join(f"P={w}: {longest[str(w)]['longest_seq']}" for w in cfg['worlds']))
    print('\nclaims:')
    for k, c in result['claims'].items():
        print(f"  {k}: {c['measured']!r:.80} -> {c['passed']}")
    print(f'wrote {path} in {result["runtime_s"]:.0f} s')


if __name__ == '__main__':
    main()
