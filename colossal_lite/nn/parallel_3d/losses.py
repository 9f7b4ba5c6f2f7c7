"""3D loss, attention core, logits gathering and first token.

Logits carry the tag put by the 3D classifiers: the batch layout (standard for
:class:`Classifier3D`, swapped for :class:`VocabParallelClassifier3D`) and the
group the classes are split over (WEIGHT, or none). The loss splits the user's
full labels the same way.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import nn

from ...communication import gather_from, reduce_from
from ...context import ParallelMode, seed
from ..functional import attention, check_targets, per_token_cross_entropy
from ..parallel_1d.losses import token_mean
from .cube import Cube3D, default_cube, gather_batch, split_batch
from .layers import LOGITS_LAYOUT_ATTR


def logits_layout(logits: torch.Tensor):
    """(batch layout, class-split axis or None) of logits made by a 3D classifier."""
    layout = getattr(logits, LOGITS_LAYOUT_ATTR, None)
    if layout is None:
        raise ValueError('3D losses and gather_logits need the logits returned by a 3D '
                         'Classifier or VocabParallelClassifier (their batch is split over '
                         'the cube and only those layers record how)')
    return layout


class CrossEntropyLoss3D(nn.Module):
    """Cross entropy of 3D classifier logits against the full labels, mean over the global batch.

    Labels ``[b, ..]`` are split like the logits' batch (no communication). Class-split
    logits: 3 all_reduces over WEIGHT of the local token count (functional.py). The local
    loss sum is all_reduced over each batch group (INPUT_X_WEIGHT, or OUTPUT and INPUT;
    identity backward: the loss is the same on every rank); the divisor is counted on the
    full labels. ``reduction='none'`` all_gathers the per-token losses to ``[b, ..]``.
    """

    def __init__(self, ignore_index: int = -100, reduction: str = 'mean',
                 vocab_parallel: Optional[bool] = None, cube: Optional[Cube3D] = None):
        super().__init__()
        if reduction not in ('mean', 'sum', 'none'):
            raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
        self.ignore_index, self.reduction, self.vocab_parallel = ignore_index, reduction, vocab_parallel
        self.cube = default_cube(cube)

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        batch, vocab = logits_layout(logits)
        if vocab is not None and vocab.size == 1:
            vocab = None
        if self.vocab_parallel is False and vocab is not None:
            logits, vocab = gather_from(logits, vocab, -1), None
        elif self.vocab_parallel and vocab is None:
            raise ValueError('vocab_parallel=True, but these logits are not split along the '
                             'classes (use a VocabParallelClassifier)')
        local_labels = split_batch(labels, batch, 'the labels')
        if logits.shape[:-1] != local_labels.shape:
            raise ValueError(f'labels {tuple(labels.shape)} do not match the logits: local logits '
                             f'{tuple(logits.shape)} need local labels {tuple(logits.shape[:-1])}, '
                             f'got {tuple(local_labels.shape)}')
        check_targets(labels, logits.shape[-1] * (vocab.size if vocab else 1), self.ignore_index)
        per_token = per_token_cross_entropy(logits, local_labels, vocab, self.ignore_index)
        if self.reduction == 'none':
            return gather_batch(per_token.view(local_labels.shape), batch)
        total = per_token.sum()
        for axis in batch.batch:
            total = reduce_from(total, axis)
        if self.reduction == 'sum':
            return total
        return token_mean(total, labels, self.ignore_index, 'mean')


class AttentionCore3D(nn.Module):
    """softmax(QK^T/sqrt(d) + mask)V on q, k, v in the swapped layout (made by 'enter'
    linears): ``[b, s, n*d] -> [b/q^2, s, n/q*d]`` (batch chunk l*q+i, heads chunk j).

    The user's full ``key_padding_mask [b, s]`` is split by batch locally. No
    communication; attention dropout draws from the TENSOR stream.
    """

    def __init__(self, head_dim: int, causal: bool = False, dropout: float = 0.0,
                 cube: Optional[Cube3D] = None):
        super().__init__()
        self.head_dim, self.causal, self.dropout = head_dim, causal, dropout
        self.cube = default_cube(cube)

    @property
    def head_split(self) -> int:
        """Ranks the heads are divided among (the hidden split q)."""
        return self.cube.q

    def rng(self):
        return seed(ParallelMode.TENSOR) if self.cube.q > 1 else contextlib.nullcontext()

    def forward(self, q, k, v, key_padding_mask=None):
        width, parts = q.shape[-1], self.cube.q
        if width % self.head_dim:
            heads = width * parts // self.head_dim
            raise ValueError(f'3D attention splits the heads over q={parts}: the number of heads '
                             f'{heads} (hidden {width * parts} / head_dim {self.head_dim}) must '
                             f'be divisible by {parts}')
        if key_padding_mask is not None:
            key_padding_mask = split_batch(key_padding_mask, self.cube.swapped, 'key_padding_mask')
        return attention(q, k, v, self.head_dim, causal=self.causal,
                         key_padding_mask=key_padding_mask,
                         dropout_p=self.dropout if self.training else 0.0, rng=self.rng)


def gather_logits_3d(logits: torch.Tensor) -> torch.Tensor:
    """Full ``[b, .., C]`` logits on every rank: all_gather the classes (WEIGHT) if split,
    then the batch (one all_gather per batch group, innermost first)."""
    batch, vocab = logits_layout(logits)
    if vocab is not None:
        logits = gather_from(logits, vocab, -1)
    return gather_batch(logits, batch)


def first_token_3d(x: torch.Tensor) -> torch.Tensor:
    """``x[:, 0]``: the batch and hidden splits are kept (standard layout of ``[b, h]``);
    no communication."""
    return x[:, 0]
