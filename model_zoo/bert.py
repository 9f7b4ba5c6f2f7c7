"""BERT: post-LN encoder with MLM (tied decoder) and next-sentence heads."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

import colossal_lite.nn as col_nn
from colossal_lite.tensor import init_by_name

from .blocks import (StagedTransformer, normal_init, plan_transformer_stages, preset_config,
                     stage_blocks, zeros_init)
from .hf import HFConvertible, constructor_args

# 30522 is padded to 30528 (divisible by 64) so every tensor split divides
BERT_PRESETS = {
    'tiny': dict(vocab_size=256, max_positions=64, hidden=32, layers=2, heads=4, dropout=0.0),
    'bert-base': dict(vocab_size=30528, max_positions=512, hidden=768, layers=12, heads=12, dropout=0.1),
    'bert-large': dict(vocab_size=30528, max_positions=512, hidden=1024, layers=24, heads=16, dropout=0.1),
}


class BERT(HFConvertible, StagedTransformer):
    """``BERT(...)(input_ids [b, s], attention_mask=None, token_type_ids=None)``
    -> ``(mlm_logits, nsp_logits)`` (only ``mlm_logits`` when ``nsp=False``)."""

    def __init__(self, vocab_size: int, max_positions: int, hidden: int, layers: int, heads: int,
                 mlp_ratio: int = 4, dropout: float = 0.1, eps: float = 1e-12,
                 type_vocab_size: int = 2, init_std: float = 0.02, nsp: bool = True,
                 checkpoint=False):
        super().__init__()
        self.arch_args = constructor_args(locals())  # for save_hf
        with init_by_name(self):  # each weight a function of (seed, its name)
            self.max_positions = max_positions
            init = normal_init(init_std)
            plan_transformer_stages(
                self, layers, hidden, mlp_ratio,
                first_params=(vocab_size + max_positions + type_vocab_size + 2) * hidden,
                last_params=(hidden + 3 + vocab_size) * hidden + vocab_size
                + ((hidden + 3) * hidden + 2 if nsp else 0),
                options=self.arch_args, checkpoint=checkpoint)
            if self.holds_first or self.holds_last:
                self.word_embeddings = col_nn.VocabParallelEmbedding(vocab_size, hidden,
                                                                     weight_init=init)
            if self.holds_first:
                self.position_embeddings = col_nn.Embedding(max_positions, hidden, weight_init=init)
                self.token_type_embeddings = col_nn.Embedding(type_vocab_size, hidden,
                                                              weight_init=init)
                self.embed_ln = col_nn.LayerNorm(hidden, eps=eps)
                self.drop = col_nn.Dropout(dropout)
            self.layers = stage_blocks(self, hidden, heads, mlp_ratio, dropout, causal=False,
                                       pre_ln=False, eps=eps, gelu_approximate='none',
                                       init_std=init_std)
            self.nsp = nsp
            if self.holds_last:
                self.mlm_dense = col_nn.Linear(hidden, hidden, weight_init=init, bias_init=zeros_init)
                self.mlm_act = nn.GELU()
                self.mlm_ln = col_nn.LayerNorm(hidden, eps=eps)
                self.mlm_decoder = col_nn.VocabParallelClassifier(
                    hidden, vocab_size, bias=True, weight=self.word_embeddings.weight)
                if nsp:
                    self.pooler = col_nn.Linear(hidden, hidden, weight_init=init,
                                                bias_init=zeros_init)
                    self.nsp_head = col_nn.Classifier(hidden, 2, weight_init=init)
        self.tie_across_stages('word_embeddings.weight')  # the LM head's weight on the last stage

    @classmethod
    def cost_sample(cls, args: dict) -> tuple:
        return (torch.zeros(2, min(args['max_positions'], 64), dtype=torch.long),)

    @classmethod
    def from_preset(cls, name: str, **overrides) -> 'BERT':
        cfg = preset_config(BERT_PRESETS, name, {k: v for k, v in overrides.items() if k != 'nsp'},
                            'BERT')
        if 'nsp' in overrides:
            cfg['nsp'] = overrides['nsp']
        return cls(**cfg)

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                token_type_ids: Optional[torch.Tensor] = None, stage_input: torch.Tensor = None,
                stage: int = None):
        spec = self.stage_spec(stage)
        x = self.stage_start(spec, stage_input)
        if spec.first:
            positions = self.positions(input_ids, self.max_positions)
            if token_type_ids is None:
                token_type_ids = torch.zeros_like(input_ids)
            x = (self.word_embeddings(input_ids) + self.position_embeddings(positions)
                 + self.token_type_embeddings(token_type_ids))
            x = self.drop(self.embed_ln(x))
        for i in spec.layers:
            x = self.layers[str(i)](x, attention_mask)
        if not spec.last:
            return x
        mlm_logits = self.mlm_decoder(self.mlm_ln(self.mlm_act(self.mlm_dense(x))))
        if not self.nsp:
            return mlm_logits
        pooled = torch.tanh(self.pooler(col_nn.first_token(x)))
        return mlm_logits, self.nsp_head(pooled)


class BertPretrainingLoss(nn.Module):
    """MLM cross entropy (mean over labelled tokens, ``-100`` elsewhere) + NSP cross entropy."""

    def __init__(self, ignore_index: int = -100):
        super().__init__()
        self.mlm = col_nn.CrossEntropyLoss(ignore_index=ignore_index)
        self.nsp = col_nn.CrossEntropyLoss()

    def forward(self, outputs, mlm_labels: torch.Tensor,
                nsp_labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        if isinstance(outputs, tuple):
            mlm_logits, nsp_logits = outputs
        else:
            mlm_logits, nsp_logits = outputs, None
        loss = self.mlm(mlm_logits, mlm_labels)
        if nsp_labels is not None:
            if nsp_logits is None:
                raise ValueError('nsp_labels given but the model has no NSP head (nsp=False)')
            loss = loss + self.nsp(nsp_logits, nsp_labels)
        return loss
