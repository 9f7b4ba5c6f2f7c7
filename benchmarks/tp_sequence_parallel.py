"""1D tensor parallelism with and without Megatron's sequence parallelism: activation memory
and tokens/s of a Llama training step on t ranks (CPU, gloo, fp32).

    python benchmarks/tp_sequence_parallel.py [--tensor 4 --seq 512 --rounds 7]

Per rank, after a warm-up step, one training step (forward, loss, backward, AdamW) is
measured twice:

* ``saved_activation_bytes``: every tensor autograd saves for backward during the forward
  (``saved_tensors_hooks``, each storage once, parameters excluded) -- the activation
  memory the issue's "activation peak" is about;
* ``step_peak_bytes``: the allocator's peak above the bytes live before the step
  (``colossal_lite.testing.peak_allocated``; includes logits, gradients and transient
  communication buffers).

Tokens/s: each layout is launched ``--rounds`` times, plain and sequence parallel
alternated (the order reversed every other round), ``--steps`` timed steps per launch; a
launch's step time is the slowest rank's. Reported: the median per layout, and the median
of the per-round ratios on wall and on CPU time (``time.process_time``: the rank's threads,
gloo's included; steadier than wall on a shared machine). The vocabulary is
kept small so the (unchanged) LM head does not hide the blocks. Writes
``results/tp_sequence_parallel.json``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks._common import environment, print_table, write_json  # noqa: E402
from colossal_lite.testing import run_distributed  # noqa: E402
from colossal_lite.testing.memory import peak_allocated  # noqa: E402
from model_zoo import GPTLMLoss, Llama  # noqa: E402


def _saved_bytes(model, ids, loss_fn) -> int:
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn(model(ids), ids)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(seen.values())


def _rank(rank, args):
    torch.manual_seed(0)
    model = Llama(vocab_size=args.vocab, hidden=args.hidden, layers=args.layers,
                  heads=args.heads, kv_heads=args.kv_heads, intermediate=args.intermediate,
                  max_positions=args.seq)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loss_fn = GPTLMLoss()
    ids = torch.randint(0, args.vocab, (args.batch, args.seq),
                        generator=torch.Generator().manual_seed(1))

    def step():
        loss = loss_fn(model(ids), ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # warm-up: optimizer state and buffers exist before the measured step
    saved = _saved_bytes(model, ids, loss_fn)
    peak = peak_allocated([step])[0]
    start, cpu_start = time.perf_counter(), time.process_time()
    for _ in range(args.steps):
        step()
    seconds = (time.perf_counter() - start) / args.steps
    cpu = (time.process_time() - cpu_start) / args.steps
    return {'saved_activation_bytes': saved, 'step_peak_bytes': peak, 's_per_step': seconds,
            'cpu_s_per_step': cpu}


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--tensor', type=int, default=4)
    p.add_argument('--hidden', type=int, default=256)
    p.add_argument('--heads', type=int, default=8)
    p.add_argument('--kv-heads', type=int, default=4)
    p.add_argument('--intermediate', type=int, default=688)
    p.add_argument('--layers', type=int, default=2)
    p.add_argument('--vocab', type=int, default=512)
    p.add_argument('--seq', type=int, default=512)
    p.add_argument('--batch', type=int, default=4)
    p.add_argument('--steps', type=int, default=5)
    p.add_argument('--rounds', type=int, default=7)
    args = p.parse_args()
    load_before = os.getloadavg()
    layouts = {'1d': False, '1d+sequence_parallel': True}
    runs = {name: [] for name in layouts}
    for r in range(args.rounds):
        for name in (list(layouts) if r % 2 == 0 else list(layouts)[::-1]):
            config = dict(parallel=dict(tensor=dict(size=args.tensor, mode='1d',
                                                    sequence_parallel=layouts[name])))
            runs[name].append(run_distributed(_rank, args.tensor, config, args, timeout=900))
    summary = {}
    for name, launches in runs.items():
        summary[name] = {
            'saved_activation_bytes_max_rank': max(r['saved_activation_bytes']
                                                   for r in launches[0]),
            'step_peak_bytes_max_rank': max(r['step_peak_bytes'] for r in launches[0]),
            'tokens_per_s': args.batch * args.seq / statistics.median(
                max(r['s_per_step'] for r in ranks) for ranks in launches)}
    plain, sp = summary['1d'], summary['1d+sequence_parallel']

    def per_round(key):   # plain / sp step time of each round (max over ranks): tokens/s ratio
        return [max(r[key] for r in a) / max(r[key] for r in b)
                for a, b in zip(runs['1d'], runs['1d+sequence_parallel'])]
    wall_rounds, cpu_rounds = per_round('s_per_step'), per_round('cpu_s_per_step')
    ratios = {'saved_activation': sp['saved_activation_bytes_max_rank']
              / plain['saved_activation_bytes_max_rank'],
              'step_peak': sp['step_peak_bytes_max_rank'] / plain['step_peak_bytes_max_rank'],
              'tokens_per_s': sp['tokens_per_s'] / plain['tokens_per_s'],
              'tokens_per_s_median_of_rounds': statistics.median(wall_rounds),
              'tokens_per_s_rounds': wall_rounds,
              'cpu_tokens_per_s_median_of_rounds': statistics.median(cpu_rounds),
              'cpu_tokens_per_s_rounds': cpu_rounds}
    rows = [['layout', 'saved activations MiB', 'step peak MiB', 'tokens/s']]
    for name, res in summary.items():
        rows.append([name, f"{res['saved_activation_bytes_max_rank'] / 2**20:.1f}",
                     f"{res['step_peak_bytes_max_rank'] / 2**20:.1f}",
                     f"{res['tokens_per_s']:.0f}"])
    print_table(rows)
    print(f"sequence parallel / plain: saved activations {ratios['saved_activation']:.3f} "
          f"(target <= 0.6), step peak {ratios['step_peak']:.3f}, tokens/s "
          f"{ratios['tokens_per_s']:.3f} (target within 5%); median of per-round ratios: wall "
          f"{ratios['tokens_per_s_median_of_rounds']:.3f}, CPU time "
          f"{ratios['cpu_tokens_per_s_median_of_rounds']:.3f}")
    path = write_json('tp_sequence_parallel', {
        'what': 'Llama training step under 1D tensor parallelism, with and without sequence '
                'parallelism; per-rank maxima; CPU, gloo, fp32',
        'config': vars(args), 'summary': summary, 'ratios_sp_over_plain': ratios,
        'targets': {'saved_activation': 0.6, 'tokens_per_s_within': 0.05},
        'load_average_before': load_before, 'load_average_after': os.getloadavg(),
        'environment': environment()})
    print(f'wrote {path}')


if __name__ == '__main__':
    main()
