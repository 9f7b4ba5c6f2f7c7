"""Shared benchmark helpers: alternated side-by-side timing, medians, table and JSON output."""
from __future__ import annotations

import json
import os
import platform
import statistics
import time
from typing import Callable, Dict, List, Optional

import torch

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'results')


def time_alternated(runs: Dict[str, Callable[[], None]], repeats: int, steps: int,
                    warmup: int = 2, cpu_times: Optional[Dict[str, List[float]]] = None
                    ) -> Dict[str, List[float]]:
    """Wall seconds per step of each callable: ``repeats`` rounds, each running every
    callable ``steps`` times, the order reversed every other round so neither side always
    goes first. ``cpu_times`` (a dict, optional) receives the same table measured with
    ``time.process_time`` (this process's CPU time, all its threads: robust to the time
    a process waits descheduled on a shared, oversubscribed machine)."""
    for fn in runs.values():
        for _ in range(warmup):
            fn()
    names = list(runs)
    times: Dict[str, List[float]] = {n: [] for n in names}
    cpu = cpu_times if cpu_times is not None else {}
    cpu.update({n: [] for n in names})
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            wall0, cpu0 = time.perf_counter(), time.process_time()
            for _ in range(steps):
                runs[name]()
            cpu[name].append((time.process_time() - cpu0) / steps)
            times[name].append((time.perf_counter() - wall0) / steps)
    return times


def ratio_summary(times: Dict[str, List[float]], ours: str, theirs: str) -> dict:
    """Medians, and the median of the per-round ratios (robust to drifts in machine load)."""
    per_round = [a / b for a, b in zip(times[ours], times[theirs])]
    return {'median_s_per_step': {k: statistics.median(v) for k, v in times.items()},
            'ratio_ours_over_theirs': statistics.median(per_round),
            'per_round_ratios': per_round}


def timed_ratios(runs: Dict[str, Callable[[], None]], ours: str, theirs: str, repeats: int,
                 steps: int, warmup: int = 2) -> dict:
    """``{'wall': ratio_summary, 'cpu': ratio_summary, 'times_s_per_step': {...}}``."""
    cpu: Dict[str, List[float]] = {}
    wall = time_alternated(runs, repeats, steps, warmup, cpu_times=cpu)
    return {'wall': ratio_summary(wall, ours, theirs), 'cpu': ratio_summary(cpu, ours, theirs),
            'times_s_per_step': {'wall': wall, 'cpu': cpu}}


def adamw_step(model, loss_fn, ids) -> Callable[[], None]:
    """One training step of ``model`` (AdamW, lr 1e-4) on ``loss_fn(model, ids)``, as a
    callable for :func:`timed_ratios`. The optimizer is set up as ``initialize`` sets it
    (``foreach`` over DTensor parameters: ``engine/foreach.py``; torch's default else)."""
    from colossal_lite.engine.foreach import prefer_foreach
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    prefer_foreach(opt)

    def step():
        opt.zero_grad(set_to_none=True)
        loss_fn(model, ids).backward()
        opt.step()
    return step


def load_average() -> List[float]:
    return list(os.getloadavg())


def environment() -> dict:
    return {'torch': torch.__version__, 'python': platform.python_version(),
            'load_average_1_5_15_min': load_average(),
            'threads': torch.get_num_threads(), 'cpu_count': os.cpu_count(),
            'machine': platform.machine()}


def write_json(name: str, payload: dict) -> str:
    os.makedirs(RESULTS_DIR, exist_ok=True)
    path = os.path.join(RESULTS_DIR, f'{name}.json')
    with open(path, 'w') as f:
        json.dump(payload, f, indent=2, sort_keys=True)
    return path


def print_table(rows: List[List[str]]):
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print('  '.join(str(c).ljust(w) for c, w in zip(row, widths)))
