"""1D (Megatron-style) tensor-parallel layers; also the serial layers (one-rank group)."""
from ..registry import register
from .layers import (Classifier1D, ColumnLinear1D, Dropout1D, Embedding1D, GroupedKVLinear1D,
                     LayerNorm1D, PatchEmbedding1D, RowLinear1D, VocabParallelClassifier1D,
                     VocabParallelEmbedding1D, default_axis, kv_linear_1d, linear_1d, qkv_1d,
                     rms_norm)
from ..losses import CrossEntropyLoss, gather_logits
from .losses import AttentionCore1D, first_token_1d, whole_positions

for _mode in (None, '1d'):
    register(_mode, 'linear')(linear_1d)
    register(_mode, 'layernorm')(LayerNorm1D)
    register(_mode, 'embedding')(Embedding1D)
    register(_mode, 'vocab_parallel_embedding')(VocabParallelEmbedding1D)
    register(_mode, 'classifier')(Classifier1D)
    register(_mode, 'vocab_parallel_classifier')(VocabParallelClassifier1D)
    register(_mode, 'patch_embedding')(PatchEmbedding1D)
    register(_mode, 'dropout')(Dropout1D)
    register(_mode, 'cross_entropy')(CrossEntropyLoss)
    register(_mode, 'attention_core')(AttentionCore1D)
    register(_mode, 'gather_logits')(gather_logits)
    register(_mode, 'first_token')(first_token_1d)
    register(_mode, 'qkv')(qkv_1d)
    register(_mode, 'kv_linear')(kv_linear_1d)
    register(_mode, 'positions')(whole_positions)

__all__ = ['Classifier1D', 'ColumnLinear1D', 'Dropout1D', 'Embedding1D', 'LayerNorm1D',
           'PatchEmbedding1D', 'RowLinear1D', 'VocabParallelClassifier1D',
           'VocabParallelEmbedding1D', 'AttentionCore1D', 'GroupedKVLinear1D', 'first_token_1d',
           'default_axis', 'kv_linear_1d', 'linear_1d', 'qkv_1d', 'rms_norm', 'whole_positions']
