"""``colossal-lite generate CKPT --prompt TEXT --tokens N [--nproc N] [--tensor-mode M]
[--depth D] [--top-k K] [--temperature T] [--seed S]``: text from a trained causal LM
(GPT, Llama).

In the parent (exit status 2 and one line on stderr when any fails, before a worker
starts): the checkpoint's job config, the layout of ``--nproc`` against ``--tensor-mode``,
the model built on the meta device for it (a causal LM with a KV cache, split evenly), the
prompt encoded with the job's tokenizer, at most ``max_positions`` tokens (the generated
ones may go past: the window slides, ``colossal_lite/generation.py``). Each worker then
launches the layout, builds the model, loads the weights (``checkpoint.load_model``) and
runs ``colossal_lite.generation.generate``; rank 0 prints the prompt and its continuation
on stdout.
"""
from __future__ import annotations

import os

from ..context import global_context as gpc
from ..generation import check_arguments, generate
from ..launcher import run_workers
from ._from_checkpoint import (PARENT_ERRORS, add_layout_arguments, check_model, fail,
                               inference_config, job_tokenizer, launch_worker)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        'generate', help='sample text from a trained GPT or Llama checkpoint (greedy or top-k)',
        epilog='example: colossal-lite generate runs/ckpt --prompt "ROMEO:" --tokens 200 --nproc 2')
    add_layout_arguments(parser)
    parser.add_argument('--prompt', required=True, help='the text to continue')
    parser.add_argument('--tokens', type=int, required=True, help='tokens to generate')
    parser.add_argument('--top-k', type=int, default=None,
                        help='sample among the K most likely tokens (default: greedy)')
    parser.add_argument('--temperature', type=float, default=1.0,
                        help='divides the logits before top-k sampling (0: greedy)')
    parser.add_argument('--seed', type=int, default=0, help='sampling seed (same on every rank)')
    parser.set_defaults(run=run)


def prepare(args):
    """Every check of the module doc; the prompt's token ids."""
    cfg = inference_config(args.checkpoint, args.nproc, args.tensor_mode, args.depth)
    model = check_model(cfg, args.nproc)
    spec = cfg.settings.job
    if not hasattr(model, 'new_kv_cache'):
        raise ValueError(f'the checkpoint holds a {spec.kind!r} model; generate needs a causal '
                         f'language model with a KV cache (gpt, llama)')
    encode, _ = job_tokenizer(spec)
    ids = encode(args.prompt)
    check_arguments(model, len(ids), args.tokens, args.top_k, args.temperature)
    return ids


def run(args, entrypoint=None) -> int:
    try:
        ids = prepare(args)
    except PARENT_ERRORS as err:
        return fail('generate', args.checkpoint, err)
    return run_workers(args.nproc, args.port, entrypoint or generate_worker,
                     os.path.abspath(args.checkpoint), args.nproc, args.tensor_mode,
                     args.depth, ids, args.tokens, args.top_k, args.temperature,
                     args.seed, what='generation')


def generate_worker(ckpt, nproc, mode, depth, ids, tokens, top_k, temperature, seed):
    """One rank: the model loaded in the layout, the tokens generated, rank 0 prints."""
    import torch

    cfg, model = launch_worker(ckpt, nproc, mode, depth)
    try:
        out = generate(model, torch.tensor(ids, dtype=torch.long), tokens, top_k=top_k,
                       temperature=temperature, seed=seed)
        if gpc.get_global_rank() == 0:
            _, decode = job_tokenizer(cfg.settings.job)
            print(decode(out.tolist()), flush=True)
        return out
    finally:
        gpc.destroy()
