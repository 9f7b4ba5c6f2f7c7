"""Where no layer family applies, the graph-level plan against pure data parallelism.

Issue 23: "for Llama with kv heads < tensor size, and for T5, where no family applies: the
auto plan beats pure data parallelism, or fits where data parallelism does not". Per model,
on 4 forked CPU ranks (gloo, one thread each), the same weights (seed 0) and batch:

* ``dp``: torch ``DistributedDataParallel`` (its best setup here: ``gradient_as_bucket_view``,
  default 25 MiB buckets), each rank a quarter of the batch, AdamW;
* ``auto``: the unmodified ``transformers`` model through ``colossal_lite.auto.parallelize``
  on mesh data 2 x tensor 2, level ``fast``, planned for this machine's measured profile
  under a memory budget of ``--fraction`` (0.6) of DDP's measured peak, AdamW.

Measured per rank with ``testing.memory.LiveStorages`` (every storage an op allocates, by any
thread, parameters, buffers and inputs included; DDP is wrapped under it, so its gradient
buckets count) over 3 steps; the peak is the max over
steps and ranks. The auto plan's first loss is checked against the serial model's on the
full batch. Then steps are timed alternately (``--repeats`` rounds), rank 0's median
per-round ratio auto / dp on wall and CPU time.

Models: Llama (h 256, 8 heads, 1 kv head < tensor 2, 4 layers, ffn 688, vocab 8192, seq 64,
batch 8); T5 (d 256, 8 heads, d_ff 1024, 4 + 4 layers, vocab 8192, source and target 64,
batch 8).

    PYTHONPATH=. python benchmarks/auto_graph_vs_dp.py [--models llama t5] [--fraction 0.6]
Writes benchmarks/results/auto_graph_vs_dp.json.
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks._common import (adamw_step, environment, print_table, timed_ratios,  # noqa: E402
                                write_json)

MEASURED = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'results', 'profiles',
                        'stops20_21.json')
MESH = {'data': 2, 'tensor': 2}
WORLD = 4
STEPS = 3
VOCAB, SEQ, BATCH = 8192, 64, 8


def build(name: str) -> torch.nn.Module:
    import transformers
    from tests.auto_graph_models import CausalLM, WithLabels
    torch.manual_seed(0)
    if name == 'llama':
        return CausalLM(transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=1, max_position_embeddings=SEQ)))
    if name == 't5':
        return WithLabels(transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=VOCAB, d_model=256, d_kv=32, d_ff=1024, num_layers=4,
            num_decoder_layers=4, num_heads=8, dropout_rate=0.0, decoder_start_token_id=0,
            pad_token_id=0)), use_cache=False)
    raise ValueError(f'unknown model {name!r}; choose llama or t5')


def batch(name: str) -> tuple:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=gen)
    if name == 'llama':
        return (ids,)
    return ids, torch.randint(1, VOCAB, (BATCH, SEQ), generator=gen)


def _max_over_ranks(value: int) -> int:
    import torch.distributed as dist
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def bench_rank(rank, args):
    warnings.filterwarnings('ignore')
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from colossal_lite.auto import parallelize
    from colossal_lite.testing.memory import peak_live_bytes
    name = args['model']
    inputs = batch(name)
    world = dist.get_world_size()
    shard = tuple(t.chunk(world)[rank] for t in inputs)
    model = build(name).train()
    box = {}

    def wrap():      # under the tracker: DDP's gradient buckets (the gradients) count
        box['ddp'] = DistributedDataParallel(model, gradient_as_bucket_view=True)
        box['step'] = adamw_step(box['ddp'], lambda m, x: m(*x).loss, shard)

    def dp_step():
        box['step']()
    held = list(model.parameters()) + list(model.buffers()) + list(shard)
    dp_peak = _max_over_ranks(max(peak_live_bytes([wrap] + [dp_step] * STEPS, held)[1:]))
    budget = args['fraction'] * dp_peak
    auto, plan = parallelize(build(name).train(), inputs, loss_fn=lambda out, *_: out.loss,
                             mesh=dict(MESH), memory_gb=budget / 2 ** 30, level='fast',
                             cluster=args['cluster'])
    with torch.no_grad():
        auto_loss = auto(*inputs).item()
        serial_loss = build(name)(*inputs).loss.item()
    if abs(auto_loss - serial_loss) > 1e-4 * max(1.0, abs(serial_loss)):
        raise RuntimeError(f'{name}: auto loss {auto_loss} != serial {serial_loss}')
    auto_step = adamw_step(auto, lambda m, x: m(*x), inputs)
    held = list(auto.parameters()) + list(auto.buffers()) + list(inputs)
    auto_peak = _max_over_ranks(max(peak_live_bytes([auto_step] * STEPS, held)))
    timed = timed_ratios({'auto': auto_step, 'dp': dp_step}, 'auto', 'dp', args['repeats'],
                         args['steps'])
    sharded = sorted(k for k, v in plan.params.items() if any(p.startswith('S') for p in v))
    return {'dp_peak_bytes': dp_peak, 'budget_bytes': budget,
            'auto_predicted_bytes': plan.predicted['memory_bytes'], 'auto_peak_bytes': auto_peak,
            'auto_fits': auto_peak <= budget, 'auto_over_dp_peak': auto_peak / dp_peak,
            'predicted_over_measured': plan.predicted['memory_bytes'] / auto_peak,
            'check': {'auto_loss': auto_loss, 'serial_loss': serial_loss},
            'sharded_params': len(sharded), 'params': len(plan.params),
            'predicted_step_s': plan.predicted['step_s'], 'timed': timed}


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--models', nargs='+', default=['llama', 't5'])
    p.add_argument('--fraction', type=float, default=0.6)
    p.add_argument('--repeats', type=int, default=5)
    p.add_argument('--steps', type=int, default=2)
    p.add_argument('--cluster', default=MEASURED)
    args = vars(p.parse_args())
    from colossal_lite.testing import run_distributed
    rows = [['model', 'dp peak MiB', 'budget MiB', 'auto predicted', 'auto measured', 'fits',
             'auto/dp wall', 'auto/dp cpu']]
    results = {}
    load_before = os.getloadavg()
    for name in args['models']:
        res = run_distributed(bench_rank, WORLD, None, dict(args, model=name), timeout=1800,
                              collective_timeout=900)[0]
        results[name] = res
        mib = 2 ** 20
        rows.append([name, f"{res['dp_peak_bytes'] / mib:.1f}", f"{res['budget_bytes'] / mib:.1f}",
                     f"{res['auto_predicted_bytes'] / mib:.1f}",
                     f"{res['auto_peak_bytes'] / mib:.1f}", str(res['auto_fits']),
                     f"{res['timed']['wall']['ratio_ours_over_theirs']:.2f}",
                     f"{res['timed']['cpu']['ratio_ours_over_theirs']:.2f}"])
    print_table(rows)
    print('wrote', write_json('auto_graph_vs_dp', {
        'args': args, 'environment': environment(), 'load_average_before': load_before,
        'mesh': MESH, 'models': results}))


if __name__ == '__main__':
    main()
