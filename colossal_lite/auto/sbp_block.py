"""The AutoDDL-style engine on a whole transformer block, forward and backward
(docs/planner_autoddl.md; the states, kinds, duality and step costs are in ``auto/sbp.py``).

A pre-LN block on ``tokens x hidden`` activations (``h`` = hidden, ``f`` = ffn ratio)::

    x [layer] -> qkv (h x 3h) -> core -> out (h x h) -> + residual -> h1 [mid]
    h1 [mid]  -> fc1 (h x fh) -> act (GeLU) -> fc2 (fh x h) -> + residual -> y [layer]

A plan gives one value per mesh axis to each variable: ``qkv``, ``out``, ``fc1``, ``fc2``
a matmul kind (M, N, K); ``core`` (attention on Q, K, V) and ``act`` (the GeLU) a state
without ``P`` (S0, S1, B: neither is linear); ``layer`` and ``mid`` the residual stream's
state, split on every axis (S0 or S1, AutoDDL's rule for LayerNorm and dropout; the
LayerNorm's per-token statistics reductions under S1 are ignored). ``y`` is the next,
identical block's ``x``, so both ends share ``layer``. Forward conversions (edges):

=================  ================  ====================  ==========
edge               tensor            from -> to            elements
=================  ================  ====================  ==========
layer -> qkv       LN(x)             layer -> X(qkv)       t h
qkv -> core        Q, K, V           Y(qkv) -> core        3 t h
core -> out        context           core -> X(out)        t h
out -> mid         attention output  Y(out) -> mid         t h
layer -> mid       residual x        layer -> mid          t h
mid -> fc1         LN(h1)            mid -> X(fc1)         t h
fc1 -> act         fc1 output        Y(fc1) -> act         f t h
act -> fc2         GeLU output       act -> X(fc2)         f t h
fc2 -> layer       MLP output        Y(fc2) -> layer       t h
mid -> layer       residual h1       mid -> layer          t h
=================  ================  ====================  ==========

Backward: every edge's dual conversion on the gradient (``sbp.transfer_backward``; the
two gradients of a residual meet in the same split state, so their sum is local) and, once
per step, each weight's gradient reduced over its ``M`` axes (``sbp.weight_grad``; weights
only: biases and LayerNorm parameters, O(h) each, are not counted). Every weight must be
split at least ``min_split`` ways (memory).

Search: :func:`coordinate_descent` (AutoDDL's), :func:`exact_dp` (given ``layer`` and
``mid`` the attention and MLP chains are independent; each chain is a min-plus product of
its edge tables, so the minimum is exact) and :func:`exhaustive` (every plan's cost
materialized in one array, for meshes of a few devices).
"""
from __future__ import annotations

import itertools
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np

from .sbp import (CORE_STATES, KINDS, OUT_STATES, X_STATE, Y_STATE, Links, meshes,
                  transfer, transfer_backward, weight_grad, weight_split)

VARS = ('layer', 'qkv', 'core', 'out', 'mid', 'fc1', 'act', 'fc2')
MATMULS = ('qkv', 'out', 'fc1', 'fc2')
VALUES = {'layer': OUT_STATES, 'mid': OUT_STATES, 'core': CORE_STATES,
          'act': CORE_STATES, **{m: KINDS for m in MATMULS}}
ATTENTION = ('layer', 'qkv', 'core', 'out', 'mid')
MLP = ('mid', 'fc1', 'act', 'fc2', 'layer')
Plan = Dict[str, Tuple[str, ...]]
LinksArg = Union[None, Links, Callable[[Tuple[int, ...]], Links]]


class BlockShape(NamedTuple):
    """A block's sizes: ``tokens`` (batch x sequence of one step), ``hidden``, ``ffn``."""
    tokens: float
    hidden: float
    ffn: int = 4


def edges(block: BlockShape) -> List[Tuple[str, str, float]]:
    """The forward conversions ``(from variable, to variable, tensor elements)``."""
    x, f = block.tokens * block.hidden, block.ffn
    return [('layer', 'qkv', x), ('qkv', 'core', 3 * x), ('core', 'out', x),
            ('out', 'mid', x), ('layer', 'mid', x), ('mid', 'fc1', x),
            ('fc1', 'act', f * x), ('act', 'fc2', f * x), ('fc2', 'layer', x),
            ('mid', 'layer', x)]


def weights(block: BlockShape) -> Dict[str, float]:
    """Each matmul's weight elements (``h x 3h``, ``h x h``, ``h x fh``, ``fh x h``)."""
    h2 = block.hidden * block.hidden
    return {'qkv': 3 * h2, 'out': h2, 'fc1': block.ffn * h2, 'fc2': block.ffn * h2}


def _as_src(var: str, value: Tuple[str, ...]) -> Tuple[str, ...]:
    """A variable's state as the source of an edge (a matmul's output ``Y``)."""
    return tuple(Y_STATE[k] for k in value) if var in MATMULS else tuple(value)


def _as_dst(var: str, value: Tuple[str, ...]) -> Tuple[str, ...]:
    """A variable's state as the destination of an edge (a matmul's input ``X``)."""
    return tuple(X_STATE[k] for k in value) if var in MATMULS else tuple(value)


def _edge(mesh, a, va, b, vb, n, links, backward) -> float:
    """Forward (and with ``backward`` its dual) cost of one edge."""
    src, dst = _as_src(a, va), _as_dst(b, vb)
    cost = transfer(n, mesh, src, dst, links)
    return cost + (transfer_backward(n, mesh, src, dst, links) if backward else 0.0)


def block_traffic(mesh: Sequence[int], plan: Plan, block: BlockShape,
                  links: Optional[Links] = None) -> Dict[str, float]:
    """Per device, one step: ``forward`` and ``backward`` activation traffic and the
    ``weight_grad`` reduction, in elements received (or seconds under ``links``)."""
    mesh = tuple(mesh)
    out = {'forward': 0.0, 'backward': 0.0, 'weight_grad': 0.0}
    for a, b, n in edges(block):
        src, dst = _as_src(a, plan[a]), _as_dst(b, plan[b])
        out['forward'] += transfer(n, mesh, src, dst, links)
        out['backward'] += transfer_backward(n, mesh, src, dst, links)
    for m, n in weights(block).items():
        out['weight_grad'] += weight_grad(n, mesh, plan[m], links)
    return out


def fits(mesh: Sequence[int], plan: Plan, min_split: int) -> bool:
    """Every weight split at least ``min_split`` ways."""
    return all(weight_split(mesh, plan[m]) >= min_split for m in MATMULS)


def block_cost(mesh: Sequence[int], plan: Plan, block: BlockShape,
               links: Optional[Links] = None, backward: bool = True, min_split: int = 1
               ) -> float:
    """The search's objective: forward (+ backward + weight gradients) traffic or time;
    infinite when a weight is split fewer than ``min_split`` ways."""
    if not fits(mesh, plan, min_split):
        return float('inf')
    t = block_traffic(mesh, plan, block, links)
    return t['forward'] + (t['backward'] + t['weight_grad'] if backward else 0.0)


def choices(mesh: Sequence[int], var: str, canonical: bool = True) -> List[Tuple[str, ...]]:
    """A variable's values on ``mesh``; ``canonical`` keeps one value on axes of size 1
    (no collective runs there and no split happens, so the cost cannot depend on it)."""
    per_axis = [VALUES[var][:1] if canonical and p == 1 else VALUES[var] for p in mesh]
    return list(itertools.product(*per_axis))


def _tables(mesh, block, links, backward, min_split, canonical=True):
    """Every edge's cost table over (from value, to value), each matmul's unary table
    (weight-gradient cost, infinite below ``min_split``), and the value lists."""
    vals = {v: choices(mesh, v, canonical) for v in VARS}
    pair = {}
    for a, b, n in edges(block):
        pair[a, b] = np.array([[_edge(mesh, a, va, b, vb, n, links, backward)
                                for vb in vals[b]] for va in vals[a]])
    unary = {v: np.zeros(len(vals[v])) for v in VARS}
    for m, n in weights(block).items():
        for i, k in enumerate(vals[m]):
            wg = weight_grad(n, mesh, k, links) if backward else 0.0
            unary[m][i] = wg if weight_split(mesh, k) >= min_split else float('inf')
    return vals, pair, unary


def _chain(chain: Sequence[str], pair, unary):
    """Min-plus product along ``chain`` (v0, ..., vk): ``cost[i0, ik]`` = the cheapest
    inner values for those ends (edges plus the inner variables' unary terms), and per
    inner variable its argmin table ``[i0, next]`` for :func:`_trace`."""
    a, b = chain[0], chain[1]
    cost = pair[a, b] + unary[b][None, :]
    back = []
    for a, b in zip(chain[1:-1], chain[2:]):
        total = cost[:, :, None] + pair[a, b][None, :, :]
        back.append(total.argmin(axis=1))
        cost = total.min(axis=1) + (unary[b][None, :] if b != chain[-1] else 0.0)
    return cost, back


def _trace(chain, back, i0: int, ik: int) -> Dict[str, int]:
    """The inner values of ``chain``'s cheapest path between ends ``i0`` and ``ik``."""
    idx, nxt = {chain[0]: i0, chain[-1]: ik}, ik
    for j in reversed(range(len(back))):
        nxt = int(back[j][i0, nxt])
        idx[chain[j + 1]] = nxt
    return idx


def exact_dp(mesh: Sequence[int], block: BlockShape, links: Optional[Links] = None,
             backward: bool = True, min_split: int = 1) -> Tuple[float, Plan]:
    """The optimum, exactly: for each (``layer``, ``mid``) the attention chain
    layer-qkv-core-out-mid and the MLP chain mid-fc1-act-fc2-layer share no variable, so
    each is minimized alone (:func:`_chain`), plus the two residual edges."""
    mesh = tuple(mesh)
    vals, pair, unary = _tables(mesh, block, links, backward, min_split)
    att, att_back = _chain(ATTENTION, pair, unary)             # [layer, mid]
    mlp, mlp_back = _chain(MLP, pair, unary)                   # [mid, layer]
    total = att + mlp.T + pair['layer', 'mid'] + pair['mid', 'layer'].T
    l, m = (int(i) for i in np.unravel_index(np.argmin(total), total.shape))
    idx = {**_trace(ATTENTION, att_back, l, m), **_trace(MLP, mlp_back, m, l)}
    return float(total[l, m]), {v: vals[v][idx[v]] for v in VARS}


def _spread(table, i: int, j: int, ndim: int):
    """``table[value_i, value_j]`` as an array broadcasting over ``ndim`` variables."""
    if i > j:
        table, i, j = table.T, j, i
    shape = [1] * ndim
    shape[i], shape[j] = table.shape
    return table.reshape(shape)


def exhaustive(mesh: Sequence[int], block: BlockShape, links: Optional[Links] = None,
               backward: bool = True, min_split: int = 1, limit: int = 2 * 10 ** 7
               ) -> Tuple[float, Plan]:
    """Every plan (all values on every axis, size-1 axes included): the cost of each
    combination of the eight variables in one array, then its minimum."""
    mesh = tuple(mesh)
    vals, pair, unary = _tables(mesh, block, links, backward, min_split, canonical=False)
    shape = [len(vals[v]) for v in VARS]
    if np.prod(shape) > limit:
        raise ValueError(f'{int(np.prod(shape))} plans on mesh {mesh}: use exact_dp')
    total = np.zeros(shape)
    for (a, b), table in pair.items():
        total += _spread(table, VARS.index(a), VARS.index(b), len(VARS))
    for i, v in enumerate(VARS):
        total += unary[v].reshape([-1 if j == i else 1 for j in range(len(VARS))])
    idx = np.unravel_index(np.argmin(total), total.shape)
    return float(total[idx]), {v: vals[v][int(i)] for v, i in zip(VARS, idx)}


def _better(c: float, ref: float) -> bool:
    """``c`` is below ``ref`` by more than rounding (relative: costs may be seconds)."""
    return c < ref and (ref == float('inf') or ref - c > 1e-12 * abs(ref))


def _plan_cost(mesh, block, links, backward, min_split) -> Callable[[Plan], float]:
    """:func:`block_cost` as a function of the plan, with each edge's and each weight's
    term remembered (a descent re-prices the same terms many times)."""
    memo: Dict[tuple, float] = {}
    sizes, wsizes = edges(block), weights(block)

    def term(key, compute):
        if key not in memo:
            memo[key] = compute()
        return memo[key]

    def cost(plan: Plan) -> float:
        if not fits(mesh, plan, min_split):
            return float('inf')
        total = sum(term((a, plan[a], b, plan[b]), lambda: _edge(
            mesh, a, plan[a], b, plan[b], n, links, backward)) for a, b, n in sizes)
        if backward:
            total += sum(term((m, plan[m]), lambda: weight_grad(n, mesh, plan[m], links))
                         for m, n in wsizes.items())
        return total
    return cost


def _descend(plan: Plan, vals, cost_of) -> Tuple[float, Plan]:
    """From ``plan``, set one variable at a time to any value that lowers the whole
    plan's cost, sweeping all variables until a sweep changes nothing."""
    cost = cost_of(plan)
    improved = True
    while improved:
        improved = False
        for var in VARS:
            for value in vals[var]:
                trial = dict(plan, **{var: value})
                c = cost_of(trial)
                if _better(c, cost):
                    plan, cost, improved = trial, c, True
    return cost, plan


def coordinate_descent(mesh: Sequence[int], block: BlockShape, links: Optional[Links] = None,
                       backward: bool = True, min_split: int = 1) -> Tuple[float, Plan]:
    """AutoDDL's search: :func:`_descend` from every start -- all four matmuls of one
    kind tuple, the residual stream (``layer`` and ``mid``) in one split state, ``core``
    and ``act`` at their first value -- and the best result. (Starting the stream in each
    state matters: ``layer`` and ``mid`` are tied by the two residual edges, so a single
    move cannot carry the stream from one state to another.)"""
    mesh = tuple(mesh)
    vals = {v: choices(mesh, v) for v in VARS}
    cost_of = _plan_cost(mesh, block, links, backward, min_split)
    best: Tuple[float, Optional[Plan]] = (float('inf'), None)
    for kinds, stream in itertools.product(vals['qkv'], vals['layer']):
        plan = {v: vals[v][0] for v in VARS}
        plan.update({m: kinds for m in MATMULS}, layer=stream, mid=stream)
        cost, plan = _descend(plan, vals, cost_of)
        if _better(cost, best[0]):
            best = (cost, plan)
    return best


def megatron_plan(axes: int = 2) -> Plan:
    """Megatron with sequence parallelism on a mesh (data..., tensor): the last axis runs
    qkv and fc1 by columns (N), out and fc2 by rows (K), heads and the GeLU split there,
    the residual stream split by features on it (so an all_gather before each column
    matmul and a reduce_scatter after each row matmul: one all_reduce's traffic each);
    every other axis is data parallel (M, tokens split)."""
    data = ('M',) * (axes - 1)
    split = ('S0',) * (axes - 1) + ('S1',)
    return {'layer': split, 'qkv': data + ('N',), 'core': split, 'out': data + ('K',),
            'mid': split, 'fc1': data + ('N',), 'act': split, 'fc2': data + ('K',)}


def data_parallel_plan(axes: int = 1) -> Plan:
    """Every matmul data parallel on every axis, every tensor split by tokens."""
    return {v: ('M',) * axes if v in MATMULS else ('S0',) * axes for v in VARS}


def node_links(mesh: Sequence[int], devices_per_node: int, intra: Tuple[float, float],
               inter: Tuple[float, float], elem_bytes: int = 2) -> Links:
    """Per-axis links of a mesh laid out with its last axis innermost (ranks ``[kG,
    (k+1)G)`` on one node): an axis whose group spans more than a node gets ``inter``."""
    out = []
    for a, p in enumerate(mesh):
        stride = int(np.prod(mesh[a + 1:])) if a + 1 < len(mesh) else 1
        out.append(intra if stride * p <= devices_per_node else inter)
    return Links(tuple(out), elem_bytes)


def search(devices: int, block: BlockShape, axes: int = 2, links: LinksArg = None,
           min_split: int = 1, backward: bool = True, method=exact_dp
           ) -> Tuple[float, Tuple[int, ...], Plan]:
    """(cost, mesh, plan): the best plan over every mesh of ``axes`` axes; ``links`` is
    None (elements), one :class:`Links` or a function of the mesh (:func:`node_links`)."""
    best: Tuple[float, Optional[Tuple[int, ...]], Optional[Plan]] = (float('inf'), None, None)
    for mesh in meshes(devices, axes):
        ln = links(mesh) if callable(links) else links
        cost, plan = method(mesh, block, ln, backward, min_split)
        if _better(cost, best[0]):
            best = (cost, mesh, plan)
    return best
