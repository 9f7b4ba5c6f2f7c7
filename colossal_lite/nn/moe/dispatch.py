"""Token dispatch: which (token, slot) pairs reach their expert, in what order, and back.

A forward routes ``N`` tokens to ``k`` experts each: ``N*k`` slots, numbered token-major
(slot ``t*k + j`` is token t's j-th choice). Tokens are the input's rows flattened
row-major, so a batch row (the second-to-last input dim, of length ``s``) holds tokens
``row*s .. row*s + s - 1``.

* :func:`capacity_keep`: with a capacity ``C`` per expert and batch row, inside each row an
  expert keeps the slots of its first ``C`` tokens in position order and drops the rest.
  It depends on the row alone, so splitting rows over data-parallel ranks keeps it.
* :func:`sort_slots`: the kept slots sorted by expert with a stable sort (inside an
  expert's segment, in slot order); :func:`combine` writes each expert output row back to
  its slot (each slot once: deterministic) and sums a token's ``k`` slots weighted by the
  routing weights (a dropped slot adds 0; the weights are not renormalized after drops).
* :class:`ExpertExchange`: expert parallelism over the EXPERT group (E ranks, rank r owning
  experts ``r*L .. r*L + L - 1``, ``L = experts / E``): the per-expert counts go first (one
  all_to_all of ``[E, L]`` int64), then the sorted rows to their expert's rank by an
  uneven all_to_all, re-sorted by local expert; :meth:`ExpertExchange.combine` is the
  reverse exchange. Rows a rank keeps for itself are not sent (nor counted), so each
  direction records ``element_size * h * (rows sent to other ranks)`` bytes under EXPERT.
  Backward of each exchange is the reverse exchange (``communication.all_to_all_rows``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ...communication import all_to_all_rows
from ...communication import collective as C
from ...context import ProcessGroupAxis


def capacity(capacity_factor: float, seq: int, top_k: int, experts: int) -> int:
    """``C = ceil(capacity_factor * s * k / experts)`` slots per expert and batch row."""
    return math.ceil(capacity_factor * seq * top_k / experts)


def capacity_keep(experts: torch.Tensor, num_experts: int, seq: int, cap: int) -> torch.Tensor:
    """``keep [N, k]`` (bool) for ``experts [N, k]``: per batch row of ``seq`` tokens, each
    expert keeps its first ``cap`` slots in token-position order (module doc)."""
    n, k = experts.shape
    row = torch.arange(n, device=experts.device).div(seq, rounding_mode='floor')
    key = (row.unsqueeze(1) * num_experts + experts).reshape(-1)   # (row, expert) per slot
    order = torch.argsort(key, stable=True)
    sizes = torch.bincount(key, minlength=max(1, -(-n // seq)) * num_experts)
    starts = torch.cumsum(sizes, 0) - sizes
    rank_in_group = torch.arange(key.numel(), device=key.device) - starts[key[order]]
    keep = torch.empty_like(key, dtype=torch.bool)
    keep[order] = rank_in_group < cap
    return keep.view(n, k)


@dataclass
class SortedSlots:
    """Kept slots sorted by expert: ``slot [S]`` (slot numbers), ``token [S]`` (= slot // k),
    ``counts [experts]`` (int64: rows per expert, summing to S)."""

    slot: torch.Tensor
    token: torch.Tensor
    counts: torch.Tensor


def sort_slots(experts: torch.Tensor, num_experts: int,
               keep: Optional[torch.Tensor] = None) -> SortedSlots:
    """The kept slots of ``experts [N, k]`` in stable expert order (module doc)."""
    flat = experts.reshape(-1)
    slot = torch.arange(flat.numel(), device=flat.device)
    if keep is not None:
        mask = keep.reshape(-1)
        slot, flat = slot[mask], flat[mask]
    order = torch.argsort(flat, stable=True)
    slot = slot[order]
    counts = torch.bincount(flat, minlength=num_experts)
    return SortedSlots(slot, slot.div(experts.shape[1], rounding_mode='floor'), counts)


def combine(rows: torch.Tensor, slots: SortedSlots, weights: torch.Tensor) -> torch.Tensor:
    """``out [N, h]``: ``sum_j weights[t, j] * y[slot t*k + j]`` with ``y`` the expert output
    ``rows [S, h]`` placed at their slots (0 at dropped slots). In ``rows``' dtype."""
    n, k = weights.shape
    per_slot = rows.new_zeros(n * k, rows.shape[-1]).index_copy(0, slots.slot, rows)
    return (per_slot.view(n, k, -1) * weights.to(rows.dtype).unsqueeze(-1)).sum(1)


def exchange_rows(x: torch.Tensor, axis: ProcessGroupAxis, send: Sequence[int],
                  recv: Sequence[int]) -> torch.Tensor:
    """Runs of ``x``'s rows (``send[r]`` rows to rank r, in rank order) exchanged over
    ``axis``; returns the received runs (``recv[r]`` from rank r) in rank order. The own
    run stays local; the others go by one differentiable uneven all_to_all."""
    me = axis.rank
    a, b = sum(send[:me]), sum(recv[:me])
    own = x[a:a + send[me]]
    remote = torch.cat([x[:a], x[a + send[me]:]])
    send_other, recv_other = list(send), list(recv)
    send_other[me] = recv_other[me] = 0
    got = all_to_all_rows(remote, axis, send_other, recv_other)
    return torch.cat([got[:b], own, got[b:]])


class ExpertExchange:
    """The expert-parallel exchange of one forward over ``axis`` (EXPERT, E ranks), for
    ``counts [experts]`` rows per expert of this rank's sorted rows. Construction runs the
    counts all_to_all (``8 * experts`` bytes). ``local_counts``: rows per local expert after
    :meth:`dispatch`. With one rank both methods are the identity."""

    def __init__(self, counts: torch.Tensor, axis: ProcessGroupAxis):
        self.axis = axis
        e = axis.size
        if e == 1:
            self.local_counts = counts.tolist()
            return
        local = counts.numel() // e
        matrix = counts.view(e, local)
        received = C.all_to_all(matrix, axis, 0, 0)   # row r: what rank r sends my experts
        self.send = matrix.sum(1).tolist()
        self.recv = received.sum(1).tolist()
        self.local_counts = received.sum(0).tolist()
        # received rows come by source rank, then local expert: order them by local expert
        expert_of_row = torch.repeat_interleave(
            torch.arange(local, device=counts.device).repeat(e), received.reshape(-1))
        self.order = torch.argsort(expert_of_row, stable=True)
        self.inverse = torch.empty_like(self.order)
        self.inverse[self.order] = torch.arange(self.order.numel(), device=counts.device)

    def dispatch(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's rows sorted by expert -> the rows of its local experts, sorted by local
        expert (then source rank, then the source's order)."""
        if self.axis.size == 1:
            return rows
        return exchange_rows(rows, self.axis, self.send, self.recv)[self.order]

    def combine(self, rows: torch.Tensor) -> torch.Tensor:
        """The local experts' outputs (in :meth:`dispatch`'s order) back to the ranks and
        rows they came from."""
        if self.axis.size == 1:
            return rows
        return exchange_rows(rows[self.inverse], self.axis, self.recv, self.send)

