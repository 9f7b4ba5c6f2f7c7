"""2D / 2.5D loss, attention core and output helpers (standard layout: ``grid.py``).

The batch is split over ``col`` x ``dep``, so a mean over the global batch sums the
per-token losses and the token counts over those two groups.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import nn

from ...communication import collective as C
from ...communication import gather_from, reduce_from
from ...context import ParallelMode, seed
from ..functional import (attention, check_targets, per_token_cross_entropy, require_logits_tag,
                          vocab_axis_of)
from ..parallel_1d.losses import resolve_vocab_axis
from .grid import Grid2p5D, resolve_grid


class CrossEntropyLoss2p5D(nn.Module):
    """Cross entropy of batch-split logits ``[b', .., C]`` (or ``[b', .., C/q]`` vocab-split over
    ``row``) against the user's full labels ``[b, ..]`` (split locally).

    Vocab-split logits: 3 all_reduces of the local token count over row (functional.py).
    'mean' / 'sum': the loss sum is all_reduced over col and dep (1 element each; 'mean'
    also sums the non-ignored token count there). 'none' all_gathers the per-token
    losses over col and dep, giving the full ``[b, ..]`` on every rank.
    """

    def __init__(self, ignore_index: int = -100, reduction: str = 'mean',
                 vocab_parallel: Optional[bool] = None, grid: Optional[Grid2p5D] = None):
        super().__init__()
        if reduction not in ('mean', 'sum', 'none'):
            raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
        self.ignore_index, self.reduction, self.vocab_parallel = ignore_index, reduction, vocab_parallel
        self.grid = resolve_grid(grid)

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        grid = self.grid
        local_labels = grid.split_batch(labels)
        if logits.shape[:-1] != local_labels.shape:
            raise ValueError(f'{grid.describe()} logits {tuple(logits.shape)} do not match the '
                             f'local labels {tuple(local_labels.shape)} (full labels '
                             f'{tuple(labels.shape)} split over d*q = {grid.d * grid.q})')
        vocab_axis = resolve_vocab_axis(logits, self.vocab_parallel, grid.row)
        check_targets(labels, logits.shape[-1] * (vocab_axis.size if vocab_axis else 1),
                      self.ignore_index)
        per_token = per_token_cross_entropy(logits, local_labels, vocab_axis, self.ignore_index)
        if self.reduction == 'none':
            per_token = per_token.view(local_labels.shape)
            return gather_from(gather_from(per_token, grid.col, 0), grid.dep, 0)
        total = reduce_from(reduce_from(per_token.sum(), grid.col), grid.dep)
        if self.reduction == 'sum':
            return total
        count = (local_labels != self.ignore_index).sum().to(total.dtype)
        count = C.all_reduce(C.all_reduce(count, grid.col), grid.dep)
        return total / count


class AttentionCore2p5D(nn.Module):
    """softmax(QK^T/sqrt(d) + mask)V on q, k, v ``[b', s, h/q]``: heads split over ``row``
    (``n/q`` heads per rank), batch split. The user's full ``key_padding_mask [b, s]`` is split
    by batch locally. No communication; attention dropout draws from the TENSOR stream.
    """

    def __init__(self, head_dim: int, causal: bool = False, dropout: float = 0.0,
                 grid: Optional[Grid2p5D] = None):
        super().__init__()
        self.head_dim, self.causal, self.dropout = head_dim, causal, dropout
        self.grid = resolve_grid(grid)

    @property
    def head_split(self) -> int:
        """Ranks the heads are divided among (the hidden split q)."""
        return self.grid.q

    def rng(self):
        return seed(ParallelMode.TENSOR) if self.grid.size > 1 else contextlib.nullcontext()

    def forward(self, q, k, v, key_padding_mask=None):
        width = q.shape[-1]
        if width % self.head_dim:
            hidden = width * self.grid.q
            raise ValueError(f'{self.grid.describe()} splits the heads over q={self.grid.q}: '
                             f'hidden {hidden} / head_dim {self.head_dim} = '
                             f'{hidden / self.head_dim:g} heads, which is not a multiple of '
                             f'{self.grid.q}; needs a head count divisible by {self.grid.q}')
        if key_padding_mask is not None:
            key_padding_mask = self.grid.split_batch(key_padding_mask)
        return attention(q, k, v, self.head_dim, causal=self.causal,
                         key_padding_mask=key_padding_mask,
                         dropout_p=self.dropout if self.training else 0.0, rng=self.rng)


def gather_logits_2p5d(logits: torch.Tensor, grid: Optional[Grid2p5D] = None) -> torch.Tensor:
    """Full ``[b, .., C]`` logits on every rank: all_gather the classes over ``row`` when
    vocab-split, then the batch over ``col`` and ``dep``."""
    grid = resolve_grid(grid)
    if grid.q * grid.d > 1:
        require_logits_tag(logits, 'gather_logits')
    axis = vocab_axis_of(logits)
    if axis is not None:
        logits = C.all_gather(logits, axis, dim=-1)
    return grid.gather_batch(logits)


def first_token_2p5d(x: torch.Tensor) -> torch.Tensor:
    """``x[:, 0]``: ``[b', s, h/q] -> [b', h/q]`` (standard layout of ``[b, h]``). No communication."""
    return x[:, 0]
