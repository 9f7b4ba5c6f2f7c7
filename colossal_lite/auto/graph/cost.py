"""Prices of the search space: per-strategy compute and memory, per-edge redistribution.

**Compute** of a node, forward + backward = ``3 * flops / (rate * ways) + 3 * overhead``, where
``ways`` is the product of the mesh axes its output is Shard or Partial on (the work is split
there), ``rate`` the profile's FLOP rate and ``overhead`` its per-kernel time. Flops:
``2 M K N`` for mm/addmm (times the batch for bmm; ``2 S i o`` for a grouped expert matmul,
``experts.py``), ``4 B H Sq Sk D`` for attention, ``2 *
out * Cin/groups * prod(kernel)`` for convolution, the output's element count otherwise.

**Redistribution** of a tensor of B bytes from placements ``src`` to ``dst``, one mesh axis i
(size p, ranks ``stride_i`` apart) at a time, innermost axis first as DTensor does, with
``b`` = B over the other axes' Shard ways at that moment (what one rank holds there):

=============  ==============  ================
src -> dst     collective      buffer bytes
=============  ==============  ================
S -> R         all_gather      b
P -> R         all_reduce      b
P -> S         reduce_scatter  b
S(a) -> S(c)   all_to_all      b / p (all_gather b on CPU)
R -> S         (local slice)   0
x -> P         not allowed     (infinite)
=============  ==============  ================

Time is ``ClusterProfile.group_time(op, bytes, stride_i, p)`` (α-β); a parameter's
gradient all_reduce is priced ``β b`` alone, since the lowered program sends all of them in
one bucket (``buckets.py``; its one α a step is not priced). A parameter's gradient comes back
through its *tree*: the parameter, the views of it (``t``, ``permute``, ``view``, ...) and the lookups
into it (``embedding``): a gradient stays Partial through them, and their edges to other ops
(and into the lookups) are its *uses*, priced bucketed. A parameter
with two or more uses (a tied embedding and LM head) has its Partial gradients summed before
the one all_reduce, so that all_reduce is priced once, on the parameter, on each axis the
parameter is replicated on (its uses' edges price no all_reduce); the one plan this
over-charges, none of its uses splitting work on that axis, has the charge taken back in the
reported prediction (:meth:`GraphCost.shared_overcharge`, :meth:`GraphCost.comm_bytes`). **Backward** of an edge
moves the gradient the other way: the consumer's input gradient is ``S`` where the input was
``S``, ``R`` where it was ``P``, and ``P`` where it was ``R`` and the consumer splits its work
on that axis (else ``R``); it is redistributed to the producer's placements with any ``P``
read as ``R``. Parameters are priced the same way (their ``P`` gradient is all-reduced: data
parallelism's gradient sum).

**Memory** per rank (``liveness.py``): a plan's prediction is the step's peak
(:meth:`GraphCost.peak_memory`), ``held + max(s P + J, (s + 2) P, (s + 1) P + 3 p)`` -- the
local parameters, buffers and inputs, the ``s`` optimizer states of the ``P`` parameter bytes,
and the largest of the joint program's liveness peak ``J`` (what autograd saves, at the
placements the ops read it, moved copies included, then the backward's gradients), the
lowered backward's two gradient copies, and the optimizer step's temporaries. The solver
budgets a per-node part of it (:meth:`GraphCost.memory`: a parameter ``s bytes / ways``, plus
its weight unless an op saves it; an op, what it saves at its own placements);
``api.search`` checks the solution's peak and re-solves with the linear budget moved by the
peak's miss.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.distributed.tensor import Partial, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from ..cluster import ClusterProfile
from .solver import Edge, Problem
from .space import Space
from .plan import names
from .strategies import VIEW_OPS
from .experts import grouped_mm_flops, is_grouped_mm
from .local_rules import inner_collectives, whole_grad_slots
from .liveness import Liveness

aten = torch.ops.aten
INF = math.inf     # an impossible redistribution (to Partial): a forbidden pair
ALIASES = VIEW_OPS | {aten.permute.default, aten.t.default, aten.transpose.int,
                      aten.slice.Tensor, aten.alias.default, aten.select.int,
                      aten.split.Tensor, aten.split_with_sizes.default}
# ops whose gradient with respect to their table input DTensor carries back Partial
LOOKUPS = {aten.embedding.default}


def _numel(t: torch.Tensor) -> int:
    return int(math.prod(t.shape))


def _nbytes(t: torch.Tensor) -> int:
    return _numel(t) * t.element_size()


def flops(node: torch.fx.Node) -> float:
    """Forward FLOPs of one node (see the module doc)."""
    out = node.meta.get('val')
    op = node.target
    args = [a.meta.get('val') if isinstance(a, torch.fx.Node) else a for a in node.args]
    if op in (aten.mm.default, aten.addmm.default):
        a, b = (args[1], args[2]) if op is aten.addmm.default else (args[0], args[1])
        return 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
    if op is aten.bmm.default:
        a, b = args[0], args[1]
        return 2.0 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
    if is_grouped_mm(op):
        return grouped_mm_flops(node)
    if op is aten.scaled_dot_product_attention.default:
        q, k = args[0], args[1]
        return 4.0 * _numel(q) * k.shape[-2]
    if op is aten.convolution.default:
        w = args[1]
        return 2.0 * _numel(out) * _numel(w[0]) / max(1, args[8] if len(args) > 8 else 1)
    if isinstance(out, torch.Tensor):
        return float(_numel(out))
    if isinstance(out, (tuple, list)):
        return float(sum(_numel(o) for o in out if isinstance(o, torch.Tensor)))
    return 0.0


def _classes(items: list) -> Tuple[np.ndarray, list]:
    """(class index of each item, the distinct items in first-seen order)."""
    index: Dict[object, int] = {}
    ids = [index.setdefault(x, len(index)) for x in items]
    return np.asarray(ids, dtype=np.int64), list(index)


def _ways(placements, mesh_shape) -> int:
    ways = 1
    for p, k in zip(placements, mesh_shape):
        if isinstance(p, (Shard, _StridedShard, Partial)):
            ways *= k
    return ways


def _grad_basis(d, slot: int, code) -> tuple:
    """The consumer output placements the dual rule reads for input ``slot`` (``code``:
    the consumer strategy's ``(ins, outs, out)`` names): partial axes count as replicated
    for a slot whose gradient a local rule gives whole there (``whole_grad_slots``)."""
    out = code[2]
    if code[3] and slot in whole_grad_slots(d.node):
        return tuple('R' if p == 'P' else p for p in out)
    return out


class GraphCost:
    """See the module doc. ``states``: optimizer buffers per parameter element;
    ``all_to_all=False`` prices a Shard -> Shard move as DTensor runs it on CPU process
    groups (all_gather of the axis, then a local chunk)."""

    def __init__(self, space: Space, cluster: ClusterProfile, states: int = 2,
                 all_to_all: bool = True):
        self.space = space
        self.all_to_all = all_to_all
        self.cluster = cluster
        self.states = states
        self.mesh_shape = space.mesh_shape
        self.strides = [int(math.prod(self.mesh_shape[i + 1:])) for i in range(len(self.mesh_shape))]
        self._steps: Dict[tuple, tuple] = {}
        self._matrices: Dict[tuple, np.ndarray] = {}
        self._names: Dict[int, List[tuple]] = {}
        self._strategy_names: Dict[int, tuple] = {}   # id(Strategy) -> its names
        self._compute: Dict[int, np.ndarray] = {}
        self._liveness: Optional[Liveness] = None
        self._trees: Optional[Dict[int, int]] = None
        self._from_param: Optional[List[bool]] = None
        self._uses: Dict[int, List[Tuple[int, int, int]]] = {}
        self.overhead = float(cluster.compute.get('kernel_overhead_s', 0.0)) \
            if isinstance(cluster.compute, dict) else 0.0

    # ------------------------------------------------------------------ collectives
    # placements travel as names here ('R', 'S<d>', 'P'): hashing them is cheap
    def collectives(self, nbytes: int, src, dst) -> Optional[List[Tuple[str, int, int]]]:
        """``(op, axis, buffer bytes)`` turning ``src`` into ``dst`` for a tensor of
        ``nbytes``; None if impossible. Axes are converted innermost first (DTensor's
        order), each at the sharding the other axes have at that moment."""
        if any(s != d and (d[0] == 'P' or ':' in s or ':' in d) for s, d in zip(src, dst)):
            return None        # no Partial is made by a move; strided ones never move
        steps = []
        now = list(src)
        for axis in reversed(range(len(now))):
            s, d, k = now[axis], dst[axis], self.mesh_shape[axis]
            if s == d or k == 1:
                now[axis] = d
                continue
            other = 1
            for j, (p, kj) in enumerate(zip(now, self.mesh_shape)):
                if j != axis and p[0] == 'S':
                    other *= kj
            b = nbytes // other
            if s[0] == 'S' and d[0] == 'S':
                steps.append(('all_to_all', axis, b // k) if self.all_to_all
                             else ('all_gather', axis, b))
            elif s[0] == 'S':
                steps.append(('all_gather', axis, b))
            elif s[0] == 'P':
                steps.append(('all_reduce' if d == 'R' else 'reduce_scatter', axis, b))
            now[axis] = d
        return steps

    def seconds(self, steps, latency: bool = True) -> float:
        if steps is None:
            return INF
        return sum(self.cluster.group_time(op, b, self.strides[a], self.mesh_shape[a], latency)
                   for op, a, b in steps)

    @staticmethod
    def _grad_placements(dst, consumer_out) -> tuple:
        return tuple('R' if d[0] == 'P' else ('P' if o[0] in 'SP' else 'R') if d == 'R' else d
                     for d, o in zip(dst, consumer_out))

    def edge_steps(self, nbytes: int, src, dst, consumer_out, needs_grad: bool,
                   bucketed: bool = False, shared: bool = False):
        """Forward and backward collectives of one edge (None when impossible) and their
        time; ``bucketed``: an edge out of a parameter's tree, whose gradient all_reduce rides
        in the lowered program's one bucket (``buckets.py``): priced by bandwidth alone;
        ``shared``: a use of a parameter with several, whose all_reduce the parameter prices
        (module doc): none here."""
        key = (nbytes, src, dst, consumer_out, needs_grad, bucketed, shared)
        hit = self._steps.get(key)
        if hit is None:
            fwd = self.collectives(nbytes, src, dst)
            bwd = []
            if fwd is not None and needs_grad:
                want = tuple('R' if p[0] == 'P' else p for p in src)
                bwd = self.collectives(nbytes, self._grad_placements(dst, consumer_out),
                                       want) or []
                if shared:
                    bwd = [step for step in bwd if step[0] != 'all_reduce']
            back = sum(self.seconds([step], not (bucketed and step[0] == 'all_reduce'))
                       for step in bwd)
            hit = self._steps[key] = (fwd, bwd, INF if fwd is None else
                                      self.seconds(fwd) + back)
        return hit

    # ------------------------------------------------------------------ parameter trees
    @property
    def trees(self) -> Dict[int, int]:
        """Decision -> the parameter whose tree holds it: the parameter, and each view op
        whose one tensor input is in the tree (module doc)."""
        if self._trees is None:
            root: Dict[int, int] = {}
            for j, d in enumerate(self.space.decisions):
                if d.kind == 'param':
                    root[j] = j
                elif d.kind == 'op' and d.node.target in ALIASES:
                    inputs = [p for p in d.producers if p is not None]
                    if len(inputs) == 1 and inputs[0][0] in root:
                        root[j] = root[inputs[0][0]]
                elif d.kind == 'op' and d.node.target in LOOKUPS and d.producers[0] is not None \
                        and d.producers[0][0] in root:
                    root[j] = root[d.producers[0][0]]
            self._trees = root
            for j, d in enumerate(self.space.decisions):
                view = j in root and d.node.target in ALIASES
                for slot, prod in enumerate(d.producers):
                    if prod is not None and prod[0] in root and not view:
                        self._uses.setdefault(root[prod[0]], []).append((prod[0], j, slot))
        return self._trees

    def shared(self, i: int) -> bool:
        """Whether parameter decision i has two or more uses whose gradients it sums."""
        d = self.space.decisions[i]
        return (d.kind == 'param' and self.trees.get(i) == i and len(self._uses.get(i, ())) > 1
                and self._needs_grad(i, self.space.output_meta(i, 0)))

    def _edge_kind(self, i: int, j: int) -> Tuple[bool, bool]:
        """(bucketed, shared) of the edge from decision i to decision j (``edge_steps``)."""
        root = self.trees.get(i)
        if root is None:
            return False, False
        view = j in self.trees and self.space.decisions[j].node.target in ALIASES
        return True, not view and self.shared(root)

    def _shared_steps(self, i: int, code) -> list:
        """The all_reduces of shared parameter i's summed gradient at its placements
        ``code`` (output names): one per axis it is replicated on."""
        src = code[1][0]
        partial = tuple('P' if p == 'R' else p for p in src)
        return self.collectives(_nbytes(self.space.output_meta(i, 0)), partial, src) or []

    def _reduced_axes(self, i: int, choice: Sequence[int]) -> set:
        """Axes on which a use of shared parameter i gives back a Partial gradient to a
        replicated tree node under ``choice``: where its all_reduce really runs."""
        axes = set()
        for t, j, slot in self._uses[i]:
            d = self.space.decisions[j]
            code = self._codes(j)[choice[j]]
            src = self._codes(t)[choice[t]][1][d.producers[slot][1]]
            grad = self._grad_placements(code[0][slot], _grad_basis(d, slot, code))
            axes.update(a for a, (g, s) in enumerate(zip(grad, src)) if g == 'P' and s == 'R')
        return axes

    def _shared_split(self, choice: Sequence[int]) -> Tuple[list, list]:
        """(the shared all_reduces ``choice`` runs, those the objective charges but it never
        runs), over every shared parameter."""
        run, unrun = [], []
        for i in range(len(self.space)):
            if self.shared(i):
                reduced = self._reduced_axes(i, choice)
                for step in self._shared_steps(i, self._codes(i)[choice[i]]):
                    (run if step[1] in reduced else unrun).append(step)
        return run, unrun

    def shared_overcharge(self, choice: Sequence[int]) -> float:
        """Seconds the solver's objective charges for shared all_reduces that ``choice``
        never runs (no use splits work on the axis): taken off the reported prediction."""
        return self.seconds(self._shared_split(choice)[1], False)

    # ------------------------------------------------------------------ per decision
    def _loss_steps(self, strategy_codes) -> list:
        """The loss's gather to every rank (``full_tensor``) from its producer's output."""
        i, out = self.space.loss
        meta = self.space.output_meta(i, out)
        rep = tuple('R' for _ in self.mesh_shape)
        return self.edge_steps(_nbytes(meta), strategy_codes[1][out], rep, rep, False)[0]

    def node_cost(self, i: int) -> np.ndarray:
        cost = self._node_cost(i)
        if self.shared(i):
            cost = cost + np.asarray([self.seconds(self._shared_steps(i, c), False)
                                      for c in self._codes(i)])
        if i == self.space.loss[0]:
            cost = cost + np.asarray([self.seconds(self._loss_steps(c)) for c in self._codes(i)])
        return cost

    def _node_cost(self, i: int) -> np.ndarray:
        """Compute seconds of decision i per strategy (no loss gather); made once."""
        if i not in self._compute:
            self._compute[i] = self._compute_cost(i)
        return self._compute[i]

    def _compute_cost(self, i: int) -> np.ndarray:
        d = self.space.decisions[i]
        if d.kind != 'op':
            return np.zeros(len(d.strategies))
        f = flops(d.node)
        if d.node.target in ALIASES:
            return np.zeros(len(d.strategies))
        costs = []
        for st, code in zip(d.strategies, self._codes(i)):
            out = st.outputs[0] if st.outputs and st.outputs[0] is not None else ()
            ways = _ways(out, self.mesh_shape) if out else 1
            costs.append(3.0 * f / (self.cluster.flops * ways) + 3.0 * self.overhead
                         + self.seconds(self._inner(d.node, code[0])))
        return np.asarray(costs)

    def _inner(self, node: torch.fx.Node, inputs) -> list:
        """Collectives an op issues inside itself (the class-split log_softmax)."""
        return inner_collectives(node, inputs, self.mesh_shape)

    @property
    def liveness(self) -> Liveness:
        if self._liveness is None:
            # CPU process groups (no all_to_all) mean a CPU program: its matmuls on oneDNN
            self._liveness = Liveness(self.space, self.states, self.all_to_all,
                                      onednn=not self.all_to_all)
        return self._liveness

    def memory(self, i: int, shared: bool = True) -> np.ndarray:
        """The solver's per-node memory of decision i, per strategy (module doc;
        ``shared=False``: the conservative sum, ``Liveness.node_memory``)."""
        return np.asarray(self.liveness.node_memory(i, [c[:2] for c in self._codes(i)],
                                                    shared))

    def peak_memory(self, choice: Sequence[int]) -> dict:
        """The step's peak per rank of a choice (module doc) and its parts: ``peak``,
        ``held``, ``params``, ``joint``, ``forward_end``, ``phase``."""
        return self.liveness.peak([self._codes(i)[c][:2] for i, c in enumerate(choice)])

    def _needs_grad(self, producer: int, meta: torch.Tensor) -> bool:
        """Whether a floating output of decision ``producer`` gets a gradient: a parameter's,
        or an op's that reads (through any chain) a parameter; values made from buffers,
        constants and inputs alone (rotary tables, masks) get none."""
        return meta.is_floating_point() and self._reaches_param(producer)

    def _reaches_param(self, i: int) -> bool:
        if self._from_param is None:
            flags = []
            for d in self.space.decisions:
                flags.append(d.kind == 'param' or (d.kind == 'op' and any(
                    p is not None and flags[p[0]] for p in d.producers)))
            self._from_param = flags
        return self._from_param[i]

    def _codes(self, i: int):
        """Per strategy of decision i: (input names per slot, output names per output,
        the consumer-side output names used for gradient duals, whether it runs locally). Repeated blocks share
        their Strategy objects, so the names are made once per object."""
        if i not in self._names:
            self._names[i] = [self._strategy_code(st)
                              for st in self.space.decisions[i].strategies]
        return self._names[i]

    def _strategy_code(self, st) -> tuple:
        code = self._strategy_names.get(id(st))
        if code is None:
            ins = tuple(None if p is None else tuple(names(p)) for p in st.inputs)
            outs = tuple(None if p is None else tuple(names(p)) for p in st.outputs)
            rep = tuple('R' for _ in self.mesh_shape)
            code = (ins, outs, outs[0] if outs and outs[0] is not None else rep, st.local)
            self._strategy_names[id(st)] = code
        return code

    def edges(self) -> List[Edge]:
        """One cost matrix [producer strategies, consumer strategies] per tensor input,
        built over the distinct placements on each side."""
        edges = []
        for j, d in enumerate(self.space.decisions):
            cons = self._codes(j)
            for slot, prod in enumerate(d.producers):
                if prod is None:
                    continue
                i, out = prod
                meta = self.space.output_meta(i, out)
                nbytes, grad = _nbytes(meta), self._needs_grad(i, meta)
                bucketed, shared = self._edge_kind(i, j)
                src_ids, srcs = _classes([c[1][out] for c in self._codes(i)])
                dst_ids, dsts = _classes([(c[0][slot], _grad_basis(d, slot, c))
                                          for c in cons])
                key = (nbytes, grad, bucketed, shared, tuple(srcs), tuple(dsts))
                small = self._matrices.get(key)
                if small is None:   # repeated blocks share their edges' matrices
                    small = self._matrices[key] = np.array(
                        [[self.edge_steps(nbytes, src, dst, out_of, grad, bucketed, shared)[2]
                          for dst, out_of in dsts] for src in srcs])
                edges.append(Edge(i, j, small[np.ix_(src_ids, dst_ids)]))
        return edges

    def problem(self, budget: Optional[float] = None, groups=()) -> Problem:
        n = len(self.space)
        return Problem(node_costs=[self.node_cost(i) for i in range(n)], edges=self.edges(),
                       memory=[self.memory(i) for i in range(n)], budget=budget,
                       groups=list(groups))

    def chosen_edges(self, choice: Sequence[int]):
        """``(consumer, producer, forward steps, backward steps)`` of every edge of a choice."""
        for j, d in enumerate(self.space.decisions):
            code = self._codes(j)[choice[j]]
            ins = code[0]
            for slot, prod in enumerate(d.producers):
                if prod is None:
                    continue
                i, o = prod
                meta = self.space.output_meta(i, o)
                src = self._codes(i)[choice[i]][1][o]
                fwd, bwd, _ = self.edge_steps(_nbytes(meta), src, ins[slot],
                                              _grad_basis(d, slot, code),
                                              self._needs_grad(i, meta), *self._edge_kind(i, j))
                yield d, self.space.decisions[i], fwd or [], bwd or []

    def moves(self, choice: Sequence[int], axis_names: Sequence[str]) -> Dict[str, List[str]]:
        """Per op node, the forward collectives the plan inserts before it, as text."""
        out: Dict[str, List[str]] = {}
        for consumer, producer, fwd, _ in self.chosen_edges(choice):
            for op, axis, b in fwd:
                out.setdefault(consumer.name, []).append(
                    f'{op}({axis_names[axis]}, {b} B) of {producer.name}')
        return out

    def comm_bytes(self, choice: Sequence[int]) -> Dict[str, int]:
        """Predicted buffer bytes per collective for one step (forward + backward)."""
        out: Dict[str, int] = {}
        for _, _, fwd, bwd in self.chosen_edges(choice):
            for op, _, b in fwd + bwd:
                out[op] = out.get(op, 0) + b
        for i, d in enumerate(self.space.decisions):
            if d.kind == 'op':
                for op, _, b in self._inner(d.node, self._codes(i)[choice[i]][0]):
                    out[op] = out.get(op, 0) + b
        loss = self.space.loss[0]
        for op, _, b in self._loss_steps(self._codes(loss)[choice[loss]]) or []:
            out[op] = out.get(op, 0) + b
        for op, _, b in self._shared_split(choice)[0]:
            out[op] = out.get(op, 0) + b
        return out
