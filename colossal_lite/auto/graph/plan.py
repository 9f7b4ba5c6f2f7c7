"""A graph-level plan: every node's placements, JSON-serializable, explainable.

Placements are written per mesh axis as ``R`` (Replicate), ``S<d>`` (Shard(d)) or ``P``
(Partial sum). ``nodes[name] = {'op', 'in': [[...] or None per tensor slot], 'out': [...],
'local'}``; ``params[fqn]`` repeats the parameters' placements. ``predicted`` holds the cost
model's step seconds, memory bytes per rank and collective bytes per op; ``pipeline`` the
stage cut (``pipeline.py``) when the graph runs as pipeline stages. A plan is bound to
the graph it was made for by node names: re-applying it to the same model and input shapes
needs no search (``parallelize(model, inputs, plan=plan)``). ``graph`` is that graph's
:func:`fingerprint`; a plan applied to another graph (another model, other shapes, a full
trace where the plan's capture stamped repeated blocks) is an error, not a silent mismatch.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

from ..cluster import dataclass_from_json
from .strategies import Strategy, placement_from_name, placement_name


def names(placements) -> Optional[List[str]]:
    return None if placements is None else [placement_name(p) for p in placements]


def from_names(values) -> Optional[tuple]:
    return None if values is None else tuple(placement_from_name(v) for v in values)


def fingerprint(graph) -> str:
    """A short hash of the graph's node names, ops and output shapes, in order."""
    text = '\n'.join(f'{n.name} {n.target} {tuple(getattr(n.meta.get("val"), "shape", ()))}'
                     for n in graph.nodes)
    return hashlib.sha1(text.encode()).hexdigest()[:16]


@dataclass
class Plan:
    mesh: Dict[str, int]
    nodes: Dict[str, dict]
    params: Dict[str, List[str]]
    predicted: Dict[str, object] = field(default_factory=dict)
    unruled: List[str] = field(default_factory=list)
    level: str = 'fast'
    search_seconds: float = 0.0
    graph: str = ''             # fingerprint() of the graph planned ('' in older plans)
    # pipeline stages (pipeline.py): {'stages', 'starts': first chain node of each stage,
    # 'stage_seconds': predicted forward + backward per micro-batch}; {} without
    pipeline: Dict[str, object] = field(default_factory=dict)

    # --------------------------------------------------------------- strategies
    def strategy(self, name: str) -> Strategy:
        entry = self.nodes[name]
        return Strategy(tuple(from_names(v) for v in entry['in']),
                        tuple(from_names(v) for v in entry['out']), bool(entry.get('local')))

    @staticmethod
    def entry(op: str, strategy: Strategy) -> dict:
        return {'op': op, 'in': [names(p) for p in strategy.inputs],
                'out': [names(p) for p in strategy.outputs], 'local': strategy.local}

    # --------------------------------------------------------------- JSON
    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> 'Plan':
        return dataclass_from_json(cls, data, 'plan')

    def save(self, path: str) -> None:
        with open(path, 'w') as f:
            json.dump(self.to_json(), f, indent=1)

    @classmethod
    def load(cls, path: str) -> 'Plan':
        with open(path) as f:
            return cls.from_json(json.load(f))

    # --------------------------------------------------------------- explain
    def explain(self, limit: Optional[int] = None) -> str:
        """Per-op placements, the collectives the plan inserts, the predicted totals and the
        ops that had no sharding rule (run replicated)."""
        mesh = ' x '.join(f'{k}={v}' for k, v in self.mesh.items())
        lines = [f'graph plan ({self.level}, searched in {self.search_seconds:.2f} s) on mesh {mesh}']
        pred = self.predicted
        if pred:
            lines.append(f"predicted: step {pred.get('step_s', 0) * 1e3:.3f} ms "
                         f"(compute {pred.get('compute_s', 0) * 1e3:.3f} ms, "
                         f"communication {pred.get('comm_s', 0) * 1e3:.3f} ms), "
                         f"memory {pred.get('memory_bytes', 0) / 2 ** 20:.1f} MiB per rank")
            comm = pred.get('comm_bytes', {})
            if comm:
                lines.append('collectives per step (buffer bytes per rank): ' + ', '.join(
                    f'{op} {b}' for op, b in sorted(comm.items())))
        if self.pipeline:
            seconds = ', '.join(f'{t * 1e3:.3f}' for t in self.pipeline['stage_seconds'])
            lines.append(f"pipeline: {self.pipeline['stages']} stages starting at "
                         f"{', '.join(self.pipeline['starts'])}; predicted ms per micro-batch "
                         f"per stage: {seconds}")
        if self.unruled:
            lines.append('no sharding rule (run replicated): ' + ', '.join(self.unruled))
        lines.append('parameters and buffers (placement per mesh axis):')
        for fqn, placements in self.params.items():
            lines.append(f"  {fqn:<60}{','.join(placements)}")
        ops = [(n, e) for n, e in self.nodes.items() if 'source' not in e]
        lines.append(f"ops ({len(ops)}): {'node':<22}{'op':<44}{'inputs':<24}output")
        for count, (name, entry) in enumerate(ops):
            if limit is not None and count >= limit:
                lines.append(f'  ... {len(ops) - count} more ops')
                break
            ins = ' '.join(','.join(p) for p in entry['in'] if p is not None) or '-'
            outs = ' '.join(','.join(p) for p in entry['out'] if p is not None) or '-'
            lines.append(f"  {name:<28}{entry['op'][:42]:<44}{ins:<24}{outs}")
            for move in entry.get('moves', ()):
                lines.append(f'      <- {move}')
        return '\n'.join(lines)
