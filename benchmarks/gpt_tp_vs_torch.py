"""A GPT-2-shaped model's training step under tensor parallelism: ours (1D) vs PyTorch's
native tensor parallelism (``parallelize_module``) on a transformers GPT-2 of the same shape.

Both start from one ``GPT2LMHeadModel`` (seed 0, same on every rank):

* ours: ``model_zoo.hf.gpt_from_hf`` under ``tensor=dict(mode='1d', size=tp)`` (column /
  row linears, fused head-aligned q/k/v, vocab-parallel embedding and LM head);
* torch: the same weights in ``TorchGPT``, a GPT-2 of plain ``nn.Embedding`` / ``nn.Linear``
  modules (HF's ``Conv1D`` is not what torch's parallel styles accept), ``c_attn``'s rows
  reordered into the blocked order ``[q_0; k_0; v_0; q_1; ...]`` so that torch's contiguous
  row shard gives each rank whole heads; then ``parallelize_module`` laid out as torchtitan
  does: c_attn, c_fc colwise and both projections rowwise, the token embedding
  vocab-parallel (``RowwiseParallel(input_layouts=Replicate())``), the LM head colwise with
  its logits left sharded over the vocabulary (``output_layouts=Shard(-1)``,
  ``use_local_output=False``) and the cross entropy (and its backward) under
  ``loss_parallel()``, so torch never gathers the full logits either; the head stays tied
  to the embedding as in ours. Layer norms and position embeddings replicated on both sides.

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

from benchmarks._common import (adamw_step as step_fn, environment, load_average,  # noqa: E402
                                print_table, timed_ratios, write_json)

WHAT = ('GPT-2-shaped training step (fwd, loss, bwd, AdamW), 1D tensor parallel vs torch '
        'parallelize_module (vocab-parallel embedding, colwise LM head, loss_parallel) on the '
        'same weights in plain torch modules, CPU gloo, fp32')


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


class TorchBlock(nn.Module):
    """A GPT-2 block of plain torch modules; the attention runs on the heads whose q/k/v
    rows this rank holds (all heads unsharded, ``c_attn``'s rows in blocked order)."""

    def __init__(self, hf_block, tp: int, head_dim: int):
        super().__init__()
        hidden = hf_block.ln_1.weight.numel()
        self.head_dim = head_dim
        self.ln_1, self.ln_2 = copy.deepcopy(hf_block.ln_1), copy.deepcopy(hf_block.ln_2)
        self.c_attn = _linear(hf_block.attn.c_attn, blocked_rows(hidden, tp))
        self.attn_proj = _linear(hf_block.attn.c_proj)
        self.c_fc = _linear(hf_block.mlp.c_fc)
        self.mlp_proj = _linear(hf_block.mlp.c_proj)

    def attention(self, x):
        b, s, _ = x.shape
        q, k, v = (t.reshape(b, s, -1, self.head_dim).transpose(1, 2)
                   for t in self.c_attn(x).chunk(3, dim=-1))
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.attn_proj(out.transpose(1, 2).reshape(b, s, -1))

    def forward(self, x):
        x = x + self.attention(self.ln_1(x))
        h = nn.functional.gelu(self.c_fc(self.ln_2(x)), approximate='tanh')
        return x + self.mlp_proj(h)


class TorchGPT(nn.Module):
    """HF GPT-2's weights in plain ``nn.Embedding`` / ``nn.Linear`` / ``nn.LayerNorm`` modules
    (what torch's tensor-parallel styles accept), LM head tied to ``wte``. Returns logits."""

    def __init__(self, hf, tp: int = 1):
        super().__init__()
        cfg, body = hf.config, hf.transformer
        self.wte, self.wpe = copy.deepcopy(body.wte), copy.deepcopy(body.wpe)
        self.h = nn.ModuleList(TorchBlock(blk, tp, cfg.n_embd // cfg.n_head) for blk in body.h)
        self.ln_f = copy.deepcopy(body.ln_f)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, ids):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def torch_tp(hf, tp: int) -> TorchGPT:
    """torch's best tensor-parallel setup for this GPT, as torchtitan lays it out:
    vocab-parallel embedding (``RowwiseParallel(input_layouts=Replicate())``), c_attn / c_fc
    colwise, both projections rowwise, the LM head colwise with its logits left as a DTensor
    sharded over the vocabulary (for ``loss_parallel``); the head stays tied to ``wte``
    (both shard the same ``[V, h]`` weight by rows). Layer norms and ``wpe`` replicated."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    model = TorchGPT(hf, tp)
    mesh = DeviceMesh('cpu', list(range(tp)))
    for block in model.h:
        parallelize_module(block, mesh, {'c_attn': ColwiseParallel(),
                                         'attn_proj': RowwiseParallel(),
                                         'c_fc': ColwiseParallel(),
                                         'mlp_proj': RowwiseParallel()})
    parallelize_module(model, mesh, {
        'wte': RowwiseParallel(input_layouts=Replicate()),
        'lm_head': ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)})
    model.lm_head.weight = model.wte.weight     # re-tie: one DTensor, Shard(0) for both
    return model


def parallel_loss(model, ids) -> torch.Tensor:
    """Next-token cross entropy on the vocabulary-sharded logits DTensor under torch's
    ``loss_parallel`` (the full logits are never gathered); the label shift matches
    ``GPTLMLoss`` (the last position ignored). ``loss_parallel`` must also cover backward,
    so the returned loss defers ``backward`` into the context."""
    from torch.distributed.tensor.parallel import loss_parallel
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    logits = model(ids)
    with loss_parallel():
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                           ignore_index=-100)
    return _LossParallel(loss)


class _LossParallel:
    """A loss whose ``backward`` runs inside ``loss_parallel`` (as torch requires)."""

    def __init__(self, loss):
        self.loss = loss

    def backward(self):
        from torch.distributed.tensor.parallel import loss_parallel
        with loss_parallel():
            self.loss.backward()

    def item(self) -> float:
        loss = self.loss
        return (loss.full_tensor() if hasattr(loss, 'full_tensor') else loss).item()


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
        built['torch'] = (torch_tp(hf, args['tp']), parallel_loss)
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
    load0 = load_average()
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
        'what': WHAT, 'load_average_start': load0,
        'config': args, 'target_ratio': 1.0, 'environment': environment(),
        'results': {str(tp): r for tp, r in results.items()},
        'ratios': {str(tp): {c: r['timed'][c]['ratio_ours_over_theirs'] for c in ('wall', 'cpu')}
                   for tp, r in results.items()},
        'memory_ratios': {str(tp): r['memory']['ratio_ours_over_torch']
                          for tp, r in results.items()}})
    print(f'wrote {path}')


if __name__ == '__main__':
    main()
