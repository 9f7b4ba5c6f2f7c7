"""Sequence parallelism (mode 'sequence'): replicated weights, split sequence, ring attention.

Which positions a rank holds is ``layout.py``'s :class:`SequenceLayout` (zigzag by default,
``parallel.tensor.zigzag``); ``ring.py`` is the memory-linear ring attention.

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

register('sequence', 'linear')(sequence_linear)
register('sequence', 'layernorm')(LayerNorm1D)
register('sequence', 'embedding')(SequenceEmbedding)
register('sequence', 'vocab_parallel_embedding')(SequenceEmbedding)
register('sequence', 'classifier')(SequenceClassifier)
register('sequence', 'vocab_parallel_classifier')(SequenceVocabClassifier)
register('sequence', 'patch_embedding')(SequencePatchEmbedding)
register('sequence', 'dropout')(SequenceDropout)
register('sequence', 'cross_entropy')(SequenceCrossEntropyLoss)
register('sequence', 'attention_core')(RingAttentionCore)
register('sequence', 'gather_logits')(gather_sequence_logits)
register('sequence', 'first_token')(first_token_sequence)
register('sequence', 'qkv')(qkv_1d)  # one matmul over the replicated weights
register('sequence', 'kv_linear')(sequence_kv_linear)
register('sequence', 'positions')(sequence_positions)

__all__ = ['RingAttentionCore', 'SequenceClassifier', 'SequenceDropout', 'SequenceEmbedding',
           'SequencePatchEmbedding', 'SequenceVocabClassifier', 'SequenceCrossEntropyLoss',
           'SequenceLayout', 'sequence_layout', 'ring_attention', 'record_blocks', 'chunk_pairs',
           'check_sequence_length', 'local_block', 'sequence_axis', 'is_sequence_split',
           'sequence_linear', 'tag_sequence_split', 'first_token_sequence',
           'gather_sequence_logits', 'scale_grad']
