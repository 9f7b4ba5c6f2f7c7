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
Peak memory is not measured here.

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


def bench_rank(rank, args):
    warnings.filterwarnings('ignore')
    from model_zoo import GPTLMLoss
    from model_zoo.hf import gpt_from_hf
    hf = hf_model(args)
    ours, theirs = gpt_from_hf(hf).train(), torch_tp(hf, args['tp'])
    del hf
    ids = torch.randint(0, args['vocab'], (args['batch'], args['seq']),
                        generator=torch.Generator().manual_seed(0))
    loss = GPTLMLoss()
    with torch.no_grad():
        ours_loss, torch_loss = loss(ours(ids), ids).item(), theirs(ids, labels=ids).loss.item()
    if abs(ours_loss - torch_loss) > 1e-5 * max(1.0, abs(torch_loss)):
        raise RuntimeError(f'losses differ: ours {ours_loss}, torch {torch_loss}')
    runs = {'ours': step_fn(ours, lambda m, x: loss(m(x), x), ids),
            'torch': step_fn(theirs, lambda m, x: m(x, labels=x).loss, ids)}
    timed = timed_ratios(runs, 'ours', 'torch', args['repeats'], args['steps'])
    return {'check': {'ours_loss': ours_loss, 'torch_loss': torch_loss}, 'timed': timed}


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
    args = vars(p.parse_args())
    from colossal_lite.testing import run_distributed
    rows = [['tp', 'clock', 'ours s/step', 'torch s/step', 'ours tokens/s', 'torch tokens/s',
             'ratio ours/torch']]
    results = {}
    for tp in args['tp']:
        config = dict(parallel=dict(tensor=dict(size=tp, mode='1d')))
        res = run_distributed(bench_rank, tp, config, dict(args, tp=tp), timeout=1200,
                              collective_timeout=600)[0]
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
    print('ratio = median of per-round time ratios (alternated rounds, rank 0, train step, '
          'gloo); target <= 1.0. cpu = process CPU time incl. gloo threads; wall = elapsed')
    path = write_json('gpt_tp_vs_torch', {
        'what': 'GPT-2-shaped training step (fwd, loss, bwd, AdamW), 1D tensor parallel vs '
                'torch parallelize_module on transformers GPT2LMHeadModel, CPU gloo, fp32',
        'config': args, 'target_ratio': 1.0, 'environment': environment(),
        'results': {str(tp): r for tp, r in results.items()},
        'ratios': {str(tp): {c: r['timed'][c]['ratio_ours_over_theirs'] for c in ('wall', 'cpu')}
                   for tp, r in results.items()}})
    print(f'wrote {path}')


if __name__ == '__main__':
    main()
