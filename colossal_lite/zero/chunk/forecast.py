"""How soon each chunk is used again, from the order of an earlier pass (Belady's rule).

Training repeats the same pass every step, so the chunk order recorded in one pass predicts
the next: :meth:`Forecast.next_use` counts the uses until a chunk comes up again, reading the
recorded order cyclically from a cursor that :meth:`Forecast.use` moves past each use. With
no order recorded yet it falls back to least-recently-used (the oldest use is "farthest").
A pass that strays from the order only makes the forecast worse, never a result wrong:
callers use it to choose what to evict. Local bookkeeping only: no communication.
"""
from __future__ import annotations

import math
from typing import Dict, Iterator, List, Optional, Sequence


class Forecast:
    def __init__(self, order: Sequence[int] = ()):
        self.order: List[int] = list(order)
        self.cursor = 0
        self.clock = 0
        self.last_use: Dict[int, int] = {}

    def set_order(self, order: Sequence[int]):
        self.order, self.cursor = list(order), 0

    def clear(self):
        self.set_order([])
        self.last_use.clear()
        self.clock = 0

    def next_use(self, index: int) -> float:
        """Uses until ``index`` comes up again (``inf``: never); before an order exists,
        minus the time of its last use (least recently used is farthest)."""
        if not self.order:
            return -self.last_use.get(index, 0)
        n = len(self.order)
        for step in range(n):
            if self.order[(self.cursor + step) % n] == index:
                return step
        return math.inf

    def use(self, index: int):
        """``index`` is used now: the clock ticks and the cursor moves past its next
        occurrence in the order (stays put when the order never has it)."""
        self.clock += 1
        self.last_use[index] = self.clock
        if self.order:
            step = self.next_use(index)
            if step != math.inf:   # 1..len: len means the recorded pass is over
                self.cursor = (self.cursor + step) % len(self.order) + 1

    def ahead(self) -> Iterator[int]:
        """The rest of the recorded pass after the cursor (no wrap-around; no copy)."""
        return (self.order[i] for i in range(self.cursor, len(self.order)))

    def upcoming(self) -> Optional[int]:
        """The chunk the order expects next (None without an order)."""
        return self.order[self.cursor % len(self.order)] if self.order else None
