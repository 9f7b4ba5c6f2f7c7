"""The pipeline schedules, one row each: what a config may ask of them and what they cost.

Plain data and small functions; this module imports nothing from colossal_lite. Readers:
the pipeline section's check (``config/pipeline.py``), the schedule generators' shape check
(``pipeline/schedules.py``), the planner's time and memory model (``auto/cost.py``,
``auto/memory.py``) and chunk ZeRO's guard (``zero/chunk/engine.py``).

Notation: P pipeline ranks (``parallel.pipeline.size``), V stages per rank (``chunks``),
M micro-batches (``num_microbatches``), r a pipeline rank. A check returns the error message
(naming the config key and value) or None; the caller raises it as its own error type.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional

DEFAULT = '1f1b'            # parallel.pipeline.schedule when chunks == 1
KEY = 'parallel.pipeline.schedule'


@dataclass(frozen=True)
class Schedule:
    """One pipeline schedule.

    ``chunks``: runs V > 1 stages per rank; ``fills``: needs M >= P; ``groups``: needs M a
    multiple of P; ``split_backward``: runs backward as B (input gradient) then W (weight
    gradient); ``zero3``: ZeRO stage 3 runs it (one stage per rank);
    ``held(P, M, V, r)``: micro-batches whose activations rank r holds at its peak, in
    whole-stage units (a chunk micro-batch counts 1/V); ``span(P, M, V, stage, forward)``:
    the step's pipeline time from the slowest stage's time per micro-batch (forward +
    backward) and its forward; ``idle(P, M, V)``: each rank's idle fraction on the unit
    clock (F = 1, B = 2, or B = W = 1 split; ``pipeline/simulator.py``)."""

    name: str
    chunks: bool
    fills: bool
    groups: bool
    split_backward: bool
    zero3: bool
    held: Callable[[int, int, int, int], float]
    span: Callable[[int, int, int, float, float], float]
    idle: Callable[[int, int, int], float]

    def check(self, size: int, chunks: int, microbatches: int) -> Optional[str]:
        """Why P = ``size``, V = ``chunks``, M = ``microbatches`` cannot run (None: it can)."""
        if chunks > 1 and not self.chunks:
            return (f"'parallel.pipeline.chunks' = {chunks} needs schedule "
                    f"{_names(lambda s: s.chunks)} (schedule {self.name!r} runs one stage "
                    f"per rank)")
        if size > 1 and self.fills and microbatches < size:
            return (f"pipeline schedule {self.name!r} needs num_microbatches >= pipeline size "
                    f"{size}, got num_microbatches = {microbatches}")
        if size > 1 and self.groups and microbatches % size:
            return (f"the {self.name} schedule needs num_microbatches divisible by the "
                    f"pipeline size {size}, got num_microbatches = {microbatches}")
        return None

    def zero3_check(self, size: int, chunks: int) -> Optional[str]:
        """Why ZeRO stage 3 cannot run this schedule at P = ``size``, V = ``chunks``."""
        if size > 1 and (not self.zero3 or chunks > 1):
            return (f"ZeRO stage 3 with pipeline parallelism runs the "
                    f"{_names(lambda s: s.zero3, ' and ')} schedules with one stage per rank, "
                    f"got schedule {self.name!r} with chunks = {chunks}")
        return None

    def in_flight(self, size: int, microbatches: int, chunks: int, rank: int) -> float:
        """:attr:`held`; 1 without a pipeline (each micro-batch's backward follows its forward)."""
        return 1.0 if size == 1 else float(self.held(size, microbatches, chunks, rank))

    def pipeline_time(self, size: int, microbatches: int, chunks: int, stage: float,
                      forward: float) -> float:
        """:attr:`span`; ``M * stage`` without a pipeline. The bubble is this minus M * stage."""
        if size == 1:
            return microbatches * stage
        return self.span(size, microbatches, chunks, stage, forward)

    def idle_fraction(self, size: int, microbatches: int, chunks: int = 1) -> float:
        return self.idle(size, microbatches, chunks)


def _flush(p, m, v, stage, forward):      # P - 1 stage times of fill and drain
    return (m + p - 1) * stage


SCHEDULES: Dict[str, Schedule] = {s.name: s for s in (
    Schedule('1f1b', chunks=False, fills=True, groups=False, split_backward=False, zero3=True,
             held=lambda p, m, v, r: min(m, p - r), span=_flush,
             idle=lambda p, m, v: (p - 1) / (m + p - 1)),
    Schedule('gpipe', chunks=False, fills=False, groups=False, split_backward=False, zero3=True,
             held=lambda p, m, v, r: m, span=_flush,
             idle=lambda p, m, v: (p - 1) / (m + p - 1)),
    Schedule('interleaved', chunks=True, fills=True, groups=True, split_backward=False,
             zero3=False,
             held=lambda p, m, v, r: min(m * v, (p - 1 - r) * 2 + (v - 1) * p + 1) / v,
             span=lambda p, m, v, stage, forward: (m + (p - 1) / v) * stage,
             idle=lambda p, m, v: (p - 1) / (v * m + p - 1)),
    Schedule('zero_bubble', chunks=False, fills=True, groups=False, split_backward=True,
             zero3=False,
             held=lambda p, m, v, r: min(m, p),
             span=lambda p, m, v, stage, forward: m * stage + (p - 1) * forward,
             idle=lambda p, m, v: (p - 1) / (3 * m + p - 1)),
)}


def _names(keep: Callable[[Schedule], bool], joiner: str = ' or ') -> str:
    return joiner.join(repr(s.name) for s in SCHEDULES.values() if keep(s))


def default_schedule(chunks: int = 1) -> str:
    """The schedule a config gets when it names none: interleaved for V > 1, else 1F1B."""
    return 'interleaved' if chunks > 1 else DEFAULT


def check_schedule(name, size: int, chunks: int, microbatches: int) -> Optional[str]:
    """Why schedule ``name`` cannot run P, V, M (an unknown name included); None if it can."""
    if name not in SCHEDULES:
        return f"'{KEY}' must be one of {list(SCHEDULES)}, got {name!r}"
    return SCHEDULES[name].check(size, chunks, microbatches)


def w_waiting(name: str, size: int, microbatches: int, rank: int) -> int:
    """Of the micro-batches rank r holds at its peak, those waiting for their W pass (split
    backward only; ZB-H1 just before its first W: min(M, r + 1))."""
    if size == 1 or not SCHEDULES[name].split_backward:
        return 0
    return min(microbatches, rank + 1)
