"""ZB-H1 (zero-bubble, same activation memory as 1F1B): backward split into B (input
gradient) and W (weight gradient); W passes fill the time a rank would wait.

The generator plays the schedule on the dry run's unit-cost clock (``actions.costs``):
every rank keeps 1F1B's order of F and B (``generators.one_f_one_b``), and before an F or B
whose input arrives later than the rank is free, or when it already holds P micro-batches'
activations (1F1B's peak; one is held until its W), it runs a pending W instead; the W
passes left at the end close the step. The result is a static per-rank order, lowered and
checked like any other schedule.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from .actions import B, F, W, Action, Order, PipeShape, costs
from .generators import one_f_one_b


def _input_time(shape: PipeShape, a: Action, ends: Dict[Tuple[str, int, int], float]
                ) -> Optional[float]:
    """When the input of F/B ``a`` is available (None: not produced yet)."""
    if a.kind == F:
        return 0.0 if a.stage == 0 else ends.get((F, a.stage - 1, a.microbatch))
    if a.stage == shape.stages - 1:
        return ends.get((F, a.stage, a.microbatch))
    return ends.get((B, a.stage + 1, a.microbatch))


def zero_bubble_h1(shape: PipeShape) -> Dict[int, Order]:
    """The compute order of every rank (module doc); V = 1."""
    P = shape.ranks
    cost = costs(split=True)
    queues = {r: list(one_f_one_b(shape, r)) for r in range(P)}
    pending: Dict[int, List[Action]] = {r: [] for r in range(P)}
    clock = {r: 0.0 for r in range(P)}
    held = {r: 0 for r in range(P)}
    ends: Dict[Tuple[str, int, int], float] = {}
    orders: Dict[int, Order] = {r: [] for r in range(P)}

    def run(rank: int, a: Action, start: float):
        clock[rank] = start + cost[a.kind]
        ends[(a.kind, a.stage, a.microbatch)] = clock[rank]
        orders[rank].append(a)
        held[rank] += 1 if a.kind == F else -1 if a.kind == W else 0
        if a.kind == B:
            pending[rank].append(Action(W, a.stage, a.microbatch))

    while any(queues.values()):
        best = None  # (time the rank can act, rank)
        for r in range(P):
            if not queues[r]:
                continue
            ready = _input_time(shape, queues[r][0], ends)
            when = max(clock[r], ready) if ready is not None else None
            if pending[r] and (when is None or when > clock[r]
                               or (queues[r][0].kind == F and held[r] >= P)):
                when = clock[r]  # a W fills the wait (or keeps memory at 1F1B's bound)
            if when is not None and (best is None or when < best[0]):
                best = (when, r)
        when, r = best
        nxt = queues[r][0]
        ready = _input_time(shape, nxt, ends)
        full = nxt.kind == F and held[r] >= P
        if pending[r] and (ready is None or ready > clock[r] or full):
            run(r, pending[r].pop(0), clock[r])
        else:
            run(r, queues[r].pop(0), max(clock[r], ready))
    for r in range(P):
        for a in pending[r]:
            run(r, a, clock[r])
    return orders
