"""Parallel layers behind mode-dispatching facades, and the losses."""
from .layers import (AttentionCore, Classifier, CrossEntropyLoss, Dropout, Embedding,
                     KeyValueLinear, LayerNorm, Linear, PatchEmbedding, RMSNorm,
                     VocabParallelClassifier, VocabParallelEmbedding, first_token,
                     gather_logits, local_positions, place_qkv_adjacent, project_qkv)
from .functional import document_ids
from .registry import implementation, register
from . import optimizer
from .moe import MoE

__all__ = ['AttentionCore', 'Classifier', 'CrossEntropyLoss', 'Dropout', 'Embedding',
           'KeyValueLinear', 'LayerNorm', 'Linear', 'RMSNorm', 'local_positions', 'PatchEmbedding', 'VocabParallelClassifier', 'VocabParallelEmbedding',
           'gather_logits', 'first_token', 'place_qkv_adjacent', 'project_qkv', 'implementation',
           'register', 'optimizer', 'document_ids', 'MoE']
