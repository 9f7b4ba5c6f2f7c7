"""Which positions of a sequence each SEQUENCE rank holds: the one place that says it.

The sequence of length ``s`` is cut into ``C`` equal chunks of ``c = s / C`` positions
(chunk ``i`` = positions ``i*c .. (i+1)*c - 1``), and rank r of the P-rank SEQUENCE group
holds some of them, concatenated in increasing order, as its local block of ``s/P``:

* contiguous (``parallel.tensor.zigzag=False``): ``C = P``, rank r holds chunk r;
* zigzag (``zigzag=True``, the default): ``C = 2P``, rank r holds chunks r and
  ``2P-1-r``. Under a causal mask every rank then has the same attention work
  (``ring.py``: 2P+1 chunk pairs each), where contiguous blocks give rank r ``r+1``
  blocks of ``(s/P)^2``.
* mode 'ulysses' (P = R x U): the chunks above are those of the R ring ranks; the U
  consecutive ranks of ring rank r hold consecutive ``s/P`` slices of its block, which
  Ulysses' all_to_all reassembles (``ulysses.py``). With R = 1 rank u holds block u.

Everything that cuts, numbers or reassembles sequence-split activations goes through a
:class:`SequenceLayout`: the embeddings and the patch tokens (:meth:`local`), the position
ids of rotary tables (:meth:`local` of the ids), the labels of the loss (:meth:`ring_order`),
``gather_logits`` (:meth:`serial_order`), the causal mask inside the ring
(:meth:`chunks_of`) and ``first_token`` (:meth:`owner`). No method communicates.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple, Union

import torch

from ...config.families import family
from ...context import ParallelMode, ProcessGroupAxis, current_context


def sequence_axis(mode: ParallelMode = ParallelMode.SEQUENCE) -> ProcessGroupAxis:
    """The current context's ``mode`` group (SEQUENCE, or mode 'ulysses'' ULYSSES or
    SEQUENCE_RING) where its tensor family splits the sequence, else a one-rank stand-in."""
    ctx = current_context()
    if family(ctx.tensor_mode).splits_sequence:
        return ctx.axis(mode)
    return ProcessGroupAxis.serial(mode)


@dataclass(frozen=True)
class SequenceLayout:
    """The positions of the sequence each rank of ``axis`` holds (module doc). With one rank
    the layout is the whole sequence in order, whatever ``zigzag`` says.

    ``ulysses`` (U, mode 'ulysses'): the ranks ``r*U .. r*U+U-1`` of ``axis`` share ring rank
    r's block of ``s/R`` positions (R = P/U), rank ``r*U+u`` holding its u-th contiguous
    ``s/P``; Ulysses' all_to_all over those U ranks reassembles the block in ring order.
    The chunks (``chunks_of``, ``num_chunks``) are the ring's."""

    axis: ProcessGroupAxis
    zigzag: bool = True
    ulysses: int = 1

    @staticmethod
    def of(axis: Optional[ProcessGroupAxis] = None) -> 'SequenceLayout':
        """The layout of ``axis`` (default: the current context's SEQUENCE axis) with the
        launched ``parallel.tensor.zigzag`` setting (default True) and, for the SEQUENCE
        axis of mode 'ulysses', its Ulysses degree."""
        axis = axis or sequence_axis()
        layout = current_context().layout
        if layout is None:
            return SequenceLayout(axis)
        whole = axis.mode is ParallelMode.SEQUENCE and axis.size == layout.tensor
        return SequenceLayout(axis, layout.zigzag, layout.ulysses_size if whole else 1)

    # ------------------------------------------------------------ chunks
    @property
    def size(self) -> int:
        return self.axis.size

    @property
    def ring_size(self) -> int:
        """R: the ranks whose blocks the ring attention combines (P / U)."""
        return self.axis.size // self.ulysses

    @property
    def is_zigzag(self) -> bool:
        """Whether a ring rank's chunks are not one contiguous block (zigzag over > 1)."""
        return self.zigzag and self.ring_size > 1

    @property
    def num_chunks(self) -> int:
        """C: 2R under zigzag, else R."""
        return 2 * self.ring_size if self.is_zigzag else self.ring_size

    def chunks_of(self, rank: Optional[int] = None) -> Tuple[int, ...]:
        """The global chunk indices the ring rank of rank ``rank`` (default: this rank)
        holds, in local order."""
        r = (self.axis.rank if rank is None else rank) // self.ulysses
        return (r, self.num_chunks - 1 - r) if self.is_zigzag else (r,)

    def check(self, length: int, what: str = 'sequence length') -> int:
        """``length`` divisible by C and by P (else a ValueError naming the numbers); the
        chunk length."""
        p, ring = self.axis.size, self.ring_size
        if self.is_zigzag and length % (2 * ring):
            who = 'P' if self.ulysses == 1 else 'R'   # the ring's ranks: all, or R groups
            raise ValueError(
                f'zigzag sequence parallelism needs the {what} divisible by 2{who} = '
                f'{2 * ring} (ring rank r holds chunks r and 2{who}-1-r of 2{who} equal '
                f'chunks; {who}={ring}), got {length}; set parallel.tensor.zigzag=False '
                f'(tensor.zigzag=False) for contiguous blocks')
        if length % p:
            raise ValueError(f'sequence parallelism needs the {what} divisible by the SEQUENCE '
                             f'group size P={p}, got {length}')
        return length // self.num_chunks

    # ------------------------------------------------------------ positions
    def _runs(self, length: int, rank: Optional[int] = None) -> List[Tuple[int, int]]:
        """(start, length) of the contiguous runs of rank ``rank``'s positions, in local
        order: its ring rank's chunks, then the u-th ``s/P`` of their concatenation."""
        c = self.check(length)
        runs = [(i * c, c) for i in self.chunks_of(rank)]
        if self.ulysses == 1:
            return runs
        width = length // self.axis.size
        lo = ((self.axis.rank if rank is None else rank) % self.ulysses) * width
        out, offset = [], 0
        for start, n in runs:
            a, b = max(lo, offset), min(lo + width, offset + n)
            if a < b:
                out.append((start + a - offset, b - a))
            offset += n
        return out

    def positions(self, length: int, rank: Optional[int] = None,
                  device: Optional[torch.device] = None) -> torch.Tensor:
        """Global positions ``[s/P]`` (int64) of rank ``rank``'s tokens, in local order."""
        return torch.cat([torch.arange(a, a + n, device=device)
                          for a, n in self._runs(length, rank)])

    def owner(self, position: int, length: int) -> Tuple[int, int]:
        """(rank, offset in its local block) of global ``position`` of a length-``length``
        sequence."""
        for rank in range(self.axis.size):
            offset = 0
            for a, n in self._runs(length, rank):
                if a <= position < a + n:
                    return rank, offset + position - a
                offset += n
        raise ValueError(f'position {position} is outside a sequence of length {length}')

    def _order(self, length: int, device) -> torch.Tensor:
        """Global positions of rank 0's tokens, then rank 1's, ...: the ring order."""
        return torch.cat([self.positions(length, r, device) for r in range(self.axis.size)])

    # ------------------------------------------------------------ cutting and reassembling
    def local(self, x: torch.Tensor, dim: int = 1, what: str = 'sequence length') -> torch.Tensor:
        """This rank's part ``[.., s/P, ..]`` of a full ``x`` along ``dim`` (a view when it is
        one run, else a concatenation; differentiable, no communication: the positions of
        other ranks get zero gradient here and are completed by the SEQUENCE_DP sum)."""
        self.check(x.shape[dim], what)
        if self.axis.size == 1:
            return x
        parts = [x.narrow(dim, a, n) for a, n in self._runs(x.shape[dim])]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim)

    def ring_order(self, full: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """``full`` with its ``dim`` permuted so that P equal contiguous pieces are the ranks'
        local blocks (so a contiguous split, e.g. ``Placement.shard``, cuts it right)."""
        if not self.is_zigzag:
            return full
        return full.index_select(dim, self._order(full.shape[dim], full.device))

    def serial_order(self, gathered: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The inverse of :meth:`ring_order`: the ranks' local blocks concatenated along
        ``dim`` (an all_gather) back in serial order (differentiable)."""
        if not self.is_zigzag:
            return gathered
        order = self._order(gathered.shape[dim], gathered.device)
        return gathered.index_select(dim, torch.argsort(order))


LayoutLike = Union[SequenceLayout, ProcessGroupAxis, None]


def as_layout(layout: LayoutLike = None) -> SequenceLayout:
    """A :class:`SequenceLayout` from a layout, an axis (with the launched zigzag setting)
    or None (the current context's SEQUENCE layout)."""
    if isinstance(layout, SequenceLayout):
        return layout
    return SequenceLayout.of(layout)


def sequence_layout() -> SequenceLayout:
    """The current context's sequence layout."""
    return SequenceLayout.of()
