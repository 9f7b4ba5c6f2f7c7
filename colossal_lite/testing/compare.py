"""Comparing a parallel run with the serial model: one measure, one check with a clear message.

``max_rel_diff`` is the suite's fp32 measure (max |a - e| / max(1, max |e|)).
:func:`assert_matches_serial` compares training traces (``trace.py``) step by step and
key by key and names the first step and key that differ, by how much, and on which rank.
``tol`` is a number or a dict by kind of key (``'loss'``, ``'output'``, ``'grad'``,
``'param'``, an extra's name, and ``'default'``), so a check can be exact for one kind
and loose for another (e.g. bf16 gradients).
"""
from __future__ import annotations

import math
from typing import Dict, Iterator, List, Mapping, Sequence, Tuple, Union

import torch

from .trace import Trace, kind_of

Tol = Union[float, Mapping[str, float]]


def max_rel_diff(actual, expected) -> float:
    """max |actual - expected| / max(1, max |expected|): the suite's fp32 comparison measure
    (infinite when either side holds a NaN or an infinity)."""
    actual, expected = torch.as_tensor(actual).float(), torch.as_tensor(expected).float()
    if actual.shape != expected.shape:
        raise AssertionError(f'shape {tuple(actual.shape)} != expected {tuple(expected.shape)}')
    if not expected.numel():
        return 0.0
    # one read-back; max propagates NaN, and a NaN or an infinity on either side makes the
    # difference or the scale non-finite (NaN compares False with any tolerance: never pass)
    diff, scale = torch.stack([(actual - expected).abs().max(), expected.abs().max()]).tolist()
    if not (math.isfinite(diff) and math.isfinite(scale)):
        return float('inf')
    return diff / max(1.0, scale)


def assert_close_dict(actual: dict, expected: dict, tol: float = 1e-5, what: str = ''):
    """Same keys, every tensor within ``tol`` (max_rel_diff); the message names the worst key."""
    missing = set(expected) ^ set(actual)
    if missing:
        raise AssertionError(f'{what} keys differ: {sorted(missing)}')
    worst = max(((max_rel_diff(actual[k], expected[k]), k) for k in expected), default=(0.0, None))
    if worst[0] > tol:
        raise AssertionError(f'{what} {worst[1]} differs by {worst[0]:.3g} > {tol}')


def tolerance(key: str, tol: Tol) -> float:
    """The tolerance of ``key`` under ``tol`` (a number, or a dict by kind with 'default')."""
    if isinstance(tol, Mapping):
        kind = kind_of(key)
        if kind in tol:
            return tol[kind]
        if 'default' not in tol:
            raise KeyError(f'no tolerance for {kind!r} (key {key!r}) in {dict(tol)}; '
                           f"add it or a 'default'")
        return tol['default']
    return tol


def _as_ranks(parallel: Union[Trace, Sequence[Trace]]) -> List[Trace]:
    return [parallel] if isinstance(parallel, Trace) else list(parallel)


def _held(traces: List[Trace], step: int, key: str) -> Iterator[Tuple[int, object]]:
    """(rank, value) of every rank whose trace holds ``key`` at ``step``."""
    for rank, trace in enumerate(traces):
        if step < len(trace.steps) and key in trace.steps[step]:
            yield rank, trace.steps[step][key]


def _check_keys(traces: List[Trace], serial: Trace):
    steps = max(len(t.steps) for t in traces)
    if steps != len(serial.steps):
        raise AssertionError(f'the parallel run recorded {steps} steps, the serial one '
                             f'{len(serial.steps)}')
    for step, expected in enumerate(serial.steps):
        held = set().union(*(t.steps[step] for t in traces if step < len(t.steps)))
        missing, extra = sorted(set(expected) - held), sorted(held - set(expected))
        if missing or extra:
            raise AssertionError(f'step {step}: keys only in the serial trace: {missing[:8]}'
                                 f'{" ..." if len(missing) > 8 else ""}; only in the parallel '
                                 f'trace: {extra[:8]}{" ..." if len(extra) > 8 else ""}')


def merge_traces(traces: Sequence[Trace], tol: Tol = 1e-5) -> Trace:
    """One trace from per-rank traces: the union of their keys, step by step. Where several
    ranks hold a key (replicas, a tied weight on two pipeline stages, the loss on every
    last-stage rank) their values must agree within ``tol`` (checked; the message names
    the ranks); the lowest rank's value is kept."""
    traces = list(traces)
    merged = Trace()
    for step in range(max(len(t.steps) for t in traces)):
        keys = dict.fromkeys(k for t in traces if step < len(t.steps) for k in t.steps[step])
        record = {}
        for key in keys:
            (first_rank, first), *others = _held(traces, step, key)
            for rank, value in others:
                if torch.equal(value, first):   # the common case: bitwise replicas
                    continue
                diff = _diff(value, first, f'step {step} {key} (rank {rank} vs {first_rank})')
                if diff > tolerance(key, tol):
                    raise AssertionError(f'step {step} {key}: rank {rank} differs from rank '
                                         f'{first_rank} by {diff:.3g} > {tolerance(key, tol)}')
            record[key] = first
        merged.steps.append(record)
    return merged


def _diff(actual, expected, where: str) -> float:
    try:
        return max_rel_diff(actual, expected)
    except AssertionError as err:   # a shape mismatch: name the value
        raise AssertionError(f'{where}: {err}') from None


def _worst_copy(traces: List[Trace], step: int, key: str, expected) -> Tuple[float, int]:
    """(largest difference from ``expected`` over the ranks holding ``key``, the first
    rank with it)."""
    worst, seen = (-1.0, -1), []
    for rank, got in _held(traces, step, key):
        if any(torch.equal(got, other) for other in seen):
            continue   # a bitwise copy of a value already compared (replicas)
        seen.append(got)
        diff = _diff(got, expected, f'step {step} {key} (rank {rank})')
        if diff > worst[0]:
            worst = (diff, rank)
    return worst


def trace_diffs(parallel: Union[Trace, Sequence[Trace]],
                serial: Trace) -> Dict[Tuple[int, str], Tuple[float, int]]:
    """``{(step, key): (worst difference over the ranks holding it, that rank)}`` in the
    serial trace's order; the keys must be the same (checked)."""
    traces = _as_ranks(parallel)
    _check_keys(traces, serial)
    return {(step, key): _worst_copy(traces, step, key, value)
            for step, expected in enumerate(serial.steps) for key, value in expected.items()}


def assert_matches_serial(parallel: Union[Trace, Sequence[Trace]], serial: Trace,
                          tol: Tol = 1e-5):
    """Every step's loss, outputs, gradients, parameters (and extras) of ``parallel`` -- one
    trace, or the per-rank traces of a run, every rank's copy of a key checked -- equal
    ``serial``'s within ``tol``; ranks holding the same key agree (:func:`merge_traces`).
    The message names the first step and key that differ, by how much, and the worst."""
    traces = _as_ranks(parallel)
    diffs = trace_diffs(traces, serial)
    failed = [(k, d) for k, d in diffs.items() if d[0] > tolerance(k[1], tol)]
    if failed:
        (step, key), (diff, rank) = failed[0]
        (w_step, w_key), (worst, w_rank) = max(failed, key=lambda kd: kd[1][0])
        raise AssertionError(
            f'step {step} {key} (rank {rank}) differs from serial by {diff:.3g} > '
            f'{tolerance(key, tol)}; {len(failed)} of {len(diffs)} values differ, the worst '
            f'step {w_step} {w_key} (rank {w_rank}) by {worst:.3g}')
    merge_traces(traces, tol)
