"""An AutoDDL-style analysis of one attention layer: per-matmul Split/Broadcast/Partial
(SBP) layouts on a device mesh, searched by coordinate descent and by exhaustive search.

Analysis only: our runtime executes one tensor family per model, not a layout per matmul;
this module measures how far per-matmul layouts could cut activation traffic (AutoDDL's
claim against Megatron) and is the seed of a second engine (docs/planner.md).

A mesh is a tuple of axis sizes (product = devices). A matrix ``[rows, cols]`` has one
state per axis: ``S0`` (rows split over it), ``S1`` (columns split), ``B`` (replicated) or
``P`` (partial sums). A matmul ``Y = X W`` takes one *kind* per axis:

=====  ======  ======  =====================
kind   X       W       Y
=====  ======  ======  =====================
M      S0      B       S0   (data parallel)
N      B       S1      S1   (Megatron column)
K      S1      S0      P    (Megatron row)
=====  ======  ======  =====================

Converting a tensor between states costs, per device, in elements received (ring
collectives; ``local`` = the tensor's elements on one device before the step): S->B
all_gather ``(p-1) local``, S0<->S1 all_to_all ``(p-1)/p local``, P->S reduce_scatter
``(p-1)/p local``, P->B all_reduce ``2 (p-1)/p local``; slicing (B->S) is free. Axes
convert one at a time in the cheapest order.

The attention layer ``X -> qkv (h x 3h) -> attention core -> out (h x h) -> X'``: the core
needs Q, K, V and gives the context with no P axis (heads ``S1`` or batch ``S0`` or ``B``);
the layer's output is split on every axis (AutoDDL's constraint for LayerNorm/dropout) and,
layers being repeated, is the next layer's input. Memory: every weight must be split at
least ``min_weight_split`` ways.
"""
from __future__ import annotations

import itertools
from typing import Dict, List, Sequence, Tuple

KINDS = ('M', 'N', 'K')
X_STATE = {'M': 'S0', 'N': 'B', 'K': 'S1'}
W_STATE = {'M': 'B', 'N': 'S1', 'K': 'S0'}
Y_STATE = {'M': 'S0', 'N': 'S1', 'K': 'P'}
CORE_STATES = ('S0', 'S1', 'B')
OUT_STATES = ('S0', 'S1')


def _local(full: float, mesh: Sequence[int], state: Sequence[str]) -> float:
    split = 1
    for p, s in zip(mesh, state):
        if s in ('S0', 'S1'):
            split *= p
    return full / split


def _step(p: int, src: str, dst: str, local: float) -> Tuple[float, float]:
    """(elements received, local size after) of one axis going src -> dst."""
    if src == dst or p == 1:
        return 0.0, local
    if dst == 'B':
        if src == 'P':
            return 2 * (p - 1) / p * local, local
        return (p - 1) * local, local * p           # all_gather
    if src == 'B':
        return 0.0, local / p                        # slice
    if src == 'P':
        return (p - 1) / p * local, local / p        # reduce_scatter
    if dst == 'P':
        raise ValueError('a split tensor never becomes partial')
    return (p - 1) / p * local, local                # all_to_all S0 <-> S1


def convert(full: float, mesh: Sequence[int], src: Sequence[str], dst: Sequence[str]) -> float:
    """Elements one device receives to turn a tensor of ``full`` elements from state
    ``src`` to ``dst`` (one state per mesh axis), axes in the cheapest order."""
    axes = [a for a in range(len(mesh)) if src[a] != dst[a] and mesh[a] > 1]
    best = float('inf')
    for order in itertools.permutations(axes):
        local, total = _local(full, mesh, src), 0.0
        for a in order:
            cost, local = _step(mesh[a], src[a], dst[a], local)
            total += cost
        best = min(best, total)
    return 0.0 if not axes else best


def weight_split(mesh: Sequence[int], kinds: Sequence[str]) -> int:
    out = 1
    for p, k in zip(mesh, kinds):
        if k != 'M':
            out *= p
    return out


def attention_traffic(mesh: Sequence[int], plan: Dict[str, tuple], tokens: float,
                      hidden: float) -> float:
    """Forward activation elements one device receives in one attention layer under
    ``plan`` = {'qkv': kinds, 'core': states, 'out': kinds, 'layer': states}."""
    x, qkv = tokens * hidden, 3 * tokens * hidden
    layer = plan['layer']
    cost = convert(x, mesh, layer, [X_STATE[k] for k in plan['qkv']])
    cost += convert(qkv, mesh, [Y_STATE[k] for k in plan['qkv']], plan['core'])
    cost += convert(x, mesh, plan['core'], [X_STATE[k] for k in plan['out']])
    cost += convert(x, mesh, [Y_STATE[k] for k in plan['out']], layer)
    return cost


def _choices(n: int) -> Dict[str, List[tuple]]:
    return {'qkv': list(itertools.product(KINDS, repeat=n)),
            'core': list(itertools.product(CORE_STATES, repeat=n)),
            'out': list(itertools.product(KINDS, repeat=n)),
            'layer': list(itertools.product(OUT_STATES, repeat=n))}


def _fits(mesh, plan, min_split) -> bool:
    return (weight_split(mesh, plan['qkv']) >= min_split
            and weight_split(mesh, plan['out']) >= min_split)


def _cost(mesh, plan, tokens, hidden, min_split) -> float:
    if not _fits(mesh, plan, min_split):
        return float('inf')
    return attention_traffic(mesh, plan, tokens, hidden)


def exhaustive(mesh: Sequence[int], tokens: float, hidden: float, min_split: int = 1
               ) -> Tuple[float, dict]:
    """The cheapest plan on ``mesh`` by trying every combination."""
    ch = _choices(len(mesh))
    best = (float('inf'), None)
    for combo in itertools.product(ch['qkv'], ch['core'], ch['out'], ch['layer']):
        plan = dict(zip(('qkv', 'core', 'out', 'layer'), combo))
        cost = _cost(mesh, plan, tokens, hidden, min_split)
        if cost < best[0]:
            best = (cost, plan)
    return best


def coordinate_descent(mesh: Sequence[int], tokens: float, hidden: float, min_split: int = 1
                       ) -> Tuple[float, dict]:
    """AutoDDL's search: from every start of the first matmul's layout, improve one
    variable (a matmul's kinds, the core's or the layer's states) at a time, all its values
    tried, until no variable improves; the best result of all starts."""
    ch = _choices(len(mesh))
    best = (float('inf'), None)
    for start in ch['qkv']:
        plan = {'qkv': start, 'core': ch['core'][0], 'out': start, 'layer': ch['layer'][0]}
        cost = _cost(mesh, plan, tokens, hidden, min_split)
        improved = True
        while improved:
            improved = False
            for var in ('qkv', 'core', 'out', 'layer'):
                for value in ch[var]:
                    trial = dict(plan, **{var: value})
                    c = _cost(mesh, trial, tokens, hidden, min_split)
                    if c < cost - 1e-9:
                        plan, cost, improved = trial, c, True
        if cost < best[0]:
            best = (cost, plan)
    return best


def meshes(devices: int, axes: int) -> List[Tuple[int, ...]]:
    """Every ordered factorization of ``devices`` (a power of two) into ``axes`` sizes."""
    k = devices.bit_length() - 1
    if 1 << k != devices:
        raise ValueError(f'meshes of a power-of-two device count, got {devices}')
    return [tuple(1 << e for e in es) for es in itertools.product(range(k + 1), repeat=axes)
            if sum(es) == k]


def search(devices: int, tokens: float, hidden: float, min_split: int = 1, axes: int = 3,
           method=coordinate_descent) -> Tuple[float, tuple, dict]:
    """(traffic, mesh, plan): the best plan over every mesh of ``axes`` axes."""
    best = (float('inf'), None, None)
    for mesh in meshes(devices, axes):
        cost, plan = method(mesh, tokens, hidden, min_split)
        if cost < best[0]:
            best = (cost, mesh, plan)
    return best
