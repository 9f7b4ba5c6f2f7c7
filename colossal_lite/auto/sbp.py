"""An AutoDDL-style analysis of one attention layer: per-matmul Split/Broadcast/Partial
(SBP) layouts on a device mesh, searched by coordinate descent and by exhaustive search;
and the primitives (states, kinds, duality, conversion costs in elements or alpha-beta
time) of the whole-block engine, ``auto/sbp_block.py`` (docs/planner_autoddl.md).

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

**Backward and time** (used by the whole-block engine, ``auto/sbp_block.py``). The gradient
of a tensor in forward state ``B`` is ``P`` (the devices' consumers of the copies compute
different parts of the result, so each device's gradient is a partial sum; every backward
op is linear in the gradient, so a partial sum passes through it against replicated saved
activations), ``S`` stays ``S``, ``P`` becomes ``B``. (A valid choice everywhere, as in
OneFlow and AutoDDL; not always the cheapest: a copy consumed redundantly could keep a
``B`` gradient.) A
forward conversion ``src -> dst`` has the backward conversion ``dual(dst) -> dual(src)``
on the gradient, per axis, with the same received elements and the same ring steps:

==========================  ===========================  ==========  =========
forward (per axis)          backward on the gradient     elements    steps
==========================  ===========================  ==========  =========
S -> B    all_gather        P -> S    reduce_scatter     (p-1) L_S   p-1
B -> S    slice (free)      S -> P    zero-pad (free)    0           0
P -> S    reduce_scatter    S -> B    all_gather         (p-1) L_S   p-1
P -> B    all_reduce        P -> B    all_reduce         2(p-1)/p L  2(p-1)
S0 <-> S1 all_to_all        S1 <-> S0 all_to_all         (p-1)/p L   p-1
==========================  ===========================  ==========  =========

(``L_S`` the split local size, ``L = p L_S`` the unsplit one: a ``P`` tensor holds the
full extent on its axis, as ``B`` does, so local sizes match step by step in the
reversed order and the cheapest order of one is the reverse of the other's.)

The matmul's backward, per axis (``dY`` arrives in ``dual(Y)``; ``X`` saved in its
forward state; ``dX = dY W^T``, ``dW = X^T dY``):

=====  ======  ======  ==========================================================
kind   dY      dX      dW
=====  ======  ======  ==========================================================
M      S0      S0      P  (X^T dY contracts the split tokens: a partial sum per device)
N      S1      P       S1 (= W's state: local)
K      B       S1      S0 (= W's state: local)
=====  ======  ======  ==========================================================

so ``dX`` is ``dual(X)`` and the only weight traffic is the reduction of ``dW`` over the
``M`` axes, once per step: a reduce_scatter per ``M`` axis then an all_gather per ``M``
axis, ``2(P_M-1)/P_M`` times the local weight elements in all (``P_M`` = product of the
``M`` axes), each step on one axis.

Time (:class:`Links`): a step on axis ``a`` with ``p`` devices costs
``steps * alpha_a + received * elem_bytes * beta_a``, ``steps`` = ``p-1`` for all_gather,
reduce_scatter and all_to_all and ``2(p-1)`` for all_reduce; ``received`` is the element
count above, which is the ring bandwidth term: all_reduce ``2(p-1)/p n``, the others
``(p-1)/p n`` with ``n`` the all_gather output or the reduce_scatter input.
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

KINDS = ('M', 'N', 'K')
X_STATE = {'M': 'S0', 'N': 'B', 'K': 'S1'}
W_STATE = {'M': 'B', 'N': 'S1', 'K': 'S0'}
Y_STATE = {'M': 'S0', 'N': 'S1', 'K': 'P'}
CORE_STATES = ('S0', 'S1', 'B')
OUT_STATES = ('S0', 'S1')
DUAL = {'S0': 'S0', 'S1': 'S1', 'B': 'P', 'P': 'B'}
DW_STATE = {'M': 'P', 'N': 'S1', 'K': 'S0'}
STEPS = {'all_gather': 1, 'reduce_scatter': 1, 'all_to_all': 1, 'all_reduce': 2}


def _local(full: float, mesh: Sequence[int], state: Sequence[str]) -> float:
    split = 1
    for p, s in zip(mesh, state):
        if s in ('S0', 'S1'):
            split *= p
    return full / split


def _collective(p: int, src: str, dst: str, local: float) -> Tuple[Optional[str], float, float]:
    """(collective, elements received, local size after) of one axis of ``p`` devices going
    ``src -> dst``; ``None`` for the free steps (slice B -> S, zero-pad S -> P)."""
    if src == dst or p == 1:
        return None, 0.0, local
    if dst == 'B':
        if src == 'P':
            return 'all_reduce', 2 * (p - 1) / p * local, local
        return 'all_gather', (p - 1) * local, local * p
    if src == 'B':
        return None, 0.0, local / p if dst != 'P' else local     # slice; B -> P keeps one copy
    if src == 'P':
        return 'reduce_scatter', (p - 1) / p * local, local / p
    if dst == 'P':
        return None, 0.0, local * p                              # zero-pad to the full extent
    return 'all_to_all', (p - 1) / p * local, local


def _step(p: int, src: str, dst: str, local: float) -> Tuple[float, float]:
    """(elements received, local size after) of one axis going src -> dst (forward only:
    a split tensor never becomes partial there)."""
    if src in ('S0', 'S1') and dst == 'P' and p > 1:
        raise ValueError('a split tensor never becomes partial')
    _, cost, local = _collective(p, src, dst, local)
    return cost, local


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


@dataclass(frozen=True)
class Links:
    """Per-axis ring links for the time metric: ``axes[a] = (alpha_s, beta_s_per_byte)``
    (one pair per mesh axis, e.g. NVLink for inner axes, the network for outer ones)."""
    axes: Tuple[Tuple[float, float], ...]
    elem_bytes: int = 2


def _price(links: Optional[Links], axis: int, p: int, op: Optional[str], received: float
           ) -> float:
    """The cost of one step: its received elements, or (``links``) its alpha-beta time."""
    if links is None or op is None:
        return received
    alpha, beta = links.axes[axis]
    return STEPS[op] * (p - 1) * alpha + received * links.elem_bytes * beta


@functools.lru_cache(maxsize=1 << 20)
def transfer(full: float, mesh: Tuple[int, ...], src: Tuple[str, ...], dst: Tuple[str, ...],
             links: Optional[Links] = None) -> float:
    """Cheapest cost (elements received per device, or time under ``links``) of turning a
    tensor of ``full`` elements from ``src`` to ``dst``, one axis at a time in the best
    order (exact: a shortest path over the sets of axes already converted, since the local
    size after a set does not depend on its order). Unlike :func:`convert`, a split tensor
    may become partial (zero-pad), which the backward of a slice does."""
    axes = tuple(a for a in range(len(mesh)) if src[a] != dst[a] and mesh[a] > 1)
    start = _local(full, mesh, src)

    @functools.lru_cache(maxsize=None)
    def rest(done: frozenset, local: float) -> float:
        best = 0.0 if len(done) == len(axes) else float('inf')
        for a in axes:
            if a not in done:
                op, got, after = _collective(mesh[a], src[a], dst[a], local)
                best = min(best, _price(links, a, mesh[a], op, got) + rest(done | {a}, after))
        return best
    return rest(frozenset(), start)


def dual(state: Sequence[str]) -> Tuple[str, ...]:
    """The state of a tensor's gradient, per axis (B <-> P, S stays S)."""
    return tuple(DUAL[s] for s in state)


def transfer_backward(full: float, mesh: Tuple[int, ...], src: Tuple[str, ...],
                      dst: Tuple[str, ...], links: Optional[Links] = None) -> float:
    """The backward of the forward conversion ``src -> dst``: its gradient goes
    ``dual(dst) -> dual(src)`` (all_gather <-> reduce_scatter, all_reduce and all_to_all
    stay, slice <-> zero-pad)."""
    return transfer(full, mesh, dual(dst), dual(src), links)


def weight_grad(full: float, mesh: Tuple[int, ...], kinds: Sequence[str],
                links: Optional[Links] = None) -> float:
    """Once per step: the reduction of a weight's gradient (``full`` elements) over the axes
    where the weight is replicated (kind ``M``: dW is ``P``): reduce_scatter ``P -> S`` on
    each, then all_gather ``S -> B``, each in its best order; ``2(P_M-1)/P_M`` times the
    local weight elements received, as one ring all_reduce over the ``M`` axes."""
    part = tuple('P' if k == 'M' else W_STATE[k] for k in kinds)
    scattered = tuple('S0' if k == 'M' else W_STATE[k] for k in kinds)
    whole = tuple('B' if k == 'M' else W_STATE[k] for k in kinds)
    return (transfer(full, mesh, part, scattered, links)
            + transfer(full, mesh, scattered, whole, links))


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
