"""GPT-2: learned positions, pre-LN blocks, tanh-GELU, LM head tied to the token embedding."""
from __future__ import annotations

import torch
from torch import nn

import colossal_lite.nn as col_nn
from colossal_lite.tensor import init_by_name

from .blocks import (StagedTransformer, normal_init, plan_transformer_stages, preset_config,
                     stage_blocks)
from .hf import HFConvertible, constructor_args
from .kv_cache import CachedDecoding, KVCache

# vocabularies are padded to a multiple of 128 (50257 -> 50304) so every tensor split divides
GPT_PRESETS = {
    'tiny': dict(vocab_size=256, max_positions=64, hidden=32, layers=2, heads=4, dropout=0.0),
    'gpt2-small': dict(vocab_size=50304, max_positions=1024, hidden=768, layers=12, heads=12, dropout=0.1),
    'gpt2-medium': dict(vocab_size=50304, max_positions=1024, hidden=1024, layers=24, heads=16, dropout=0.1),
    'gpt2-large': dict(vocab_size=50304, max_positions=1024, hidden=1280, layers=36, heads=20, dropout=0.1),
    'gpt2-xl': dict(vocab_size=50304, max_positions=1024, hidden=1600, layers=48, heads=25, dropout=0.1),
}


class GPT(CachedDecoding, HFConvertible, StagedTransformer):
    """``GPT(...)(input_ids [b, s]) -> logits`` (vocab-split under tensor parallelism;
    ``colossal_lite.nn.gather_logits`` gives the full ``[b, s, V]``).

    Under pipeline parallelism a rank builds only its stages (``colossal_lite.pipeline.stages``):
    ``wte``/``wpe`` on stage 0, ``ln_f``/``lm_head`` on the last stage, which also holds ``wte``
    (the weight the head is tied to, summed over the EMBEDDING group in the engine)."""

    def __init__(self, vocab_size: int, max_positions: int, hidden: int, layers: int, heads: int,
                 mlp_ratio: int = 4, dropout: float = 0.1, eps: float = 1e-5,
                 init_std: float = 0.02, checkpoint=False):
        super().__init__()
        self.arch_args = constructor_args(locals())  # for save_hf
        with init_by_name(self):  # each weight a function of (seed, its name)
            self.max_positions = max_positions
            plan_transformer_stages(
                self, layers, hidden, mlp_ratio, first_params=(vocab_size + max_positions) * hidden,
                last_params=(vocab_size + 2) * hidden, options=self.arch_args,
                checkpoint=checkpoint)
            if self.holds_first or self.holds_last:
                self.wte = col_nn.VocabParallelEmbedding(vocab_size, hidden,
                                                         weight_init=normal_init(init_std))
            if self.holds_first:
                self.wpe = col_nn.Embedding(max_positions, hidden, weight_init=normal_init(0.01))
                self.drop = col_nn.Dropout(dropout)
            self.blocks = stage_blocks(self, hidden, heads, mlp_ratio, dropout, causal=True,
                                       pre_ln=True, eps=eps, gelu_approximate='tanh',
                                       init_std=init_std)
            if self.holds_last:
                self.ln_f = col_nn.LayerNorm(hidden, eps=eps)
                self.lm_head = col_nn.VocabParallelClassifier(hidden, vocab_size, bias=False,
                                                              weight=self.wte.weight)
        self.tie_across_stages('wte.weight')  # the LM head's weight on the last stage

    @classmethod
    def cost_sample(cls, args: dict) -> tuple:
        return (torch.zeros(2, min(args['max_positions'], 64), dtype=torch.long),)

    @classmethod
    def from_preset(cls, name: str, **overrides) -> 'GPT':
        return cls(**preset_config(GPT_PRESETS, name, overrides, 'GPT'))

    def forward(self, input_ids: torch.Tensor, stage_input: torch.Tensor = None,
                stage: int = None, kv_cache: KVCache = None,
                last_only: bool = False, position_ids: torch.Tensor = None,
                packed: bool = False) -> torch.Tensor:
        """``kv_cache``: see :meth:`new_kv_cache`; ``last_only``: the logits of the last
        position only, ``[b, 1, V]`` (no tensor mode splits the sequence: a local slice).
        ``position_ids [b, s]`` (default ``0 .. s-1`` after the cached tokens) pick the
        learned positions; ``packed=True``: each row holds several documents whose
        ``position_ids`` restart at 0, and a token attends only within its document
        (docs/llama.md, "Packed documents")."""
        self.check_last_only(last_only)
        spec = self.stage_spec(stage)
        x = self.stage_start(spec, stage_input)
        position_ids, docs = self.packed_step(input_ids, position_ids, packed, kv_cache)
        if spec.first:
            positions = self._positions(input_ids, kv_cache) if position_ids is None \
                else position_ids.expand(input_ids.shape)
            x = self.drop(self.wte(input_ids) + self.wpe(positions))
        for i in spec.layers:
            x = self.blocks[str(i)](x, kv_cache=None if kv_cache is None else kv_cache.layer(i),
                                    document_ids=docs)
        if kv_cache is not None:
            kv_cache.length += input_ids.shape[1]
        if not spec.last:
            return x
        return self.lm_head(self.ln_f(x[:, -1:] if last_only else x))

    def _positions(self, input_ids: torch.Tensor, kv_cache) -> torch.Tensor:
        """Position ids of ``input_ids [b, s]``, after the ``kv_cache.length`` cached ones."""
        if kv_cache is None:
            return self.positions(input_ids, self.max_positions)
        offset = kv_cache.length
        if offset + input_ids.shape[1] > self.max_positions:
            raise ValueError(f'{offset} cached + {input_ids.shape[1]} new tokens exceed '
                             f'max_positions {self.max_positions}')
        return self.positions(input_ids, self.max_positions) + offset


class GPTLMLoss(nn.Module):
    """Next-token cross entropy, mean over predicted tokens: logits[:, t] predicts labels[:, t+1].

    The shift is applied to the full labels (the last position gets ``ignore_index``), so
    the logits never move between ranks.
    """

    def __init__(self, ignore_index: int = -100):
        super().__init__()
        self.ignore_index = ignore_index
        self.loss = col_nn.CrossEntropyLoss(ignore_index=ignore_index)

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        shifted = torch.full_like(labels, self.ignore_index)
        shifted[:, :-1] = labels[:, 1:]
        return self.loss(logits, shifted)
