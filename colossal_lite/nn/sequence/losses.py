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
from ..losses import CrossEntropyLoss
from .layers import sequence_axis


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


class SequenceCrossEntropyLoss(CrossEntropyLoss):
    """The shared cross entropy (``nn/losses.py``) over sequence-split logits ``[b, s/P, C]``
    (labels cut the same way; 1 all_reduce of 1 element over SEQUENCE for 'mean' and 'sum').
    Replicated per-sample logits ``[b, C]`` (NSP, class heads) are reduced locally and their
    gradient scaled by ``1/P``: the SEQUENCE_DP gradient sum adds the P equal shares."""

    def own_share(self, per_token: torch.Tensor, leading) -> torch.Tensor:
        if leading:
            return per_token
        return scale_grad(per_token, 1.0 / sequence_axis().size)


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
