"""Strategy selection for the graph-level auto-parallelizer (AutoDDL / Rhino style).

Node ``i`` has ``S_i`` candidate sharding strategies; a choice ``c`` (one index per node)
costs

    T(c) = sum_i t_i[c_i] + sum_{e = (u -> v)} R_e[c_u, c_v]

(per-node compute/communication time plus, per edge, the redistribution time between the
producer's and the consumer's layouts) and uses memory ``M(c) = sum_i m_i[c_i]``, which
must stay ``<= budget`` (within ``1e-9 * max(1, budget)`` bytes). Nodes of one *group*
(identical repeated blocks) take the same strategy index.

**Reduction** (both levels). Groups are contracted (union-find; overlapping groups merge):
one node ``g`` with ``t_g = sum_{i in g} t_i`` and ``m_g = sum_{i in g} m_i``; an edge
inside a group (or a self-loop) adds its diagonal ``R_e[a, a]`` to ``t_g``. Edges are then
oriented from the lower to the higher contracted node (transposing ``R`` where needed),
parallel edges are merged by summing their matrices, and a *separable* matrix
``R[a, b] = u[a] + w[b]`` (all zeros, constant, or a function of one side only) is folded
into the two node costs and dropped. Contracted nodes are ordered by their smallest
member, so the oriented graph is a DAG.

**optimal**: an exact ILP solved by HiGHS (``scipy.optimize.milp``), the local-polytope
("tight") formulation. Binary ``x[g, a]`` and continuous ``y[e, r, q] >= 0`` over the
distinct rows ``r`` and distinct columns ``q`` of ``R_e`` (identical rows/columns share a
variable)::

    min  sum_g t_g . x_g + sum_e sum_{r,q} R_e[r, q] y[e, r, q]
    s.t. sum_a x[g, a] = 1                                   for every g
         sum_q y[e, r, q] = sum_{a in row class r} x[u, a]   for every e = (u -> v), r
         sum_r y[e, r, q] = sum_{b in col class q} x[v, b]   for every e, q
         sum_g m_g . x_g <= budget

The objective is scaled to a largest coefficient of 1 and the memory row to coefficients
of at most 1; HiGHS runs with ``mip_rel_gap = 1e-9`` (its absolute gap, 1e-6 of the scaled
objective, is not exposed by scipy). ``time_limit`` is HiGHS's; past it the incumbent is
returned with a warning.

**fast**: starts, then iterated conditional modes (ICM), on the contracted DAG.

* *Sweep DP* (the greedy in topological order, made exact on chains): forward
  ``F_v[b] = t_v[b] + sum_{e=(u->v)} (min_a (F_u[a] + R_e[a, b]) - min_a F_u[a])``, then
  backward ``c_v = argmin_b F_v[b] + sum_{e=(v->w)} R_e[b, c_w]`` (Viterbi on a chain).
* *Loopy min-sum belief propagation*, damped, vectorized over all edges (catches what
  ICM cannot leave on graphs with reconvergent paths; see ``belief_propagation``).
* *ICM* re-picks each node given all its neighbours, ``argmin_a t_v[a] + sum_e R_e``,
  until no move improves. It runs per class of a greedy graph colouring: nodes of one
  colour are not adjacent, so updating them together equals updating them one by one.

The memory budget uses a Lagrangian penalty, node costs ``t + lambda m``: ``lambda`` is
bracketed by factors of 10 from the median ratio of a node's cost spread to its memory
spread and bisected geometrically (to 5%), each trial a sweep DP + ICM; never above
``2 (total cost spread) / (smallest memory step)``, where every node takes its
least-memory strategy (always a candidate). Trials over the budget are repaired (moves of
least time per byte freed); the best fitting candidates are polished by ICM that only
accepts moves keeping ``M <= budget`` and by paired exchanges (one node spends memory
on a gain, a non-adjacent one frees it).

If even ``sum_g min_a m_g[a]`` exceeds the budget, both levels raise
:class:`InfeasibleBudget`.
"""
from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
from scipy import sparse
from scipy.optimize import Bounds, LinearConstraint, milp

LEVELS = ('fast', 'optimal')
BRUTE_FORCE_LIMIT = 200_000


def _budget_tol(budget: float) -> float:
    return 1e-9 * max(1.0, abs(budget))


@dataclass
class Edge:
    """A producer -> consumer edge; ``cost[a, b]`` is the redistribution time when the
    producer takes strategy ``a`` and the consumer strategy ``b``."""
    src: int
    dst: int
    cost: np.ndarray

    def __post_init__(self):
        self.cost = np.asarray(self.cost, dtype=float)


@dataclass
class Problem:
    """Per-node costs ``t_i`` (seconds), edges, optional per-node memory ``m_i`` (bytes)
    with a budget, and groups of nodes forced to one strategy index."""
    node_costs: List[np.ndarray]
    edges: List[Edge]
    memory: Optional[List[np.ndarray]] = None
    budget: Optional[float] = None
    groups: List[List[int]] = field(default_factory=list)

    def __post_init__(self):
        self.node_costs = [np.asarray(c, dtype=float) for c in self.node_costs]
        if self.memory is not None:
            self.memory = [np.asarray(m, dtype=float) for m in self.memory]
        self.validate()

    @property
    def num_nodes(self) -> int:
        return len(self.node_costs)

    def validate(self) -> None:
        """ValueError naming the node, edge or group whose shape or index is wrong."""
        n = self.num_nodes
        for i, c in enumerate(self.node_costs):
            if c.ndim != 1 or c.size == 0:
                raise ValueError(f'node_costs[{i}] must be a non-empty 1-D array, '
                                 f'got shape {c.shape}')
        sizes = [c.size for c in self.node_costs]
        arrays = list(self.node_costs)
        if self.memory is not None:
            if len(self.memory) != n:
                raise ValueError(f'memory has {len(self.memory)} entries for {n} nodes')
            for i, m in enumerate(self.memory):
                if m.shape != (sizes[i],):
                    raise ValueError(f'memory[{i}] has shape {m.shape}, '
                                     f'node_costs[{i}] has shape {(sizes[i],)}')
            arrays += self.memory
        for j, e in enumerate(self.edges):
            if not (0 <= e.src < n and 0 <= e.dst < n):
                raise ValueError(f'edge {j} ({e.src} -> {e.dst}) names a node outside 0..{n - 1}')
            want = (sizes[e.src], sizes[e.dst])
            if e.cost.shape != want:
                raise ValueError(f'edge {j} ({e.src} -> {e.dst}) cost has shape {e.cost.shape}, '
                                 f'expected {want} (strategies of node {e.src}, node {e.dst})')
            if np.isnan(e.cost).any() or (e.cost == -np.inf).any():
                raise ValueError(f'edge {j} ({e.src} -> {e.dst}) cost has NaN or -inf '
                                 f'(+inf marks a forbidden pair)')
        for g, members in enumerate(self.groups):
            for i in members:
                if not 0 <= i < n:
                    raise ValueError(f'group {g} names node {i} outside 0..{n - 1}')
                if sizes[i] != sizes[members[0]]:
                    raise ValueError(f'group {g}: node {i} has {sizes[i]} strategies, '
                                     f'node {members[0]} has {sizes[members[0]]}')
        if arrays and not np.isfinite(np.concatenate(arrays)).all():
            raise ValueError('node costs and memory must be finite')
        if self.budget is not None and not math.isfinite(self.budget):
            raise ValueError(f'budget must be finite or None, got {self.budget}')

    def _check_choice(self, choice: Sequence[int]) -> None:
        if len(choice) != self.num_nodes:
            raise ValueError(f'choice has {len(choice)} entries for {self.num_nodes} nodes')
        for i, s in enumerate(choice):
            if not 0 <= s < self.node_costs[i].size:
                raise ValueError(f'choice[{i}] = {s} outside 0..{self.node_costs[i].size - 1}')

    def objective(self, choice: Sequence[int]) -> float:
        """T(c) = sum_i t_i[c_i] + sum_e R_e[c_src, c_dst]."""
        self._check_choice(choice)
        total = float(sum(float(c[s]) for c, s in zip(self.node_costs, choice)))
        return total + sum(float(e.cost[choice[e.src], choice[e.dst]]) for e in self.edges)

    def memory_of(self, choice: Sequence[int]) -> float:
        """M(c) = sum_i m_i[c_i] (0 without a memory term)."""
        self._check_choice(choice)
        if self.memory is None:
            return 0.0
        return sum(float(m[s]) for m, s in zip(self.memory, choice))


@dataclass
class Solution:
    choice: List[int]
    objective: float
    memory: float
    level: str
    seconds: float


class InfeasibleBudget(ValueError):
    """No choice fits the budget; ``smallest`` is the least memory any choice needs."""

    def __init__(self, budget: float, smallest: float):
        self.budget = float(budget)
        self.smallest = float(smallest)
        super().__init__(f'memory budget {self.budget!r} bytes is below the smallest achievable '
                         f'memory {self.smallest!r} bytes (least-memory strategy everywhere)')


# ---------------------------------------------------------------- reduction


def _contract(problem: Problem) -> np.ndarray:
    """owner[i]: the contracted node of original node i, numbered by smallest member."""
    parent = list(range(problem.num_nodes))

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for members in problem.groups:
        for i in members[1:]:
            a, b = find(members[0]), find(i)
            parent[max(a, b)] = min(a, b)
    roots = np.array([find(i) for i in range(problem.num_nodes)], dtype=np.int64)
    _, owner = np.unique(roots, return_inverse=True)
    return owner.reshape(-1)


@dataclass
class _Reduced:
    owner: np.ndarray                        # original node -> contracted node
    cost: List[np.ndarray]                   # contracted node -> [S_g]
    memory: List[np.ndarray]                 # contracted node -> [S_g]
    edges: Dict[Tuple[int, int], np.ndarray]  # (u, v), u < v -> [S_u, S_v]

    def min_memory(self) -> float:
        return float(sum(m.min() for m in self.memory))


def _fold_separable(red: _Reduced) -> None:
    """Move every R[a, b] = u[a] + w[b] into the node costs (vectorized per shape)."""
    by_shape: Dict[tuple, list] = {}
    for key, mat in red.edges.items():
        if np.isfinite(mat).all():            # a forbidden (+inf) pair is never separable
            by_shape.setdefault(mat.shape, []).append(key)
    for keys in by_shape.values():
        stack = np.stack([red.edges[k] for k in keys])
        col, row = stack[:, :, :1], stack[:, :1, :]
        resid = np.abs(stack - col - row + stack[:, :1, :1]).max(axis=(1, 2))
        scale = np.abs(col).max(axis=(1, 2)) + np.abs(row).max(axis=(1, 2))
        for j in np.flatnonzero(resid <= 1e-12 * scale):
            u, v = keys[j]
            red.cost[u] = red.cost[u] + stack[j, :, 0]
            red.cost[v] = red.cost[v] + stack[j, 0, :] - stack[j, 0, 0]
            del red.edges[keys[j]]


def _reduce(problem: Problem) -> _Reduced:
    owner = _contract(problem)
    k = int(owner.max()) + 1 if owner.size else 0
    sizes = [0] * k
    for i, c in enumerate(problem.node_costs):
        sizes[owner[i]] = c.size
    cost = [np.zeros(s) for s in sizes]
    memory = [np.zeros(s) for s in sizes]
    for i, c in enumerate(problem.node_costs):
        cost[owner[i]] += c
        if problem.memory is not None:
            memory[owner[i]] += problem.memory[i]
    edges: Dict[Tuple[int, int], np.ndarray] = {}
    for e in problem.edges:
        u, v, mat = int(owner[e.src]), int(owner[e.dst]), e.cost
        if u == v:                            # inside a group: both ends take index a
            cost[u] += np.diagonal(mat)
            continue
        if u > v:
            u, v, mat = v, u, mat.T
        edges[(u, v)] = edges[(u, v)] + mat if (u, v) in edges else mat   # never mutated
    red = _Reduced(owner, cost, memory, edges)
    _fold_separable(red)
    return red


def _check_budget(budget: Optional[float], smallest: float) -> None:
    if budget is not None and smallest > budget + _budget_tol(budget):
        raise InfeasibleBudget(budget, smallest)


# ---------------------------------------------------------------- optimal: ILP


def _solve_ilp(red: _Reduced, budget: Optional[float], time_limit: float) -> np.ndarray:
    """The ILP of the module docstring; returns the contracted nodes' strategies."""
    sizes = [c.size for c in red.cost]
    xoff = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    nx = int(xoff[-1])
    obj = [np.concatenate(red.cost)]
    rows, cols, vals = [], [], []
    y_ub = [np.ones(nx)]
    nrow, ncol = len(sizes), nx
    for g, s in enumerate(sizes):                       # sum_a x[g, a] = 1
        rows.append(np.full(s, g))
        cols.append(xoff[g] + np.arange(s))
        vals.append(np.ones(s))
    for (u, v), mat in red.edges.items():
        uniq_rows, ra = np.unique(mat, axis=0, return_inverse=True)
        small, qb = np.unique(uniq_rows, axis=1, return_inverse=True)
        ra, qb = ra.reshape(-1), qb.reshape(-1)
        nr, nq = small.shape
        ycols = ncol + np.arange(nr * nq)
        forbidden = ~np.isfinite(small.ravel())        # +inf: y fixed to 0
        obj.append(np.where(forbidden, 0.0, small.ravel()))
        y_ub.append(np.where(forbidden, 0.0, 1.0))
        # row-class marginals: sum_q y[r, q] - sum_{a in r} x[u, a] = 0
        rows += [nrow + np.repeat(np.arange(nr), nq), nrow + ra]
        cols += [ycols, xoff[u] + np.arange(sizes[u])]
        vals += [np.ones(nr * nq), -np.ones(sizes[u])]
        # column-class marginals: sum_r y[r, q] - sum_{b in q} x[v, b] = 0
        rows += [nrow + nr + np.tile(np.arange(nq), nr), nrow + nr + qb]
        cols += [ycols, xoff[v] + np.arange(sizes[v])]
        vals += [np.ones(nr * nq), -np.ones(sizes[v])]
        nrow, ncol = nrow + nr + nq, ncol + nr * nq
    lb = np.concatenate([np.ones(len(sizes)), np.zeros(nrow - len(sizes))])
    ub = lb.copy()
    if budget is not None:                              # sum m . x <= budget (scaled)
        mem = np.concatenate(red.memory)
        scale = max(abs(budget), float(np.abs(mem).max(initial=0.0)), 1.0)
        rows.append(np.full(nx, nrow))
        cols.append(np.arange(nx))
        vals.append(mem / scale)
        lb, ub = np.append(lb, -np.inf), np.append(ub, (budget + _budget_tol(budget)) / scale)
        nrow += 1
    a = sparse.coo_array((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
                         shape=(nrow, ncol)).tocsc()
    c = np.concatenate(obj)
    c = c / max(float(np.abs(c).max(initial=0.0)), 1e-300)
    integrality = np.concatenate([np.ones(nx), np.zeros(ncol - nx)])
    res = milp(c, integrality=integrality, bounds=Bounds(0.0, np.concatenate(y_ub)),
               constraints=LinearConstraint(a, lb, ub),
               options={'time_limit': time_limit, 'mip_rel_gap': 1e-9})
    if res.x is None:
        raise RuntimeError(f'HiGHS found no solution: {res.message}')
    if res.status != 0:
        warnings.warn(f'HiGHS stopped before proving optimality: {res.message}')
    return np.array([int(np.argmax(res.x[xoff[g]:xoff[g + 1]])) for g in range(len(sizes))])


# ---------------------------------------------------------------- fast: DP, BP, ICM


class _LocalSearch:
    """The contracted problem as padded arrays (strategies padded to S_max with cost +inf,
    edge matrices to [S_max, S_max] with 0; edges sorted by consumer) and the classes of a
    greedy colouring, with the searches that run on them."""

    def __init__(self, red: _Reduced):
        k = len(red.cost)
        s = max(c.size for c in red.cost)
        self.valid = np.zeros((k, s), dtype=bool)
        self.cost = np.full((k, s), np.inf)
        self.mem = np.zeros((k, s))
        for g, (c, m) in enumerate(zip(red.cost, red.memory)):
            self.valid[g, :c.size] = True
            self.cost[g, :c.size], self.mem[g, :c.size] = c, m
        keys = sorted(red.edges, key=lambda uv: (uv[1], uv[0]))   # a node's in-edges adjacent
        self.src = np.array([u for u, _ in keys], dtype=np.int64)
        self.dst = np.array([v for _, v in keys], dtype=np.int64)
        self.w = np.zeros((len(keys), s, s))
        for j, key in enumerate(keys):
            mat = red.edges[key]
            self.w[j, :mat.shape[0], :mat.shape[1]] = mat
        # a forbidden pair (+inf) becomes a finite cost above any plan's total, so messages
        # never meet inf - inf; a choice using one is never the cheapest
        finite = np.isfinite(self.w)
        if not finite.all():
            spread = np.abs(self.w[finite]).sum() + np.abs(self.cost[np.isfinite(self.cost)]).sum()
            self.w[~finite] = 1e3 * (spread + 1.0)
        bounds = np.searchsorted(self.dst, np.arange(k + 1))
        self.in_edges = [slice(bounds[g], bounds[g + 1]) for g in range(k)]   # views into w
        self.out_edges = self._incident(self.src, k)
        nbrs: List[set] = [set() for _ in range(k)]
        for u, v in zip(self.src.tolist(), self.dst.tolist()):
            nbrs[u].add(v)
            nbrs[v].add(u)
        self.nbrs = [np.array(sorted(ns), dtype=np.int64) for ns in nbrs]
        self.classes = self._colour_classes(k, s)

    @staticmethod
    def _incident(ends: np.ndarray, k: int) -> list:
        order = np.argsort(ends, kind='stable')
        bounds = np.searchsorted(ends[order], np.arange(k + 1))
        return [order[bounds[g]:bounds[g + 1]] for g in range(k)]

    def _colour_classes(self, k: int, s: int) -> list:
        """Greedy colouring in node order; per colour (nodes, in-edges, their bincount
        indices, out-edges, theirs)."""
        colour = [0] * k
        for g in range(k):
            used = {colour[h] for h in self.nbrs[g].tolist() if h < g}
            while colour[g] in used:
                colour[g] += 1
        colour = np.array(colour)
        pos = np.zeros(k, dtype=np.int64)
        classes = []
        for c in range(int(colour.max()) + 1):
            nodes = np.flatnonzero(colour == c)
            pos[nodes] = np.arange(nodes.size)
            e_in = np.flatnonzero(colour[self.dst] == c)
            e_out = np.flatnonzero(colour[self.src] == c)
            # flat indices into the class's [n, S] local-cost table, for np.bincount
            idx_in = (pos[self.dst[e_in]][:, None] * s + np.arange(s)).ravel()
            idx_out = (pos[self.src[e_out]][:, None] * s + np.arange(s)).ravel()
            classes.append((nodes, e_in, idx_in, e_out, idx_out))
        return classes

    def value(self, choice: np.ndarray, base: np.ndarray) -> float:
        edges = self.w[np.arange(self.src.size), choice[self.src], choice[self.dst]].sum()
        return float(base[np.arange(choice.size), choice].sum() + edges)

    def memory(self, choice: np.ndarray) -> float:
        return float(self.mem[np.arange(choice.size), choice].sum())

    def sweep_dp(self, base: np.ndarray) -> np.ndarray:
        """Forward min-sum pass then backward decode, as if the DAG were a tree.

        F_v[b] = base_v[b] + sum_{e = (u -> v)} (min_a (F_u[a] + R_e[a, b]) - min_a F_u[a]);
        then, last node first, c_v = argmin_b F_v[b] + sum_{e = (v -> w)} R_e[b, c_w].
        Exact on a chain (Viterbi) and on any graph where each node has one consumer;
        elsewhere a producer feeding several consumers is counted once per consumer
        (the subtraction keeps every message's spread within its edge's spread).
        """
        f = base.copy()
        for v, e in enumerate(self.in_edges):
            if e.stop > e.start:
                up = f[self.src[e]]
                msg = (up[:, :, None] + self.w[e]).min(axis=1) - up.min(axis=1)[:, None]
                f[v] += msg.sum(axis=0)
        choice = np.zeros(base.shape[0], dtype=np.int64)
        for v in range(base.shape[0] - 1, -1, -1):
            e = self.out_edges[v]
            local = f[v] + self.w[e, :, choice[self.dst[e]]].sum(axis=0) if e.size else f[v]
            choice[v] = int(np.argmin(local))
        return choice

    def belief_propagation(self, base: np.ndarray, work: float = 3e7) -> np.ndarray:
        """Damped loopy min-sum belief propagation; returns the best decoded choice.

        Messages on e = (u -> v): m_uv[b] = min_a (B_u[a] - m_vu[a] + R_e[a, b]) and
        m_vu[a] = min_b (R_e[a, b] + B_v[b] - m_uv[b]), shifted to minimum 0 and averaged
        with the previous ones; beliefs B_v = base_v + sum of incoming messages; each
        iteration decodes argmin B and keeps the cheapest. Iterations: at most 30 and
        ``work / (E S^2)`` (at least 5).
        """
        k, s = base.shape
        iters = int(min(30, max(5, work // max(1, self.w.size))))
        to_dst = (self.dst[:, None] * s + np.arange(s)).ravel()
        to_src = (self.src[:, None] * s + np.arange(s)).ravel()
        fwd, bwd = np.zeros((self.src.size, s)), np.zeros((self.src.size, s))
        best, best_value = None, np.inf
        for _ in range(iters):
            belief = (base + np.bincount(to_dst, fwd.ravel(), minlength=k * s).reshape(k, s)
                      + np.bincount(to_src, bwd.ravel(), minlength=k * s).reshape(k, s))
            choice = np.argmin(belief, axis=1)
            value = self.value(choice, base)
            if value < best_value:
                best, best_value = choice, value
            new_fwd = ((belief[self.src] - bwd)[:, :, None] + self.w).min(axis=1)
            new_bwd = (self.w + (belief[self.dst] - fwd)[:, None, :]).min(axis=2)
            fwd = 0.5 * fwd + 0.5 * (new_fwd - new_fwd.min(axis=1, keepdims=True))
            bwd = 0.5 * bwd + 0.5 * (new_bwd - new_bwd.min(axis=1, keepdims=True))
        return best

    def _local(self, cls, choice: np.ndarray, base: np.ndarray) -> np.ndarray:
        """[n, S]: each class node's cost per strategy given its neighbours' choices."""
        nodes, e_in, idx_in, e_out, idx_out = cls
        n, s = nodes.size, base.shape[1]
        local = base[nodes].copy()
        if e_in.size:
            local += np.bincount(idx_in, self.w[e_in, choice[self.src[e_in]], :].ravel(),
                                 minlength=n * s).reshape(n, s)
        if e_out.size:
            local += np.bincount(idx_out, self.w[e_out, :, choice[self.dst[e_out]]].ravel(),
                                 minlength=n * s).reshape(n, s)
        return local

    def _step(self, cls, choice: np.ndarray, base: np.ndarray, slack: float) -> Tuple[int, float]:
        """Re-pick one colour class given its neighbours; returns (moves, memory added)."""
        nodes = cls[0]
        local = self._local(cls, choice, base)
        rows, cur = np.arange(nodes.size), choice[nodes]
        dm = self.mem[nodes] - self.mem[nodes, cur][:, None]
        if math.isfinite(slack):
            local = np.where(dm <= slack, local, np.inf)
        new = np.argmin(local, axis=1)
        now = local[rows, cur]
        gain = now - local[rows, new]
        move = gain > 1e-12 * np.abs(now) + 1e-300
        if math.isfinite(slack):                   # keep M <= budget: best gains first
            inc = dm[rows, new]
            up = np.flatnonzero(move & (inc > 0))
            room = slack - inc[move & (inc <= 0)].sum()
            up = up[np.argsort(-gain[up], kind='stable')]
            move[up[np.cumsum(inc[up]) > room]] = False
        choice[nodes[move]] = new[move]
        return int(move.sum()), float(dm[rows, new][move].sum())

    def repair(self, choice: np.ndarray, base: np.ndarray, excess: float) -> np.ndarray:
        """Free ``excess`` bytes by the moves of least cost increase per byte freed."""
        choice = choice.copy()
        while excess > 0:
            freed_sweep = 0.0
            for cls in self.classes:
                nodes = cls[0]
                local = self._local(cls, choice, base)
                rows, cur = np.arange(nodes.size), choice[nodes]
                freed = self.mem[nodes, cur][:, None] - self.mem[nodes]
                extra = local - local[rows, cur][:, None]
                ratio = np.where((freed > 0) & self.valid[nodes],
                                 extra / np.where(freed > 0, freed, 1.0), np.inf)
                new = np.argmin(ratio, axis=1)
                cand = np.flatnonzero(np.isfinite(ratio[rows, new]))
                cand = cand[np.argsort(ratio[cand, new[cand]], kind='stable')]
                gained = np.cumsum(freed[cand, new[cand]])
                cand = cand[:int(np.searchsorted(gained, excess)) + 1]   # up to the one covering it
                choice[nodes[cand]] = new[cand]
                done = float(freed[cand, new[cand]].sum())
                excess, freed_sweep = excess - done, freed_sweep + done
                if excess <= 0:
                    break
            if freed_sweep == 0.0:
                break
        return choice

    def exchange(self, choice: np.ndarray, limit: float, tries: int = 16) -> bool:
        """Paired moves under the budget, in place: node i takes a strategy that gains time
        but needs more memory than the slack, a node j not adjacent to i (so the two
        changes add up exactly) takes one that frees enough, if the pair gains time.
        Nodes next to a moved node wait for the next round. Returns whether any moved."""
        k, s = self.cost.shape
        local = np.empty_like(self.cost)
        for cls in self.classes:
            local[cls[0]] = self._local(cls, choice, self.cost)
        rows = np.arange(k)
        d = local - local[rows, choice][:, None]                 # +inf on padding
        dm = self.mem - self.mem[rows, choice][:, None]
        slack = limit - self.memory(choice)
        tol = 1e-12 * float(np.abs(local[rows, choice]).sum()) + 1e-300
        ups = np.flatnonzero((d < -tol) & (dm > slack))
        blocked = np.zeros(k, dtype=bool)
        moved = False
        for flat in ups[np.argsort(d.ravel()[ups], kind='stable')][:tries]:
            i, si = divmod(int(flat), s)
            if blocked[i]:
                continue
            ok = (dm <= slack - dm[i, si]) & ~blocked[:, None]
            ok[i] = False
            ok[self.nbrs[i]] = False
            total = np.where(ok, d, np.inf)
            j, sj = divmod(int(np.argmin(total)), s)
            if not d[i, si] + total[j, sj] < -tol:
                continue
            choice[i], choice[j] = si, sj
            slack -= dm[i, si] + dm[j, sj]
            for n in (i, j):
                blocked[n] = True
                blocked[self.nbrs[n]] = True
            moved = True
        return moved

    def polish(self, choice: np.ndarray, limit: float, deadline: float,
               rounds: int = 100) -> np.ndarray:
        """Constrained ICM alternated with paired exchanges until neither improves."""
        for _ in range(rounds):
            choice = self.icm(choice, self.cost, deadline, slack=limit - self.memory(choice))
            if time.perf_counter() > deadline or not self.exchange(choice, limit):
                break
        return choice

    def icm(self, choice: np.ndarray, base: np.ndarray, deadline: float,
            slack: float = math.inf, max_sweeps: int = 200) -> np.ndarray:
        choice = choice.copy()
        for _ in range(max_sweeps):
            moved = 0
            for cls in self.classes:
                m, added = self._step(cls, choice, base, slack)
                moved, slack = moved + m, slack - added
            if moved == 0 or time.perf_counter() > deadline:
                break
        return choice


def _solve_fast(red: _Reduced, budget: Optional[float], time_limit: float) -> np.ndarray:
    """Starts, Lagrangian search and polish of the module docstring."""
    deadline = time.perf_counter() + time_limit
    eng = _LocalSearch(red)
    limit = math.inf if budget is None else budget + _budget_tol(budget)
    found, over = [], []                     # candidates within / over the budget

    def run(lam: float, start) -> bool:
        base = eng.cost + lam * eng.mem
        trial = eng.icm(start(base), base, deadline)
        fits = eng.memory(trial) <= limit
        (found if fits else over).append(trial)
        return fits

    if run(0.0, eng.sweep_dp):
        run(0.0, eng.belief_propagation)
    else:                                    # the free optimum is over: price the memory
        found.append(_least_memory_choice(eng))
        lo, hi = _bracket(eng, lambda lam: run(lam, eng.sweep_dp), deadline)
        while hi / lo > 1.05 and time.perf_counter() < deadline:     # geometric bisection
            mid = math.sqrt(lo * hi)
            lo, hi = (lo, mid) if run(mid, eng.sweep_dp) else (mid, hi)
        run(hi, eng.belief_propagation)
    repaired = [eng.repair(c, eng.cost, eng.memory(c) - limit) for c in over]
    found += [c for c in repaired if eng.memory(c) <= limit]
    found = [eng.icm(c, eng.cost, deadline, slack=limit - eng.memory(c)) for c in found]
    found.sort(key=lambda c: eng.value(c, eng.cost))
    if math.isfinite(limit):
        found = [eng.polish(c, limit, deadline) for c in found[:2]]
    return min(found, key=lambda c: eng.value(c, eng.cost))


def _least_memory_choice(eng: _LocalSearch) -> np.ndarray:
    """Each node's least-memory strategy (cheapest among ties): feasible whenever any is."""
    mem = np.where(eng.valid, eng.mem, np.inf)
    least = mem.min(axis=1, keepdims=True)
    return np.argmin(np.where(mem <= least + 1e-12 * np.abs(least), eng.cost, np.inf), axis=1)


def _bracket(eng: _LocalSearch, fits, deadline: float) -> Tuple[float, float]:
    """(lo, hi): lambda = lo gives too much memory, hi fits. Starts at the median ratio of
    a node's cost spread to its memory spread and moves by factors of 10; never beyond
    lambda_max = 2 (total cost spread) / (smallest memory step), where every node takes
    its least-memory strategy (already a candidate)."""
    cost = np.where(eng.valid, eng.cost, np.nan)
    mem = np.where(eng.valid, eng.mem, np.nan)
    cost_spread = np.nanmax(cost, 1) - np.nanmin(cost, 1)
    mem_spread = np.nanmax(mem, 1) - np.nanmin(mem, 1)
    steps = np.diff(np.sort(np.where(eng.valid, eng.mem, eng.mem.max()), axis=1), axis=1)
    spread = cost_spread.sum()
    if eng.w.size:
        spread += np.ptp(eng.w.reshape(len(eng.w), -1), axis=1).sum()
    lam_max = 2.0 * max(spread, 1e-300) / steps[steps > 0].min()
    ratios = cost_spread[mem_spread > 0] / mem_spread[mem_spread > 0]
    lam = min(float(np.median(ratios)) if (ratios > 0).any() else lam_max * 1e-6, lam_max)
    lam = max(lam, lam_max * 1e-12)
    if fits(lam):
        for _ in range(6):
            if time.perf_counter() > deadline or not fits(lam / 10):
                return lam / 10, lam
            lam /= 10
        return lam / 10, lam
    while lam * 10 < lam_max and time.perf_counter() < deadline:
        if fits(lam * 10):
            return lam, lam * 10
        lam *= 10
    return lam, lam_max


# ---------------------------------------------------------------- entry points


def solve(problem: Problem, level: str = 'fast', time_limit: float = 60.0) -> Solution:
    """One strategy per node minimizing T(c) subject to M(c) <= budget and the groups."""
    if level not in LEVELS:
        raise ValueError(f'level must be one of {LEVELS}, got {level!r}')
    t0 = time.perf_counter()
    problem.validate()
    if problem.num_nodes == 0:
        _check_budget(problem.budget, 0.0)
        return Solution([], 0.0, 0.0, level, time.perf_counter() - t0)
    red = _reduce(problem)
    _check_budget(problem.budget, red.min_memory())
    if level == 'optimal':
        reduced_choice = _solve_ilp(red, problem.budget, time_limit)
    else:
        reduced_choice = _solve_fast(red, problem.budget, time_limit)
    choice = [int(reduced_choice[g]) for g in red.owner]
    return Solution(choice, problem.objective(choice), problem.memory_of(choice), level,
                    time.perf_counter() - t0)


def brute_force(problem: Problem) -> Solution:
    """Every group-consistent choice, evaluated on the original (uncontracted) problem."""
    t0 = time.perf_counter()
    problem.validate()
    owner = _contract(problem)
    sizes = [0] * (int(owner.max()) + 1 if owner.size else 0)
    for i, c in enumerate(problem.node_costs):
        sizes[owner[i]] = c.size
    total = math.prod(sizes)
    if total > BRUTE_FORCE_LIMIT:
        raise ValueError(f'brute force over {total} choices exceeds {BRUTE_FORCE_LIMIT}')
    combos = np.indices(sizes, dtype=np.int64).reshape(len(sizes), total).T[:, owner]   # [total, n]
    obj = np.zeros(total)
    mem = np.zeros(total)
    for i, c in enumerate(problem.node_costs):
        obj += c[combos[:, i]]
        if problem.memory is not None:
            mem += problem.memory[i][combos[:, i]]
    for e in problem.edges:
        obj += e.cost[combos[:, e.src], combos[:, e.dst]]
    if problem.budget is not None:
        _check_budget(problem.budget, float(mem.min()))
        obj = np.where(mem <= problem.budget + _budget_tol(problem.budget), obj, np.inf)
    choice = [int(s) for s in combos[int(np.argmin(obj))]]
    return Solution(choice, problem.objective(choice), problem.memory_of(choice), 'brute_force',
                    time.perf_counter() - t0)
