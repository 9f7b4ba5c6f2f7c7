"""Transformer building blocks written only with colossal_lite.nn facades.

Each block reads like the single-device model; the facades decide, from the
launched tensor mode, how weights and activations are split.
"""
from __future__ import annotations

from typing import Callable, Tuple

import torch
from torch import nn

import colossal_lite.nn as col_nn
from colossal_lite.pipeline.stages import StagedModel, measure_part_costs, transformer_weights


def normal_init(std: float = 0.02) -> Callable[[torch.Tensor, object], object]:
    """``init(tensor, generator)``: normal(0, std) from ``generator`` (None: the default one)."""
    return lambda w, g: nn.init.normal_(w, mean=0.0, std=std, generator=g)


def zeros_init(b: torch.Tensor, g=None):
    return nn.init.zeros_(b)


class SelfAttention(nn.Module):
    """Multi-head self-attention: q, k, v projections open a parallel region, out closes it.

    ``query``, ``key``, ``value`` are three Linears (their own state-dict keys and seeded
    weights); ``col_nn.project_qkv`` runs them as one fused, head-aligned matmul, over a
    view of their local weights, which lie back to back in one storage
    (``col_nn.place_qkv_adjacent``)."""

    def __init__(self, hidden: int, heads: int, dropout: float, causal: bool, init_std: float):
        super().__init__()
        if hidden % heads:
            raise ValueError(f'hidden size {hidden} must be divisible by the number of heads {heads}')
        kw = dict(region='enter', weight_init=normal_init(init_std), bias_init=zeros_init)
        self.query = col_nn.Linear(hidden, hidden, **kw)
        self.key = col_nn.Linear(hidden, hidden, **kw)
        self.value = col_nn.Linear(hidden, hidden, **kw)
        col_nn.place_qkv_adjacent(self.query, self.key, self.value)
        self.core = col_nn.AttentionCore(hidden // heads, causal=causal, dropout=dropout,
                                         num_heads=heads)
        self.dense = col_nn.Linear(hidden, hidden, region='exit', weight_init=normal_init(init_std),
                                   bias_init=zeros_init)

    def forward(self, x, key_padding_mask=None, kv_cache=None, document_ids=None):
        """``kv_cache`` (a ``kv_cache.LayerKV``): this step's local k, v are appended to it
        and the queries attend to every cached key (causal mask offset by the cache).
        ``document_ids``: the full ``[b, keys]`` documents of packed rows (attention within
        each document; ``col_nn.AttentionCore``)."""
        q, k, v = col_nn.project_qkv(x, self.query, self.key, self.value)
        if kv_cache is not None:
            k, v = kv_cache.extend(k, v)
        if document_ids is not None:
            return self.dense(self.core(q, k, v, key_padding_mask, document_ids=document_ids))
        ctx = self.core(q, k, v, key_padding_mask)
        return self.dense(ctx)


class MLP(nn.Module):
    """fc1 (h -> ratio*h, opens the region), GELU, fc2 (closes it)."""

    def __init__(self, hidden: int, ratio: int, gelu_approximate: str, init_std: float):
        super().__init__()
        self.fc1 = col_nn.Linear(hidden, ratio * hidden, region='enter',
                                 weight_init=normal_init(init_std), bias_init=zeros_init)
        self.act = nn.GELU(approximate=gelu_approximate)
        self.fc2 = col_nn.Linear(ratio * hidden, hidden, region='exit',
                                 weight_init=normal_init(init_std), bias_init=zeros_init)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class TransformerLayer(nn.Module):
    """Pre-LN (GPT, ViT) or post-LN (BERT) block of attention and MLP with residuals.

    ``checkpoint=True`` recomputes the block's activations in backward
    (colossal_lite.engine.checkpoint), restoring RNG states so dropout masks repeat.
    """

    def __init__(self, hidden: int, heads: int, mlp_ratio: int = 4, dropout: float = 0.0,
                 causal: bool = False, pre_ln: bool = True, eps: float = 1e-5,
                 gelu_approximate: str = 'none', init_std: float = 0.02, checkpoint: bool = False):
        super().__init__()
        self.pre_ln, self.checkpoint = pre_ln, checkpoint
        self.ln1 = col_nn.LayerNorm(hidden, eps=eps)
        self.attn = SelfAttention(hidden, heads, dropout, causal, init_std)
        self.ln2 = col_nn.LayerNorm(hidden, eps=eps)
        self.mlp = MLP(hidden, mlp_ratio, gelu_approximate, init_std)
        self.drop1 = col_nn.Dropout(dropout)
        self.drop2 = col_nn.Dropout(dropout)

    def _forward(self, x, key_padding_mask=None, kv_cache=None, document_ids=None):
        if self.pre_ln:
            x = x + self.drop1(self.attn(self.ln1(x), key_padding_mask, kv_cache, document_ids))
            return x + self.drop2(self.mlp(self.ln2(x)))
        x = self.ln1(x + self.drop1(self.attn(x, key_padding_mask, kv_cache, document_ids)))
        return self.ln2(x + self.drop2(self.mlp(x)))

    def forward(self, x, key_padding_mask=None, kv_cache=None, document_ids=None):
        if self.checkpoint and self.training and torch.is_grad_enabled() and kv_cache is None:
            from colossal_lite.engine.checkpoint import checkpoint
            return checkpoint(self._forward, x, key_padding_mask, None, document_ids)
        return self._forward(x, key_padding_mask, kv_cache, document_ids)


def checkpointed_blocks(checkpoint, layers: int) -> frozenset:
    """The serial indices of the blocks a model's ``checkpoint`` option recomputes in
    backward: ``True`` all ``layers`` blocks, ``False`` none, or a collection (list, tuple,
    set, range) of block indices in ``[0, layers)`` -- e.g. ``range(k)`` for the first k, or
    the planner's per-block choice. A ValueError names the value and the layer count."""
    if isinstance(checkpoint, bool):
        return frozenset(range(layers)) if checkpoint else frozenset()
    if not isinstance(checkpoint, (list, tuple, set, frozenset, range)):
        raise ValueError(f'checkpoint must be True, False or a collection of block indices in '
                         f'[0, {layers}) (the model has {layers} layers), got {checkpoint!r}'
                         + (' (the first k blocks: range(k))' if isinstance(checkpoint, int)
                            else ''))
    bad = [i for i in checkpoint if isinstance(i, bool) or not isinstance(i, int)
           or not 0 <= i < layers]
    if bad:
        raise ValueError(f'checkpoint = {checkpoint!r}: block index {bad[0]!r} is not in '
                         f'[0, {layers}) (the model has {layers} layers)')
    return frozenset(checkpoint)


_MEASURED: dict = {}  # (model class, arguments of the timed copy) -> (first, block, last) s


class StagedTransformer(StagedModel):
    """GPT, BERT and ViT: a first part, transformer blocks and a last part cut into pipeline
    stages (``colossal_lite.pipeline.stages``); each subclass gives :meth:`cost_sample`."""

    untimed_options = ('dropout', 'init_std', 'checkpoint')

    @classmethod
    def cost_sample(cls, args: dict) -> tuple:
        """Small inputs for the model built with constructor arguments ``args``."""
        raise NotImplementedError

    @classmethod
    def part_costs(cls, args: dict) -> Tuple[float, float, float]:
        """(first part, one block, last part) forward+backward seconds of ``cls(**args)`` on
        this CPU, for ``partition='cost'`` (``colossal_lite.pipeline.resolve_partition``):
        a 3-block copy with dropout 0 timed as a described 3-stage pipeline
        (``measure_part_costs``), once per process and arguments. No communication."""
        small = dict(args, layers=3, dropout=0.0, checkpoint=False)
        key = (cls.__name__, tuple(sorted(small.items())))
        if key not in _MEASURED:
            _MEASURED[key] = measure_part_costs(lambda: cls(**small),
                                                lambda: cls.cost_sample(small))
        return _MEASURED[key]


def plan_transformer_stages(model, layers: int, hidden: int, mlp_ratio: int, first_params: int,
                            last_params: int, options: dict, checkpoint=False):
    """Decide ``model``'s pipeline stages over ``layers`` blocks and which blocks are
    checkpointed (``model.checkpointed``: :func:`checkpointed_blocks` of ``checkpoint``).
    ``first_params`` / ``last_params``: parameter counts of the parts before and after the
    blocks (``partition='parameters'``); ``options``: the model's constructor arguments, which
    name the cut ``resolve_partition`` agreed for ``partition='cost'``. Neither times nor
    communicates."""
    model.checkpointed = checkpointed_blocks(checkpoint, layers)
    model.plan_stages(layers, transformer_weights(hidden, mlp_ratio, first_params, last_params),
                      options=options)


def stage_blocks(model, hidden: int, heads: int, mlp_ratio: int, dropout: float,
                 **layer_options) -> nn.ModuleDict:
    """The :class:`TransformerLayer` blocks of ``model``'s stages (all of them when not
    pipelined), keyed by serial index; block i checkpointed when i is in ``model.checkpointed``
    (set by :func:`plan_transformer_stages`)."""
    return model.build_blocks(
        lambda i: TransformerLayer(hidden, heads, mlp_ratio, dropout,
                                   checkpoint=i in model.checkpointed, **layer_options))


def preset_config(presets: dict, name: str, overrides: dict, family: str,
                  extra: tuple = ()) -> dict:
    """The preset's options updated by ``overrides``: a preset's own keys, ``checkpoint`` and
    the ``extra`` options the presets leave at their default (e.g. Llama's ``moe``)."""
    if name not in presets:
        raise ValueError(f"unknown {family} preset '{name}'; presets: {sorted(presets)}")
    cfg = dict(presets[name])
    unknown = set(overrides) - set(cfg) - {'checkpoint'} - set(extra)
    if unknown:
        raise ValueError(f'unknown {family} options {sorted(unknown)}; options: {sorted(cfg)}')
    cfg.update(overrides)
    return cfg
