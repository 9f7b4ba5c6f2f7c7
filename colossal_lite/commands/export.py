"""``colossal-lite export CKPT --hf DIR``: a checkpoint's model as a Hugging Face
transformers directory (config + safetensors).

One process, no process group: the job's model is built serially (its config from the
checkpoint), the weights loaded (``checkpoint.load_model``, full tensors) and the model's
own ``save_hf(DIR)`` writes the directory (``model_zoo``: GPT-2 / BERT / ViT / Llama,
vocabulary padding cut back). Errors before anything is written give exit status 2.
"""
from __future__ import annotations

import os
import sys

from ..checkpoint import load_model
from ..job import build_model, resolve_vocab
from ._from_checkpoint import PARENT_ERRORS, fail, inference_config


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        'export', help="write a checkpoint's model as a Hugging Face transformers directory",
        epilog='example: colossal-lite export runs/ckpt --hf runs/hf_gpt')
    parser.add_argument('checkpoint', help='a checkpoint directory written by colossal-lite train')
    parser.add_argument('--hf', required=True, metavar='DIR', help='the directory to write')
    parser.set_defaults(run=run)


def export(ckpt: str, hf_dir: str) -> str:
    """Build the checkpoint's model serially, load it and ``save_hf(hf_dir)``; the directory."""
    cfg = inference_config(ckpt, 1)
    spec = resolve_vocab(cfg.settings.job)
    model = build_model(spec)
    if not hasattr(model, 'save_hf'):
        raise NotImplementedError(f'the checkpoint\'s {spec.kind!r} model has no save_hf '
                                  f'(Hugging Face export of this model is not implemented)')
    if os.path.exists(hf_dir) and not os.path.isdir(hf_dir):
        raise ValueError(f'--hf {hf_dir!r} is a file, not a directory')
    load_model(ckpt, model)
    model.save_hf(hf_dir)
    return hf_dir


def run(args) -> int:
    try:
        out = export(args.checkpoint, args.hf)
    except PARENT_ERRORS as err:
        return fail('export', args.checkpoint, err)
    print(f'colossal-lite export: wrote {os.path.abspath(out)}', file=sys.stderr)
    return 0
