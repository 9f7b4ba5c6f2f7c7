"""Sequence vs 1D tensor parallelism inside a pipeline: 2 stages x tensor 2 x data 2 (8 ranks).

    python benchmarks/seq_vs_1d_pipeline.py [--quick]

A tiny-ish GPT (``SHAPE``: hidden 256, 4 layers, 4 heads, seq 64, vocab 256, dropout 0),
1F1B over M = ``M`` micro-batches of ``MICRO`` sequences per data replica, fp32, on 8 CPU
ranks (gloo, one thread each). Both layouts live in one launched run: the processes are
launched with the sequence layout, then the groups of the 1D layout are built on the same
processes and the global context's state is switched before each engine runs (the library
resolves a ParallelMode through the global context at call time). Both models hold the
same full weights (drawn by name): their first-step losses are compared as a check that
each runs on its own groups. Steps (zero_grad + execute_schedule + step) are timed in
rounds, order reversed every other round, a barrier before each step; a round's step time
is the slowest rank's; reported: medians and the median of per-round ratios, of wall time
(tokens/s) and of CPU seconds per step summed over the ranks (``process_time``: robust to
the time a rank waits descheduled on this shared machine; a gloo receive waits without
spinning, so waiting costs no CPU time).

Bytes per step (``colossal_lite.communication.comm_profile``), per rank:

* ``PIPELINE`` sends between the stages (activations forward, gradients backward: M
  messages each way, each an int64 header of 64 bytes + the payload);
* the ``PARALLEL_1D`` all_gather that a 1D stage boundary needs: the collectives issued
  inside ``StageLink.recv`` (wrapped here, in the benchmark's processes only). Under 1D
  the activation between stages is replicated over the t = 2 tensor ranks, so each sends
  only its 1/t slice and the receiver all-gathers it (Megatron's scatter-gather); under
  sequence parallelism each rank already holds a different 1/t of the sequence and sends
  it as is, with no gather. Without the scatter-gather, 1D would send the full activation
  from every tensor rank (t times the bytes; given as ``1d_without_scatter_gather``).

Writes ``results/seq_vs_1d_pipeline.json``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks._common import environment, load_average, print_table, write_json  # noqa: E402
from colossal_lite.testing import run_distributed  # noqa: E402

WORLD, STAGES, TENSOR = 8, 2, 2
SHAPE = dict(vocab_size=256, max_positions=64, hidden=256, layers=4, heads=4, dropout=0.0)
SEQ, MICRO, M = 64, 2, 4
SEED = 1024


def config(mode: str) -> dict:
    return dict(parallel=dict(pipeline=dict(size=STAGES, schedule='1f1b'),
                              tensor=dict(size=TENSOR, mode=mode)),
                num_microbatches=M, seed=SEED)


class Layouts:
    """The launched layout and a second one built on the same processes; ``use(name)``
    makes one of them the global context's state."""

    def __init__(self, launched: str, other: str):
        from colossal_lite.config import load_config
        from colossal_lite.context import global_context as gpc
        self.gpc = gpc
        self.states = {launched: dict(gpc.__dict__)}
        gpc._axes = {}  # the launched state keeps its own dict
        gpc.init_parallel_groups(load_config(config(other)))
        self.states[other] = dict(gpc.__dict__)
        self.current = other

    def use(self, name: str):
        if name != self.current:
            self.gpc.__dict__.clear()
            self.gpc.__dict__.update(self.states[name])
            self.current = name


class BoundaryBytes:
    """Counts the collectives issued inside ``StageLink.recv`` (the receiving side of a
    stage boundary) while ``active``."""

    def __init__(self):
        from colossal_lite.communication import CommStats, comm_profile
        from colossal_lite.pipeline.p2p import StageLink
        self.stats, self.active = CommStats(), False
        original = StageLink.recv

        def recv(link, *args):
            if not self.active:
                return original(link, *args)
            with comm_profile() as inner:
                out = original(link, *args)
            for mode, op in inner.keys():
                if op != 'recv':
                    self.stats.record(mode, op, inner.bytes(mode, op),
                                      _group_size(mode))
            return out
        StageLink.recv = recv


def _group_size(mode):
    from colossal_lite.context import global_context as gpc
    return gpc.get_world_size(mode)


def build(mode: str):
    import colossal_lite as clt
    from colossal_lite.context import ParallelMode, global_context as gpc
    from model_zoo import GPT, GPTLMLoss
    gpc.set_seed(SEED)
    model = GPT.from_preset('tiny', **SHAPE)
    engine, *_ = clt.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4), GPTLMLoss())
    replica = gpc.get_local_rank(ParallelMode.DATA)  # each data replica its own batch
    g = torch.Generator().manual_seed(100 + replica)
    ids = torch.randint(0, SHAPE['vocab_size'], (M * MICRO, SEQ), generator=g)

    def step():
        engine.zero_grad()
        _, _, loss = engine.execute_schedule((ids, ids))
        engine.step()
        return loss
    return step


def worker(rank, repeats: int):
    import torch.distributed as dist
    from colossal_lite.communication import comm_profile
    from colossal_lite.context import ParallelMode
    boundary = BoundaryBytes()
    steps = {'sequence': build('sequence')}
    layouts = Layouts('sequence', '1d')
    steps['1d'] = build('1d')
    names = list(steps)
    first_loss, sent, gathered, wire, total = {}, {}, {}, {}, {}
    for name in names:  # warm-up, the loss check and the byte counts
        layouts.use(name)
        boundary.stats.reset()
        boundary.active = True
        with comm_profile() as stats:
            first_loss[name] = float(steps[name]())
        boundary.active = False
        sent[name] = stats.bytes(mode=ParallelMode.PIPELINE, op='send')
        gathered[name] = boundary.stats.bytes(op='all_gather')
        wire[name] = boundary.stats.wire_bytes(op='all_gather')
        total[name] = stats.by_mode()
    times, cpu = {n: [] for n in names}, {n: [] for n in names}
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            layouts.use(name)
            dist.barrier()
            start, cpu0 = time.perf_counter(), time.process_time()
            steps[name]()
            times[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - cpu0)
    layouts.use('sequence')  # the launched state, for teardown
    return dict(times=times, cpu=cpu, first_loss=first_loss, pipeline_send_bytes=sent,
                boundary_all_gather_bytes=gathered, boundary_all_gather_wire_bytes=wire,
                bytes_by_mode=total)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--quick', action='store_true', help='3 rounds')
    args = parser.parse_args()
    repeats = 3 if args.quick else 15
    load_before, start = load_average(), time.time()
    per_rank = run_distributed(worker, WORLD, config('sequence'), repeats, timeout=900,
                               collective_timeout=300)
    names = list(per_rank[0]['times'])
    step_s = {n: [max(r['times'][n][k] for r in per_rank) for k in range(repeats)]
              for n in names}
    tokens = (WORLD // (STAGES * TENSOR)) * M * MICRO * SEQ
    tps = {n: tokens / statistics.median(v) for n, v in step_s.items()}
    speedup = statistics.median(b / a for a, b in zip(step_s['sequence'], step_s['1d']))
    cpu_s = {n: [sum(r['cpu'][n][k] for r in per_rank) for k in range(repeats)] for n in names}
    cpu_ratio = statistics.median(b / a for a, b in zip(cpu_s['sequence'], cpu_s['1d']))
    act = MICRO * SEQ * SHAPE['hidden'] * 4  # one micro-batch's activation, fp32
    by_rank = {key: {n: [r[key][n] for r in per_rank] for n in names}
               for key in ('pipeline_send_bytes', 'boundary_all_gather_bytes',
                           'boundary_all_gather_wire_bytes', 'first_loss')}
    no_sg = [M * (act + 64)] * WORLD  # every tensor rank sends the full activation
    data = dict(world=WORLD, pipeline=STAGES, tensor=TENSOR, data=WORLD // (STAGES * TENSOR),
                model=SHAPE, seq=SEQ, micro_batch=MICRO, num_microbatches=M, schedule='1f1b',
                repeats=repeats, tokens_per_step=tokens, step_s=step_s,
                median_step_s={n: statistics.median(v) for n, v in step_s.items()},
                tokens_per_s=tps, speedup_sequence_over_1d=speedup,
                cpu_s_per_step_all_ranks=cpu_s, cpu_1d_over_sequence=cpu_ratio,
                per_rank_per_step=dict(by_rank,
                                       pipeline_send_bytes_1d_without_scatter_gather=no_sg),
                bytes_by_mode_rank0=per_rank[0]['bytes_by_mode'],
                activation_bytes_per_microbatch_full=act,
                wall_s=time.time() - start,
                environment=dict(environment(), load_average_before=load_before),
                note=('CPU gloo, 8 ranks (one thread each) on a shared 2-core machine; ratios '
                      'side by side in one run. Stage 0 ranks send activations, stage 1 ranks '
                      'gradients: M messages of (1/t of the activation + a 64-byte header) '
                      'per rank under both layouts.'))
    write_json('seq_vs_1d_pipeline', data)
    rows = [['layout', 'median s/step', 'tokens/s', 'PIPELINE send B/rank/step',
             'boundary all_gather B/rank/step (wire)', 'first loss']]
    for n in names:
        rows.append([n, f"{data['median_step_s'][n]:.3f}", f'{tps[n]:.0f}',
                     f"{statistics.median(by_rank['pipeline_send_bytes'][n]):.0f}",
                     f"{statistics.median(by_rank['boundary_all_gather_bytes'][n]):.0f} "
                     f"({statistics.median(by_rank['boundary_all_gather_wire_bytes'][n]):.0f})",
                     f"{by_rank['first_loss'][n][0]:.6f}"])
    rows.append(['1d w/o scatter-gather', '', '', f'{no_sg[0]}', '0', ''])
    print(f"GPT {SHAPE['hidden']}h x {SHAPE['layers']} layers, seq {SEQ}, M = {M} x {MICRO}, "
          f"pipeline {STAGES} x tensor {TENSOR} x data {WORLD // (STAGES * TENSOR)}, "
          f'{repeats} rounds')
    print_table(rows)
    print(f'sequence / 1D tokens/s (median of per-round ratios): {speedup:.2f}x; CPU seconds '
          f'per step, 1D / sequence: {cpu_ratio:.2f}x')
    modes = sorted({m for n in names for m in data['bytes_by_mode_rank0'][n]})
    rows = [['bytes per step, rank 0 (buffer sizes)'] + modes]
    for n in names:
        rows.append([n] + [str(data['bytes_by_mode_rank0'][n].get(m, 0)) for m in modes])
    print_table(rows)


if __name__ == '__main__':
    main()
