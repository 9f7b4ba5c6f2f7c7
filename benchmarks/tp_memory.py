"""Per-rank memory of two linear layers (the Colossal-AI paper's range test) per tensor mode.

    python benchmarks/tp_memory.py [--quick]

Model: ``Linear(h, 4h, region='enter') -> GELU -> Linear(4h, h, region='exit')`` built with
the mode-dispatching facade, input ``[b, h]`` in the mode's standard layout (requires grad).
Measured per rank, fp32, after one forward:

* parameter bytes: the local shards (``p.numel() * p.element_size()``);
* activation bytes: every tensor autograd saves for backward, counted once per storage with
  ``torch.autograd.graph.saved_tensors_hooks``, excluding storages that are parameters
  (gathered weight copies, as 3D saves, do count), plus the output.

This is an exact count of what the layers keep alive, not a peak-allocator reading (which
on CPU is not available and would include transient communication buffers).
Runs: 1D vs 2D vs 2.5D (d=1) on 4 ranks; 1D vs 2.5D (d=2) vs 3D on 8 ranks; the batch is
scaled at fixed hidden and the hidden at fixed batch. Writes ``results/tp_memory.json`` and
``results/tp_memory.png``; the paper's figures (8 GPUs, batch 512: 2.5D -44%, 3D -65% vs 1D)
are stored beside ours.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks._common import RESULTS_DIR, environment, print_table, write_json  # noqa: E402
from colossal_lite.testing import run_distributed  # noqa: E402

PAPER = {'batch_512_8dev_reduction_vs_1d': {'2.5d': 0.44, '3d': 0.65},
         'hidden_16384_8dev_reduction_vs_1d': {'2.5d': 0.62, '3d': 0.742}}

LAYOUTS = {  # label -> (world, tensor config, extra Linear kwargs)
    '1d@4': (4, dict(size=4, mode='1d'), {}),
    '2d@4': (4, dict(size=4, mode='2d'), {}),
    '2.5d(d=1)@4': (4, dict(size=4, mode='2.5d', depth=1), {}),
    '1d@8': (8, dict(size=8, mode='1d'), {}),
    '2.5d(d=2)@8': (8, dict(size=8, mode='2.5d', depth=2), {}),
    '3d@8': (8, dict(size=8, mode='3d'), {}),
    # 3D variant that keeps the gathered x and A for backward (less communication)
    '3d(keep_gathered)@8': (8, dict(size=8, mode='3d'), dict(keep_gathered=True)),
}


def split_input(x: torch.Tensor) -> torch.Tensor:
    """The full ``[b, h]`` input in the launched mode's standard layout."""
    from colossal_lite.context import global_context as gpc
    mode = gpc.tensor_mode
    if mode in ('2d', '2.5d'):
        from colossal_lite.nn.parallel_2p5d import Grid2p5D
        return Grid2p5D.current().split_activation(x)
    if mode == '3d':
        from colossal_lite.nn.parallel_3d import default_cube, split_activation
        return split_activation(x, default_cube().standard)
    return x   # 1D: replicated


def measure(batch: int, hidden: int, linear_kwargs: dict) -> dict:
    import colossal_lite.nn as col_nn
    torch.manual_seed(0)
    layers = torch.nn.Sequential(col_nn.Linear(hidden, 4 * hidden, region='enter', **linear_kwargs),
                                 torch.nn.GELU(),
                                 col_nn.Linear(4 * hidden, hidden, region='exit', **linear_kwargs))
    params = {p.untyped_storage().data_ptr() for p in layers.parameters()}
    param_bytes = sum(p.numel() * p.element_size() for p in layers.parameters())
    saved = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            saved[ptr] = t.untyped_storage().nbytes()
        return t
    x = split_input(torch.randn(batch, hidden)).requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layers(x)
    saved.setdefault(y.untyped_storage().data_ptr(), y.untyped_storage().nbytes())
    y.sum().backward()   # the graph is complete and runs
    return {'param_bytes': param_bytes, 'activation_bytes': sum(saved.values()),
            'total_bytes': param_bytes + sum(saved.values())}


def worker(rank, sizes, linear_kwargs):
    return [dict(batch=b, hidden=h, **measure(b, h, linear_kwargs)) for b, h in sizes]


def run(quick: bool) -> dict:
    batches = [64, 128, 256, 512] if not quick else [64, 512]
    hiddens = [256, 512, 1024, 2048] if not quick else [256, 1024]
    fixed_hidden, fixed_batch = 512, 64
    sizes = [(b, fixed_hidden) for b in batches] + [(fixed_batch, h) for h in hiddens]
    results = {}
    for label, (world, tensor, linear_kwargs) in LAYOUTS.items():
        try:
            per_rank = run_distributed(worker, world, dict(parallel=dict(tensor=tensor)), sizes,
                                       linear_kwargs, timeout=600)
        except Exception as err:   # a family that is missing or fails is reported, not hidden
            results[label] = {'missing': f'{type(err).__name__}: {str(err)[-300:]}'}
            continue
        results[label] = {'max_over_ranks': [max(r[k]['total_bytes'] for r in per_rank)
                                             for k in range(len(sizes))],
                          'rank0': per_rank[0]}
    return dict(sizes=sizes, batches=batches, hiddens=hiddens, fixed_hidden=fixed_hidden,
                fixed_batch=fixed_batch, results=results)


def reductions(data: dict, base: str, others, size) -> dict:
    k = [tuple(s) for s in data['sizes']].index(size)
    ref = data['results'][base]
    out = {}
    for label in others:
        res = data['results'][label]
        if 'missing' in res or 'missing' in ref:
            out[label] = None
        else:
            out[label] = 1 - res['max_over_ranks'][k] / ref['max_over_ranks'][k]
    return out


def plot(data: dict, path: str):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    n_b = len(data['batches'])
    for row, labels in enumerate((['1d@4', '2d@4', '2.5d(d=1)@4'],
                                   ['1d@8', '2.5d(d=2)@8', '3d@8', '3d(keep_gathered)@8'])):
        for col, (xs, sl, xlabel) in enumerate(((data['batches'], slice(0, n_b), 'batch'),
                                                (data['hiddens'], slice(n_b, None), 'hidden'))):
            ax = axes[row][col]
            for label in labels:
                res = data['results'][label]
                if 'missing' not in res:
                    ax.plot(xs, [v / 2 ** 20 for v in res['max_over_ranks'][sl]], 'o-', label=label)
            ax.set_xscale('log', base=2)
            ax.set_yscale('log')
            ax.set_xlabel(xlabel)
            ax.set_ylabel('MiB per rank (params + saved activations)')
            fixed = (f"hidden={data['fixed_hidden']}" if col == 0 else f"batch={data['fixed_batch']}")
            ax.set_title(f'{LAYOUTS[labels[0]][0]} ranks, {fixed}')
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--quick', action='store_true', help='two sizes per range (CI smoke run)')
    args = parser.parse_args()
    data = run(args.quick)
    ours8 = reductions(data, '1d@8', ['2.5d(d=2)@8', '3d@8', '3d(keep_gathered)@8'],
                       (512, data['fixed_hidden']))
    ours4 = reductions(data, '1d@4', ['2d@4', '2.5d(d=1)@4'], (512, data['fixed_hidden']))
    data.update(environment=environment(), paper=PAPER,
                ours_batch_512_8ranks_reduction_vs_1d=ours8,
                ours_batch_512_4ranks_reduction_vs_1d=ours4,
                method='parameter bytes + bytes of tensors saved for backward (saved_tensors_hooks,'
                       ' one count per storage, parameters excluded) + output; fp32; max over ranks')
    write_json('tp_memory', data)
    plot(data, os.path.join(RESULTS_DIR, 'tp_memory.png'))
    rows = [['layout'] + [f'b={b},h={h}' for b, h in data['sizes']]]
    for label, res in data['results'].items():
        rows.append([label] + (['missing'] if 'missing' in res else
                               [f'{v / 2 ** 20:.2f}' for v in res['max_over_ranks']]))
    print('MiB per rank (max over ranks)')
    print_table(rows)
    paper = PAPER['batch_512_8dev_reduction_vs_1d']
    print(f'batch 512, 8 ranks, reduction vs 1D: ours {ours8}; paper {paper}')
    print(f'batch 512, 4 ranks, reduction vs 1D: ours {ours4}')


if __name__ == '__main__':
    main()
