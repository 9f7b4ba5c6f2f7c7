"""Parallel layers behind mode-dispatching facades, and the losses."""
from .layers import (AttentionCore, Classifier, CrossEntropyLoss, Dropout, Embedding, LayerNorm,
                     Linear, PatchEmbedding, VocabParallelClassifier, VocabParallelEmbedding,
                     gather_logits, first_token, place_qkv_adjacent, project_qkv)
from .registry import implementation, register
from . import optimizer

__all__ = ['AttentionCore', 'Classifier', 'CrossEntropyLoss', 'Dropout', 'Embedding', 'LayerNorm',
           'Linear', 'PatchEmbedding', 'VocabParallelClassifier', 'VocabParallelEmbedding',
           'gather_logits', 'first_token', 'place_qkv_adjacent', 'project_qkv', 'implementation',
           'register', 'optimizer']
