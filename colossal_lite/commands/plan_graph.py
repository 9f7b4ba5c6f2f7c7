"""``colossal-lite plan --graph (--hf DIR | --hf-config JSON) --devices N [--mesh data=2,tensor=4]
[--memory-gb G] [--cluster C] [--level fast|optimal] [--batch B] [--seq S] [--write-plan F]``:
plan a Hugging Face causal LM graph by graph (docs/auto_graph.md) without running it.

The model is built on the meta device from its config (``--hf`` reads ``DIR/config.json``;
``--hf-config`` takes a JSON file or an inline JSON object with ``model_type``), captured with
``[B, S]`` token ids as input and labels, and searched on one process. Prints
``plan.explain()``; ``--write-plan`` saves the plan's JSON.
"""
from __future__ import annotations

import json
import os
import sys
import warnings

import torch

from ..auto.cluster import load_profile
from ..auto.graph.api import apply_pins, resolve_mesh, search
from ..auto.graph.space import Space
from ..auto.graph.trace import capture


def _hf_config(args):
    from transformers import AutoConfig
    if args.hf:
        return AutoConfig.from_pretrained(args.hf, local_files_only=True)
    text = args.hf_config
    data = json.load(open(text)) if os.path.isfile(text) else json.loads(text)
    if 'model_type' not in data:
        raise ValueError(f'--hf-config needs a "model_type" key, got keys {sorted(data)}')
    kind = data.pop('model_type')
    return AutoConfig.for_model(kind, **data)


def parse_mesh(text, devices: int) -> dict:
    if not text:
        return {'tensor': devices}
    mesh = {}
    for part in text.split(','):
        name, _, size = part.partition('=')
        if not size.strip().isdigit():
            raise ValueError(f'--mesh takes name=size pairs like data=2,tensor=4, got {text!r}')
        mesh[name.strip()] = int(size)
    return mesh


class _CausalLM(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids, labels=ids, use_cache=False).loss


def run_graph(args) -> int:
    from transformers import AutoModelForCausalLM
    try:
        if not (args.hf or args.hf_config):
            raise ValueError('--graph needs --hf DIR or --hf-config JSON')
        mesh = resolve_mesh(parse_mesh(args.mesh, args.devices), args.devices)
        config = _hf_config(args)
        seq = args.seq or min(getattr(config, 'max_position_embeddings', 512), 2048)
        with torch.device('meta'):
            model = AutoModelForCausalLM.from_config(config)
            ids = torch.zeros(args.batch, seq, dtype=torch.long)
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')
            captured = capture(_CausalLM(model), (ids,))
            space = Space(captured, tuple(mesh.values()))
        apply_pins(space, None)
        plan = search(space, load_profile(args.cluster), args.memory_gb, args.level, mesh)
    except (ValueError, NotImplementedError) as exc:
        print(f'colossal-lite plan: {exc}', file=sys.stderr)
        return 2
    print(plan.explain(limit=args.show))
    if args.write_plan:
        plan.save(args.write_plan)
        print(f'wrote {args.write_plan}')
    return 0
