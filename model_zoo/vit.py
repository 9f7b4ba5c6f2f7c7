"""ViT: patch embedding with class token and positions, pre-LN blocks, classifier on the class token."""
from __future__ import annotations

import torch
from torch import nn

import colossal_lite.nn as col_nn
from colossal_lite.tensor import init_by_name

from .blocks import layer_stack, normal_init, preset_config, zeros_init

VIT_PRESETS = {
    # 'tiny' fits scikit-learn's 8x8 one-channel digits
    'tiny': dict(img_size=8, patch_size=2, in_chans=1, num_classes=10, hidden=32, layers=2,
                 heads=4, dropout=0.0),
    'vit-base': dict(img_size=224, patch_size=16, in_chans=3, num_classes=1000, hidden=768,
                     layers=12, heads=12, dropout=0.1),
    'vit-large': dict(img_size=224, patch_size=16, in_chans=3, num_classes=1000, hidden=1024,
                      layers=24, heads=16, dropout=0.1),
}


class ViT(nn.Module):
    """``ViT(...)(images [b, C, H, W]) -> class logits [b, num_classes]``."""

    def __init__(self, img_size: int, patch_size: int, in_chans: int, num_classes: int, hidden: int,
                 layers: int, heads: int, mlp_ratio: int = 4, dropout: float = 0.1,
                 eps: float = 1e-6, init_std: float = 0.02, checkpoint: bool = False):
        super().__init__()
        with init_by_name(self):  # each weight a function of (seed, its name)
            self.patch_embed = col_nn.PatchEmbedding(img_size, patch_size, in_chans, hidden)
            self.drop = col_nn.Dropout(dropout)
            self.blocks = layer_stack(layers, hidden, heads, mlp_ratio, dropout,
                                      causal=False, pre_ln=True, eps=eps, gelu_approximate='none',
                                      init_std=init_std, checkpoint=checkpoint)
            self.norm = col_nn.LayerNorm(hidden, eps=eps)
            self.head = col_nn.Classifier(hidden, num_classes, weight_init=normal_init(init_std),
                                          bias_init=zeros_init)

    @classmethod
    def from_preset(cls, name: str, **overrides) -> 'ViT':
        return cls(**preset_config(VIT_PRESETS, name, overrides, 'ViT'))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.patch_embed(images))
        for block in self.blocks:
            x = block(x)
        return self.head(col_nn.first_token(self.norm(x)))
