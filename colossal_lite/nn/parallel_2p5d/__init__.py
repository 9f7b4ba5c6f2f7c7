"""2.5D tensor parallelism (d x q x q ranks: SUMMA in each depth layer, batch split over depth).

The same classes serve mode '2d' (depth 1, see ``parallel_2d``): :func:`register_family`
registers every layer kind for a mode.
"""
from ..registry import register
from .grid import Grid2p5D
from .layers import (Classifier2p5D, Dropout2p5D, Embedding2p5D, LayerNorm2p5D, Linear2p5D,
                     PatchEmbedding2p5D, SummaAffine2p5D, VocabParallelClassifier2p5D,
                     VocabParallelEmbedding2p5D, kv_linear_2p5d, positions_2p5d, qkv_2p5d)
from ..losses import CrossEntropyLoss, gather_logits
from .losses import AttentionCore2p5D, first_token_2p5d
from .summa import SummaLinear, summa_linear, summa_loop

FAMILY = {
    'linear': Linear2p5D,
    'layernorm': LayerNorm2p5D,
    'embedding': Embedding2p5D,
    'vocab_parallel_embedding': VocabParallelEmbedding2p5D,
    'classifier': Classifier2p5D,
    'vocab_parallel_classifier': VocabParallelClassifier2p5D,
    'patch_embedding': PatchEmbedding2p5D,
    'dropout': Dropout2p5D,
    'cross_entropy': CrossEntropyLoss,
    'attention_core': AttentionCore2p5D,
    'gather_logits': gather_logits,
    'first_token': first_token_2p5d,
    'qkv': qkv_2p5d,
    'kv_linear': kv_linear_2p5d,
    'positions': positions_2p5d,
}


def register_family(mode: str):
    """Register every kind of this family for tensor mode ``mode`` ('2d' or '2.5d')."""
    for kind, impl in FAMILY.items():
        register(mode, kind)(impl)


register_family('2.5d')

__all__ = ['Grid2p5D', 'Classifier2p5D', 'Dropout2p5D', 'Embedding2p5D', 'LayerNorm2p5D',
           'Linear2p5D', 'PatchEmbedding2p5D', 'SummaAffine2p5D', 'VocabParallelClassifier2p5D',
           'VocabParallelEmbedding2p5D', 'AttentionCore2p5D', 'first_token_2p5d', 'qkv_2p5d', 'SummaLinear', 'summa_linear', 'summa_loop',
           'FAMILY', 'register_family']
