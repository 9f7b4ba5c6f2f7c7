"""Time of the graph solver's ``fast`` level (``auto/graph/solver.py``) against the graph size.

Random problems shaped like a captured model: ``n`` decisions of 20 strategies each, 2n edges
from each node to a node a geometric(0.05) distance ahead (skip connections), 10 repeated
blocks of 100 nodes sharing their decisions, and a memory budget at 30% of the way from the
least memory to the mean (it binds, so the Lagrangian search runs). Median of ``--repeats``
solves per size. The target (issue 23): 5,000 nodes within 3 s; a linear pass should take
about twice as long at twice the size.

The unit test (tests/test_graph_solver.py) solves the same 5,000-node problem and checks the
plan is valid; the time is measured here, not there (a slow CI host took 3.3 s).

Run: ``PYTHONPATH=. python benchmarks/graph_solver_time.py`` ->
benchmarks/results/graph_solver_time.json
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from benchmarks._common import environment, print_table, write_json  # noqa: E402
from colossal_lite.auto.graph.solver import Edge, Problem, solve  # noqa: E402


def least_memory(problem: Problem) -> float:
    """Sum over groups (disjoint here) and ungrouped nodes of the least memory."""
    grouped = {i for g in problem.groups for i in g}
    least = sum(sum(problem.memory[i] for i in g).min() for g in problem.groups)
    return least + sum(m.min() for i, m in enumerate(problem.memory) if i not in grouped)


def synthetic_problem(n: int = 5000, strategies: int = 20, seed: int = 0) -> Problem:
    """The module doc's problem with ``n`` nodes (n >= 1000)."""
    rng = np.random.default_rng(seed)
    costs = list(rng.random((n, strategies)))
    memory = list(rng.integers(1, 1 << 20, size=(n, strategies)).astype(float))
    src = rng.integers(0, n - 1, size=2 * n)
    dst = np.minimum(src + 1 + rng.geometric(0.05, size=src.size), n - 1)
    edges = [Edge(int(a), int(b), m)
             for a, b, m in zip(src, dst, rng.random((src.size, strategies, strategies)))]
    groups = [list(range(k, 1000, 100)) for k in range(100)]      # 10 repeated blocks of 100
    problem = Problem(costs, edges, memory=memory, groups=groups)
    least = least_memory(problem)
    problem.budget = float(least + 0.3 * (sum(m.mean() for m in memory) - least))
    return problem


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--sizes', type=int, nargs='+', default=[1000, 2500, 5000, 10000])
    parser.add_argument('--repeats', type=int, default=5)
    args = parser.parse_args()
    rows, results = [['nodes', 'edges', 'median s', 'min s', 'max s', 'objective']], []
    for n in args.sizes:
        problem = synthetic_problem(n)
        seconds, objective = [], None
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            sol = solve(problem, level='fast')
            seconds.append(time.perf_counter() - t0)
            assert sol.memory <= problem.budget
            objective = sol.objective
        results.append({'nodes': n, 'edges': len(problem.edges), 'seconds': seconds,
                        'median_s': statistics.median(seconds), 'objective': objective})
        rows.append([n, len(problem.edges), f'{statistics.median(seconds):.2f}',
                     f'{min(seconds):.2f}', f'{max(seconds):.2f}', f'{objective:.1f}'])
    print_table(rows)
    at_5000 = [r['median_s'] for r in results if r['nodes'] == 5000]
    path = write_json('graph_solver_time', {
        'args': vars(args), 'environment': environment(), 'sizes': results,
        'target': 'fast solve of 5,000 nodes x 20 strategies x 10,000 edges <= 3 s',
        'meets_target': bool(at_5000 and at_5000[0] <= 3.0)})
    print(f'wrote {path}')


if __name__ == '__main__':
    main()
