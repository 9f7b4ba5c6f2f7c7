"""Training throughput of BERT-base-shaped layers: sequence parallelism vs 1D, same 4 ranks.

    python benchmarks/seq_throughput.py [--quick]

``LAYERS`` BERT-base encoder layers (hidden 768, 12 heads, 4h MLP, dropout 0.1; depth
reduced from 12 for time), batch ``BATCH`` x sequence ``SEQ``, fp32, on 4 ranks. One step
= forward + backward of the layers + the gradient synchronization each layout needs:
sequence parallelism all-reduces the replicated gradients over SEQUENCE_DP
(``allreduce_gradients``); 1D needs none (weights are split, dp = 1). Both models are
built in one launched run over the same ranks (``_seq_layers.built_as``) and timed
alternately (``_common.time_alternated``: rounds, order reversed every other round);
reported: medians and the median of per-round ratios; tokens/s = batch*seq / step time.
Two more sequence variants are timed in the same rounds for the breakdown: without the
gradient all-reduce, and with it overlapped with backward (``engine.GradientReducer``).
Writes ``results/seq_throughput.json``.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks._common import environment, print_table, ratio_summary, time_alternated, write_json  # noqa: E402,E501
from benchmarks._seq_layers import bert_layers, layer_input, run_layers  # noqa: E402
from colossal_lite.testing import run_distributed  # noqa: E402

WORLD, HIDDEN, HEADS = 4, 768, 12
CONFIG = dict(parallel=dict(tensor=dict(mode='sequence', size=WORLD)))


def make_step(mode, batch, seq, layers, grad_sync='after'):
    """``grad_sync`` (sequence only): 'after' backward (allreduce_gradients), 'overlap'
    (engine.GradientReducer: bucket all-reduces start during backward) or None."""
    from colossal_lite.engine import GradientReducer, allreduce_gradients
    model = bert_layers(mode, HIDDEN, HEADS, layers)
    x = layer_input(mode, batch, seq, HIDDEN)
    grad = torch.randn_like(x)
    reducer = GradientReducer(model.parameters(), overlap=True) \
        if mode == 'sequence' and grad_sync == 'overlap' else None

    def step():
        model.zero_grad(set_to_none=False)
        if reducer is not None:
            reducer.prepare(sync=True)
        run_layers(model, x).backward(grad)
        if reducer is not None:
            reducer.synchronize()
        elif mode == 'sequence' and grad_sync == 'after':
            allreduce_gradients(model.parameters())
    return step


def worker(rank, batch, seq, layers, repeats):
    torch.manual_seed(rank)
    runs = {mode: make_step(mode, batch, seq, layers) for mode in ('sequence', '1d')}
    # for the breakdown only: the same sequence step without the gradient all-reduce
    runs['sequence_without_grad_sync'] = make_step('sequence', batch, seq, layers, None)
    runs['sequence_overlapped_grad_sync'] = make_step('sequence', batch, seq, layers, 'overlap')
    times = time_alternated(runs, repeats=repeats, steps=1, warmup=1)
    return {k: [float(t) for t in v] for k, v in times.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--quick', action='store_true', help='short sequence, 3 rounds')
    args = parser.parse_args()
    batch, seq, layers, repeats = (1, 128, 1, 3) if args.quick else (2, 512, 2, 7)
    per_rank = run_distributed(worker, WORLD, CONFIG, batch, seq, layers, repeats,
                               timeout=1200, collective_timeout=600)
    # a step ends when the slowest rank ends: per round, the max over ranks
    times = {m: [max(r[m][k] for r in per_rank) for k in range(repeats)] for m in per_rank[0]}
    summary = ratio_summary(times, 'sequence', '1d')
    tokens = batch * seq
    tps = {m: tokens / t for m, t in summary['median_s_per_step'].items()}
    compute_only = ratio_summary(times, 'sequence_without_grad_sync', '1d')
    overlapped = ratio_summary(times, 'sequence_overlapped_grad_sync', '1d')
    data = dict(world=WORLD, hidden=HIDDEN, heads=HEADS, layers=layers, batch=batch, seq=seq,
                repeats=repeats, times_s=times, tokens_per_s=tps,
                speedup_sequence_over_1d=1 / summary['ratio_ours_over_theirs'], **summary,
                speedup_sequence_without_grad_sync_over_1d=1 / compute_only[
                    'ratio_ours_over_theirs'],
                speedup_sequence_overlapped_grad_sync_over_1d=1 / overlapped[
                    'ratio_ours_over_theirs'],
                environment=environment(),
                note='CPU gloo, 4 ranks sharing the machine; ratios measured side by side')
    write_json('seq_throughput', data)
    rows = [['mode', 'median s/step', 'tokens/s']]
    for m in times:
        rows.append([m, f"{summary['median_s_per_step'][m]:.3f}", f'{tps[m]:.0f}'])
    print(f'{layers} BERT-base layers, batch {batch} x seq {seq}, {WORLD} ranks, {repeats} rounds')
    print_table(rows)
    print(f"sequence / 1D throughput (median of per-round ratios): "
          f"{data['speedup_sequence_over_1d']:.2f}x; without the gradient all-reduce "
          f"{data['speedup_sequence_without_grad_sync_over_1d']:.2f}x; overlapped with backward "
          f"{data['speedup_sequence_overlapped_grad_sync_over_1d']:.2f}x")


if __name__ == '__main__':
    main()
