"""2D / 2.5D attention core and first token (standard layout: ``grid.py``); the loss and
``gather_logits`` read the logits' placement (``nn/losses.py``)."""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import nn

from ...context import ParallelMode, seed
from ..functional import attention
from .grid import Grid2p5D, resolve_grid


class AttentionCore2p5D(nn.Module):
    """softmax(QK^T/sqrt(d) + mask)V on q, k, v ``[b', s, h/q]``: heads split over ``row``
    (``n/q`` heads per rank), batch split. The user's full ``key_padding_mask [b, s]`` and
    ``document_ids [b, s]`` are split by batch locally. No communication; attention dropout draws from the TENSOR stream.
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

    def forward(self, q, k, v, key_padding_mask=None, document_ids=None):
        width = q.shape[-1]
        if width % self.head_dim:
            hidden = width * self.grid.q
            raise ValueError(f'{self.grid.describe()} splits the heads over q={self.grid.q}: '
                             f'hidden {hidden} / head_dim {self.head_dim} = '
                             f'{hidden / self.head_dim:g} heads, which is not a multiple of '
                             f'{self.grid.q}; needs a head count divisible by {self.grid.q}')
        if key_padding_mask is not None:
            key_padding_mask = self.grid.split_batch(key_padding_mask)
        if document_ids is not None:
            document_ids = self.grid.split_batch(document_ids)
        return attention(q, k, v, self.head_dim, causal=self.causal,
                         key_padding_mask=key_padding_mask,
                         dropout_p=self.dropout if self.training else 0.0, rng=self.rng,
                         document_ids=document_ids)


def first_token_2p5d(x: torch.Tensor) -> torch.Tensor:
    """``x[:, 0]``: ``[b', s, h/q] -> [b', h/q]`` (standard layout of ``[b, h]``). No communication."""
    return x[:, 0]
