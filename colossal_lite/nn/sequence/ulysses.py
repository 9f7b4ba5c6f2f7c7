"""Ulysses attention (all-to-all from sequence to heads) and the ring x Ulysses hybrid.

Sharding. Mode 'ulysses' has P = R x U ranks in its SEQUENCE group: U consecutive ranks
form a ULYSSES group, and the R ranks with the same Ulysses index a SEQUENCE_RING group
(R = ``parallel.tensor.ring``, default 1). Rank (r, u) holds the tokens
:class:`~.layout.SequenceLayout` gives it (``s/P`` of them) with all heads::

    q [b, s/P, n*d]      k, v [b, s/P, n_kv*d]

An all_to_all over ULYSSES re-splits them from the sequence to the heads::

    q [b, s/P, n*d]  ->  [b, s/R, (n/U) d]      k, v  ->  [b, s/R, (n'/U) d]

rank u receiving query heads ``u n/U .. (u+1) n/U - 1`` of its ring rank's whole block,
in ring order. ``n' = n_kv`` when U divides n_kv; when n_kv divides U (grouped-query
attention with fewer kv heads than Ulysses ranks) each kv head is first repeated U/n_kv
times, so rank u receives the one kv head its query heads read, and the repeat's backward
sums the copies' gradients. Attention on the block: with R = 1 plain attention over the
whole sequence (``functional.attention``, SDPA; plain causal attention -- no padding mask, no
packed documents -- as SDPA's ``is_causal`` (``sdpa_causal``), which builds and saves no
``s x s`` mask and gives the same numbers); with R > 1 ring attention (``ring.py``) of
these heads over SEQUENCE_RING, with its (zigzag) chunks. The output goes back by the
inverse all_to_all to ``[b, s/P, n*d]``.

Bytes per rank and layer, e the element size ((U-1)/U of each tensor leaves the rank)::

    forward   (U-1)/U * b (s/P) (2 n + 2 n') d e          q and out; k and v
    backward  the same (the transposed all_to_alls)

plus, for R > 1, ``ring.py``'s bytes for ``s/R`` tokens of ``n'/U`` kv heads over R ranks.
Needs n divisible by U, and n_kv divisible by U or dividing it.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch

from ...communication import all_to_all_to
from ...context import ParallelMode, ProcessGroupAxis, seed
from ..functional import attention, local_heads
from ..parallel_1d import AttentionCore1D
from .layers import sequence_linear
from .layout import SequenceLayout, sequence_axis
from .ring import ring_attention


def check_ulysses_heads(heads: int, kv_heads: int, ulysses: int):
    """A ValueError naming the counts unless U divides the query heads and the kv heads
    divide or are divided by U."""
    if heads % ulysses:
        raise ValueError(f'Ulysses splits the attention heads over its U = {ulysses} ranks: '
                         f'it needs the heads ({heads}) divisible by U (parallel.tensor.size / '
                         f'parallel.tensor.ring)')
    if kv_heads % ulysses and ulysses % kv_heads:
        raise ValueError(f'Ulysses needs the kv heads ({kv_heads}) divisible by U = {ulysses} '
                         f'(split) or dividing it (each repeated U / kv_heads times)')


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int,
                      ulysses: ProcessGroupAxis, ring: SequenceLayout, causal: bool = False,
                      key_padding_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                      rng: Callable[[], contextlib.AbstractContextManager]
                      = contextlib.nullcontext,
                      document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """softmax(Q K^T / sqrt(d) + mask) V of local ``q [b, s/P, n*d]``, ``k, v [b, s/P,
    n_kv*d]`` (module doc): all_to_all over ``ulysses``, attention over the ring block of
    ``ring`` (a one-rank layout: the whole sequence), all_to_all back. ``key_padding_mask``
    (the user's mask) and ``document_ids`` (packed rows) are full ``[b, s]``."""
    u = ulysses.size
    heads, kv_heads = local_heads(q, k, head_dim)
    check_ulysses_heads(heads, kv_heads, u)
    b, s_l = q.shape[0], q.shape[1]
    if kv_heads % u:   # fewer kv heads than ranks: rank i gets kv head i // (U / n_kv)
        k, v = (t.view(b, s_l, kv_heads, 1, head_dim).expand(-1, -1, -1, u // kv_heads, -1)
                .reshape(b, s_l, u * head_dim) for t in (k, v))
    q_h = all_to_all_to(q, ulysses, scatter_dim=2, gather_dim=1)
    k_h, v_h = all_to_all_to(torch.stack([k, v]), ulysses, scatter_dim=3, gather_dim=2)
    if ring.size == 1:
        out = attention(q_h, k_h, v_h, head_dim, causal=causal, key_padding_mask=key_padding_mask,
                        dropout_p=dropout_p, rng=rng, document_ids=document_ids,
                        sdpa_causal=True)
    else:
        out = ring_attention(q_h, k_h, v_h, head_dim, ring, causal=causal,
                             key_padding_mask=key_padding_mask, dropout_p=dropout_p, rng=rng,
                             document_ids=document_ids)
    return all_to_all_to(out, ulysses, scatter_dim=1, gather_dim=2)


def ulysses_kv_linear(in_features: int, kv_heads: int, head_dim: int, num_heads: int,
                      bias: bool = True, **kwargs):
    """The facade's KeyValueLinear: every head on every rank, weight replicated; the heads
    are checked against the ULYSSES size here, at construction."""
    check_ulysses_heads(num_heads, kv_heads, sequence_axis(ParallelMode.ULYSSES).size)
    return sequence_linear(in_features, kv_heads * head_dim, bias, 'enter', **kwargs)


class UlyssesAttentionCore(AttentionCore1D):
    """softmax(QK^T/sqrt(d) + mask)V with q ``[b, s/P, n*d]`` and k, v ``[b, s/P, n_kv*d]``
    (this rank's tokens, all heads) by Ulysses over ULYSSES and, with ``parallel.tensor.ring``
    > 1, ring attention over SEQUENCE_RING (module doc). ``head_split`` is U. Attention
    dropout draws from the per-rank TENSOR stream."""

    def __init__(self, head_dim: int, causal: bool = False, dropout: float = 0.0,
                 axis: Optional[ProcessGroupAxis] = None,
                 ring_axis: Optional[ProcessGroupAxis] = None):
        super().__init__(head_dim, causal, dropout,
                         axis=axis or sequence_axis(ParallelMode.ULYSSES))
        self.ring_layout = SequenceLayout.of(ring_axis
                                             or sequence_axis(ParallelMode.SEQUENCE_RING))

    def rng(self):
        split = self.axis.size * self.ring_layout.size > 1
        return seed(ParallelMode.TENSOR) if split else contextlib.nullcontext()

    def forward(self, q, k, v, key_padding_mask=None, document_ids=None):
        return ulysses_attention(q, k, v, self.head_dim, self.axis, self.ring_layout,
                                 causal=self.causal, key_padding_mask=key_padding_mask,
                                 dropout_p=self.dropout if self.training else 0.0, rng=self.rng,
                                 document_ids=document_ids)
