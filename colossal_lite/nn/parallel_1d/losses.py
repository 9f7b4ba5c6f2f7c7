"""1D loss and attention core: activations are replicated, so no batch reduction is needed."""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import nn

from ...communication import gather_from
from ...context import ParallelMode, ProcessGroupAxis, seed
from ..functional import (attention, check_targets, per_token_cross_entropy, require_logits_tag,
                          vocab_axis_of)
from .layers import default_axis


def resolve_vocab_axis(logits: torch.Tensor, vocab_parallel: Optional[bool],
                       axis: ProcessGroupAxis) -> Optional[ProcessGroupAxis]:
    """The group the logits' classes are split over: from the tag, or forced by the caller."""
    tagged = vocab_axis_of(logits)
    if vocab_parallel is None:
        if axis.size > 1:
            require_logits_tag(logits, 'CrossEntropyLoss(vocab_parallel=None)')
        return tagged
    if vocab_parallel:
        return tagged or axis
    return None


def token_mean(per_token: torch.Tensor, labels: torch.Tensor, ignore_index: int,
               reduction: str) -> torch.Tensor:
    """torch's reductions over the tokens whose label is not ``ignore_index``."""
    if reduction == 'none':
        return per_token
    total = per_token.sum()
    if reduction == 'sum':
        return total
    return total / (labels != ignore_index).sum()


class CrossEntropyLoss1D(nn.Module):
    """Cross entropy of logits ``[.., C]`` (or vocab-split ``[.., C/p]``) against full labels.

    Vocab-split logits cost 3 all_reduces of N floats (see functional.py); replicated
    logits none. ``reduction='mean'`` averages over non-ignored tokens, as torch does.
    """

    def __init__(self, ignore_index: int = -100, reduction: str = 'mean',
                 vocab_parallel: Optional[bool] = None, axis: Optional[ProcessGroupAxis] = None):
        super().__init__()
        if reduction not in ('mean', 'sum', 'none'):
            raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
        self.ignore_index, self.reduction, self.vocab_parallel = ignore_index, reduction, vocab_parallel
        self.axis = axis or default_axis()

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if logits.shape[:-1] != labels.shape:
            raise ValueError(f'logits {tuple(logits.shape)} and labels {tuple(labels.shape)} '
                             f'disagree: logits must be labels.shape + (classes,)')
        vocab_axis = resolve_vocab_axis(logits, self.vocab_parallel, self.axis)
        check_targets(labels, logits.shape[-1] * (vocab_axis.size if vocab_axis else 1),
                      self.ignore_index)
        per_token = per_token_cross_entropy(logits, labels, vocab_axis, self.ignore_index)
        out = token_mean(per_token, labels.reshape(-1), self.ignore_index, self.reduction)
        return out.view(labels.shape) if self.reduction == 'none' else out


class AttentionCore1D(nn.Module):
    """softmax(QK^T/sqrt(d))V on this rank's heads: q, k, v ``[b, s, n/p * d]``. No communication;
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

    def forward(self, q, k, v, key_padding_mask=None):
        return attention(q, k, v, self.head_dim, causal=self.causal,
                         key_padding_mask=key_padding_mask,
                         dropout_p=self.dropout if self.training else 0.0, rng=self.rng)


def gather_logits_1d(logits: torch.Tensor) -> torch.Tensor:
    """Full logits ``[.., C]`` from vocab-split ones (all_gather; differentiable: backward
    keeps this rank's chunk of the gradient); others unchanged."""
    if default_axis().size > 1:
        require_logits_tag(logits, 'gather_logits')
    axis = vocab_axis_of(logits)
    return gather_from(logits, axis, -1) if axis is not None else logits


def first_token_1d(x: torch.Tensor) -> torch.Tensor:
    """``x[:, 0]``: activations are replicated, no communication."""
    return x[:, 0]
