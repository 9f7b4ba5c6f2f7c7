"""Sequence-parallel loss, logits gathering and first token.

Cross entropy of sequence-split logits ``[b, s/P, C]`` against the user's full
labels ``[b, s]`` (labels cut the same way: put in the ring order of the
``SequenceLayout``, then cut into P contiguous pieces, so zigzag chunks line up)::

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
from ..losses import CrossEntropyLoss, gather_logits
from .layers import is_sequence_split
from .layout import sequence_axis, sequence_layout


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

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Under zigzag the labels are put in ring order (so the contiguous cut of the
        logits' placement gives each rank its chunks' labels) and per-token losses
        (``reduction='none'``) back in serial order; means and sums do not depend on the order."""
        layout = sequence_layout()
        split = is_sequence_split(logits) and labels.dim() >= 2
        if not (layout.is_zigzag and split and labels.shape[1] == logits.shape[1] * layout.size):
            return super().forward(logits, labels)
        out = super().forward(logits, layout.ring_order(labels, 1))
        return layout.serial_order(out, 1) if self.reduction == 'none' else out

    def own_share(self, per_token: torch.Tensor, leading) -> torch.Tensor:
        if leading:
            return per_token
        return scale_grad(per_token, 1.0 / sequence_axis().size)


class _FirstToken(torch.autograd.Function):
    """Forward: ``x[:, offset]`` of the owner's block, broadcast over SEQUENCE.
    Backward: the P gradient shares reduced (summed) onto the owner's position."""

    @staticmethod
    def forward(ctx, x, axis, owner, offset):
        ctx.axis, ctx.shape, ctx.owner, ctx.offset = axis, x.shape, owner, offset
        if axis.rank == owner:
            first = x[:, offset].contiguous()
        else:
            first = x.new_empty((x.shape[0],) + tuple(x.shape[2:]))
        return C.broadcast(first, axis, src=owner)

    @staticmethod
    def backward(ctx, grad):
        total = C.reduce(grad.contiguous(), ctx.axis, dst=ctx.owner)
        dx = grad.new_zeros(ctx.shape)
        if ctx.axis.rank == ctx.owner:
            dx[:, ctx.offset] = total
        return dx, None, None, None


def first_token_sequence(x: torch.Tensor) -> torch.Tensor:
    """``x[:, 0]`` of a ``[b, s/P, h]`` activation: the [CLS] token, which the
    ``SequenceLayout`` puts on SEQUENCE rank 0 at local offset 0 (both layouts).
    Returns the replicated ``[b, h]``. Forward: 1 broadcast of b*h; backward: 1 reduce of b*h."""
    layout = sequence_layout()
    if layout.size == 1:
        return x[:, 0]
    owner, offset = layout.owner(0, x.shape[1] * layout.size)
    return _FirstToken.apply(x, layout.axis, owner, offset)


def gather_sequence_logits(logits: torch.Tensor) -> torch.Tensor:
    """The full logits in serial order on every rank (differentiable): sequence-split
    ``[b, s/P, C]`` logits are all-gathered over SEQUENCE (``b*s*C`` elements received)
    and, under zigzag, put back in serial order; replicated ``[b, C]`` ones returned as
    they are. Backward keeps this rank's part of the gradient."""
    full = gather_logits(logits)
    layout = sequence_layout()
    return layout.serial_order(full, 1) if is_sequence_split(logits) else full
