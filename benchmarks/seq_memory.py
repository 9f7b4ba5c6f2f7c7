"""Longest sequence within a per-rank activation budget: sequence parallelism vs 1D, 4 ranks.

    python benchmarks/seq_memory.py [--quick]

BERT-base-shaped encoder layers (hidden 768, 12 heads, 4h MLP, post-LN, dropout 0.1,
batch 1, fp32), ``LAYERS`` of them, on 4 ranks: sequence parallelism (each rank holds
``s/4`` tokens, ring self-attention) vs 1D tensor parallelism (Megatron: heads and MLP
split, activations between blocks replicated), built side by side in one run over the
same ranks (``_seq_layers.built_as``).

Activation bytes per rank = the distinct storages autograd saves in one forward
(``torch.autograd.graph.saved_tensors_hooks``, parameters excluded) plus the output:
what the layers keep alive until backward, i.e. the peak of retained activations.
They are measured at several sequence lengths, fitted exactly by ``a s^2 + c s``
(attention probabilities grow with s^2, everything else with s), and the longest
sequence (multiple of 64) within ``BUDGET_MIB`` is solved from the fit and then
*verified by measurement* at that length and 64 tokens more.
Writes ``results/seq_memory.json`` and ``results/seq_memory.png``.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks._common import RESULTS_DIR, environment, print_table, write_json  # noqa: E402
from benchmarks._seq_layers import bert_layers, layer_input, saved_activation_bytes  # noqa: E402
from colossal_lite.testing import run_distributed  # noqa: E402

WORLD, HIDDEN, HEADS, BATCH, LAYERS, STEP = 4, 768, 12, 1, 2, 64
BUDGET_MIB = 512
OTHER_BUDGETS_MIB = (64, 128, 256, 512, 1024, 2048)   # solved from the fits only
MODES = ('sequence', '1d')
CONFIG = dict(parallel=dict(tensor=dict(mode='sequence', size=WORLD)))


def worker(rank, seqs_by_mode):
    out = {}
    for mode, seqs in seqs_by_mode.items():
        model = bert_layers(mode, HIDDEN, HEADS, LAYERS)
        out[mode] = [saved_activation_bytes(model, layer_input(mode, BATCH, s, HIDDEN))
                     for s in seqs]
    return out


def measure(seqs_by_mode):
    """Max over ranks of the activation bytes, per mode and sequence length."""
    per_rank = run_distributed(worker, WORLD, CONFIG, seqs_by_mode, timeout=600,
                               collective_timeout=600)
    return {m: [max(r[m][k] for r in per_rank) for k in range(len(seqs))]
            for m, seqs in seqs_by_mode.items()}


def fit(seqs, values):
    """Least-squares a, c of ``a s^2 + c s`` and the largest relative residual."""
    xs = torch.tensor([[float(s) ** 2, float(s)] for s in seqs], dtype=torch.float64)
    ys = torch.tensor(values, dtype=torch.float64)
    coef = torch.linalg.lstsq(xs, ys.unsqueeze(1)).solution.squeeze(1)
    resid = float(((xs @ coef - ys).abs() / ys).max())
    return float(coef[0]), float(coef[1]), resid


def longest_within(a, c, budget):
    s = (-c + math.sqrt(c * c + 4 * a * budget)) / (2 * a)
    return int(s // STEP) * STEP


def plot(data, path):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    grid = list(range(STEP, int(max(data['longest'].values()) * 1.3), STEP))
    for mode in MODES:
        a, c = data['fit'][mode]['a'], data['fit'][mode]['c']
        ax.plot(grid, [(a * s * s + c * s) / 2 ** 20 for s in grid], '-', alpha=0.5)
        ax.plot(data['seqs'], [v / 2 ** 20 for v in data['bytes'][mode]], 'o',
                color=ax.lines[-1].get_color(), label=f'{mode} (measured, fit)')
        ax.axvline(data['longest'][mode], ls=':', color=ax.lines[-1].get_color())
    ax.axhline(BUDGET_MIB, color='k', ls='--', label=f'budget {BUDGET_MIB} MiB')
    ax.set_xlabel('sequence length')
    ax.set_ylabel('activation MiB per rank (saved for backward)')
    ax.set_title(f'{LAYERS} BERT-base layers, batch {BATCH}, {WORLD} ranks')
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--quick', action='store_true', help='fewer lengths, no verification')
    args = parser.parse_args()
    seqs = [256, 512, 1024] if args.quick else [256, 512, 1024, 1536, 2048]
    measured = measure({m: seqs for m in MODES})
    budget = BUDGET_MIB * 2 ** 20
    fits, longest = {}, {}
    for mode in MODES:
        a, c, resid = fit(seqs, measured[mode])
        fits[mode] = dict(a=a, c=c, max_rel_residual=resid)
        longest[mode] = longest_within(a, c, budget)
    verify = {}
    if not args.quick:
        check = measure({m: [longest[m], longest[m] + STEP] for m in MODES})
        verify = {m: dict(at_longest=check[m][0], one_step_more=check[m][1],
                          fits=check[m][0] <= budget < check[m][1]) for m in MODES}
    data = dict(world=WORLD, hidden=HIDDEN, heads=HEADS, batch=BATCH, layers=LAYERS,
                budget_mib=BUDGET_MIB, seqs=seqs, bytes=measured, fit=fits, longest=longest,
                verify=verify, ratio_longest_sequence_over_1d=longest['sequence'] / longest['1d'],
                longest_by_budget_mib={
                    str(m): {mode: longest_within(fits[mode]['a'], fits[mode]['c'], m * 2 ** 20)
                             for mode in MODES} for m in OTHER_BUDGETS_MIB},
                reduction_vs_1d_at={str(s): 1 - measured['sequence'][k] / measured['1d'][k]
                                    for k, s in enumerate(seqs)},
                environment=environment(),
                method='bytes of distinct storages saved for backward in one forward '
                       '(saved_tensors_hooks, parameters excluded) + output; max over ranks; fp32')
    write_json('seq_memory', data)
    plot(data, os.path.join(RESULTS_DIR, 'seq_memory.png'))
    rows = [['mode'] + [f's={s}' for s in seqs] + ['longest @ budget', 'verified']]
    for mode in MODES:
        rows.append([mode] + [f'{v / 2 ** 20:.1f}' for v in measured[mode]]
                    + [str(longest[mode]), str(verify.get(mode, {}).get('fits', '-'))])
    print(f'activation MiB per rank, {LAYERS} BERT-base layers, batch {BATCH}, {WORLD} ranks; '
          f'budget {BUDGET_MIB} MiB')
    print_table(rows)
    print(f"longest sequence, sequence / 1D = {data['ratio_longest_sequence_over_1d']:.2f}")
    for m, res in data['longest_by_budget_mib'].items():
        print(f"  budget {m:>5} MiB (from the fit): sequence {res['sequence']}, 1d {res['1d']}")


if __name__ == '__main__':
    main()
