"""Cutting a model's layer list into S = P*V contiguous stages.

A pipelined model is a list of ``n`` repeated blocks between a first part (embeddings)
and a last part (heads). Stage ``s`` of ``S`` holds blocks ``layers[s]`` (a contiguous
range); stage 0 also holds the first part and stage S-1 the last. Stage ``s`` runs on
pipeline rank ``s % P`` (so rank r holds stages r, r+P, ..., r+(V-1)P).

The cut minimizes the largest stage weight (the time of the slowest stage bounds the
pipeline's step) by binary search over the bound with a greedy fill, where a stage's weight
is the sum of its blocks' weights plus the first/last part's weight on stages 0 / S-1:

* ``uniform``: every block weighs 1, the first and last parts 0 (equal block counts);
* ``parameters``: weights are parameter counts (embeddings and heads included);
* ``cost``: weights are measured forward+backward times (``stages.resolve_partition``, an
  explicit step before the model is built);
* an explicit list of blocks per stage (:func:`explicit_cut`), e.g. the planner's BMW cut.

Every stage holds at least one block, so ``n >= S`` (else a ValueError naming both).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence


@dataclass(frozen=True)
class StageSpec:
    """Stage ``index`` of ``count``: blocks ``layers``; first/last parts by position."""

    index: int
    count: int
    layers: range

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1


def _greedy_cut(weights: Sequence[float], stages: int, bound: float, head: float,
                tail: float) -> Optional[List[range]]:
    """Fill stages left to right as far as ``bound`` allows (>= 1 block each, enough left for
    the rest); the ranges, or None when some stage must exceed ``bound``."""
    n, i, out = len(weights), 0, []
    for s in range(stages):
        load = head if s == 0 else 0.0
        tail_here = tail if s == stages - 1 else 0.0
        start = i
        while i < n and (i == start or load + weights[i] + tail_here <= bound) \
                and n - (i + 1) >= stages - s - 1:
            load += weights[i]
            i += 1
        if load + tail_here > bound:
            return None
        out.append(range(start, i))
    return out if i == n else None


def balanced_cut(weights: Sequence[float], stages: int, head: float = 0.0,
                 tail: float = 0.0) -> List[range]:
    """Contiguous ranges of block indices, one per stage, minimizing the heaviest stage."""
    n = len(weights)
    if n < stages:
        raise ValueError(f'cannot cut {n} layers into {stages} pipeline stages (pipeline size '
                         f'x chunks): every stage needs at least one layer')
    if any(w < 0 for w in weights) or head < 0 or tail < 0:
        raise ValueError('layer weights must be non-negative')
    low = max(max(weights, default=0.0), head, tail)
    high = sum(weights) + head + tail
    for _ in range(100):  # bisection on the bound; the cut at `high` always fits
        mid = (low + high) / 2
        if _greedy_cut(weights, stages, mid, head, tail) is not None:
            high = mid
        else:
            low = mid
        if high - low <= 1e-9 * max(1.0, high):
            break
    return _greedy_cut(weights, stages, high, head, tail)


def uniform_cut(layers: int, stages: int) -> List[range]:
    """Equal block counts; the first ``layers % stages`` stages hold one more."""
    if layers < stages:
        raise ValueError(f'cannot cut {layers} layers into {stages} pipeline stages (pipeline '
                         f'size x chunks): every stage needs at least one layer')
    base, extra = divmod(layers, stages)
    out, start = [], 0
    for s in range(stages):
        size = base + (1 if s < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def explicit_cut(counts: Sequence[int], layers: int) -> List[range]:
    """The ranges of an explicit cut: ``counts[s]`` consecutive blocks on stage ``s``
    (``parallel.pipeline.partition=[n_0, ..., n_{S-1}]``); a ValueError unless every count is
    at least 1 and they sum to ``layers``."""
    if any(n < 1 for n in counts) or sum(counts) != layers:
        raise ValueError(f"'parallel.pipeline.partition' = {list(counts)} must give every "
                         f"stage at least one block and sum to the model's {layers} layers, "
                         f"got sum {sum(counts)}")
    out, start = [], 0
    for n in counts:
        out.append(range(start, start + n))
        start += n
    return out


def stage_specs(ranges: Sequence[range]) -> List[StageSpec]:
    return [StageSpec(s, len(ranges), r) for s, r in enumerate(ranges)]


def cut(method: str, layers: int, stages: int, block_weight: float = 1.0,
        head_weight: float = 0.0, tail_weight: float = 0.0) -> List[range]:
    """The block ranges of every stage for partition ``method`` (module doc). For
    ``parameters`` / ``cost`` the caller passes the per-block, first-part and last-part
    weights (identical blocks: one ``block_weight``)."""
    if method == 'uniform':
        return uniform_cut(layers, stages)
    if method in ('parameters', 'cost'):
        return balanced_cut([block_weight] * layers, stages, head_weight, tail_weight)
    raise ValueError(f"unknown partition {method!r}; use 'uniform', 'parameters' or 'cost'")


def rank_stages(ranges: Sequence[range], pipeline_size: int, pipeline_rank: int
                ) -> List[StageSpec]:
    """The stages of one pipeline rank (stage s on rank s % P), in stage order."""
    return [spec for spec in stage_specs(ranges) if spec.index % pipeline_size == pipeline_rank]
