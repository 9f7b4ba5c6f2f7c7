"""Search time of the planner (``colossal_lite.auto``) from a hand-written cluster profile.

For GPT models of 12 to 48 layers on 8 to 64 devices of the ``nodes4x8`` profile (nodes of
8 A100s, extended to the device count), times ``search`` (every executable candidate
costed) and the whole ``plan()`` (search + ``check_layout`` with a meta build of the chosen
layout + the per-layer DP and the BMW cut), median of 5 repeats. The acceptance bar:
48 layers on 64 devices well under 1 s (Galvatron-BMW reports hundreds of seconds for its
DP search).

Run: ``PYTHONPATH=. python benchmarks/planner_search_time.py`` ->
benchmarks/results/planner_search_time.json
"""
from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import model_zoo  # noqa: E402,F401
from benchmarks._common import environment, print_table, write_json  # noqa: E402
from colossal_lite.auto import load_profile, plan  # noqa: E402
from colossal_lite.auto.model_spec import model_shape  # noqa: E402
from colossal_lite.auto.search import search  # noqa: E402

# (preset, overrides, devices, global batch, memory GiB); gpt2-xl with 32 heads (its 25
# heads split over no tensor size) so every tensor family is searched
CASES = [('gpt2-small', {}, 8, 64, 16), ('gpt2-medium', {}, 16, 128, 16),
         ('gpt2-large', {}, 32, 256, 16), ('gpt2-xl', dict(heads=32), 64, 512, 40)]
REPEATS = 5
SEQ = 1024


def _median_time(fn) -> float:
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    base = load_profile('nodes4x8')
    rows = [['model', 'layers', 'devices', 'candidates', 'search s', 'plan() s', 'chosen',
             'step ms', 'GiB']]
    records = []
    for preset, overrides, devices, batch, mem in CASES:
        shape = model_shape('gpt', preset, seq=SEQ, **overrides)
        prof = base.with_devices(devices, mem * 2 ** 30)
        result = search(shape, prof, devices, batch)
        t_search = _median_time(lambda: search(shape, prof, devices, batch))
        t_plan = _median_time(lambda: plan(f'gpt:{preset}', devices=devices, memory_gb=mem,
                                           cluster=base, batch=batch, seq=SEQ, **overrides))
        chosen = plan(f'gpt:{preset}', devices=devices, memory_gb=mem, cluster=base,
                      batch=batch, seq=SEQ, **overrides)
        est = chosen.estimate
        records.append(dict(model=preset, overrides=overrides, layers=shape.layers,
                            devices=devices, batch=batch, seq=SEQ, memory_gib=mem,
                            candidates=result.evaluated, feasible=len(result.feasible),
                            search_s=t_search, plan_s=t_plan,
                            chosen=est.candidate.describe(), step_time_s=est.step_time,
                            memory_per_device_gib=est.peak_memory / 2 ** 30,
                            per_layer=chosen.per_layer))
        rows.append([preset, shape.layers, devices, result.evaluated, f'{t_search:.3f}',
                     f'{t_plan:.3f}', est.candidate.describe(), f'{est.step_time * 1e3:.1f}',
                     f'{est.peak_memory / 2 ** 30:.2f}'])
    print_table(rows)
    path = write_json('planner_search_time', dict(
        profile='nodes4x8 (extended to the device count)', repeats=REPEATS,
        units='seconds, median of repeats, one process', results=records,
        environment=environment()))
    print('wrote', path)
    return records


if __name__ == '__main__':
    main()
