"""A GPT-2-shaped model's training step under tensor parallelism: ours (1D) vs PyTorch's
native tensor parallelism (``parallelize_module``) on a transformers GPT-2 of the same shape.

Both start from one ``GPT2LMHeadModel`` (seed 0, same on every rank):

* ours: ``model_zoo.hf.gpt_from_hf`` under ``tensor=dict(mode='1d', size=tp)`` (column /
  row linears, fused head-aligned q/k/v, vocab-parallel embedding and LM head);
* torch: the same HF model with its ``Conv1D`` layers turned into ``nn.Linear`` (what
  ``ColwiseParallel`` / ``RowwiseParallel`` accept), ``c_attn``'s rows reordered into
  the blocked order ``[q_0; k_0; v_0; q_1; ...]`` so that torch's contiguous row shard
  gives each rank whole heads, and ``attn.split_size = h / tp``; then
  ``parallelize_module`` with c_attn, c_fc colwise and both c_proj rowwise (embeddings,
  LM head and layer norms replicated: HF's loss needs the full logits, so neither
  torch's ``loss_parallel`` nor SequenceParallel is applied; ours splits the vocabulary,
  which is part of the measured difference).

The script checks that both give the same loss on the same batch, then times forward +
loss + backward + AdamW step, alternated round by round, on tp forked ranks (gloo, one
thread each), and reports rank 0's median per-round ratio ours / torch on wall and CPU
time, and tokens/s. Target: ours >= 1.0x torch's tokens/s (ratio of times <= 1.0).

Peak memory is measured apart, each side alone in fresh ranks (so the other side's model is
not resident): the HF model is built and dropped, one warm-up step allocates the AdamW
state, then the peak RSS is reset (``benchmarks/_memory.py``: ``malloc_trim`` +
``/proc/self/clear_refs``) and ``--memory-steps`` steps run. Reported per side, as the
maximum over ranks: ``peak_rss_bytes`` (the steady-state peak of a training step; the
torch runtime, the same for both sides, included), ``step_growth_bytes`` (that peak minus
the RSS before the steps: gradients, activations, logits) and ``model_data_bytes`` (live
tensor storages after a step: parameters + AdamW state + what the step keeps). Target:
ours <= torch's peak.

    python benchmarks/gpt_tp_vs_torch.py [--tp 2 4 --hidden 512 --layers 8 --seq 128 --batch 8]
Writes benchmarks/results/gpt_tp_vs_torch.json.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks._common import (adamw_step as step_fn, environment, print_table,  # noqa: E402
                                timed_ratios, write_json)


def hf_model(args):
    import transformers
    cfg = transformers.GPT2Config(vocab_size=args['vocab'], n_positions=args['seq'],
                                  n_embd=args['hidden'], n_layer=args['layers'],
                                  n_head=args['heads'], resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).train()


def _linear(conv, rows=None) -> nn.Linear:
    """HF ``Conv1D`` (weight ``[in, out]``) as ``nn.Linear``; ``rows`` reorders the outputs."""
    fin, fout = conv.weight.shape
    lin = nn.Linear(fin, fout)
    with torch.no_grad():
        w, b = conv.weight.t(), conv.bias
        if rows is not None:
            w, b = w[rows], b[rows]
        lin.weight.copy_(w)
        lin.bias.copy_(b)
    return lin


def blocked_rows(hidden: int, tp: int) -> torch.Tensor:
    """Row order of the fused ``[3h, h]`` q/k/v weight that puts rank r's
    ``[q_r; k_r; v_r]`` in the r-th contiguous block of ``3h/tp`` rows."""
    part = hidden // tp
    return torch.cat([torch.arange(which * hidden + r * part, which * hidden + (r + 1) * part)
                      for r in range(tp) for which in range(3)])


def torch_tp(hf, tp: int):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    model = copy.deepcopy(hf)
    hidden = model.config.n_embd
    mesh = DeviceMesh('cpu', list(range(tp)))
    for block in model.transformer.h:
        block.attn.c_attn = _linear(block.attn.c_attn, blocked_rows(hidden, tp))
        block.attn.c_proj = _linear(block.attn.c_proj)
        block.mlp.c_fc = _linear(block.mlp.c_fc)
        block.mlp.c_proj = _linear(block.mlp.c_proj)
        block.attn.split_size = hidden // tp
        parallelize_module(block, mesh, {'attn.c_attn': ColwiseParallel(),
                                         'attn.c_proj': RowwiseParallel(),
                                         'mlp.c_fc': ColwiseParallel(),
                                         'mlp.c_proj': RowwiseParallel()})
    return model


def batch(args) -> torch.Tensor:
    return torch.randint(0, args['vocab'], (args['batch'], args['seq']),
                         generator=torch.Generator().manual_seed(0))


def build_sides(args, sides=('ours', 'torch')):
    """``{side: (model, loss_fn(model, ids))}`` built from one HF model (dropped after)."""
    from model_zoo import GPTLMLoss
    from model_zoo.hf import gpt_from_hf
    hf = hf_model(args)
    loss = GPTLMLoss()
    built = {}
    if 'ours' in sides:
        built['ours'] = (gpt_from_hf(hf).train(), lambda m, x: loss(m(x), x))
    if 'torch' in sides:
        built['torch'] = (torch_tp(hf, args['tp']), lambda m, x: m(x, labels=x).loss)
    del hf
    return built


def bench_rank(rank, args):
    warnings.filterwarnings('ignore')
    built, ids = build_sides(args), batch(args)
    with torch.no_grad():
        ours_loss, torch_loss = (fn(model, ids).item() for model, fn in
                                 (built['ours'], built['torch']))
    if abs(ours_loss - torch_loss) > 1e-5 * max(1.0, abs(torch_loss)):
        raise RuntimeError(f'losses differ: ours {ours_loss}, torch {torch_loss}')
    runs = {side: step_fn(model, fn, ids) for side, (model, fn) in built.items()}
    timed = timed_ratios(runs, 'ours', 'torch', args['repeats'], args['steps'])
    return {'check': {'ours_loss': ours_loss, 'torch_loss': torch_loss}, 'timed': timed}


def memory_rank(rank, args, side):
    """One side alone: its steady-state training-step memory on this rank (bytes)."""
    from benchmarks._memory import live_tensor_bytes, peak_rss, reset_peak, rss_bytes
    warnings.filterwarnings('ignore')
    (model, fn), = build_sides(args, (side,)).values()
    step = step_fn(model, fn, batch(args))
    step()  # allocates the AdamW state
    reset_peak()
    before = rss_bytes()
    for _ in range(args['memory_steps']):
        step()
    peak = peak_rss()
    return {'peak_rss_bytes': peak, 'step_growth_bytes': peak - before,
            'model_data_bytes': live_tensor_bytes()}


def measure_memory(args, tp, config) -> dict:
    """``{side: {measure: max over ranks}}`` and the ratios ours / torch."""
    from colossal_lite.testing import run_distributed
    out = {}
    for side in ('ours', 'torch'):
        per_rank = run_distributed(memory_rank, tp, config, args, side, timeout=1200,
                                   collective_timeout=600)
        out[side] = {k: max(r[k] for r in per_rank) for k in per_rank[0]}
    out['ratio_ours_over_torch'] = {k: out['ours'][k] / out['torch'][k] for k in out['ours']}
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--tp', type=int, nargs='+', default=[2, 4])
    p.add_argument('--hidden', type=int, default=512)
    p.add_argument('--layers', type=int, default=8)
    p.add_argument('--heads', type=int, default=8)
    p.add_argument('--seq', type=int, default=128)
    p.add_argument('--batch', type=int, default=8)
    p.add_argument('--vocab', type=int, default=8192)
    p.add_argument('--repeats', type=int, default=7)
    p.add_argument('--steps', type=int, default=1)
    p.add_argument('--memory-steps', type=int, default=2)
    args = vars(p.parse_args())
    from colossal_lite.testing import run_distributed
    rows = [['tp', 'clock', 'ours s/step', 'torch s/step', 'ours tokens/s', 'torch tokens/s',
             'ratio ours/torch']]
    results = {}
    for tp in args['tp']:
        config = dict(parallel=dict(tensor=dict(size=tp, mode='1d')))
        res = run_distributed(bench_rank, tp, config, dict(args, tp=tp), timeout=1200,
                              collective_timeout=600)[0]
        res['memory'] = measure_memory(dict(args, tp=tp), tp, config)
        results[tp] = res
        tokens = args['batch'] * args['seq']
        for clock, summary in res['timed'].items():
            if clock == 'times_s_per_step':
                continue
            med = summary['median_s_per_step']
            rows.append([str(tp), clock, f"{med['ours']:.4f}", f"{med['torch']:.4f}",
                         f"{tokens / med['ours']:.0f}", f"{tokens / med['torch']:.0f}",
                         f"{summary['ratio_ours_over_theirs']:.3f}"])
    print_table(rows)
    mem_rows = [['tp', 'measure (max over ranks)', 'ours MiB', 'torch MiB', 'ratio ours/torch']]
    for tp, res in results.items():
        mem = res['memory']
        for k in ('peak_rss_bytes', 'step_growth_bytes', 'model_data_bytes'):
            mem_rows.append([str(tp), k, f"{mem['ours'][k] / 2**20:.1f}",
                             f"{mem['torch'][k] / 2**20:.1f}",
                             f"{mem['ratio_ours_over_torch'][k]:.3f}"])
    print_table(mem_rows)
    print('ratio = median of per-round time ratios (alternated rounds, rank 0, train step, '
          'gloo); target <= 1.0. cpu = process CPU time incl. gloo threads; wall = elapsed')
    path = write_json('gpt_tp_vs_torch', {
        'what': 'GPT-2-shaped training step (fwd, loss, bwd, AdamW), 1D tensor parallel vs '
                'torch parallelize_module on transformers GPT2LMHeadModel, CPU gloo, fp32',
        'config': args, 'target_ratio': 1.0, 'environment': environment(),
        'results': {str(tp): r for tp, r in results.items()},
        'ratios': {str(tp): {c: r['timed'][c]['ratio_ours_over_theirs'] for c in ('wall', 'cpu')}
                   for tp, r in results.items()},
        'memory_ratios': {str(tp): r['memory']['ratio_ours_over_torch']
                          for tp, r in results.items()}})
    print(f'wrote {path}')


if __name__ == '__main__':
    main()
