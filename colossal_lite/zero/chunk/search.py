"""The chunk-size search: the capacity that wastes least memory for a model.

Parameters (first-use order) are packed greedily into chunks of ``capacity`` elements (a
parameter larger than that gets a chunk of its own, rounded up to the granularity); the waste
is ``sum(chunk capacities) - sum(parameter elements)``. Capacities are multiples of the
granularity ``L = lcm(dp_sizes)`` so that every listed data-parallel size divides every chunk.
The search scans the multiples of L from the largest parameter up to ``max_elems`` (at most
``steps`` candidates, evenly spaced) and keeps the least waste, then the fewest chunks.
No communication.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class ChunkSearchResult:
    capacity: int       # elements per chunk
    waste: int          # padding elements over all chunks
    chunks: int


def packed_waste(numels: Sequence[int], capacity: int, granularity: int = 1):
    """``(waste, chunks)`` of packing ``numels`` in order into chunks of ``capacity``."""
    total, chunks, fill = 0, 0, None
    for n in numels:
        if n > capacity:
            total += -(-n // granularity) * granularity
            chunks += 1
            continue
        if fill is None or fill + n > capacity:
            total += capacity
            chunks += 1
            fill = 0
        fill += n
    return total - sum(numels), chunks


def search_chunk_size(numels: Sequence[int], dp_sizes: Sequence[int] = (1, 2, 4, 8),
                      max_elems: int = 64 * 1024 * 1024, steps: int = 1024) -> ChunkSearchResult:
    if not numels:
        raise ValueError('the chunk-size search needs at least one parameter')
    granularity = math.lcm(*[int(d) for d in dp_sizes])
    low = -(-max(numels) // granularity) * granularity
    high = max(low, min(max_elems, -(-sum(numels) // granularity) * granularity))
    stride = max(granularity, ((high - low) // steps) // granularity * granularity)
    best = None
    for capacity in range(low, high + 1, stride):
        waste, chunks = packed_waste(numels, capacity, granularity)
        key = (waste, chunks)
        if best is None or key < (best.waste, best.chunks):
            best = ChunkSearchResult(capacity, waste, chunks)
    return best
