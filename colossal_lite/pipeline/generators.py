"""Compute orders of the one-stage-per-rank and interleaved schedules, one function each.

A generator gives one rank's order of compute actions (``actions.py``); ``schedules.py``
dispatches by name, lowers and checks. ZB-H1 (``zero_bubble.py``) starts from
:func:`one_f_one_b`.
"""
from __future__ import annotations

from .actions import B, F, Action, Order, PipeShape


def gpipe(shape: PipeShape, rank: int) -> Order:
    """All forwards, then all backwards (V = 1)."""
    s, m = rank, range(shape.microbatches)
    return [Action(F, s, i) for i in m] + [Action(B, s, i) for i in m]


def one_f_one_b(shape: PipeShape, rank: int) -> Order:
    """PipeDream-flush: P-1-r warm-up forwards, then one forward / one backward, then the
    remaining backwards (V = 1). At most P-r micro-batches in flight on rank r."""
    s, M = rank, shape.microbatches
    warmup = min(shape.ranks - 1 - rank, M)
    order = [Action(F, s, i) for i in range(warmup)]
    for i in range(M - warmup):
        order += [Action(F, s, warmup + i), Action(B, s, i)]
    order += [Action(B, s, i) for i in range(M - warmup, M)]
    return order


def interleaved_1f1b(shape: PipeShape, rank: int) -> Order:
    """Megatron's interleaved 1F1B: micro-batches go through the V chunks of a rank in
    groups of P; ``(P-1-r)*2 + (V-1)*P`` warm-up forwards, then 1F1B over the
    (chunk, micro-batch) sequence, backwards taking the chunks in reverse."""
    P, V, M = shape.ranks, shape.chunks, shape.microbatches
    total = M * V

    def unit(k: int, forward: bool):
        group, within = divmod(k, P * V)
        chunk = within // P
        if not forward:
            chunk = V - 1 - chunk
        return chunk * P + rank, group * P + within % P

    warmup = min(total, (P - 1 - rank) * 2 + (V - 1) * P)
    order = [Action(F, *unit(k, True)) for k in range(warmup)]
    for k in range(total - warmup):
        order += [Action(F, *unit(warmup + k, True)), Action(B, *unit(k, False))]
    order += [Action(B, *unit(k, False)) for k in range(total - warmup, total)]
    return order
