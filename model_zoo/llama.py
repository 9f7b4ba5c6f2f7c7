"""Llama (and Mistral, Qwen2): RMSNorm, rotary positions, SwiGLU, grouped-query attention.

Pre-norm blocks ``x + attn(norm(x))``, ``x + mlp(norm(x))``; no biases except the optional
q/k/v bias (Qwen2); LM head untied (Llama-3 8B/70B) or tied (Llama-3.2 1B). Written only
with ``colossal_lite.nn`` facades, so it runs in every layout: the k/v projections are
``col_nn.KeyValueLinear`` (split with the heads, or replicated per group in 1D when the
ranks outnumber the kv heads), the rotary tables are made for the positions of the tokens
this rank holds (``col_nn.local_positions``; ``colossal_lite.nn.rotary``).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

import colossal_lite.nn as col_nn
from colossal_lite.config import ConfigError
from colossal_lite.context import ParallelMode, current_context
from colossal_lite.nn.rotary import (apply_rotary, check_rope_scaling, rope_frequencies,
                                     rotary_tables)
from colossal_lite.pipeline.stages import parameter_weights
from colossal_lite.tensor import init_by_name

from .blocks import StagedTransformer, checkpointed_blocks, normal_init, preset_config, zeros_init
from .hf import HFConvertible, constructor_args
from .kv_cache import CachedDecoding, KVCache

_LLAMA3 = dict(vocab_size=128256, max_positions=131072, rope_theta=500000.0, eps=1e-5)


def _llama3_scaling(factor: float) -> dict:
    return dict(factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_positions=8192)


_DEFAULTS = dict(kv_heads=None, intermediate=None, max_positions=2048, rope_theta=10000.0,
                 rope_scaling=None, eps=1e-5, qkv_bias=False, tie_embeddings=False,
                 init_std=0.02, dropout=0.0)

LLAMA_PRESETS = {
    'tiny': dict(_DEFAULTS, vocab_size=256, max_positions=64, hidden=64, layers=2, heads=4,
                 kv_heads=2, intermediate=128),
    'llama3-1b': dict(_DEFAULTS, **_LLAMA3, hidden=2048, layers=16, heads=32, kv_heads=8,
                      intermediate=8192, rope_scaling=_llama3_scaling(32.0),
                      tie_embeddings=True),
    'llama3-8b': dict(_DEFAULTS, **_LLAMA3, hidden=4096, layers=32, heads=32, kv_heads=8,
                      intermediate=14336, rope_scaling=_llama3_scaling(8.0)),
    'llama3-70b': dict(_DEFAULTS, **_LLAMA3, hidden=8192, layers=80, heads=64, kv_heads=8,
                       intermediate=28672, rope_scaling=_llama3_scaling(8.0)),
}


class LlamaAttention(nn.Module):
    """q ``[h -> n*d]`` and k, v ``[h -> n_kv*d]`` open the region (one fused matmul,
    ``col_nn.project_qkv``), q and k rotated, causal attention with query head i reading kv
    head ``i // (n / n_kv)``, o ``[n*d -> h]`` closes it."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, qkv_bias: bool,
                 dropout: float, init_std: float):
        super().__init__()
        self.head_dim = head_dim
        kw = dict(weight_init=normal_init(init_std), bias_init=zeros_init)
        self.q_proj = col_nn.Linear(hidden, heads * head_dim, bias=qkv_bias, region='enter', **kw)
        self.k_proj = col_nn.KeyValueLinear(hidden, kv_heads, head_dim, heads, bias=qkv_bias, **kw)
        self.v_proj = col_nn.KeyValueLinear(hidden, kv_heads, head_dim, heads, bias=qkv_bias, **kw)
        col_nn.place_qkv_adjacent(self.q_proj, self.k_proj, self.v_proj)
        self.core = col_nn.AttentionCore(head_dim, causal=True, dropout=dropout, num_heads=heads)
        self.o_proj = col_nn.Linear(heads * head_dim, hidden, bias=False, region='exit',
                                    weight_init=normal_init(init_std))

    def forward(self, x, rope, kv_cache=None, document_ids=None):
        q, k, v = col_nn.project_qkv(x, self.q_proj, self.k_proj, self.v_proj)
        cos, sin = rope
        q, k = apply_rotary(q, cos, sin, self.head_dim), apply_rotary(k, cos, sin, self.head_dim)
        if kv_cache is not None:
            k, v = kv_cache.extend(k, v)
        if document_ids is not None:  # packed rows: attention within each document
            return self.o_proj(self.core(q, k, v, document_ids=document_ids))
        return self.o_proj(self.core(q, k, v))


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``: gate and up ``[h -> i]`` open the region, down closes it."""

    def __init__(self, hidden: int, intermediate: int, init_std: float):
        super().__init__()
        kw = dict(bias=False, weight_init=normal_init(init_std))
        self.gate_proj = col_nn.Linear(hidden, intermediate, region='enter', **kw)
        self.up_proj = col_nn.Linear(hidden, intermediate, region='enter', **kw)
        self.down_proj = col_nn.Linear(intermediate, hidden, region='exit', **kw)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


MOE_LAYER_KEYS = ('score', 'renormalize', 'capacity_factor', 'aux_loss_coef', 'z_loss_coef',
                  'bias_update_rate', 'shared_experts', 'shared_ffn_hidden', 'shared_gate',
                  'expert_tensor_parallel')
MOE_KEYS = ('experts', 'top_k', 'ffn_hidden', 'first_dense') + MOE_LAYER_KEYS


def check_moe(moe, layers: int = None, expert_ranks: int = 1, tensor_1d: int = 1,
              intermediate: int = None) -> dict:
    """``moe`` (None, or a dict of :data:`MOE_KEYS`) checked -> the normalized dict (None when
    no MoE): ``experts`` >= 1, ``1 <= top_k <= experts``, ``experts`` divisible by
    ``expert_ranks`` (``parallel.expert``), ``capacity_factor`` None or > 0, ``first_dense``
    in ``[0, layers]``, ``expert_tensor_parallel`` None/bool (True only under 1D tensor
    parallelism, ``tensor_1d`` > 1), the expert width divisible by ``tensor_1d`` when it is
    cut (``ffn_hidden``, else ``intermediate``). Each failure a ConfigError (a ValueError) naming ``model.moe.<key>``;
    no communication (the same check runs in ``colossal-lite train`` before any worker)."""
    if moe is None:
        return None
    if not isinstance(moe, dict):
        raise ConfigError(f"'model.moe' must be a dict (experts=..., top_k=..., ...), "
                          f"got {moe!r}")
    unknown = sorted(set(moe) - set(MOE_KEYS))
    if unknown:
        raise ConfigError(f"unknown 'model.moe' keys {unknown}; keys: {list(MOE_KEYS)}")
    for key in ('experts', 'top_k'):
        if key not in moe:
            raise ConfigError(f"'model.moe.{key}' is required (moe=dict(experts=X, top_k=k))")
        value = moe[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"'model.moe.{key}' must be a positive integer, got {value!r}")
    experts, top_k = moe['experts'], moe['top_k']
    if top_k > experts:
        raise ConfigError(f"'model.moe.top_k' = {top_k} exceeds 'model.moe.experts' = "
                          f"{experts}: each token picks top_k distinct experts")
    if experts % expert_ranks:
        raise ConfigError(f"'model.moe.experts' = {experts} must be divisible by "
                          f"'parallel.expert' = {expert_ranks} (each expert rank holds "
                          f"experts / parallel.expert of every MoE layer)")
    cf = moe.get('capacity_factor')
    if cf is not None and (isinstance(cf, bool) or not isinstance(cf, (int, float))
                           or not cf > 0):
        raise ConfigError(f"'model.moe.capacity_factor' must be None (dropless) or a number "
                          f"> 0, got {cf!r}")
    first_dense = moe.get('first_dense', 0)
    if isinstance(first_dense, bool) or not isinstance(first_dense, int) or first_dense < 0 \
            or (layers is not None and first_dense > layers):
        raise ConfigError(f"'model.moe.first_dense' must be an integer in [0, layers = "
                          f"{layers}], got {first_dense!r}")
    etp = moe.get('expert_tensor_parallel')
    if etp is not None and not isinstance(etp, bool):
        raise ConfigError(f"'model.moe.expert_tensor_parallel' must be None, True or False, "
                          f"got {etp!r}")
    if etp and tensor_1d == 1:
        raise ConfigError("'model.moe.expert_tensor_parallel' = True needs 1D tensor "
                          "parallelism (parallel.tensor = dict(mode='1d', size > 1))")
    width = moe.get('ffn_hidden') or intermediate
    if etp is not False and tensor_1d > 1 and width is not None and width % tensor_1d:
        raise ConfigError(f"the expert width ('model.moe.ffn_hidden', else "
                          f"'model.intermediate') = {width} must be divisible by "
                          f"'parallel.tensor.size' = {tensor_1d} (expert tensor parallelism; "
                          f"'model.moe.expert_tensor_parallel' = False keeps experts whole)")
    return dict(moe, first_dense=first_dense)


def moe_block_params(hidden: int, intermediate: int, moe: dict) -> int:
    """The MoE MLP's parameters in one block (router, experts, shared experts and gate)."""
    ffn = moe.get('ffn_hidden') or intermediate
    shared = moe.get('shared_experts', 0) * (moe.get('shared_ffn_hidden') or ffn)
    return (moe['experts'] * (hidden + 3 * hidden * ffn) + 3 * hidden * shared
            + hidden * bool(shared and moe.get('shared_gate')))


class LlamaBlock(nn.Module):
    """``x + attn(attn_norm(x))`` then ``x + mlp(mlp_norm(x))``; ``checkpoint=True``
    recomputes the block in backward. ``moe`` (checked by :func:`check_moe`): the MLP is a
    ``col_nn.MoE`` of ``moe['experts']`` SwiGLU experts of width ``moe['ffn_hidden']``
    (default ``intermediate``)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int,
                 eps: float, qkv_bias: bool, dropout: float, init_std: float,
                 checkpoint: bool = False, moe: dict = None):
        super().__init__()
        self.checkpoint = checkpoint
        self.attn_norm = col_nn.RMSNorm(hidden, eps=eps)
        self.attn = LlamaAttention(hidden, heads, kv_heads, head_dim, qkv_bias, dropout, init_std)
        self.mlp_norm = col_nn.RMSNorm(hidden, eps=eps)
        if moe is None:
            self.mlp = SwiGLU(hidden, intermediate, init_std)
        else:
            self.mlp = col_nn.MoE(hidden, moe.get('ffn_hidden') or intermediate, moe['experts'],
                                  moe['top_k'], weight_init=normal_init(init_std),
                                  **{k: moe[k] for k in MOE_LAYER_KEYS if k in moe})
        self.drop1 = col_nn.Dropout(dropout)
        self.drop2 = col_nn.Dropout(dropout)

    def _forward(self, x, cos, sin, kv_cache=None, document_ids=None):
        x = x + self.drop1(self.attn(self.attn_norm(x), (cos, sin), kv_cache, document_ids))
        return x + self.drop2(self.mlp(self.mlp_norm(x)))

    def forward(self, x, rope, kv_cache=None, document_ids=None):
        if self.checkpoint and self.training and torch.is_grad_enabled() and kv_cache is None:
            from colossal_lite.engine.checkpoint import checkpoint
            return checkpoint(self._forward, x, *rope, None, document_ids)
        return self._forward(x, *rope, kv_cache, document_ids)


def llama_block_params(hidden: int, heads: int, kv_heads: int, head_dim: int,
                       intermediate: int, qkv_bias: bool) -> int:
    """Parameters of one block: q, k, v, o, gate, up, down and the two norms."""
    qkv = hidden * (heads + 2 * kv_heads) * head_dim + (heads + 2 * kv_heads) * head_dim * qkv_bias
    return qkv + heads * head_dim * hidden + 3 * hidden * intermediate + 2 * hidden


class Llama(CachedDecoding, HFConvertible, StagedTransformer):
    """``Llama(...)(input_ids [b, s]) -> logits`` (vocab-split under tensor parallelism;
    ``colossal_lite.nn.gather_logits`` gives the full ``[b, s, V]``).

    ``kv_heads`` (default ``heads``): key/value heads of grouped-query attention (1: MQA);
    ``intermediate``: the SwiGLU width (default ``ceil(8h/3)`` to a multiple of 256, as
    Llama); ``rope_scaling``: Llama-3's (``nn.rotary``); ``qkv_bias``: Qwen2's q/k/v biases;
    ``tie_embeddings``: the LM head reads the embedding's weight.

    ``moe=dict(experts=X, top_k=k, ...)``: every block's MLP is a ``col_nn.MoE`` (Mixtral,
    Qwen2-MoE; docs/moe.md "The model"): ``ffn_hidden`` the experts' width (default
    ``intermediate``), ``first_dense=n`` keeps the first n blocks' dense SwiGLU (DeepSeek),
    the other keys are :class:`~colossal_lite.nn.MoE`'s (``score``, ``renormalize``,
    ``capacity_factor``, ``aux_loss_coef``, ``z_loss_coef``, ``bias_update_rate``,
    ``shared_experts``, ``shared_ffn_hidden``, ``shared_gate``, ``expert_tensor_parallel``);
    experts split over
    ``parallel.expert`` ranks. Checked by :func:`check_moe` before any collective.

    Under pipeline parallelism a rank builds only its stages: ``embed`` on stage 0,
    ``norm``/``lm_head`` on the last (which also holds ``embed`` when tied); every stage
    makes the rotary tables from the inputs' positions."""

    def __init__(self, vocab_size: int, hidden: int, layers: int, heads: int,
                 kv_heads: Optional[int] = None, intermediate: Optional[int] = None,
                 max_positions: int = 2048, rope_theta: float = 10000.0, rope_scaling=None,
                 eps: float = 1e-5, qkv_bias: bool = False, tie_embeddings: bool = False,
                 init_std: float = 0.02, dropout: float = 0.0, checkpoint=False, moe=None):
        super().__init__()
        self.arch_args = constructor_args(locals())  # for save_hf
        ctx = current_context()
        tensor_1d = ctx.axis(ParallelMode.TENSOR).size if ctx.tensor_mode == '1d' else 1
        moe = check_moe(moe, layers, ctx.axis(ParallelMode.EXPERT).size, tensor_1d,
                        intermediate)
        self.moe = moe
        kv_heads = heads if kv_heads is None else kv_heads
        if intermediate is None:
            intermediate = 256 * -(-(8 * hidden // 3) // 256)
        if hidden % heads:
            raise ValueError(f'hidden size {hidden} must be divisible by heads {heads}')
        if heads % kv_heads:
            raise ValueError(f'heads {heads} must be divisible by kv_heads {kv_heads}')
        head_dim = hidden // heads
        self.max_positions, self.head_dim = max_positions, head_dim
        self.rope_freqs = rope_frequencies(head_dim, rope_theta, check_rope_scaling(rope_scaling))
        with init_by_name(self):  # each weight a function of (seed, its name)
            self.checkpointed = checkpointed_blocks(checkpoint, layers)
            embed_params = vocab_size * hidden
            block_params = llama_block_params(hidden, heads, kv_heads, head_dim, intermediate,
                                              qkv_bias)
            if moe is not None:  # every block weighted as an MoE block
                block_params += moe_block_params(hidden, intermediate, moe) - 3 * hidden * \
                    intermediate
            self.plan_stages(layers, parameter_weights(
                embed_params, block_params,
                hidden + embed_params), options=self.arch_args)  # tied: the last stage's copy
            if self.holds_first or (self.holds_last and tie_embeddings):
                self.embed = col_nn.VocabParallelEmbedding(vocab_size, hidden,
                                                           weight_init=normal_init(init_std))
            if self.holds_first:
                self.drop = col_nn.Dropout(dropout)
            self.blocks = self.build_blocks(lambda i: LlamaBlock(
                hidden, heads, kv_heads, head_dim, intermediate, eps, qkv_bias, dropout,
                init_std, checkpoint=i in self.checkpointed,
                moe=moe if moe is not None and i >= moe['first_dense'] else None))
            if self.holds_last:
                self.norm = col_nn.RMSNorm(hidden, eps=eps)
                self.lm_head = col_nn.VocabParallelClassifier(
                    hidden, vocab_size, bias=False, weight_init=normal_init(init_std),
                    weight=self.embed.weight if tie_embeddings else None)
        if tie_embeddings:
            self.tie_across_stages('embed.weight')

    @classmethod
    def cost_sample(cls, args: dict) -> tuple:
        return (torch.zeros(2, min(args['max_positions'], 64), dtype=torch.long),)

    @classmethod
    def from_preset(cls, name: str, **overrides) -> 'Llama':
        return cls(**preset_config(LLAMA_PRESETS, name, overrides, 'Llama', extra=('moe',)))

    def forward(self, input_ids: torch.Tensor, stage_input: torch.Tensor = None,
                stage: int = None, kv_cache: KVCache = None, last_only: bool = False,
                position_ids: torch.Tensor = None, packed: bool = False) -> torch.Tensor:
        """``position_ids [b, s]`` (default ``0 .. s-1`` after the cached tokens) place the
        rotary angles; ``kv_cache``: see :meth:`new_kv_cache`; ``last_only``: the logits of
        the last position only, ``[b, 1, V]``. ``packed=True``: each row holds several
        documents whose ``position_ids`` restart at 0; a token attends only within its
        document (docs/llama.md, "Packed documents"; :meth:`packed_step`)."""
        self.check_last_only(last_only)
        spec = self.stage_spec(stage)
        x = self.stage_start(spec, stage_input)
        position_ids, docs = self.packed_step(input_ids, position_ids, packed, kv_cache)
        if position_ids is None:
            position_ids = self._positions(input_ids, kv_cache)
        rope = rotary_tables(col_nn.local_positions(position_ids), self.rope_freqs)
        if spec.first:
            x = self.drop(self.embed(input_ids))
        for i in spec.layers:
            x = self.blocks[str(i)](x, rope,
                                    kv_cache=None if kv_cache is None else kv_cache.layer(i),
                                    document_ids=docs)
        if kv_cache is not None:
            kv_cache.length += input_ids.shape[1]
        if not spec.last:
            return x
        return self.lm_head(self.norm(x[:, -1:] if last_only else x))

    def _positions(self, input_ids: torch.Tensor, kv_cache) -> torch.Tensor:
        """Positions ``[s]`` of ``input_ids [b, s]``, after the ``kv_cache.length`` cached ones."""
        offset = 0 if kv_cache is None else kv_cache.length
        end = offset + input_ids.shape[1]
        if end > self.max_positions:
            raise ValueError(f'{offset} cached + {input_ids.shape[1]} new tokens exceed '
                             f'max_positions {self.max_positions}')
        return torch.arange(offset, end, device=input_ids.device)
