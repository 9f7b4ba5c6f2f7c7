"""Pipeline schedules by name: generate each rank's compute order, lower it, dry-run it.

The vocabulary (:class:`Action`, :class:`PipeShape`, the action kinds) is ``actions.py``;
the generators are ``generators.py`` (GPipe, 1F1B, interleaved: one small function per
schedule giving one rank's compute order) and ``zero_bubble.py`` (ZB-H1); what a schedule
admits (P, V, M) is its row of the schedule table (``colossal_lite/config/schedules.py``).
This module sits above them all:

* :func:`compute_orders` dispatches by name;
* :func:`lower` adds the point-to-point actions: the sender's SEND follows its compute, the
  receiver's RECV comes right before the compute that needs it. Sends are non-blocking,
  receives block (``simulator.py`` checks that this never deadlocks and that every send
  meets its receive);
* :func:`build_schedule` does all three.

A new schedule is a new generator and a table row, not a new runtime.
"""
from __future__ import annotations

from typing import Callable, Dict

from ..config.schedules import SCHEDULES
from .actions import (B, COMPUTE, F, RECV_B, RECV_F, SEND_B, SEND_F, W, Action, Order,
                      PipeShape, RankGenerator)
from .generators import gpipe, interleaved_1f1b, one_f_one_b
from .simulator import simulate
from .zero_bubble import zero_bubble_h1

__all__ = ['B', 'COMPUTE', 'F', 'RECV_B', 'RECV_F', 'SEND_B', 'SEND_F', 'W', 'Action', 'Order',
           'PipeShape', 'GENERATORS', 'SPLIT_BACKWARD', 'build_schedule', 'check_shape',
           'compute_orders', 'gpipe', 'interleaved_1f1b', 'lower', 'one_f_one_b']


def _every_rank(generator: RankGenerator) -> Callable[[PipeShape], Dict[int, Order]]:
    return lambda shape: {r: generator(shape, r) for r in range(shape.ranks)}


# schedule name -> shape -> {rank: compute order}
GENERATORS: Dict[str, Callable[[PipeShape], Dict[int, Order]]] = {
    'gpipe': _every_rank(gpipe), '1f1b': _every_rank(one_f_one_b),
    'interleaved': _every_rank(interleaved_1f1b), 'zero_bubble': zero_bubble_h1}
SPLIT_BACKWARD = tuple(name for name, row in SCHEDULES.items() if row.split_backward)


def compute_orders(name: str, shape: PipeShape) -> Dict[int, Order]:
    """The compute order of every rank for schedule ``name``."""
    if name not in GENERATORS:
        raise ValueError(f"unknown pipeline schedule {name!r}; schedules: {sorted(GENERATORS)}")
    return GENERATORS[name](shape)


def lower(shape: PipeShape, orders: Dict[int, Order]) -> Dict[int, Order]:
    """Insert the point-to-point actions: a SEND after the compute that produces what another
    rank needs, the RECV just before the compute on that rank that consumes it."""
    out: Dict[int, Order] = {}
    last = shape.stages - 1
    for rank, order in orders.items():
        actions: Order = []
        for a in order:
            if a.kind == F and a.stage > 0 and shape.rank_of(a.stage - 1) != rank:
                actions.append(Action(RECV_F, a.stage, a.microbatch))
            if a.kind == B and a.stage < last and shape.rank_of(a.stage + 1) != rank:
                actions.append(Action(RECV_B, a.stage, a.microbatch))
            actions.append(a)
            if a.kind == F and a.stage < last and shape.rank_of(a.stage + 1) != rank:
                actions.append(Action(SEND_F, a.stage, a.microbatch))
            if a.kind == B and a.stage > 0 and shape.rank_of(a.stage - 1) != rank:
                actions.append(Action(SEND_B, a.stage, a.microbatch))
        out[rank] = actions
    return out


def build_schedule(name: str, ranks: int, microbatches: int, chunks: int = 1) -> Dict[int, Order]:
    """Generated, lowered and simulated per-rank action lists (raises if they deadlock)."""
    shape = PipeShape(ranks, chunks, microbatches)
    check_shape(name, shape)
    actions = lower(shape, compute_orders(name, shape))
    simulate(shape, actions)
    return actions


def check_shape(name: str, shape: PipeShape):
    """The combinations a schedule cannot run (its table row's check), as ValueErrors naming
    the numbers."""
    P, V, M = shape.ranks, shape.chunks, shape.microbatches
    if min(P, V, M) < 1:
        raise ValueError(f'pipeline ranks, chunks and micro-batches must be >= 1, got {P}, {V}, {M}')
    if name not in GENERATORS:
        raise ValueError(f"unknown pipeline schedule {name!r}; schedules: {sorted(GENERATORS)}")
    why = SCHEDULES[name].check(P, V, M)
    if why:
        raise ValueError(why)
