"""Pipeline schedules on 4 CPU processes: idle fraction against its formula, activation memory,
and tokens/s side by side with ``torch.distributed.pipelining``.

    python benchmarks/pipeline_schedules.py [--quick]

Model: a GPT layer stack of equal blocks (``SHAPE``: hidden 256, 8 layers, 4 heads, seq 64,
vocab 256 so the embedding and head are cheap, dropout 0), fp32, micro-batches of ``MICRO``
sequences, M = P..4P micro-batches, P = 4 pipeline ranks (gloo, one thread each).

For each of our schedules (gpipe, 1f1b, interleaved with V = 2 chunks, zero_bubble) and each
M, one launched run holds our engine (``GPT.from_preset`` after launch: this rank's stages)
and torch's counterpart built from the same blocks and weights (a serial GPT built in a
described one-rank context, its blocks wrapped per stage in ``PipelineStage``):
ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B (same loop layout, V = 2) and, for zero
bubble, ScheduleInterleavedZeroBubble with one stage per rank (ZB1P = ZB-H1) plus
ScheduleZBVZeroBubble (V-shaped, 2 stages per rank). A step is zero_grad + the schedule + the
tied-embedding gradient sum over the first and last rank + AdamW, on both sides. Steps are
timed in rounds, the order reversed every other round, a barrier before each step; a round's
step time is the slowest rank's; reported: medians and the median of per-round ratios, of
wall time (tokens/s) and of CPU seconds per step summed over the ranks (``process_time``:
robust to the time a rank waits descheduled on this shared, oversubscribed machine).

* Idle fraction: from our runtime's timeline (``engine.schedule.record_timeline``), per rank
  ``1 - busy / makespan``; busy = the rank's F, B and W actions; makespan = first compute start
  to last compute end over all ranks. ``time.perf_counter`` is CLOCK_MONOTONIC on Linux, one
  clock for every process of the machine (checked: the spread of the ranks' barrier exits is
  recorded). Median over the timed rounds. Formulas: (P-1)/(M+P-1) (GPipe, 1F1B),
  (P-1)/(VM+P-1) (interleaved), (P-1)/(3M+P-1) for ZB-H1 at unit costs, and ZB-H1 with the
  measured costs: (P-1)(T_F+T_B-T_W) / (M(T_F+T_B+T_W) + (P-1)(T_F+T_B-T_W)).
* Activation memory: CPU has no allocator accounting like ``torch.cuda.max_memory_allocated``
  (and RSS hides freed memory in malloc's arenas), so we measure what autograd holds: every
  tensor saved for backward goes through ``saved_tensors_hooks`` and is counted (once per
  storage, parameters excluded) until autograd releases it; the peak over one step is the
  measured number, on both sides. Predicted: our timeline's micro-batches in flight (F to B,
  or F to W under a split backward) times the measured saved bytes of one micro-batch's
  forward on that stage.

Writes ``results/pipeline_schedules.json`` and ``results/pipeline_schedules.png`` (our
timelines at M = 2P).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks._common import RESULTS_DIR, environment, load_average, print_table, write_json  # noqa: E402,E501
from colossal_lite.testing import run_distributed  # noqa: E402

P = 4
SHAPE = dict(vocab_size=256, max_positions=64, hidden=256, layers=8, heads=4, dropout=0.0)
SEQ, MICRO = 64, 2
# ours -> (pipeline config, [(torch schedule, stages per rank, layout)])
SCHEDULES = {
    'gpipe': (dict(schedule='gpipe'), [('ScheduleGPipe', 1, 'loop')]),
    '1f1b': (dict(schedule='1f1b'), [('Schedule1F1B', 1, 'loop')]),
    'interleaved': (dict(schedule='interleaved', chunks=2),
                    [('ScheduleInterleaved1F1B', 2, 'loop')]),
    'zero_bubble': (dict(schedule='zero_bubble'),
                    [('ScheduleInterleavedZeroBubble', 1, 'loop'),
                     ('ScheduleZBVZeroBubble', 2, 'v')]),
}
COMPUTE = ('F', 'B', 'W')


# ------------------------------------------------------------------ measured activations
class SavedActivations:
    """Bytes of the tensors autograd holds for backward (each storage once, parameters
    excluded), live and peak, through ``torch.autograd.graph.saved_tensors_hooks``."""

    def __init__(self, params):
        self.exclude = {p.untyped_storage().data_ptr() for p in params}
        self.refs, self.live, self.peak = {}, 0, 0

    def _pack(self, t):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.exclude or storage.nbytes() == 0:
            return t
        if ptr not in self.refs:
            self.refs[ptr] = 0
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        self.refs[ptr] += 1
        # detached: an output saved by its own node must not point back at that node (a
        # cycle through C++ that Python's gc cannot free, keeping the graph alive)
        return _Held(self, t.detach(), ptr, storage.nbytes())

    def release(self, ptr, nbytes):
        self.refs[ptr] -= 1
        if not self.refs[ptr]:
            del self.refs[ptr]
            self.live -= nbytes

    def __call__(self):
        return torch.autograd.graph.saved_tensors_hooks(
            self._pack, lambda x: x.tensor if isinstance(x, _Held) else x)


class _Held:
    __slots__ = ('owner', 'tensor', 'ptr', 'nbytes')

    def __init__(self, owner, tensor, ptr, nbytes):
        self.owner, self.tensor, self.ptr, self.nbytes = owner, tensor, ptr, nbytes

    def __del__(self):
        self.owner.release(self.ptr, self.nbytes)


def measured_peak(step, params) -> int:
    tracker = SavedActivations(params)
    with tracker():
        step()
    return tracker.peak


# ------------------------------------------------------------------ torch's side
class TorchStage(nn.Module):
    """Stage ``index`` of a serial GPT's blocks ``layers`` (+ embeddings first, head last)."""

    def __init__(self, full, layers, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.wte, self.wpe, self.drop = full.wte, full.wpe, full.drop
        self.blocks = nn.ModuleList([full.blocks[str(i)] for i in layers])
        if last:
            self.ln_f, self.lm_head = full.ln_f, full.lm_head

    def forward(self, x):
        if self.first:
            b, s = x.shape
            x = self.drop(self.wte(x) + self.wpe(torch.arange(s, device=x.device).expand(b, s)))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.last else x


def serial_gpt():
    """The whole GPT, built in a described one-rank context (same weights by name)."""
    from colossal_lite.config import parse_parallel
    from colossal_lite.context import ParallelContext, use_context
    from model_zoo import GPT
    with use_context(ParallelContext.describe(parse_parallel({}).with_world_size(1), 0)):
        return GPT.from_preset('tiny', **SHAPE)


def torch_pipeline(full, name: str, chunks: int, style: str, M: int):
    """``(step(batch), parameters)`` of torch's schedule ``name`` over this rank's stages."""
    import torch.distributed.pipelining as pp
    from colossal_lite.communication import collective as C
    from colossal_lite.context import ParallelMode, global_context as gpc
    from model_zoo import GPTLMLoss
    rank, S = gpc.get_local_rank(ParallelMode.PIPELINE), P * chunks
    ids = [rank + v * P for v in range(chunks)] if style == 'loop' else [rank, 2 * P - 1 - rank]
    per = SHAPE['layers'] // S
    modules = [TorchStage(full, range(s * per, (s + 1) * per), s == 0, s == S - 1) for s in ids]
    stages = [pp.PipelineStage(m, s, S, gpc.device, group=gpc.get_group(ParallelMode.PIPELINE))
              for m, s in zip(modules, ids)]
    schedule = getattr(pp, name)(stages if chunks > 1 or 'ZeroBubble' in name else stages[0],
                                 M, loss_fn=GPTLMLoss())
    params = list({id(p): p for m in modules for p in m.parameters()}.values())
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    first, last = 0 in ids, S - 1 in ids
    tied = full.wte.weight if first != last else None  # else both ends share it here

    def step(batch):
        optimizer.zero_grad()
        inputs, labels = batch
        args = (inputs,) if first else ()
        kwargs = dict(target=labels, losses=[]) if last else {}
        schedule.step(*args, **kwargs)
        if tied is not None:
            C.all_reduce(tied.grad, ParallelMode.EMBEDDING, inplace=True)
        optimizer.step()
    return step, params


# ------------------------------------------------------------------ one launched run
def stage_bytes(model, batch) -> dict:
    """Saved-activation bytes of one micro-batch's forward on each of this rank's stages."""
    ids = batch[0][:MICRO]
    out = {}
    for spec in model.stages:
        x = None if spec.first else torch.randn(MICRO, SEQ, SHAPE['hidden'], requires_grad=True)
        tracker = SavedActivations(model.parameters())
        with tracker():
            y = model(ids, stage_input=x, stage=spec.index)
        out[spec.index] = tracker.live
        del y
    return out


def worker(rank, schedule: str, M: int, repeats: int):
    import torch.distributed as dist
    import colossal_lite as clt
    from model_zoo import GPT, GPTLMLoss
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, SHAPE['vocab_size'], (M * MICRO, SEQ), generator=g)
    batch = (ids, ids)
    model = GPT.from_preset('tiny', **SHAPE)
    engine, *_ = clt.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4), GPTLMLoss())
    engine.schedule.record_timeline = True
    full = serial_gpt()

    def ours():
        engine.zero_grad()
        engine.execute_schedule(batch)
        engine.step()
    runs, params = {'ours': ours}, {'ours': list(engine.model.parameters())}
    for name, chunks, style in SCHEDULES[schedule][1]:
        step, params[name] = torch_pipeline(full, name, chunks, style, M)
        runs[name] = lambda step=step: step(batch)
    for fn in runs.values():  # warm-up (torch infers shapes on its first step)
        fn()
    memory = {name: measured_peak(fn, params[name]) for name, fn in runs.items()}
    memory_timeline = _timeline(engine)
    per_mb = stage_bytes(engine.model, batch)
    names = list(runs)
    starts, ends, cpu = ({n: [] for n in names} for _ in range(3))
    timelines = []
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            dist.barrier()
            cpu0 = time.process_time()
            starts[name].append(time.perf_counter())
            runs[name]()
            ends[name].append(time.perf_counter())
            cpu[name].append(time.process_time() - cpu0)
            if name == 'ours':
                timelines.append(_timeline(engine))
    return dict(starts=starts, ends=ends, cpu=cpu, timelines=timelines, memory=memory,
                memory_timeline=memory_timeline, stage_bytes=per_mb)


def _timeline(engine):
    return [(a.kind, a.stage, a.microbatch, s, e) for a, s, e in engine.schedule.timeline]


def split_backward_cost(repeats: int = 15) -> dict:
    """One process, one thread: median seconds of a middle stage's forward, fused backward and
    split backward (B, then W; ``split_backward.py``) on one micro-batch, alternated."""
    from colossal_lite.config import parse_parallel
    from colossal_lite.context import ParallelContext, use_context
    from colossal_lite.pipeline.split_backward import SplitBackward
    from model_zoo import GPT
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    layout = parse_parallel({'pipeline': P}).with_world_size(P)
    with use_context(ParallelContext.describe(layout, 1)):
        model = GPT.from_preset('tiny', **SHAPE)
    params = list(model.parameters())
    ids = torch.zeros(MICRO, SEQ, dtype=torch.long)
    grad = torch.randn(MICRO, SEQ, SHAPE['hidden'])
    times = {k: [] for k in ('F', 'fused', 'B', 'W')}

    def timed(key, fn):
        start = time.perf_counter()
        out = fn()
        times[key].append(time.perf_counter() - start)
        return out

    def forward():
        x = torch.randn(MICRO, SEQ, SHAPE['hidden'], requires_grad=True)
        return x, timed('F', lambda: model(ids, stage_input=x, stage=1))

    def fused():
        x, out = forward()
        timed('fused', lambda: torch.autograd.backward(out, grad))

    def split():
        x, out = forward()
        parts = SplitBackward(out, grad, x, params)
        timed('B', parts.input_grad)
        del out
        timed('W', parts.weight_grad)
    for r in range(repeats + 2):
        for fn in ((fused, split) if r % 2 == 0 else (split, fused)):
            model.zero_grad(set_to_none=True)
            fn()
    torch.set_num_threads(threads)
    med = {k: statistics.median(v[4:]) for k, v in times.items()}  # 2 warm-up rounds
    med['B_plus_W_over_fused'] = (med['B'] + med['W']) / med['fused']
    return med


# ------------------------------------------------------------------ analysis
def formula(schedule: str, M: int, chunks: int = 1) -> float:
    if schedule == 'interleaved':
        return (P - 1) / (chunks * M + P - 1)
    if schedule == 'zero_bubble':
        return (P - 1) / (3 * M + P - 1)
    return (P - 1) / (M + P - 1)


def zb_formula_measured(M: int, tf: float, tb: float, tw: float) -> float:
    idle = (P - 1) * max(tf + tb - tw, 0.0)
    return idle / (M * (tf + tb + tw) + idle)


def idle_fractions(rank_timelines):
    """Per-rank idle fraction and the makespan of one step (rank_timelines: one per rank)."""
    compute = [[t for t in tl if t[0] in COMPUTE] for tl in rank_timelines]
    begin = min(t[3] for tl in compute for t in tl)
    end = max(t[4] for tl in compute for t in tl)
    makespan = end - begin
    busy = [sum(t[4] - t[3] for t in tl) for tl in compute]
    return [1 - b / makespan for b in busy], makespan


def time_breakdown(rank_timelines):
    """Per rank, the fractions of the compute span spent in compute, in receives (waiting
    for a peer, then copying), in sends (posting), and elsewhere (runtime overhead)."""
    spans = [(t[3], t[4]) for tl in rank_timelines for t in tl if t[0] in COMPUTE]
    begin, end = min(s for s, _ in spans), max(e for _, e in spans)
    out = []
    for tl in rank_timelines:
        part = {'compute': 0.0, 'recv': 0.0, 'send': 0.0}
        for kind, _, _, s, e in tl:
            d = max(0.0, min(e, end) - max(s, begin))
            part['compute' if kind in COMPUTE else 'recv' if kind.startswith('RECV')
                 else 'send'] += d
        part = {k: v / (end - begin) for k, v in part.items()}
        part['other'] = 1 - sum(part.values())
        out.append(part)
    return out


def in_flight(timeline, stage_bytes, split: bool):
    """(peak micro-batches held, peak predicted bytes) along one rank's timeline."""
    held, peak_n, live, peak_b = set(), 0, 0, 0
    for kind, stage, m, _, _ in timeline:
        if kind == 'F':
            held.add((stage, m))
            live += stage_bytes[stage]
        elif kind == ('W' if split else 'B'):
            held.discard((stage, m))
            live -= stage_bytes[stage]
        peak_n, peak_b = max(peak_n, len(held)), max(peak_b, live)
    return peak_n, peak_b


def action_costs(rounds):
    """Median duration of F, B and W over every rank and round."""
    out = {}
    for kind in COMPUTE:
        d = [t[4] - t[3] for ranks in rounds for tl in ranks for t in tl if t[0] == kind]
        if d:
            out[kind] = statistics.median(d)
    return out


def analyse(schedule: str, M: int, per_rank: list, repeats: int) -> dict:
    chunks = SCHEDULES[schedule][0].get('chunks', 1)
    names = list(per_rank[0]['starts'])
    step_s = {n: [max(r['ends'][n][k] - r['starts'][n][k] for r in per_rank)
                  for k in range(repeats)] for n in names}
    cpu_s = {n: [sum(r['cpu'][n][k] for r in per_rank) for k in range(repeats)] for n in names}
    tokens = M * MICRO * SEQ
    rounds = [[r['timelines'][k] for r in per_rank] for k in range(repeats)]
    idle = [idle_fractions(rs) for rs in rounds]
    per_rank_idle = [statistics.median(i[0][rank] for i in idle) for rank in range(P)]
    costs = action_costs(rounds)
    skew = statistics.median(max(r['starts']['ours'][k] for r in per_rank)
                             - min(r['starts']['ours'][k] for r in per_rank)
                             for k in range(repeats))
    split = schedule == 'zero_bubble'
    predicted = [in_flight(r['memory_timeline'], {int(k): v for k, v in r['stage_bytes'].items()},
                           split) for r in per_rank]
    out = dict(
        schedule=schedule, M=M, chunks=chunks, tokens_per_step=tokens,
        step_s=step_s, median_step_s={n: statistics.median(v) for n, v in step_s.items()},
        tokens_per_s={n: tokens / statistics.median(v) for n, v in step_s.items()},
        ours_over_torch_tokens_per_s={
            n: statistics.median(b / a for a, b in zip(step_s['ours'], step_s[n]))
            for n in names if n != 'ours'},
        cpu_s_per_step_all_ranks=cpu_s,
        torch_over_ours_cpu_s_per_step={
            n: statistics.median(b / a for a, b in zip(cpu_s['ours'], cpu_s[n]))
            for n in names if n != 'ours'},
        idle_fraction_per_rank=per_rank_idle,
        idle_fraction_mean=statistics.mean(per_rank_idle),
        idle_formula=formula(schedule, M, chunks),
        makespan_s=statistics.median(i[1] for i in idle),
        busy_s_per_rank=[statistics.median(sum(t[4] - t[3] for t in rs[rank] if t[0] in COMPUTE)
                                           for rs in rounds) for rank in range(P)],
        time_fractions_per_rank=[
            {k: statistics.median(b[rank][k] for b in map(time_breakdown, rounds))
             for k in ('compute', 'recv', 'send', 'other')} for rank in range(P)],
        action_median_s=costs, barrier_exit_spread_s=skew,
        activation_bytes_measured_peak={n: [r['memory'][n] for r in per_rank] for n in names},
        activation_bytes_per_microbatch={f'rank{k}': r['stage_bytes']
                                         for k, r in enumerate(per_rank)},
        microbatches_in_flight_peak=[p[0] for p in predicted],
        activation_bytes_predicted_peak=[p[1] for p in predicted],
        timeline_at_median_round=rounds[sorted(range(repeats),
                                               key=lambda k: step_s['ours'][k])[repeats // 2]])
    if split:
        out['idle_formula_measured_costs'] = zb_formula_measured(
            M, costs['F'], costs['B'], costs.get('W', 0.0))
    return out


# ------------------------------------------------------------------ output
def plot(results: list, M: int, path: str):
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        print('matplotlib not installed: no timeline plot')
        return None
    chosen = [r for r in results if r['M'] == M]
    colors = {'F': '#4c72b0', 'B': '#55a868', 'W': '#dd8452'}
    fig, axes = plt.subplots(len(chosen), 1, figsize=(11, 2.0 * len(chosen)), squeeze=False,
                             sharex=True)
    for ax, res in zip(axes[:, 0], chosen):
        timeline = res['timeline_at_median_round']
        t0 = min(t[3] for tl in timeline for t in tl)
        for rank, tl in enumerate(timeline):
            for kind, stage, m, s, e in tl:
                if kind in colors:
                    ax.barh(rank, (e - s) * 1e3, left=(s - t0) * 1e3, height=0.8,
                            color=colors[kind], edgecolor='black', linewidth=0.3)
                    if res['chunks'] > 1:
                        ax.text((s + e - 2 * t0) / 2 * 1e3, rank, str(stage // P),
                                ha='center', va='center', fontsize=5)
        ax.set_yticks(range(P))
        ax.set_yticklabels([f'rank {r}' for r in range(P)])
        ax.invert_yaxis()
        ax.set_title(f"{res['schedule']} (M = {M}): idle {res['idle_fraction_mean']:.2f} "
                     f"measured, {res['idle_formula']:.2f} formula", fontsize=9)
    axes[-1, 0].set_xlabel('ms since the first compute (F blue, B green, W orange; '
                           'interleaved: chunk index)')
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--quick', action='store_true', help='M = P and 2P, 3 rounds')
    args = parser.parse_args()
    ms, repeats = ([P, 2 * P], 3) if args.quick else ([P, 2 * P, 4 * P], 5)
    load_before, start = load_average(), time.time()
    split_cost = split_backward_cost()
    print('one middle stage, one micro-batch, 1 process: forward {F:.4f} s, fused backward '
          '{fused:.4f} s, split B {B:.4f} + W {W:.4f} s = {B_plus_W_over_fused:.2f}x the fused'
          .format(**split_cost), flush=True)
    results = []
    for schedule, (pipeline, _) in SCHEDULES.items():
        for M in ms:
            cfg = dict(parallel=dict(pipeline=dict(size=P, **pipeline)), num_microbatches=M)
            per_rank = run_distributed(worker, P, cfg, schedule, M, repeats, timeout=600,
                                       collective_timeout=300)
            results.append(analyse(schedule, M, per_rank, repeats))
            r = results[-1]
            print(f"{schedule:12s} M={M:2d}: idle {r['idle_fraction_mean']:.3f} "
                  f"(formula {r['idle_formula']:.3f}), ours/torch tokens/s "
                  + ', '.join(f'{k} {v:.2f}x'
                              for k, v in r['ours_over_torch_tokens_per_s'].items()),
                  flush=True)
    png = plot(results, 2 * P, os.path.join(RESULTS_DIR, 'pipeline_schedules.png'))
    data = dict(pipeline_size=P, model=SHAPE, seq=SEQ, micro_batch=MICRO, repeats=repeats,
                results=results, split_backward_cost_s=split_cost, wall_s=time.time() - start,
                environment=dict(environment(), load_average_before=load_before),
                plot=os.path.basename(png) if png else None,
                note=('CPU gloo, 4 ranks (one thread each) on a shared 2-core machine: ranks '
                      'compete for cores, so an action runs slower when more ranks compute at '
                      'once and bubbles are partly filled by the other ranks; tokens/s ratios '
                      'are side by side in one run per row. Our split backward (B + W, '
                      'split_backward.py) costs more than the fused one '
                      '(split_backward_cost_s): compare zero bubble by tokens/s and CPU time, '
                      'not only by its idle fraction.'))
    write_json('pipeline_schedules', data)
    report(results)


def report(results):
    rows = [['schedule', 'M', 'idle meas', 'idle formula', 'ZB formula (meas. costs)',
             'ours tok/s', 'torch tok/s (schedule)', 'ours/torch', 'CPU torch/ours',
             'act. peak MiB ours (r0..r3)',
             'torch', 'in flight (r0..r3)']]
    mib = lambda b: f'{b / 2 ** 20:.1f}'  # noqa: E731
    for r in results:
        torch_names = [n for n in r['tokens_per_s'] if n != 'ours']
        rows.append([
            r['schedule'], r['M'], f"{r['idle_fraction_mean']:.3f}", f"{r['idle_formula']:.3f}",
            f"{r['idle_formula_measured_costs']:.3f}" if 'idle_formula_measured_costs' in r else '',
            f"{r['tokens_per_s']['ours']:.0f}",
            ', '.join(f"{r['tokens_per_s'][n]:.0f} ({n.replace('Schedule', '')})"
                      for n in torch_names),
            ', '.join(f"{r['ours_over_torch_tokens_per_s'][n]:.2f}x" for n in torch_names),
            ', '.join(f"{r['torch_over_ours_cpu_s_per_step'][n]:.2f}x" for n in torch_names),
            '/'.join(mib(b) for b in r['activation_bytes_measured_peak']['ours']),
            '; '.join('/'.join(mib(b) for b in r['activation_bytes_measured_peak'][n])
                      for n in torch_names),
            '/'.join(str(n) for n in r['microbatches_in_flight_peak'])])
    print_table(rows)
    rows = [['schedule', 'M', 'makespan s', 'busy s (mean rank)', 'compute/recv/send/other',
             'F/B/W median ms']]
    for r in results:
        parts = [statistics.mean(f[k] for f in r['time_fractions_per_rank'])
                 for k in ('compute', 'recv', 'send', 'other')]
        rows.append([r['schedule'], r['M'], f"{r['makespan_s']:.3f}",
                     f"{statistics.mean(r['busy_s_per_rank']):.3f}",
                     '/'.join(f'{p:.2f}' for p in parts),
                     '/'.join(f"{r['action_median_s'][k] * 1e3:.1f}"
                              for k in COMPUTE if k in r['action_median_s'])])
    print_table(rows)


if __name__ == '__main__':
    main()
