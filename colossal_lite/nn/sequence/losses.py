"""Sequence-parallel loss, logits gathering and first token.

Cross entropy of sequence-split logits ``[b, s/P, C]`` against the user's full
labels ``[b, s]`` (labels cut the same way)::

    local  = [ sum_{own valid tokens} CE_t , #own valid tokens ]
    global = all_reduce_sum(local) over SEQUENCE      # 1 all_reduce of 2 floats
    loss   = global[0] / global[1]                    # mean over every valid token

The sum goes through ``reduce_from`` (identity backward), so rank r back-propagates
``dCE_t / N`` for its own tokens only: with masked-LM labels spread unevenly over
the ranks the mean is still over all N valid tokens. Replicated logits ``[b, C]``
(NSP, class heads) are reduced locally and their gradient scaled by ``1/P`` (see
layers.py: the SEQUENCE_DP gradient sum adds the P equal shares).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ...communication import collective as C
from ...communication import gather_from, reduce_from
from ...context import ProcessGroupAxis
from ..functional import check_targets, per_token_cross_entropy
from ..parallel_1d.losses import token_mean
from .layers import local_block, sequence_axis, sequence_axis_of


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def scale_grad(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Identity forward; gradient times ``scale`` backward."""
    return x if scale == 1 else _ScaleGrad.apply(x, scale)


class SequenceCrossEntropyLoss(nn.Module):
    """Cross entropy over a split sequence (see module doc); the vocabulary is never split
    in sequence mode, so ``vocab_parallel`` is accepted and ignored.

    ``reduction='none'`` returns the full per-token losses ``[b, s]`` (all_gather over
    SEQUENCE), as the serial loss does. Communication: 1 all_reduce of 2 floats over
    SEQUENCE for 'mean' (and 'sum'), none for replicated logits.
    """

    def __init__(self, ignore_index: int = -100, reduction: str = 'mean',
                 vocab_parallel: Optional[bool] = None, axis: Optional[ProcessGroupAxis] = None):
        super().__init__()
        if reduction not in ('mean', 'sum', 'none'):
            raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
        self.ignore_index, self.reduction = ignore_index, reduction
        self.axis = axis or sequence_axis()

    def _is_split(self, logits: torch.Tensor, labels: torch.Tensor) -> bool:
        p = self.axis.size
        if p > 1 and logits.dim() == labels.dim() + 1 and labels.dim() >= 2 \
                and labels.shape[1] == logits.shape[1] * p \
                and logits.shape[:1] + logits.shape[2:-1] == labels.shape[:1] + labels.shape[2:]:
            return True
        if sequence_axis_of(logits) is not None or logits.shape[:-1] != labels.shape:
            raise ValueError(
                f'logits {tuple(logits.shape)} and full labels {tuple(labels.shape)} disagree: '
                f'expected sequence-split logits [b, s/P, C] with P={p} for labels [b, s], or '
                f'replicated logits equal to labels.shape + (classes,)')
        return False

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        check_targets(labels, logits.shape[-1], self.ignore_index)
        if not self._is_split(logits, labels):
            per_token = per_token_cross_entropy(logits, labels, None, self.ignore_index)
            out = token_mean(per_token, labels.reshape(-1), self.ignore_index, self.reduction)
            out = out.view(labels.shape) if self.reduction == 'none' else out
            return scale_grad(out, 1.0 / self.axis.size)
        local = local_block(labels, self.axis, 1, 'label sequence length')
        per_token = per_token_cross_entropy(logits, local, None, self.ignore_index)
        if self.reduction == 'none':  # the full [b, s] per-token losses, as the serial loss
            return gather_from(per_token.view(local.shape), self.axis, 1)
        count = (local != self.ignore_index).sum().to(per_token.dtype)
        totals = reduce_from(torch.stack([per_token.sum(), count]), self.axis)
        if self.reduction == 'sum':
            return totals[0]
        return totals[0] / totals[1].detach()


def gather_logits_sequence(logits: torch.Tensor) -> torch.Tensor:
    """Full ``[b, s, C]`` logits from sequence-split ones (all_gather of dim 1 over
    SEQUENCE; backward keeps the own block); replicated logits are returned unchanged."""
    axis = sequence_axis_of(logits)
    return gather_from(logits, axis, 1) if axis is not None else logits


class _FirstToken(torch.autograd.Function):
    """Forward: ``x[:, 0]`` of rank 0's block, broadcast over SEQUENCE.
    Backward: the P gradient shares reduced (summed) onto rank 0's position 0."""

    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis, ctx.shape = axis, x.shape
        if axis.rank == 0:
            first = x[:, 0].contiguous()
        else:
            first = x.new_empty((x.shape[0],) + tuple(x.shape[2:]))
        return C.broadcast(first, axis, src=0)

    @staticmethod
    def backward(ctx, grad):
        total = C.reduce(grad.contiguous(), ctx.axis, dst=0)
        dx = grad.new_zeros(ctx.shape)
        if ctx.axis.rank == 0:
            dx[:, 0] = total
        return dx, None


def first_token_sequence(x: torch.Tensor) -> torch.Tensor:
    """``x[:, 0]`` of a ``[b, s/P, h]`` activation: the [CLS] token lives on SEQUENCE rank 0.
    Returns the replicated ``[b, h]``. Forward: 1 broadcast of b*h; backward: 1 reduce of b*h."""
    axis = sequence_axis()
    if axis.size == 1:
        return x[:, 0]
    return _FirstToken.apply(x, axis)
