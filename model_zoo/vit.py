"""ViT: patch embedding with class token and positions, pre-LN blocks, classifier on the class token."""
from __future__ import annotations

import torch
from torch import nn

import colossal_lite.nn as col_nn
from colossal_lite.tensor import init_by_name

from .blocks import (StagedTransformer, normal_init, plan_transformer_stages, preset_config,
                     stage_blocks, zeros_init)
from .hf import HFConvertible, constructor_args

VIT_PRESETS = {
    # 'tiny' fits scikit-learn's 8x8 one-channel digits
    'tiny': dict(img_size=8, patch_size=2, in_chans=1, num_classes=10, hidden=32, layers=2,
                 heads=4, dropout=0.0),
    'vit-base': dict(img_size=224, patch_size=16, in_chans=3, num_classes=1000, hidden=768,
                     layers=12, heads=12, dropout=0.1),
    'vit-large': dict(img_size=224, patch_size=16, in_chans=3, num_classes=1000, hidden=1024,
                      layers=24, heads=16, dropout=0.1),
}


class ViT(HFConvertible, StagedTransformer):
    """``ViT(...)(images [b, C, H, W]) -> class logits [b, num_classes]``."""

    def __init__(self, img_size: int, patch_size: int, in_chans: int, num_classes: int, hidden: int,
                 layers: int, heads: int, mlp_ratio: int = 4, dropout: float = 0.1,
                 eps: float = 1e-6, init_std: float = 0.02, checkpoint=False):
        super().__init__()
        self.arch_args = constructor_args(locals())  # for save_hf
        with init_by_name(self):  # each weight a function of (seed, its name)
            patches = (img_size // patch_size) ** 2
            plan_transformer_stages(
                self, layers, hidden, mlp_ratio,
                first_params=(in_chans * patch_size ** 2 + 3 + patches) * hidden,
                last_params=(num_classes + 2) * hidden + num_classes,
                options=self.arch_args, checkpoint=checkpoint)
            if self.holds_first:
                self.patch_embed = col_nn.PatchEmbedding(img_size, patch_size, in_chans, hidden)
                self.drop = col_nn.Dropout(dropout)
            self.blocks = stage_blocks(self, hidden, heads, mlp_ratio, dropout, causal=False,
                                       pre_ln=True, eps=eps, gelu_approximate='none',
                                       init_std=init_std)
            if self.holds_last:
                self.norm = col_nn.LayerNorm(hidden, eps=eps)
                self.head = col_nn.Classifier(hidden, num_classes,
                                              weight_init=normal_init(init_std),
                                              bias_init=zeros_init)

    @classmethod
    def cost_sample(cls, args: dict) -> tuple:
        return (torch.zeros(2, args['in_chans'], args['img_size'], args['img_size']),)

    @classmethod
    def from_preset(cls, name: str, **overrides) -> 'ViT':
        return cls(**preset_config(VIT_PRESETS, name, overrides, 'ViT'))

    def forward(self, images: torch.Tensor, stage_input: torch.Tensor = None,
                stage: int = None) -> torch.Tensor:
        spec = self.stage_spec(stage)
        x = self.stage_start(spec, stage_input)
        if spec.first:
            x = self.drop(self.patch_embed(images))
        for i in spec.layers:
            x = self.blocks[str(i)](x)
        return self.head(col_nn.first_token(self.norm(x))) if spec.last else x
