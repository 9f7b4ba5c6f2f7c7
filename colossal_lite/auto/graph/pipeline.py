"""Pipeline stages on a captured graph (Rhino's pipeline partition), run by our pipeline runtime.

``parallelize(...)`` under a launched ``parallel.pipeline`` = P (V chunks: S = P*V stages)
plans the graph's placements on the mesh of one stage (the ranks that share a pipeline
coordinate), then cuts the graph into S contiguous stages:

* **What a stage holds.** The graph's ops in topological order, less the *free* ops (those
  that read no parameter, even indirectly: masks, positions, rotary tables), form a chain;
  stage s holds one contiguous piece of it. Every stage recomputes the free ops it reads, so
  they never cross a stage boundary. A parameter is held by every stage that reads it (a tied
  embedding by the first and the last); the others are dropped from this rank's model.
* **Where it may cut.** After chain position k the values made at or before k and read after
  it cross. A cut is valid when each of them is one floating tensor whose planned placement
  has no Partial (a partial sum would need its gradient's placement changed in transit).
* **Balance.** The valid cuts split the chain into segments; each op weighs its chosen
  strategy's compute seconds plus the collectives of its input edges, forward and backward
  (``GraphCost``); ``pipeline.partition.balanced_cut`` gives the cut minimizing the
  heaviest stage.
* **Messages.** Stage s sends the values crossing its end (its own or passed through from
  earlier stages) as ONE flat tensor: each value redistributed to its planned placements, its
  local shard flattened and cast to the widest of their float dtypes (exact: every dtype
  casts up and back losslessly), concatenated (:class:`Boundary`). The receiver splits it
  and wraps each piece back as a DTensor with the same placements; ``StageLink`` moves it
  between the ranks at the same mesh coordinate of adjacent pipeline ranks, with its shape
  handshake, and autograd carries the gradient back the same way.

Gradients: inside a stage DTensor reduces them as without pipelining (a data-parallel
gradient once per micro-batch); a parameter held by several stages has its gradient summed
over PIPELINE in ``engine.step()`` (:meth:`PipelinedAutoModel.synchronize_stage_gradients`).
"""
from __future__ import annotations

import copy
import operator
from dataclasses import dataclass
from typing import Dict, List, Sequence, Set, Tuple

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate

from ...pipeline.partition import StageSpec, balanced_cut
from .execute import GraphRunner, local_shape
from .strategies import Strategy
from .trace import Captured


@dataclass
class StageGraph:
    """Stage ``index``: its graph (``captured.inputs`` also names ``('boundary', k)``: the
    k-th value received), the node names it receives and those it sends (none on the last)."""

    index: int
    captured: Captured
    receives: List[str]
    sends: List[str]

    @property
    def params(self) -> Set[str]:
        return {source for kind, source in self.captured.inputs if kind == 'param'}


def _param_derived(captured: Captured) -> Set[torch.fx.Node]:
    """Nodes that read a parameter, directly or through other nodes."""
    placeholders = [n for n in captured.graph.nodes if n.op == 'placeholder']
    derived = {n for n, (kind, _) in zip(placeholders, captured.inputs) if kind == 'param'}
    for node in captured.graph.nodes:
        if node.op == 'call_function' and any(a in derived for a in node.all_input_nodes):
            derived.add(node)
    return derived


def chain(captured: Captured) -> List[torch.fx.Node]:
    """The ops a stage cut divides: every call_function node that reads a parameter."""
    derived = _param_derived(captured)
    return [n for n in captured.graph.nodes if n.op == 'call_function' and n in derived]


def planned_placements(node: torch.fx.Node, choice: Dict[str, Strategy], ndim: int) -> tuple:
    """The placements the plan gives ``node``'s output (a getitem: its producer's output)."""
    index = 0
    if node.target is operator.getitem:
        node, index = node.args[0], node.args[1]
    st = choice.get(node.name)
    want = st.outputs[index] if st is not None and index < len(st.outputs) else None
    return tuple(want) if want is not None else (Replicate(),) * ndim


def _crossing_spans(order: List[torch.fx.Node]) -> Dict[torch.fx.Node, Tuple[int, int]]:
    """``{value: (position made, last position read)}`` over the chain (the output node reads
    at position ``len(order)``)."""
    pos = {n: i for i, n in enumerate(order)}
    spans = {}
    for n in order:
        reads = [pos.get(u, len(order)) for u in n.users]
        if reads:
            spans[n] = (pos[n], max(reads))
    return spans


def valid_cuts(order: List[torch.fx.Node], choice: Dict[str, Strategy], ndim: int) -> List[bool]:
    """``ok[k]``: whether the chain may be cut after position k (module doc)."""
    bad = [0] * (len(order) + 1)
    for n, (made, last) in _crossing_spans(order).items():
        val = n.meta.get('val')
        sendable = (isinstance(val, torch.Tensor) and val.is_floating_point()
                    and not any(isinstance(p, Partial)
                                for p in planned_placements(n, choice, ndim)))
        if not sendable and last > made:
            bad[made] += 1
            bad[last] -= 1
    ok, running = [], 0
    for k in range(len(order) - 1):
        running += bad[k]
        ok.append(running == 0)
    return ok


def cut_chain(order: List[torch.fx.Node], weights: Sequence[float], ok: Sequence[bool],
              stages: int) -> List[str]:
    """The first node name of each stage: the valid cuts' segments cut by
    ``balanced_cut`` (a ValueError when there are fewer segments than stages)."""
    segments, start = [], 0
    for k in range(len(order)):
        if k == len(order) - 1 or ok[k]:
            segments.append(range(start, k + 1))
            start = k + 1
    if len(segments) < stages:
        raise ValueError(f'the graph has {len(segments) - 1} places where it can be cut into '
                         f'pipeline stages (a cut must pass only whole floating tensors that '
                         f'are not partial sums), fewer than the {stages - 1} that {stages} '
                         f'stages need; use fewer stages')
    seg_weights = [sum(weights[i] for i in seg) for seg in segments]
    ranges = balanced_cut(seg_weights, stages)
    return [order[segments[r.start].start].name for r in ranges]


def split(captured: Captured, starts: Sequence[str]) -> List[StageGraph]:
    """The stage graphs of a cut (``starts[s]``: the first chain node of stage s)."""
    order = chain(captured)
    pos = {n.name: i for i, n in enumerate(order)}
    missing = [s for s in starts if s not in pos]
    if missing or [pos[s] for s in starts] != sorted(pos[s] for s in starts) or \
            (starts and pos[starts[0]] != 0):
        raise ValueError(f'pipeline cut {list(starts)} does not name increasing positions of '
                         f'this graph\'s chain starting at its first op; plan the model again')
    bounds = [pos[s] for s in starts] + [len(order)]
    spans = _crossing_spans(order)
    stages = []
    for s in range(len(starts)):
        lo, hi = bounds[s], bounds[s + 1]
        receives = [n for n, (made, last) in spans.items() if made < lo <= last]
        sends = [] if s == len(starts) - 1 else \
            [n for n, (made, last) in spans.items() if made < hi <= last]
        stages.append(_stage_graph(captured, s, order[lo:hi], receives, sends,
                                   last=s == len(starts) - 1))
    return stages


def _stage_graph(captured: Captured, index: int, own: List[torch.fx.Node],
                 receives: List[torch.fx.Node], sends: List[torch.fx.Node],
                 last: bool) -> StageGraph:
    graph = captured.graph
    output = next(n for n in graph.nodes if n.op == 'output')
    members = set(own)
    frontier = list(own) + ([output] if last else [])
    received = set(receives)
    while frontier:          # the free ops this stage reads (recomputed here)
        node = frontier.pop()
        for arg in node.all_input_nodes:
            if arg.op == 'call_function' and arg not in members and arg not in received:
                members.add(arg)
                frontier.append(arg)
    new = torch.fx.Graph()
    env: Dict[torch.fx.Node, torch.fx.Node] = {}
    inputs: List[tuple] = []
    placeholders = [n for n in graph.nodes if n.op == 'placeholder']
    for node, entry in zip(placeholders, captured.inputs):
        if any(u in members or (last and u is output) for u in node.users):
            env[node] = new.node_copy(node)
            inputs.append(entry)
    for k, node in enumerate(receives):
        env[node] = new.placeholder(node.name)
        env[node].meta = copy.copy(node.meta)
        inputs.append(('boundary', k))
    for node in graph.nodes:
        if node in members:
            env[node] = new.node_copy(node, lambda a: env[a])
    if last:
        new.node_copy(output, lambda a: env[a])
    else:
        new.output(tuple(env[n] for n in sends))
    renamed = [(n.name, env[n].name) for n in env if n.name != env[n].name]
    if renamed:
        raise RuntimeError(f'stage {index}: nodes were renamed while copying: {renamed[:3]}')
    module = torch.fx.GraphModule(captured.graph_module, new)
    return StageGraph(index, Captured(module, inputs, captured.constants, captured.stamped),
                      [n.name for n in receives], [n.name for n in sends])


def stage_weights(space, cost, choice: Sequence[int]) -> Dict[str, float]:
    """Per op node name: its chosen strategy's compute seconds plus the forward and
    backward collectives of its input edges (what a stage holding it spends)."""
    weights = {d.name: float(cost._node_cost(i)[choice[i]])
               for i, d in enumerate(space.decisions) if d.kind == 'op'}
    for consumer, _, fwd, bwd in cost.chosen_edges(choice):
        if consumer.name in weights:
            weights[consumer.name] += cost.seconds(fwd) + cost.seconds(bwd)
    return weights


def plan_cut(space, cost, choice: Sequence[int], stages: int) -> dict:
    """``plan.pipeline`` of the solved ``choice``: the stage count, each stage's first chain
    node and its predicted seconds per micro-batch (forward + backward)."""
    captured = space.captured
    strategies = {d.name: d.strategies[c] for d, c in zip(space.decisions, choice)}
    order = chain(captured)
    weights_by_name = stage_weights(space, cost, choice)
    weights = [weights_by_name.get(n.name, 0.0) for n in order]
    ok = valid_cuts(order, strategies, len(space.mesh_shape))
    starts = cut_chain(order, weights, ok, stages)
    bounds = [order.index(next(n for n in order if n.name == s)) for s in starts] + [len(order)]
    seconds = [sum(weights[bounds[s]:bounds[s + 1]]) for s in range(stages)]
    return {'stages': stages, 'starts': starts, 'stage_seconds': seconds}


class Boundary:
    """The values one stage sends the next, packed as one flat tensor (module doc)."""

    def __init__(self, nodes: Sequence[torch.fx.Node], choice: Dict[str, Strategy], mesh):
        self.mesh = mesh
        self.metas = [n.meta['val'] for n in nodes]
        self.placements = [planned_placements(n, choice, mesh.ndim) for n in nodes]
        self.shapes = [local_shape(m.shape, mesh, p) for m, p in zip(self.metas, self.placements)]
        self.sizes = [int(torch.Size(s).numel()) for s in self.shapes]
        dtype = self.metas[0].dtype if self.metas else torch.float32
        for m in self.metas[1:]:
            dtype = torch.promote_types(dtype, m.dtype)
        self.dtype = dtype

    def pack(self, values: Sequence) -> torch.Tensor:
        pieces = []
        for value, want in zip(values, self.placements):
            if not isinstance(value, DTensor):
                value = DTensor.from_local(value, self.mesh, [Replicate()] * self.mesh.ndim,
                                           run_check=False)
            if tuple(value.placements) != want:
                value = value.redistribute(self.mesh, want)
            pieces.append(value.to_local().reshape(-1).to(self.dtype))
        return torch.cat(pieces)

    def unpack(self, flat: torch.Tensor) -> List[DTensor]:
        if flat.numel() != sum(self.sizes):
            raise ValueError(f'a stage received {flat.numel()} values where its boundary holds '
                             f'{sum(self.sizes)} ({len(self.sizes)} tensors)')
        out = []
        for piece, shape, meta, want in zip(flat.split(self.sizes), self.shapes, self.metas,
                                            self.placements):
            local = piece.view(shape).to(meta.dtype)
            out.append(DTensor.from_local(local, self.mesh, want, run_check=False,
                                          shape=meta.shape, stride=meta.stride()))
        return out


class StageRunner(GraphRunner):
    """A stage's graph over DTensors: the last stage returns the loss, the others the tuple
    of values they send."""

    def __init__(self, stage: StageGraph, mesh, choice, placeholders, last: bool):
        super().__init__(stage.captured, mesh, choice, placeholders)
        self.last = last

    def output(self, target, args, kwargs):
        if self.last:
            return super().output(target, args, kwargs)
        return tuple(args[0])


def stage_specs_of(count: int, size: int, rank: int) -> List[StageSpec]:
    """This pipeline rank's stages (stage s on rank s % P); ``layers`` is unused here."""
    return [StageSpec(s, count, range(0)) for s in range(count) if s % size == rank]
