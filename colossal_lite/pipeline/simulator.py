"""Dry run of a lowered schedule: deadlock, unmatched messages, broken dependencies, timing.

Semantics are the runtime's: sends never block, a receive blocks until its matching
send was issued, compute runs in list order. The dry run executes every rank as far
as it can; if no rank can move and some have actions left, the schedule deadlocks
(:class:`ScheduleError` names each stuck rank's next action). It also checks that each
compute has its inputs (the previous stage's forward, received if on another rank;
the next stage's backward for a backward; its own backward for a weight gradient),
that every send is received exactly once by the right rank, and that every stage
runs every micro-batch's F and B (and W when backward is split) exactly once.

Timing uses unit costs (F = 1, B = 2 unsplit or 1 + W = 1 split, messages free): the
result gives per-rank busy intervals, the makespan and the idle fraction
``1 - busy / makespan``, and the peak number of micro-batches whose activations a
rank holds (forwards whose backward -- or weight gradient, if split -- has not run).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Tuple

from .actions import (B, COMPUTE, F, RECV_B, RECV_F, SEND_B, SEND_F, W, Action, Order,
                      PipeShape, costs)


class ScheduleError(ValueError):
    """A schedule that would hang or compute with missing inputs."""


@dataclass
class SimResult:
    makespan: float
    busy: Dict[int, List[Tuple[float, float, Action]]] = field(default_factory=dict)
    peak_in_flight: Dict[int, int] = field(default_factory=dict)

    def idle_fraction(self, rank: int) -> float:
        work = sum(end - start for start, end, _ in self.busy[rank])
        return 1.0 - work / self.makespan if self.makespan else 0.0


def _message_key(action: Action) -> Tuple[str, int, int]:
    """(direction, receiving stage, micro-batch) of a send or receive."""
    if action.kind == SEND_F:
        return F, action.stage + 1, action.microbatch
    if action.kind == SEND_B:
        return B, action.stage - 1, action.microbatch
    return (F if action.kind == RECV_F else B), action.stage, action.microbatch


class _Run:
    def __init__(self, shape: PipeShape, actions: Dict[int, Order], forward_only: bool = False):
        self.shape, self.actions, self.forward_only = shape, actions, forward_only
        self.split = any(a.kind == W for order in actions.values() for a in order)
        self.cost = costs(self.split)
        self.pos = {r: 0 for r in actions}
        self.clock = {r: 0.0 for r in actions}
        self.done: Dict[Tuple[str, int, int], float] = {}       # (kind, stage, mb) -> end
        self.posted: Dict[Tuple[str, int, int], Tuple[float, int]] = {}  # key -> (time, sender)
        self.received: Dict[int, set] = {r: set() for r in actions}
        self.result = SimResult(0.0, {r: [] for r in actions}, {r: 0 for r in actions})
        self.in_flight = {r: 0 for r in actions}

    def fail(self, rank: int, action: Action, why: str):
        raise ScheduleError(f'rank {rank}, action {action!r}: {why}')

    def has_input(self, rank: int, key: Tuple[str, int, int], action: Action) -> bool:
        """Whether ``key`` was computed on this rank or received from another one."""
        if key in self.received[rank]:
            return True
        stage = key[1]
        if self.shape.rank_of(stage) == rank:
            return key in self.done
        return False

    def step(self, rank: int) -> bool:
        """Run the next action of ``rank`` if it can run; whether it did."""
        a = self.actions[rank][self.pos[rank]]
        if a.kind in (RECV_F, RECV_B):
            if self.shape.rank_of(a.stage) != rank:
                self.fail(rank, a, f'stage {a.stage} lives on rank {self.shape.rank_of(a.stage)}')
            key = _message_key(a)
            if key not in self.posted:
                return False
            when, sender = self.posted.pop(key)
            self.received[rank].add((key[0], key[1] - 1 if key[0] == F else key[1] + 1, key[2]))
            self.clock[rank] = max(self.clock[rank], when)
        elif a.kind in (SEND_F, SEND_B):
            source = (F if a.kind == SEND_F else B, a.stage, a.microbatch)
            if source not in self.done or self.shape.rank_of(a.stage) != rank:
                self.fail(rank, a, 'sends what this rank has not computed')
            key = _message_key(a)
            if key in self.posted:
                self.fail(rank, a, 'sends the same message twice')
            self.posted[key] = (self.clock[rank], rank)
        elif a.kind in COMPUTE:
            self.compute(rank, a)
        else:
            self.fail(rank, a, 'unknown action kind')
        self.pos[rank] += 1
        return True

    def compute(self, rank: int, a: Action):
        s, m, last = a.stage, a.microbatch, self.shape.stages - 1
        if self.shape.rank_of(s) != rank:
            self.fail(rank, a, f'stage {s} lives on rank {self.shape.rank_of(s)}')
        if (a.kind, s, m) in self.done:
            self.fail(rank, a, 'runs twice')
        if a.kind == F and s > 0 and not self.has_input(rank, (F, s - 1, m), a):
            self.fail(rank, a, f'needs the activation of stage {s - 1}, not received')
        if a.kind == B:
            if (F, s, m) not in self.done:
                self.fail(rank, a, 'backward before its forward')
            if s < last and not self.has_input(rank, (B, s + 1, m), a):
                self.fail(rank, a, f'needs the gradient of stage {s + 1}, not received')
        if a.kind == W and (B, s, m) not in self.done:
            self.fail(rank, a, 'weight gradient before its input gradient')
        start = self.clock[rank]
        end = start + self.cost[a.kind]
        self.clock[rank] = end
        self.done[(a.kind, s, m)] = end
        self.result.busy[rank].append((start, end, a))
        frees = W if self.split else B
        self.in_flight[rank] += 1 if a.kind == F else -1 if a.kind == frees else 0
        self.result.peak_in_flight[rank] = max(self.result.peak_in_flight[rank],
                                               self.in_flight[rank])

    def run(self) -> SimResult:
        while True:
            moved = False
            for rank in self.actions:
                while self.pos[rank] < len(self.actions[rank]) and self.step(rank):
                    moved = True
            if all(self.pos[r] == len(self.actions[r]) for r in self.actions):
                break
            if not moved:
                stuck = {r: self.actions[r][self.pos[r]] for r in self.actions
                         if self.pos[r] < len(self.actions[r])}
                raise ScheduleError(f'deadlock: ranks wait forever at {stuck}')
        self.check_complete()
        self.result.makespan = max(self.clock.values(), default=0.0)
        return self.result

    def check_complete(self):
        if self.posted:
            raise ScheduleError(f'sent but never received: {sorted(self.posted)}')
        kinds = (F,) if self.forward_only else (F, B, W) if self.split else (F, B)
        missing = [(k, s, m) for k in kinds for s in range(self.shape.stages)
                   for m in range(self.shape.microbatches) if (k, s, m) not in self.done]
        if missing:
            raise ScheduleError(f'never computed: {missing[:8]}{"..." if len(missing) > 8 else ""}')


def simulate(shape: PipeShape, actions: Dict[int, Order], forward_only: bool = False
             ) -> SimResult:
    """Dry-run ``actions`` (see module doc); raises :class:`ScheduleError` on any fault.
    ``forward_only``: the lists hold forwards only (evaluation), none is missing a backward."""
    if sorted(actions) != list(range(shape.ranks)):
        raise ScheduleError(f'expected action lists for ranks 0..{shape.ranks - 1}, got '
                            f'{sorted(actions)}')
    return _Run(shape, actions, forward_only).run()


def timeline(result: SimResult) -> str:
    """One text line per rank, one character per time unit: F, b (input/full backward),
    W, '.' idle."""
    width = int(round(result.makespan))
    lines = []
    for rank in sorted(result.busy):
        row = ['.'] * width
        for start, end, action in result.busy[rank]:
            for t in range(int(start), int(end)):
                row[t] = 'b' if action.kind == B else action.kind
        lines.append(f'rank {rank}: ' + ''.join(row))
    return '\n'.join(lines)
