"""``colossal-lite generate CKPT --prompt TEXT --tokens N [--nproc N] [--tensor-mode M]
[--depth D] [--top-k K] [--temperature T] [--seed S] [--greedy]``: text from a trained
causal LM (GPT, Llama). It samples among the top 40 tokens at temperature 0.8 unless told
otherwise (``--greedy``: the most likely token each step); the seed is drawn on rank 0 and
printed on stderr unless ``--seed`` fixes it, and the same seed gives the same text.

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
import secrets
import sys

from ..communication import collective as C
from ..config import ConfigError
from ..context import ParallelMode
from ..context import global_context as gpc
from ..generation import check_arguments, generate
from ..launcher import run_workers
from ._from_checkpoint import (PARENT_ERRORS, add_layout_arguments, check_model, fail,
                               inference_config, job_tokenizer, launch_worker, on_nodes)

TOP_K, TEMPERATURE = 40, 0.8   # the sampling defaults


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        'generate', help='sample text from a trained GPT or Llama checkpoint (greedy or top-k)',
        epilog='example: colossal-lite generate runs/ckpt --prompt "ROMEO:" --tokens 200 --nproc 2')
    add_layout_arguments(parser)
    parser.add_argument('--prompt', required=True, help='the text to continue')
    parser.add_argument('--tokens', type=int, required=True, help='tokens to generate')
    parser.add_argument('--top-k', type=int, default=None,
                        help=f'sample among the K most likely tokens (default {TOP_K})')
    parser.add_argument('--temperature', type=float, default=None,
                        help=f'divides the logits before top-k sampling (default {TEMPERATURE}; '
                             f'0: greedy)')
    parser.add_argument('--seed', type=int, default=None,
                        help='sampling seed (default: drawn at random and printed); the same '
                             'seed gives the same text')
    parser.add_argument('--greedy', action='store_true',
                        help='pick the most likely token each step instead of sampling')
    parser.set_defaults(run=run)


def sampling(args):
    """``(top_k, temperature)`` of the flags: top-k 40 at temperature 0.8 unless given;
    ``--greedy``: ``(None, 1.0)`` (the most likely token), which takes neither flag."""
    if args.greedy:
        given = [flag for flag, value in (('--top-k', args.top_k),
                                          ('--temperature', args.temperature)) if value is not None]
        if given:
            raise ConfigError(f'--greedy picks the most likely token: it takes no '
                              f'{" or ".join(given)}')
        return None, 1.0
    return (TOP_K if args.top_k is None else args.top_k,
            TEMPERATURE if args.temperature is None else args.temperature)


def prepare(args):
    """Every check of the module doc; the prompt's token ids. Sets ``args.top_k`` and
    ``args.temperature`` to what the workers use (:func:`sampling`)."""
    args.top_k, args.temperature = sampling(args)
    flags = getattr(args, 'world_flags', None)    # on several nodes (on_nodes)
    cfg = inference_config(args.checkpoint, args.nproc, args.tensor_mode, args.depth, flags)
    model = check_model(cfg, args.nproc, flags)
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
        nodes, local, args = on_nodes(args)   # args.nproc: all nodes' processes from here on
        ids = prepare(args)
    except PARENT_ERRORS as err:
        return fail('generate', args.checkpoint, err)
    return run_workers(local, args.port, entrypoint or generate_worker,
                     os.path.abspath(args.checkpoint), args.nproc, args.tensor_mode,
                     args.depth, ids, args.tokens, args.top_k, args.temperature,
                     args.seed, what='generation', nodes=nodes)


def generate_worker(ckpt, nproc, mode, depth, ids, tokens, top_k, temperature, seed):
    """One rank: the model loaded in the layout, the tokens generated, rank 0 prints."""
    import torch

    cfg, model = launch_worker(ckpt, nproc, mode, depth)
    try:
        sampled = top_k is not None and temperature > 0
        if sampled and seed is None:
            seed = _shared_seed()
        out = generate(model, torch.tensor(ids, dtype=torch.long), tokens, top_k=top_k,
                       temperature=temperature, seed=0 if seed is None else seed)
        if gpc.get_global_rank() == 0:
            if sampled:
                print(f'colossal-lite generate: seed {seed} (top-k {top_k}, temperature '
                      f'{temperature}; --seed {seed} gives this text again)', file=sys.stderr,
                      flush=True)
            _, decode = job_tokenizer(cfg.settings.job)
            print(decode(out.tolist()), flush=True)
        return out
    finally:
        gpc.destroy()


def _shared_seed() -> int:
    """A seed drawn on global rank 0, the same on every rank (a broadcast over GLOBAL)."""
    import torch
    seed = torch.tensor([secrets.randbelow(2 ** 31)], dtype=torch.long, device=gpc.device)
    return int(C.broadcast(seed, ParallelMode.GLOBAL, src=0).item())
