"""model_zoo GPT / Llama (serial) vs Hugging Face GPT2LMHeadModel / LlamaForCausalLM: one
training step on CPU.

Same config and the same weights (HF's converted by model_zoo.hf); the script first
checks that both give the same loss and logits, then times forward + loss + backward
+ AdamW step, the two models alternated round by round, and reports the median of the
per-round time ratios (ours / theirs; target: GPT <= 0.9, Llama <= 0.85), on two clocks:
wall time and the process's CPU time (the robust one on a shared, oversubscribed machine).

    python benchmarks/serial_vs_hf.py --model gpt|llama [--hidden 256 --layers 4 --seq 128]
Writes benchmarks/results/<model>_serial_vs_hf.json.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks._common import (adamw_step as step_fn, environment, print_table,  # noqa: E402
                                timed_ratios, write_json)
from model_zoo import GPTLMLoss, Llama  # noqa: E402
from model_zoo.hf import gpt_from_hf  # noqa: E402


def _gpt(args, transformers):
    cfg = transformers.GPT2Config(vocab_size=args.vocab, n_positions=args.seq, n_embd=args.hidden,
                                  n_layer=args.layers, n_head=args.heads, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    hf = transformers.GPT2LMHeadModel(cfg)
    return hf, gpt_from_hf(hf)


def _llama(args, transformers):
    cfg = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                                   num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                   num_key_value_heads=args.kv_heads,
                                   intermediate_size=args.intermediate,
                                   max_position_embeddings=args.seq, tie_word_embeddings=False)
    hf = transformers.LlamaForCausalLM(cfg)
    return hf, Llama.from_hf(hf)


MODELS = {'gpt': (_gpt, 0.9), 'llama': (_llama, 0.85)}  # builder, target ratio


def build(args):
    import transformers
    torch.manual_seed(0)
    hf, ours = MODELS[args.model][0](args, transformers)
    return hf.train(), ours.train()


def check_equal(hf, ours, ids) -> dict:
    with torch.no_grad():
        out = hf(ids, labels=ids)
        logits = ours(ids)
        loss = GPTLMLoss()(logits, ids)
    diff = (logits - out.logits).abs().max().item()
    loss_diff = abs(loss.item() - out.loss.item())
    if diff > 1e-4 * out.logits.abs().max().item() or loss_diff > 1e-5:
        raise SystemExit(f'models differ: max logit diff {diff}, loss diff {loss_diff}')
    return {'max_abs_logit_diff': diff, 'loss_diff': loss_diff, 'loss': loss.item()}


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--model', choices=sorted(MODELS), default='gpt')
    p.add_argument('--hidden', type=int, default=256)
    p.add_argument('--layers', type=int, default=4)
    p.add_argument('--heads', type=int, default=4)
    p.add_argument('--kv-heads', type=int, default=2, help='Llama only')
    p.add_argument('--intermediate', type=int, default=688, help='Llama only')
    p.add_argument('--seq', type=int, default=128)
    p.add_argument('--batch', type=int, default=8)
    p.add_argument('--vocab', type=int, default=8192)
    p.add_argument('--threads', type=int, default=1)
    p.add_argument('--repeats', type=int, default=15)
    p.add_argument('--steps', type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    hf, ours = build(args)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    check = check_equal(hf, ours, ids)
    ours_loss = GPTLMLoss()
    runs = {'ours': step_fn(ours, lambda m, x: ours_loss(m(x), x), ids),
            'hf': step_fn(hf, lambda m, x: m(x, labels=x).loss, ids)}
    timed = timed_ratios(runs, 'ours', 'hf', args.repeats, args.steps)
    times = timed.pop('times_s_per_step')
    summary = timed
    rows = [['clock', 'ours s/step', 'hf s/step', 'ours tokens/s', 'ratio ours/hf']]
    for clock, res in summary.items():
        med = res['median_s_per_step']
        rows.append([clock, f"{med['ours']:.4f}", f"{med['hf']:.4f}",
                     f"{args.batch * args.seq / med['ours']:.0f}",
                     f"{res['ratio_ours_over_theirs']:.3f}"])
    print_table(rows)
    target = MODELS[args.model][1]
    print(f'ratio = median of per-round ratios (alternated rounds); target <= {target}. cpu = '
          'process CPU time, robust to a shared machine; wall = elapsed time')
    path = write_json(f'{args.model}_serial_vs_hf', {
        'what': 'training step (forward, loss, backward, AdamW) on CPU, fp32, alternated rounds',
        'config': vars(args), 'equality_check': check, 'times_s_per_step': times,
        'target_ratio': target, 'environment': environment(), 'summary': summary,
        'ratio_ours_over_hf': {c: r['ratio_ours_over_theirs'] for c, r in summary.items()}})
    print(f'wrote {path}')


if __name__ == '__main__':
    main()
