"""Predicted vs measured step time of the planner's candidates on this machine.

Measures a cluster profile of this machine (``colossal_lite.auto.profile.measure``: α-β of
gloo collectives on 4 forked ranks, one block's FLOP rate), then for every layout of a small
GPT (hidden 128, 4 layers, 4 heads, vocabulary 256, sequence 64, global batch 16) on 4 ranks
-- data, 1D, 2D, sequence, pipeline (1F1B, 4 micro-batches) and their mixes; no ZeRO, no
checkpointing -- runs the real engine (``initialize`` + ``execute_schedule`` + ``step``,
AdamW) on 4 forked gloo ranks: 2 warm-up steps, then the median over 5 steps of the
slowest rank's step time. Prints predicted and measured times side by side, Kendall's tau
between the two rankings, and how far the planner's pick is from the measured best.
Peak memory is not compared: CPU tensors have no allocator statistics here.

Run: ``PYTHONPATH=. python benchmarks/planner_accuracy.py`` -> benchmarks/results/
planner_accuracy.json and .png (≈ 2 min on 2 cores).
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import model_zoo  # noqa: E402,F401
from benchmarks._common import environment, print_table, write_json  # noqa: E402
from colossal_lite.auto.cost import Candidate, evaluate  # noqa: E402
from colossal_lite.auto.model_spec import model_shape  # noqa: E402
from colossal_lite.auto.planner import plan_config  # noqa: E402
from colossal_lite.auto.profile import measure  # noqa: E402
from colossal_lite.auto.search import layouts  # noqa: E402
from colossal_lite.testing import run_distributed  # noqa: E402

MODEL = dict(vocab_size=256, max_positions=64, hidden=128, layers=4, heads=4, dropout=0.0)
SEQ, BATCH, WORLD, WARMUP, STEPS = 64, 16, 4, 2, 5


def _measure(rank, steps, warmup):
    torch.set_num_threads(1)
    import colossal_lite as clt
    from colossal_lite import communication as comm
    from colossal_lite.context import ParallelMode, global_context as gpc
    from colossal_lite.testing import engine_step
    from model_zoo import GPT, GPTLMLoss
    torch.manual_seed(0)
    model = GPT(**MODEL)
    engine, *_ = clt.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                GPTLMLoss())
    data = gpc.get_world_size(ParallelMode.DATA)
    ids = torch.randint(0, 256, (BATCH // data, SEQ),
                        generator=torch.Generator().manual_seed(gpc.get_local_rank(ParallelMode.DATA)))
    times = []
    for i in range(warmup + steps):
        comm.barrier()
        start = time.perf_counter()
        engine_step(engine, (ids, ids))
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def kendall_tau(a, b) -> float:
    n, score = len(a), 0
    for i in range(n):
        for j in range(i + 1, n):
            x, y = a[i] - a[j], b[i] - b[j]
            score += (x * y > 0) - (x * y < 0)
    return score / (n * (n - 1) / 2)


def main():
    profile = measure('this machine (measured)')
    shape = model_shape('gpt', None, seq=SEQ, **MODEL)
    cands = []
    for layout in layouts(shape, WORLD, BATCH):
        if layout.mode == '2.5d':
            continue  # depth 1 on 4 ranks is the 2D grid
        m = 4 if layout.pipeline > 1 else 1
        cands.append(Candidate(layout, m, '1f1b'))
    records, rows = [], [['layout', 'predicted ms', 'measured ms']]
    for cand in cands:
        predicted = evaluate(shape, profile, cand, BATCH).step_time
        config = plan_config(shape, cand, BATCH)
        run = {k: config[k] for k in ('parallel', 'num_microbatches')}
        per_rank = run_distributed(_measure, WORLD, run, STEPS, WARMUP, timeout=600)
        measured = statistics.median(max(step) for step in zip(*per_rank))
        records.append(dict(layout=cand.describe(), predicted_s=predicted, measured_s=measured))
        rows.append([cand.describe(), f'{predicted * 1e3:.1f}', f'{measured * 1e3:.1f}'])
        print(rows[-1], flush=True)
    pred = [r['predicted_s'] for r in records]
    meas = [r['measured_s'] for r in records]
    tau = kendall_tau(pred, meas)
    pick = min(range(len(records)), key=lambda i: pred[i])
    regret = meas[pick] / min(meas) - 1
    print_table(rows)
    print(f"Kendall tau {tau:.2f}; the planner's pick ({records[pick]['layout']}) is "
          f"{regret * 100:.0f}% slower than the measured best "
          f"({records[meas.index(min(meas))]['layout']})")
    path = write_json('planner_accuracy', dict(
        model=MODEL, seq=SEQ, batch=BATCH, world=WORLD, steps=STEPS, warmup=WARMUP,
        profile=profile.to_json(), results=records, kendall_tau=tau,
        pick=records[pick]['layout'], pick_regret=regret, environment=environment()))
    _plot(records)
    print('wrote', path)


def _plot(records):
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 5))
    for r in records:
        ax.scatter(r['predicted_s'] * 1e3, r['measured_s'] * 1e3)
        ax.annotate(r['layout'].split(' M=')[0], (r['predicted_s'] * 1e3, r['measured_s'] * 1e3),
                    fontsize=6)
    ax.set_xlabel('predicted step time (ms)')
    ax.set_ylabel('measured step time (ms)')
    ax.set_title('planner: predicted vs measured, GPT h=128 L=4 on 4 gloo ranks')
    fig.tight_layout()
    fig.savefig(os.path.join(os.path.dirname(__file__), 'results', 'planner_accuracy.png'), dpi=120)


if __name__ == '__main__':
    main()
