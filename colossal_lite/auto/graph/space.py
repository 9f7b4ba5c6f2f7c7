"""The search space: one decision per graph node, its candidate strategies, its producers.

Decisions are the graph's tensor placeholders (parameters, buffers, constants, user inputs:
one output placement each, never Partial) and its call_function nodes (the strategies of
``strategies.node_strategies``). ``getitem`` on a multi-output op is not a decision: it
reads output i of its producer. Decisions are numbered in graph (topological) order.
"""
from __future__ import annotations

import itertools
import operator
import warnings
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch.distributed.tensor.placement_types import _StridedShard

from .strategies import (Strategy, axis_states, fits, node_strategies, outputs_of,
                         strided_state, tensor_args)
from .trace import Captured


NO_OPS = {torch.ops.aten._assert_tensor_metadata.default}


@dataclass
class Decision:
    node: torch.fx.Node
    kind: str                       # 'param', 'buffer', 'constant', 'input' or 'op'
    strategies: List[Strategy]
    source: object = None           # fqn for parameters/buffers/constants, index for inputs
    # per tensor input slot: (producer decision id, producer output index) or None
    producers: List[Optional[Tuple[int, int]]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.node.name


class Space:
    """See the module doc."""

    def __init__(self, captured: Captured, mesh_shape: Sequence[int]):
        self.captured = captured
        self.mesh_shape = tuple(int(k) for k in mesh_shape)
        self.decisions: List[Decision] = []
        self.index: Dict[str, int] = {}
        self.unruled: List[str] = []
        alias: Dict[str, Tuple[int, int]] = {}     # node name -> (decision, output index)
        placeholders = [n for n in captured.graph.nodes if n.op == 'placeholder']
        for node, (kind, source) in zip(placeholders, captured.inputs):
            val = node.meta.get('val')
            if not isinstance(val, torch.Tensor) or not node.users:
                continue   # e.g. the unread alias of a tied weight: the read one decides
            states = [axis_states(val, k, partial=False) + strided_state(val, node, k)
                      for k in self.mesh_shape]
            options = [Strategy((), (tuple(p),)) for p in itertools.product(*states)
                       if fits(val, p, self.mesh_shape)]
            self._add(Decision(node, kind, options, source), alias)
        for node in captured.graph.nodes:
            if node.op != 'call_function':
                continue
            if node.target in NO_OPS:     # checks export leaves in; the runner skips them
                continue
            if node.target is operator.getitem:
                src, _ = alias[node.args[0].name]
                alias[node.name] = (src, node.args[1])
                continue
            options, ruled = node_strategies(node, self.mesh_shape)
            if not ruled and str(node.target) not in self.unruled:
                self.unruled.append(str(node.target))
            producers = [alias[s.name] if s is not None else None for s in tensor_args(node)]
            self._add(Decision(node, 'op', options, producers=producers), alias)
        out = next(n for n in captured.graph.nodes if n.op == 'output')
        self.loss: Tuple[int, int] = alias[out.args[0][0].name]   # gathered to every rank
        if self.unruled:
            warnings.warn(f'no sharding rule for {", ".join(self.unruled)}: these ops run '
                          f'replicated (their inputs are gathered); see plan.explain()',
                          stacklevel=3)

    def _add(self, decision: Decision, alias) -> None:
        self.index[decision.name] = len(self.decisions)
        alias[decision.name] = (len(self.decisions), 0)
        self.decisions.append(decision)

    def __len__(self) -> int:
        return len(self.decisions)

    def output_meta(self, i: int, out: int) -> Optional[torch.Tensor]:
        outs = outputs_of(self.decisions[i].node)
        return outs[out] if out < len(outs) else None


def reachable(src, dst) -> bool:
    """Whether redistribution can turn placements ``src`` into ``dst``: a Partial is only
    ever produced by an op (DTensor does not make one from a Replicate or a Shard), and a
    strided shard (``fused.py``) is neither moved nor made by a move."""
    return all(s == d or not (d.is_partial() or isinstance(s, _StridedShard)
                              or isinstance(d, _StridedShard)) for s, d in zip(src, dst))


def _strided(placements) -> bool:
    return placements is not None and any(isinstance(p, _StridedShard) for p in placements)


def _valid(space: Space, picked: List[int], i: int) -> List[int]:
    """The strategies of decision i whose inputs its producers' picks can reach."""
    d = space.decisions[i]
    return [k for k, s in enumerate(d.strategies)
            if all(pr is None or want is None or
                   reachable(space.decisions[pr[0]].strategies[picked[pr[0]]].outputs[pr[1]],
                             want)
                   for pr, want in zip(d.producers, s.inputs))]


def random_choice(space: Space, rng) -> List[int]:
    """A uniformly drawn valid choice (no input asks for a Partial its producer does not
    give, no strided shard moves): the test of the executor on plans no cost model would
    pick. A strided pick that leaves a consumer nothing is redrawn without strided outputs
    (strided chains have one user per link, so no other consumer depends on it)."""
    picked: List[int] = []
    for i, d in enumerate(space.decisions):
        ok = _valid(space, picked, i)
        if not ok:
            for pr in d.producers:
                prod = space.decisions[pr[0]] if pr is not None else None
                if prod is not None and _strided(prod.strategies[picked[pr[0]]].outputs[pr[1]]):
                    plain = [k for k in _valid(space, picked, pr[0])
                             if not any(_strided(o) for o in prod.strategies[k].outputs)]
                    picked[pr[0]] = rng.choice(plain)
            ok = _valid(space, picked, i)
        picked.append(rng.choice(ok))
    return picked
