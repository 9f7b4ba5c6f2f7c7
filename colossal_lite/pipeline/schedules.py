"""Pipeline schedules as data: per-rank lists of actions, made by small generators.

Stage ``s`` of ``S = P*V`` stages lives on rank ``s % P`` (V virtual stages per rank,
rank r holding stages r, r+P, ...). A schedule is ``{rank: [Action, ...]}``:

* compute actions ``F`` (forward), ``B`` (backward; the input gradient only when the
  schedule splits backward), ``W`` (weight gradient of a split backward) of
  micro-batch ``m`` on stage ``s``;
* communication ``SEND_F``/``RECV_F`` (activation from stage s to s+1) and
  ``SEND_B``/``RECV_B`` (gradient from stage s to s-1), added by :func:`lower`: the
  sender's SEND follows its compute, the receiver's RECV comes right before the compute
  that needs it. Sends are non-blocking, receives block (``simulator.py`` checks that
  this never deadlocks and that every send meets its receive).

Each generator gives the compute order of one rank; a new schedule is a new generator,
not a new runtime.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List

F, B, W = 'F', 'B', 'W'
SEND_F, RECV_F, SEND_B, RECV_B = 'SEND_F', 'RECV_F', 'SEND_B', 'RECV_B'
COMPUTE = (F, B, W)


@dataclass(frozen=True)
class Action:
    kind: str
    stage: int
    microbatch: int

    def __repr__(self) -> str:
        return f'{self.kind}{self.stage}.{self.microbatch}'


@dataclass(frozen=True)
class PipeShape:
    """P ranks, V stages per rank, M micro-batches."""

    ranks: int
    chunks: int
    microbatches: int

    @property
    def stages(self) -> int:
        return self.ranks * self.chunks

    def rank_of(self, stage: int) -> int:
        return stage % self.ranks

    def stages_of(self, rank: int) -> List[int]:
        return [rank + v * self.ranks for v in range(self.chunks)]


Order = List[Action]
Generator = Callable[[PipeShape, int], Order]


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


GENERATORS: Dict[str, Generator] = {'gpipe': gpipe, '1f1b': one_f_one_b,
                                    'interleaved': interleaved_1f1b}
SPLIT_BACKWARD = ('zero_bubble',)


def compute_orders(name: str, shape: PipeShape) -> Dict[int, Order]:
    """The compute order of every rank for schedule ``name``."""
    if name == 'zero_bubble':
        from .zero_bubble import zero_bubble_h1
        return zero_bubble_h1(shape)
    if name not in GENERATORS:
        raise ValueError(f"unknown pipeline schedule {name!r}; schedules: "
                         f"{sorted(GENERATORS) + list(SPLIT_BACKWARD)}")
    return {r: GENERATORS[name](shape, r) for r in range(shape.ranks)}


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
    from .simulator import simulate
    shape = PipeShape(ranks, chunks, microbatches)
    check_shape(name, shape)
    actions = lower(shape, compute_orders(name, shape))
    simulate(shape, actions)
    return actions


def check_shape(name: str, shape: PipeShape):
    """The combinations a schedule cannot run, as ValueErrors naming the numbers."""
    P, V, M = shape.ranks, shape.chunks, shape.microbatches
    if min(P, V, M) < 1:
        raise ValueError(f'pipeline ranks, chunks and micro-batches must be >= 1, got {P}, {V}, {M}')
    if name != 'interleaved' and V != 1:
        raise ValueError(f"schedule {name!r} runs one stage per rank; chunks={V} needs "
                         f"schedule 'interleaved'")
    if name == 'interleaved' and M % P:
        raise ValueError(f'the interleaved schedule needs num_microbatches divisible by the '
                         f'pipeline size {P}, got {M}')
    if name in ('1f1b', 'interleaved', 'zero_bubble') and M < P:
        raise ValueError(f'schedule {name!r} needs num_microbatches >= pipeline size {P}, got {M}')
