"""Sequence parallelism: replicated weights, split sequence; mode 'sequence' attends by ring
attention, mode 'ulysses' by Ulysses' all-to-all (and, with ``ring`` > 1, a ring over it).

Which positions a rank holds is ``layout.py``'s :class:`SequenceLayout` (zigzag by default,
``parallel.tensor.zigzag``); ``ring.py`` is the memory-linear ring attention, ``ulysses.py``
the all-to-all attention.

Every kind of ``nn/registry.py`` is registered here explicitly; per-token layers
are the 1D layers over a one-rank group (``LayerNorm1D``, the 1D linear).
"""
from ..parallel_1d import LayerNorm1D, qkv_1d
from ..registry import register
from .layers import (RingAttentionCore, SequenceClassifier, SequenceDropout, SequenceEmbedding,
                     SequencePatchEmbedding, SequenceVocabClassifier, check_sequence_length,
                     is_sequence_split, local_block, sequence_kv_linear, sequence_linear,
                     sequence_positions, tag_sequence_split)
from .layout import SequenceLayout, sequence_axis, sequence_layout
from .losses import (SequenceCrossEntropyLoss, first_token_sequence, gather_sequence_logits,
                     scale_grad)
from .ring import chunk_pairs, record_blocks, ring_attention
from .ulysses import (UlyssesAttentionCore, check_ulysses_heads, ulysses_attention,
                      ulysses_kv_linear)

# 'sequence' (ring) and 'ulysses' share every layer but the attention core and kv linear
_SHARED = {'linear': sequence_linear, 'layernorm': LayerNorm1D, 'embedding': SequenceEmbedding,
           'vocab_parallel_embedding': SequenceEmbedding, 'classifier': SequenceClassifier,
           'vocab_parallel_classifier': SequenceVocabClassifier,
           'patch_embedding': SequencePatchEmbedding, 'dropout': SequenceDropout,
           'cross_entropy': SequenceCrossEntropyLoss, 'gather_logits': gather_sequence_logits,
           'first_token': first_token_sequence,
           'qkv': qkv_1d,  # one matmul over the replicated weights
           'positions': sequence_positions}
_OWN = {'sequence': {'attention_core': RingAttentionCore, 'kv_linear': sequence_kv_linear},
        'ulysses': {'attention_core': UlyssesAttentionCore, 'kv_linear': ulysses_kv_linear}}
for _mode, _own in _OWN.items():
    for _kind, _impl in {**_SHARED, **_own}.items():
        register(_mode, _kind)(_impl)

__all__ = ['RingAttentionCore', 'SequenceClassifier', 'SequenceDropout', 'SequenceEmbedding',
           'SequencePatchEmbedding', 'SequenceVocabClassifier', 'SequenceCrossEntropyLoss',
           'SequenceLayout', 'sequence_layout', 'ring_attention', 'UlyssesAttentionCore',
           'ulysses_attention', 'check_ulysses_heads', 'record_blocks', 'chunk_pairs',
           'check_sequence_length', 'local_block', 'sequence_axis', 'is_sequence_split',
           'sequence_linear', 'tag_sequence_split', 'first_token_sequence',
           'gather_sequence_logits', 'scale_grad']
