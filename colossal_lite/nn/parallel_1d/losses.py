"""1D attention core and first token (the loss and gather_logits are ``nn/losses.py``)."""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import nn

from ...context import ParallelMode, ProcessGroupAxis, seed
from ..functional import attention
from ...communication import gather_from
from .layers import default_axis, sequence_dim


class AttentionCore1D(nn.Module):
    """softmax(QK^T/sqrt(d))V on this rank's heads: q, k, v ``[b, s, n/p * d]``; the user's full
    ``key_padding_mask`` and ``document_ids [b, s]`` as they are. No communication;
    attention dropout draws from the TENSOR stream (heads differ across ranks)."""

    def __init__(self, head_dim: int, causal: bool = False, dropout: float = 0.0,
                 axis: Optional[ProcessGroupAxis] = None):
        super().__init__()
        self.head_dim, self.causal, self.dropout = head_dim, causal, dropout
        self.axis = axis or default_axis()

    @property
    def head_split(self) -> int:
        """Ranks the heads are divided among."""
        return self.axis.size

    def rng(self):
        return seed(ParallelMode.TENSOR) if self.axis.size > 1 else contextlib.nullcontext()

    def forward(self, q, k, v, key_padding_mask=None, document_ids=None):
        return attention(q, k, v, self.head_dim, causal=self.causal,
                         key_padding_mask=key_padding_mask,
                         dropout_p=self.dropout if self.training else 0.0, rng=self.rng,
                         document_ids=document_ids)


def first_token_1d(x: torch.Tensor) -> torch.Tensor:
    """``x[:, 0]``: activations are replicated, no communication (sequence parallel: the
    sequence blocks are all_gathered first, the gradient kept per block)."""
    axis = default_axis()
    if sequence_dim(axis) is not None:
        x = gather_from(x, axis, 1)
    return x[:, 0]


def whole_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """Every rank holds the whole sequence and batch: the position ids as they are."""
    return position_ids
