"""Which positions of a sequence each SEQUENCE rank holds: the one place that says it.

The sequence of length ``s`` is cut into ``C`` equal chunks of ``c = s / C`` positions
(chunk ``i`` = positions ``i*c .. (i+1)*c - 1``), and rank r of the P-rank SEQUENCE group
holds some of them, concatenated in increasing order, as its local block of ``s/P``:

* contiguous (``parallel.tensor.zigzag=False``): ``C = P``, rank r holds chunk r;
* zigzag (``zigzag=True``, the default): ``C = 2P``, rank r holds chunks r and
  ``2P-1-r``. Under a causal mask every rank then has the same attention work
  (``ring.py``: 2P+1 chunk pairs each), where contiguous blocks give rank r ``r+1``
  blocks of ``(s/P)^2``.

Everything that cuts, numbers or reassembles sequence-split activations goes through a
:class:`SequenceLayout`: the embeddings and the patch tokens (:meth:`local`), the position
ids of rotary tables (:meth:`local` of the ids), the labels of the loss (:meth:`ring_order`),
``gather_logits`` (:meth:`serial_order`), the causal mask inside the ring
(:meth:`chunks_of`) and ``first_token`` (:meth:`owner`). No method communicates.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch

from ...context import ParallelMode, ProcessGroupAxis, current_context


def sequence_axis() -> ProcessGroupAxis:
    """SEQUENCE when the current context's mode is 'sequence', else a one-rank stand-in."""
    ctx = current_context()
    if ctx.tensor_mode == 'sequence':
        return ctx.axis(ParallelMode.SEQUENCE)
    return ProcessGroupAxis.serial(ParallelMode.SEQUENCE)


@dataclass(frozen=True)
class SequenceLayout:
    """The chunks of the sequence each rank of ``axis`` holds (module doc). With one rank
    the layout is the whole sequence in order, whatever ``zigzag`` says."""

    axis: ProcessGroupAxis
    zigzag: bool = True

    @staticmethod
    def of(axis: Optional[ProcessGroupAxis] = None) -> 'SequenceLayout':
        """The layout of ``axis`` (default: the current context's SEQUENCE axis) with the
        launched ``parallel.tensor.zigzag`` setting (default True)."""
        axis = axis or sequence_axis()
        layout = current_context().layout
        return SequenceLayout(axis, True if layout is None else layout.zigzag)

    # ------------------------------------------------------------ chunks
    @property
    def size(self) -> int:
        return self.axis.size

    @property
    def is_zigzag(self) -> bool:
        """Whether the chunks of a rank are not one contiguous block (zigzag over > 1 rank)."""
        return self.zigzag and self.axis.size > 1

    @property
    def num_chunks(self) -> int:
        """C: 2P under zigzag, else P."""
        return 2 * self.axis.size if self.is_zigzag else self.axis.size

    def chunks_of(self, rank: Optional[int] = None) -> Tuple[int, ...]:
        """The global chunk indices rank ``rank`` (default: this rank) holds, in local order."""
        r = self.axis.rank if rank is None else rank
        return (r, self.num_chunks - 1 - r) if self.is_zigzag else (r,)

    def check(self, length: int, what: str = 'sequence length') -> int:
        """``length`` divisible by C (else a ValueError naming the numbers); the chunk length."""
        p = self.axis.size
        if self.is_zigzag and length % (2 * p):
            raise ValueError(
                f'zigzag sequence parallelism needs the {what} divisible by 2P = {2 * p} (rank r '
                f'holds chunks r and 2P-1-r of 2P equal chunks; P={p}), got {length}; set '
                f'parallel.tensor.zigzag=False (tensor.zigzag=False) for contiguous blocks, which '
                f'need it divisible by P={p} only')
        if length % p:
            raise ValueError(f'sequence parallelism needs the {what} divisible by the SEQUENCE '
                             f'group size P={p}, got {length}')
        return length // self.num_chunks

    # ------------------------------------------------------------ positions
    def positions(self, length: int, rank: Optional[int] = None,
                  device: Optional[torch.device] = None) -> torch.Tensor:
        """Global positions ``[s/P]`` (int64) of rank ``rank``'s tokens, in local order."""
        c = self.check(length)
        return torch.cat([torch.arange(i * c, (i + 1) * c, device=device)
                          for i in self.chunks_of(rank)])

    def owner(self, position: int, length: int) -> Tuple[int, int]:
        """(rank, offset in its local block) of global ``position`` of a length-``length``
        sequence."""
        c = self.check(length)
        chunk = position // c
        for rank in range(self.axis.size):
            chunks = self.chunks_of(rank)
            if chunk in chunks:
                return rank, chunks.index(chunk) * c + position % c
        raise ValueError(f'position {position} is outside a sequence of length {length}')

    def _order(self, length: int, device) -> torch.Tensor:
        """Global positions of rank 0's tokens, then rank 1's, ...: the ring order."""
        return torch.cat([self.positions(length, r, device) for r in range(self.axis.size)])

    # ------------------------------------------------------------ cutting and reassembling
    def local(self, x: torch.Tensor, dim: int = 1, what: str = 'sequence length') -> torch.Tensor:
        """This rank's part ``[.., s/P, ..]`` of a full ``x`` along ``dim`` (a view when it is
        one block, else a concatenation; differentiable, no communication: the positions of
        other ranks get zero gradient here and are completed by the SEQUENCE_DP sum)."""
        c = self.check(x.shape[dim], what)
        if self.axis.size == 1:
            return x
        parts = [x.narrow(dim, i * c, c) for i in self.chunks_of()]
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
