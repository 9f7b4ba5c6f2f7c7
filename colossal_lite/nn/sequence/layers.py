"""Sequence parallelism: the model is replicated, the sequence is split over SEQUENCE (P ranks).

Standard layout: an activation ``[b, s, h]`` lives on rank r as its part ``[b, s/P, h]``
of the sequence, the positions :class:`~.layout.SequenceLayout` gives it (zigzag, the
default: chunks r and 2P-1-r of 2P equal chunks; ``parallel.tensor.zigzag=False``: the
contiguous block ``r*s/P .. (r+1)*s/P - 1``). Every weight is
replicated (full shape, serial keys, no ShardSpec entry). Per-token layers
(Linear, LayerNorm, MLP, Dropout) are the 1D layers over a one-rank group, acting
on the local sub-sequence; only attention (ring self-attention, ``ring.py``),
the losses over the split sequence, ``gather_logits`` and ``first_token``
communicate.

Per-sample activations (``[b, h]`` after :func:`first_token`, NSP / class logits)
are replicated on the P ranks. Gradient convention (docs/architecture.md): each
rank's parameter gradient covers its own sub-sequence, and the gradient handler
sums over SEQUENCE_DP; so a loss over replicated logits back-propagates ``1/P`` of
its gradient on every rank (the P shares sum to one).
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F

from ...context import ParallelMode, ProcessGroupAxis, seed
from ...tensor import placement_of, tag
from ..parallel_1d import (AttentionCore1D, Classifier1D, Dropout1D, Embedding1D,
                           PatchEmbedding1D, VocabParallelClassifier1D, linear_1d)
from ..functional import check_ids
from .layout import LayoutLike, SequenceLayout, as_layout, sequence_axis, sequence_layout
from .ring import ring_attention

SERIAL_1D = ProcessGroupAxis.serial(ParallelMode.PARALLEL_1D)


def check_sequence_length(length: int, layout: LayoutLike = None,
                          what: str = 'sequence length'):
    """``length`` splits over the layout (``SequenceLayout.check``): divisible by P, or by
    2P under zigzag; a ValueError naming the numbers (and ``tensor.zigzag=False``) else."""
    as_layout(layout).check(length, what)


def local_block(x: torch.Tensor, layout: LayoutLike = None, dim: int = 1,
                what: str = 'sequence length') -> torch.Tensor:
    """This rank's part of ``dim`` (``SequenceLayout.local``: its contiguous block, or its two
    zigzag chunks; no communication either way: the positions of other ranks get zero
    gradient here and are completed by the SEQUENCE_DP gradient sum). ``layout``: a
    SequenceLayout, a SEQUENCE axis (with the launched zigzag setting) or None (current)."""
    return as_layout(layout).local(x, dim, what)


def tag_sequence_split(t: torch.Tensor, axis: ProcessGroupAxis) -> torch.Tensor:
    """Tag ``t`` as cut along dim 1 over ``axis`` (read by the loss and gather_logits)."""
    return tag(t, (1, axis))


def is_sequence_split(t: torch.Tensor) -> bool:
    placement = placement_of(t)
    return placement is not None and bool(placement.cut_modes(1))


def sequence_linear(in_features: int, out_features: int, bias: bool = True,
                    region: Optional[str] = None, **kwargs):
    """Per-token linear on the local sub-sequence: the 1D linear over a one-rank group.
    Weight [out, in] and bias [out] replicated; ``region`` changes nothing. No communication."""
    kwargs.pop('axis', None)
    return linear_1d(in_features, out_features, bias, region, axis=SERIAL_1D, **kwargs)


def sequence_kv_linear(in_features: int, kv_heads: int, head_dim: int, num_heads: int,
                       bias: bool = True, **kwargs):
    """The facade's KeyValueLinear: every head on every rank, weight replicated."""
    return sequence_linear(in_features, kv_heads * head_dim, bias, 'enter', **kwargs)


def sequence_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """Positions of this rank's tokens (``[s]`` or ``[b, s]`` ids -> ``[s/P]`` or
    ``[b, s/P]``): its part of the last (sequence) dim, in the order of its activations."""
    return sequence_layout().local(position_ids, dim=position_ids.dim() - 1)


class SequenceEmbedding(Embedding1D):
    """Full ids ``[b, s]`` (tokens, positions or token types) -> ``[b, s/P, h]``.

    Weight [V, h] replicated (the vocabulary is not split in sequence mode, so this
    also serves VocabParallelEmbedding). The ids are cut to this rank's block
    before the lookup (its ``SequenceLayout`` part), so position ids keep their global
    values. No communication.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: Optional[int] = None,
                 axis: Optional[ProcessGroupAxis] = None, **kwargs):
        super().__init__(num_embeddings, embedding_dim, padding_idx, axis=SERIAL_1D, **kwargs)
        self.seq_layout = SequenceLayout.of(axis)
        self.seq_axis = self.seq_layout.axis

    def forward(self, ids):
        check_ids(ids, self.num_embeddings, 'Embedding')  # full ids: every rank raises together
        return super().forward(self.seq_layout.local(ids))


class _TagsSequence:
    """Mixin: outputs of a ``[b, s/P, h]`` input are tagged as sequence-split."""

    def forward(self, x):
        out = super().forward(x)
        return tag_sequence_split(out, self.seq_axis) if x.dim() >= 3 else out


class SequenceClassifier(_TagsSequence, Classifier1D):
    """Logits of every class: weight [C, h], bias [C] replicated; input ``[b, s/P, h]``
    -> ``[b, s/P, C]`` (tagged sequence-split) or ``[b, h]`` -> ``[b, C]`` (replicated).
    No communication."""

    def __init__(self, in_features: int, num_classes: int, bias: bool = True, weight=None,
                 axis: Optional[ProcessGroupAxis] = None, **kwargs):
        super().__init__(in_features, num_classes, bias, weight, axis=SERIAL_1D, **kwargs)
        self.seq_axis = axis or sequence_axis()


class SequenceVocabClassifier(_TagsSequence, VocabParallelClassifier1D):
    """LM head: weight [V, h] (tied to the embedding) and bias [V] replicated, the
    vocabulary is not split; ``[b, s/P, h] -> [b, s/P, V]`` tagged sequence-split.
    No communication."""

    def __init__(self, in_features: int, num_classes: int, bias: bool = False, weight=None,
                 axis: Optional[ProcessGroupAxis] = None, **kwargs):
        super().__init__(in_features, num_classes, bias, weight, axis=SERIAL_1D, **kwargs)
        self.seq_axis = axis or sequence_axis()


class SequenceDropout(Dropout1D):
    """Dropout. Sequence-split activations (dim >= 3) draw from the TENSOR (= SEQUENCE)
    stream, whose seed differs per sequence rank; replicated per-sample ones (dim < 3)
    from the default stream, equal on every rank. No communication."""

    def __init__(self, p: float = 0.5, inside_region: bool = False,
                 axis: Optional[ProcessGroupAxis] = None):
        super().__init__(p, inside_region, axis=axis or sequence_axis())

    def forward(self, x):
        if not self.training or self.p == 0:
            return x
        split = x.dim() >= 3 and self.axis.size > 1
        with seed(ParallelMode.TENSOR) if split else contextlib.nullcontext():
            return F.dropout(x, self.p, True)


class SequencePatchEmbedding(PatchEmbedding1D):
    """Images ``[b, C, H, W]`` (full, replicated) -> tokens ``[b, (1 + patches)/P, h]``.

    Conv weights, class token and positions replicated; every rank embeds the whole
    image and keeps its part of the tokens (the gradient of the other parts is
    completed by the SEQUENCE_DP sum). No communication. Under zigzag the 1 + k^2
    tokens never divide by 2P (>= 4): ViT needs ``parallel.tensor.zigzag=False``.
    """

    TOKENS = 'number of tokens (1 class token + patches)'

    def __init__(self, img_size: int, patch_size: int, in_chans: int, embed_size: int,
                 axis: Optional[ProcessGroupAxis] = None, **kwargs):
        super().__init__(img_size, patch_size, in_chans, embed_size, **kwargs)
        self.seq_layout = SequenceLayout.of(axis)
        self.seq_axis = self.seq_layout.axis
        self.seq_layout.check(1 + self.num_patches, self.TOKENS)

    def forward(self, images):
        return self.seq_layout.local(super().forward(images), 1, self.TOKENS)


class RingAttentionCore(AttentionCore1D):
    """softmax(QK^T/sqrt(d) + mask)V with q ``[b, s/P, n*d]`` and k, v ``[b, s/P, n_kv*d]``
    (all heads of this rank's tokens; grouped-query attention when n_kv < n).

    Ring attention with online softmax (``ring.py``): ``[k; v]`` blocks (n_kv heads) make
    P-1 ring exchanges forward, and P-1 plus P-1 of the fp32 ``[dk; dv]`` accumulators
    backward. ``key_padding_mask`` and ``document_ids`` are the user's full ``[b, s]``
    tensors (every rank cuts the chunk pairs it computes from them); causal masking
    compares the global positions of the chunks (``SequenceLayout``). The largest
    temporaries are one block's ``[b, n, c, 2c]`` scores (c = s/P or s/2P); attention
    dropout draws one seed per forward from the per-rank TENSOR stream.
    """

    def __init__(self, head_dim: int, causal: bool = False, dropout: float = 0.0,
                 axis: Optional[ProcessGroupAxis] = None):
        super().__init__(head_dim, causal, dropout, axis=axis or sequence_axis())
        self.seq_layout = SequenceLayout.of(self.axis)

    head_split = 1  # every rank holds all heads of its sub-sequence

    def forward(self, q, k, v, key_padding_mask=None, document_ids=None):
        return ring_attention(q, k, v, self.head_dim, self.seq_layout, causal=self.causal,
                              key_padding_mask=key_padding_mask,
                              dropout_p=self.dropout if self.training else 0.0, rng=self.rng,
                              document_ids=document_ids)
