"""The vocabulary of pipeline schedules: action kinds, :class:`Action`, :class:`PipeShape`.

Stage ``s`` of ``S = P*V`` stages lives on rank ``s % P`` (V virtual stages per rank, rank
r holding stages r, r+P, ...). A schedule is ``{rank: [Action, ...]}``:

* compute actions ``F`` (forward), ``B`` (backward; the input gradient only when the
  schedule splits backward), ``W`` (weight gradient of a split backward) of micro-batch
  ``m`` on stage ``s``;
* communication ``SEND_F``/``RECV_F`` (activation from stage s to s+1) and
  ``SEND_B``/``RECV_B`` (gradient from stage s to s-1).

The generators (``schedules.py``, ``zero_bubble.py``), the dry run (``simulator.py``) and the
runtime all speak it; this module imports none of them.
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
RankGenerator = Callable[[PipeShape, int], Order]       # (shape, rank) -> compute order


def costs(split: bool) -> Dict[str, float]:
    """The unit clock of the dry run and of the ZB-H1 generator: F = 1, B = 2, or B = W = 1
    when backward is split."""
    return {F: 1.0, B: 1.0 if split else 2.0, W: 1.0}
