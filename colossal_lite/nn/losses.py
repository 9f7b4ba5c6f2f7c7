"""Cross entropy and logits gathering for every family, read from the logits' placement.

Every classifier tags its logits with a :class:`~colossal_lite.tensor.Placement`:
cuts along the batch (2D/2.5D/3D), the sequence (sequence mode) and the classes
(vocab-parallel heads). So one loss serves every layout::

    labels_local = labels cut like the logits' leading dims     (no communication)
    per_token    = CE(logits_local, labels_local)               (vocab-split: functional.py)
    'sum'        = reduce_from(sum per_token) over each batch/sequence cut mode
    'mean'       = 'sum' / #(labels != ignore_index)            (counted on the full labels)
    'none'       = per_token gathered over the batch/sequence cuts -> full [b, ..]

``reduce_from`` is identity backward: every rank holds the same loss and back-propagates
into its own tokens only. :func:`gather_logits` undoes every cut with differentiable
all_gathers, so a user's own loss on gathered logits trains in every family.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..communication import gather_from, reduce_from
from ..context import ParallelMode, current_context
from ..tensor import Placement, placement_of
from .functional import check_targets, per_token_cross_entropy


def tensor_parallel_size() -> int:
    return current_context().get_world_size(ParallelMode.TENSOR)


def logits_placement(logits: torch.Tensor, what: str) -> Placement:
    """The logits' placement; untagged logits are whole only when nothing is split."""
    placement = placement_of(logits)
    if placement is not None:
        return placement
    if tensor_parallel_size() > 1:
        raise ValueError(
            f'{what} needs the logits returned by a colossal_lite Classifier or '
            f'VocabParallelClassifier; this tensor has lost their layout (slicing, views, '
            f'.detach() and module hooks drop it). Slice the labels instead of the logits, '
            f'or call gather_logits on the classifier output first')
    return Placement(tuple(logits.shape))


def _split_modes(placement: Placement, ndim: int):
    """(modes cutting the leading ``ndim - 1`` dims, the mode cutting the classes or None)."""
    leading = tuple(mode for dim, mode in placement.cuts if dim < ndim - 1)
    vocab = placement.cut_modes(ndim - 1)
    return leading, (vocab[0] if vocab else None)


class CrossEntropyLoss(nn.Module):
    """Cross entropy of tagged logits against the user's full labels (see module doc).

    ``vocab_parallel=False`` gathers class-split logits first; True insists they are
    split. Communication: 3 all_reduces of the local token count over the class-split
    group (vocab-parallel logits), one all_reduce of 1 element per batch/sequence cut
    ('mean' and 'sum'), or all_gathers of the per-token losses ('none').
    """

    def __init__(self, ignore_index: int = -100, reduction: str = 'mean',
                 vocab_parallel: Optional[bool] = None, **unused):
        super().__init__()
        if reduction not in ('mean', 'sum', 'none'):
            raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
        self.ignore_index, self.reduction, self.vocab_parallel = ignore_index, reduction, vocab_parallel

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        placement = logits_placement(logits, 'CrossEntropyLoss')
        if tuple(labels.shape) != placement.shape[:-1]:
            raise ValueError(f'logits {placement.shape} (full shape) and labels '
                             f'{tuple(labels.shape)} disagree: logits must be labels.shape + '
                             f'(classes,)')
        leading, vocab = _split_modes(placement, logits.dim())
        if vocab is not None and self.vocab_parallel is False:
            logits, vocab = gather_from(logits, vocab, -1), None
        elif vocab is None and self.vocab_parallel:
            raise ValueError('vocab_parallel=True, but these logits are not split along the '
                             'classes (use a VocabParallelClassifier)')
        check_targets(labels, placement.shape[-1], self.ignore_index)
        local_labels = placement.shard(labels, dims=labels.dim())
        vocab_axis = current_context().axis(vocab) if vocab is not None else None
        per_token = per_token_cross_entropy(logits, local_labels, vocab_axis, self.ignore_index)
        per_token = self.own_share(per_token, leading)
        if self.reduction == 'none':
            out = per_token.view(local_labels.shape)
            for dim, mode in reversed(placement.cuts):
                if dim < labels.dim():
                    out = gather_from(out, mode, dim)
            return out
        total = per_token.sum()
        for mode in leading:
            total = reduce_from(total, mode)
        if self.reduction == 'sum':
            return total
        return total / (labels != self.ignore_index).sum()

    def own_share(self, per_token: torch.Tensor, leading) -> torch.Tensor:
        """Hook for families whose replicated per-sample logits need a gradient share."""
        return per_token


def gather_logits(logits: torch.Tensor) -> torch.Tensor:
    """The full logits a serial model would return, on every rank (differentiable)."""
    return logits_placement(logits, 'gather_logits').gather_differentiable(logits)
