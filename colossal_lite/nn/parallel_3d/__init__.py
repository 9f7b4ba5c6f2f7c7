"""3D tensor-parallel layers (mode '3d', q^3 ranks); see cube.py for the layouts."""
from ..registry import register
from .cube import (ActLayout, Cube3D, Orientation, default_cube, gather_activation, split_activation,
                   swap_layout)
from .layers import (Classifier3D, Dropout3D, Embedding3D, LayerNorm3D, Linear3D,
                     PatchEmbedding3D, VocabParallelClassifier3D, VocabParallelEmbedding3D,
                     kv_linear_3d, positions_3d, qkv_3d)
from ..losses import CrossEntropyLoss, gather_logits
from .losses import AttentionCore3D, first_token_3d

for _kind, _impl in (('linear', Linear3D), ('layernorm', LayerNorm3D), ('embedding', Embedding3D),
                     ('vocab_parallel_embedding', VocabParallelEmbedding3D),
                     ('classifier', Classifier3D),
                     ('vocab_parallel_classifier', VocabParallelClassifier3D),
                     ('patch_embedding', PatchEmbedding3D), ('dropout', Dropout3D),
                     ('cross_entropy', CrossEntropyLoss), ('attention_core', AttentionCore3D),
                     ('gather_logits', gather_logits), ('first_token', first_token_3d),
                     ('qkv', qkv_3d), ('kv_linear', kv_linear_3d),
                     ('positions', positions_3d)):
    register('3d', _kind)(_impl)

__all__ = ['ActLayout', 'Cube3D', 'Orientation', 'default_cube', 'gather_activation',
           'split_activation', 'swap_layout', 'Classifier3D', 'Dropout3D', 'Embedding3D',
           'LayerNorm3D', 'Linear3D', 'PatchEmbedding3D', 'VocabParallelClassifier3D',
           'VocabParallelEmbedding3D', 'AttentionCore3D', 'first_token_3d', 'qkv_3d']
