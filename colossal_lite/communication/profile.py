"""Exact counts of every collective: calls and bytes per (ParallelMode, op).

Two byte measures are recorded for each call, per calling rank:

* ``bytes``: the size of the op's full buffer -- the tensor for all_reduce,
  broadcast, reduce, all_to_all, send and recv; the gathered output for
  all_gather; the unreduced input for reduce_scatter.
* ``wire_bytes``: what a ring (or pipelined chain) implementation moves in or
  out of the rank for that buffer of n bytes over p ranks:
  all_reduce 2(p-1)/p*n, all_gather and reduce_scatter (p-1)/p*n,
  all_to_all (p-1)/p*n, broadcast and reduce n*(p-1)/p, send/recv n. A call
  recorded with ``exact_wire=True`` (``all_to_all_uneven``, which records only
  the rows that leave the rank) moves exactly its recorded bytes: wire = bytes.

Ops on a group of one rank move nothing and are not recorded.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict
from fractions import Fraction
from typing import Dict, List, Optional, Tuple

from ..config.modes import ParallelMode

Key = Tuple[ParallelMode, str]

_RING_FACTOR = {
    'all_reduce': lambda p: Fraction(2 * (p - 1), p),
    'all_gather': lambda p: Fraction(p - 1, p),
    'reduce_scatter': lambda p: Fraction(p - 1, p),
    'all_to_all': lambda p: Fraction(p - 1, p),
    'broadcast': lambda p: Fraction(p - 1, p),
    'reduce': lambda p: Fraction(p - 1, p),
    'send': lambda p: Fraction(1),
    'recv': lambda p: Fraction(1),
}


def ring_wire_bytes(op: str, nbytes: int, group_size: int) -> Fraction:
    """Bytes a ring implementation of ``op`` moves per rank for a buffer of ``nbytes``."""
    return _RING_FACTOR[op](group_size) * nbytes


class CommStats:
    """Counts of calls, buffer bytes and ring wire bytes, keyed by (mode, op)."""

    def __init__(self):
        self._calls: Dict[Key, int] = defaultdict(int)
        self._bytes: Dict[Key, int] = defaultdict(int)
        # buffer bytes per (key, group size): integers on the hot path, the exact ring
        # factor applied when wire bytes are read
        self._bytes_by_size: Dict[Tuple[Key, Optional[int]], int] = defaultdict(int)

    def record(self, mode: ParallelMode, op: str, nbytes: int, group_size: int,
               exact_wire: bool = False):
        """Count one call; ``exact_wire``: ``nbytes`` is already what leaves the rank (no
        ring factor applies: kept under group size None)."""
        key = (mode, op)
        self._calls[key] += 1
        self._bytes[key] += nbytes
        self._bytes_by_size[(key, None if exact_wire else group_size)] += nbytes

    @property
    def _wire(self) -> Dict[Key, Fraction]:
        wire: Dict[Key, Fraction] = defaultdict(Fraction)
        for ((mode, op), size), n in self._bytes_by_size.items():
            wire[(mode, op)] += Fraction(n) if size is None else ring_wire_bytes(op, n, size)
        return wire

    def _sum(self, table, mode, op):
        return sum(v for (m, o), v in table.items()
                   if (mode is None or m == mode) and (op is None or o == op))

    def calls(self, mode: Optional[ParallelMode] = None, op: Optional[str] = None) -> int:
        return self._sum(self._calls, mode, op)

    def bytes(self, mode: Optional[ParallelMode] = None, op: Optional[str] = None) -> int:
        return self._sum(self._bytes, mode, op)

    def wire_bytes(self, mode: Optional[ParallelMode] = None, op: Optional[str] = None) -> float:
        return float(self._sum(self._wire, mode, op))

    def keys(self) -> List[Key]:
        return sorted(self._calls, key=lambda k: (k[0].value, k[1]))

    def reset(self):
        self._calls.clear()
        self._bytes.clear()
        self._bytes_by_size.clear()

    def by_mode(self) -> Dict[str, int]:
        """Buffer bytes per mode name, for printing."""
        out: Dict[str, int] = defaultdict(int)
        for (mode, _), n in self._bytes.items():
            out[mode.name] += n
        return dict(out)

    def table(self) -> str:
        rows = [f"{'mode':<28}{'op':<16}{'calls':>8}{'bytes':>16}"]
        for mode, op in self.keys():
            rows.append(f"{mode.name:<28}{op:<16}{self._calls[(mode, op)]:>8}"
                        f"{self._bytes[(mode, op)]:>16}")
        return '\n'.join(rows)


# every run-wide total, always on; plus the stats of any open comm_profile() blocks
total_stats = CommStats()
_active: List[CommStats] = []


def record(mode: ParallelMode, op: str, nbytes: int, group_size: int,
           exact_wire: bool = False):
    total_stats.record(mode, op, nbytes, group_size, exact_wire)
    for stats in _active:
        stats.record(mode, op, nbytes, group_size, exact_wire)


@contextlib.contextmanager
def comm_profile():
    """Count the collectives issued inside the block: ``with comm_profile() as stats: ...``."""
    stats = CommStats()
    _active.append(stats)
    try:
        yield stats
    finally:
        _active.remove(stats)
