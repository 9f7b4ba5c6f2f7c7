"""The routed experts' compute on CPU: a loop of matmuls over each expert's segment (ours,
``nn.moe.grouped_swiglu``) vs a padded batched matmul vs ``torch.nn.functional.grouped_mm``.

Forward + backward of the SwiGLU experts on ``tokens * top_k`` rows sorted by expert
(router-like random assignment; skew 0: balanced, skew 1.5: expert 0 takes ~3x the mean
at E = 8), for E in
{2, 4, 8} experts: ``tokens`` 4096, ``h`` 256, ``f`` 512, ``top_k`` 2. Timed side by side,
alternated round by round; medians of the repeats, CPU time of this process (robust to a
shared, loaded machine) and wall time.

    python benchmarks/moe_grouped.py [--threads 1 --repeats 7 --tokens 4096 --skews 0,1.5]

Writes benchmarks/results/moe_grouped.json and prints a table.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks._common import environment, print_table, time_alternated, write_json  # noqa: E402
from colossal_lite.nn.moe import grouped_swiglu  # noqa: E402


def padded_swiglu(x, counts, gate, up, down):
    """The segments padded to the largest count, three ``bmm``s, the rows picked back."""
    experts, cap = len(counts), max(counts)
    sizes = torch.tensor(counts)
    starts = torch.cumsum(sizes, 0) - sizes
    expert = torch.repeat_interleave(torch.arange(experts), sizes)
    slot = expert * cap + torch.arange(x.shape[0]) - starts[expert]
    buf = x.new_zeros(experts * cap, x.shape[1]).index_copy(0, slot, x).view(experts, cap, -1)
    y = torch.bmm(F.silu(torch.bmm(buf, gate)) * torch.bmm(buf, up), down)
    return y.view(experts * cap, -1).index_select(0, slot)


def grouped_mm_swiglu(x, counts, gate, up, down):
    offs = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    h = F.silu(F.grouped_mm(x, gate, offs=offs)) * F.grouped_mm(x, up, offs=offs)
    return F.grouped_mm(h, down, offs=offs)


IMPLS = {'loop (ours)': grouped_swiglu, 'padded bmm': padded_swiglu,
         'grouped_mm': grouped_mm_swiglu}


def case(experts, tokens, top_k, hidden, ffn, skew, repeats):
    g = torch.Generator().manual_seed(0)
    weights = [(torch.randn(experts, hidden, ffn, generator=g) / hidden ** 0.5),
               (torch.randn(experts, hidden, ffn, generator=g) / hidden ** 0.5),
               (torch.randn(experts, ffn, hidden, generator=g) / ffn ** 0.5)]
    weights = [w.requires_grad_() for w in weights]
    logits = torch.randn(tokens, experts, generator=g)
    logits[:, 0] += skew
    ids = torch.topk(logits, top_k, dim=-1).indices.reshape(-1).sort().values
    counts = torch.bincount(ids, minlength=experts).tolist()
    x = torch.randn(tokens * top_k, hidden, generator=g, requires_grad=True)
    grad = torch.randn(tokens * top_k, hidden, generator=g)
    ref = grouped_swiglu(x, counts, *weights)
    runs, errors = {}, {}
    for name, fn in IMPLS.items():
        try:
            diff = (fn(x, counts, *weights) - ref).abs().max().item()
            assert diff < 1e-4, f'{name} differs by {diff}'
        except Exception as err:  # record what fails (e.g. grouped_mm missing) and go on
            errors[name] = f'{type(err).__name__}: {err}'
            continue

        def run(fn=fn):
            fn(x, counts, *weights).backward(grad)
            for t in [x] + weights:
                t.grad = None
        runs[name] = run
    cpu = {}
    wall = time_alternated(runs, repeats=repeats, steps=1, warmup=1, cpu_times=cpu)
    med = lambda table: {k: statistics.median(v) for k, v in table.items()}  # noqa: E731
    return dict(experts=experts, counts=counts, cpu_s=med(cpu), wall_s=med(wall),
                errors=errors)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--tokens', type=int, default=4096)
    parser.add_argument('--top-k', type=int, default=2)
    parser.add_argument('--hidden', type=int, default=256)
    parser.add_argument('--ffn', type=int, default=512)
    parser.add_argument('--experts', default='2,4,8')
    parser.add_argument('--skews', default='0,1.5')
    parser.add_argument('--threads', type=int, default=1)
    parser.add_argument('--repeats', type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = [dict(skew=float(skew), **case(int(e), args.tokens, args.top_k, args.hidden,
                                             args.ffn, float(skew), args.repeats))
               for skew in args.skews.split(',') for e in args.experts.split(',')]
    names = list(IMPLS)
    rows = [['skew', 'E', 'rows per expert (min-max)'] + [f'{n} cpu ms' for n in names]
            + ['padded / loop', 'grouped_mm / loop']]
    for r in results:
        cpu = r['cpu_s']
        loop = cpu['loop (ours)']
        rows.append([r['skew'], r['experts'], f"{min(r['counts'])}-{max(r['counts'])}"]
                    + [f'{cpu[n] * 1e3:.0f}' if n in cpu else 'failed' for n in names]
                    + [f"{cpu[n] / loop:.2f}" if n in cpu else '-'
                       for n in ('padded bmm', 'grouped_mm')])
    print_table(rows)
    path = write_json('moe_grouped', dict(args=vars(args), environment=environment(),
                                          results=results))
    print(f'wrote {path}')


if __name__ == '__main__':
    main()
