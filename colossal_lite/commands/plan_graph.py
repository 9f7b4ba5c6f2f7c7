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
from ..auto.graph.api import resolve_mesh, search
from ..auto.graph.space import Space
from ..auto.graph.trace import capture
from ..models import hf_causal_lm, hf_sizes


def _hf_config_dict(text: str) -> dict:
    """``--hf-config``: a JSON file or an inline JSON object."""
    return json.load(open(text)) if os.path.isfile(text) else json.loads(text)


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


def run_graph(args) -> int:
    try:
        if not (args.hf or args.hf_config):
            raise ValueError('--graph needs --hf DIR or --hf-config JSON')
        mesh = resolve_mesh(parse_mesh(args.mesh, args.devices), args.devices)
        config = _hf_config_dict(args.hf_config) if args.hf_config else None
        with torch.device('meta'):   # the config only: no weights are made or read
            model = hf_causal_lm(config=config, path=args.hf)
            positions = hf_sizes(model.model.config)['positions'] or 2048
            ids = torch.zeros(args.batch, args.seq or min(positions, 2048), dtype=torch.long)
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')
            space = Space(capture(model, (ids,)), tuple(mesh.values()))
        plan = search(space, load_profile(args.cluster), args.memory_gb, args.level, mesh)
    except (ValueError, NotImplementedError) as exc:
        print(f'colossal-lite plan: {exc}', file=sys.stderr)
        return 2
    print(plan.explain(limit=args.show))
    if args.write_plan:
        plan.save(args.write_plan)
        print(f'wrote {args.write_plan}')
    return 0
