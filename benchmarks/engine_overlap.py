"""Data-parallel engine step (dp=2, gloo, CPU): overlapped bucketed gradient all-reduce vs
all-reduce after backward, and the cost of activation checkpointing.

Three engines train the same GPT (same weights, same batch) on 2 forked ranks:

* ``overlap``: GradientReducer(overlap=True), buckets all-reduced asynchronously from
  post-accumulate-grad hooks while backward runs (the default of ``initialize``);
* ``after_backward``: GradientReducer(overlap=False), every bucket reduced in ``step()``;
* ``overlap_ckpt``: as ``overlap`` with ``checkpoint=True`` blocks (recompute in backward).

Each engine step (zero_grad, forward, backward, step) is timed, alternated round by
round; the script reports median seconds per step and median per-round ratios
overlap / after_backward and overlap_ckpt / overlap, and the bytes autograd saves for
backward in one forward with and without checkpointing (saved_tensors_hooks, parameters
excluded). It also records that the three engines' weights stay equal.

    python benchmarks/engine_overlap.py [--hidden 256 --layers 4 --seq 128 --batch 4 --bucket-mb 1]
Writes benchmarks/results/engine_overlap.json.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks._common import environment, print_table, time_alternated, write_json  # noqa: E402

WORLD = 2


def ratio(times: dict, ours: str, theirs: str) -> dict:
    """Median of the per-round ratios ours / theirs (robust to drifts in machine load)."""
    per_round = [a / b for a, b in zip(times[ours], times[theirs])]
    return {'median_ratio': statistics.median(per_round), 'per_round_ratios': per_round}


def _engine(args, state, checkpoint, overlap):
    from colossal_lite.engine import Engine, GradientReducer
    from model_zoo import GPT, GPTLMLoss
    model = GPT(vocab_size=args.vocab, max_positions=args.seq, hidden=args.hidden,
                layers=args.layers, heads=args.heads, dropout=0.0, checkpoint=checkpoint)
    model.load_state_dict(state)
    reducer = GradientReducer(model.parameters(), int(args.bucket_mb * 2 ** 20), overlap=overlap)
    return Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-4), GPTLMLoss(),
                  gradient_handler=reducer)


def saved_activation_bytes(engine, ids) -> int:
    """Bytes autograd keeps for backward in one forward + loss (parameters excluded)."""
    params = {p.data_ptr() for p in engine.model.parameters()}
    total = [0]

    def pack(t):
        if t.data_ptr() not in params:
            total[0] += t.numel() * t.element_size()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = engine.criterion(engine(ids), ids)
    loss.backward()
    engine.optimizer.zero_grad(set_to_none=True)
    return total[0]


def _worker(rank, args, state):
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    engines = {'overlap': _engine(args, state, False, True),
               'after_backward': _engine(args, state, False, False),
               'overlap_ckpt': _engine(args, state, True, True)}

    def step(engine):
        def run():
            engine.zero_grad()
            engine.execute_schedule((ids, ids))
            engine.step()
        return run
    saved = {name: saved_activation_bytes(engines[name], ids)
             for name in ('overlap', 'overlap_ckpt')}
    runs = {name: step(e) for name, e in engines.items()}
    for run in runs.values():
        run()
    ref = engines['overlap'].model.state_dict()
    worst = max((e.model.state_dict()[k] - v).abs().max().item()
                for e in engines.values() for k, v in ref.items())
    times = time_alternated(runs, repeats=args.repeats, steps=args.steps, warmup=1)
    return {'times': times, 'max_weight_diff': worst, 'saved_bytes': saved}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--hidden', type=int, default=256)
    parser.add_argument('--layers', type=int, default=4)
    parser.add_argument('--heads', type=int, default=8)
    parser.add_argument('--vocab', type=int, default=4096)
    parser.add_argument('--seq', type=int, default=128)
    parser.add_argument('--batch', type=int, default=4)
    parser.add_argument('--bucket-mb', type=float, default=1.0)
    parser.add_argument('--repeats', type=int, default=7)
    parser.add_argument('--steps', type=int, default=3)
    args = parser.parse_args()

    from colossal_lite.testing import run_distributed
    from model_zoo import GPT
    torch.manual_seed(0)
    state = GPT(vocab_size=args.vocab, max_positions=args.seq, hidden=args.hidden,
                layers=args.layers, heads=args.heads, dropout=0.0).state_dict()
    result = run_distributed(_worker, WORLD, {}, args, state, timeout=3000,
                             collective_timeout=600)[0]
    times = result['times']
    overlap = ratio(times, 'overlap', 'after_backward')
    ckpt = ratio(times, 'overlap_ckpt', 'overlap')
    medians = {k: statistics.median(v) for k, v in times.items()}
    print_table([['variant', 'median s/step']] + [[k, f'{v:.4f}'] for k, v in medians.items()])
    print(f"overlap / after_backward = {overlap['median_ratio']:.3f}; "
          f"checkpointed / plain = {ckpt['median_ratio']:.3f}; "
          f"max weight diff {result['max_weight_diff']:.2e}")
    print(f"saved activation bytes per forward (rank 0): plain {result['saved_bytes']['overlap']}, "
          f"checkpointed {result['saved_bytes']['overlap_ckpt']}")
    path = write_json('engine_overlap', {
        'config': vars(args), 'world': WORLD, 'environment': environment(),
        'seconds_per_step': times, 'median_seconds_per_step': medians,
        'overlap_vs_after_backward': overlap,
        'checkpoint_vs_plain': ckpt,
        'saved_activation_bytes_per_forward': {'plain': result['saved_bytes']['overlap'],
                                               'checkpointed': result['saved_bytes']['overlap_ckpt']},
        'max_weight_diff_between_variants': result['max_weight_diff']})
    print(f'wrote {path}')


if __name__ == '__main__':
    main()
