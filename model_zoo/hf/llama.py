"""Hugging Face Llama, Mistral and Qwen2 <-> model_zoo Llama.

The three HF model types (five with Mixtral and Qwen2-MoE, ``moe_hf.py``) are one
architecture with one key layout: pre-norm RMSNorm
blocks, rotary positions (rotate-half), grouped-query attention, a SwiGLU MLP, a final
RMSNorm and an LM head (tied to the embedding or not). They differ only in which config
fields exist (:data:`_TYPES`): Qwen2 always has q/k/v biases, Llama's ``attention_bias``
puts a bias on all four projections, Mistral and Qwen2 may use a sliding window. Every
projection is ``nn.Linear`` (``[out, in]``) on both sides and head ``n`` reads the same
rows of q, k, v in both models, so every map is a rename:

==============================  ===============================================
ours                            HF (body keys under ``model.`` in ``*ForCausalLM``)
==============================  ===============================================
embed.weight                    ``embed_tokens.weight``
blocks.{i}.attn_norm.weight     ``layers.{i}.input_layernorm.weight``
blocks.{i}.attn.q_proj          ``layers.{i}.self_attn.q_proj`` (k, v alike; ``.bias``
                                when ``qkv_bias``); ``o_proj`` alike, no bias
blocks.{i}.mlp_norm.weight      ``layers.{i}.post_attention_layernorm.weight``
blocks.{i}.mlp.gate_proj        ``layers.{i}.mlp.gate_proj`` (up_proj, down_proj alike)
norm.weight                     ``norm.weight``
lm_head.weight                  ``lm_head.weight`` (outside ``model.``); the embedding's
                                weight when ``tie_word_embeddings``
==============================  ===============================================

Read: ``{Llama,Mistral,Qwen2}ForCausalLM`` and the headless ``{..}Model`` (an untied LM head
keeps our seeded initial weights). Written: the ``*ForCausalLM`` of the model type it was
read from; a model not read from HF is written as ``LlamaForCausalLM``, or as
``Qwen2ForCausalLM`` when it has q/k/v biases (Llama cannot hold them without an o_proj bias).

Config: ``rms_norm_eps`` -> ``eps``, ``num_key_value_heads`` -> ``kv_heads``,
``rope_parameters`` (transformers 5; ``rope_scaling`` + ``rope_theta`` before) with
``rope_type`` 'default' -> ``rope_theta`` or 'llama3' -> also ``rope_scaling=dict(factor,
low_freq_factor, high_freq_factor, original_max_positions)``, ``initializer_range`` ->
``init_std``. Dropout: HF's only rate, ``attention_dropout`` (on the attention
probabilities), becomes ours, which also drops the embedding output and both residual
branches (training only; ``dropout=`` overrides it). Fields ours cannot represent raise a
ValueError naming them: ``hidden_act`` other than silu, ``head_dim`` other than
``hidden_size / num_attention_heads``, ``mlp_bias``, ``attention_bias`` (Llama),
``rope_type`` other than default/llama3, ``partial_rotary_factor`` < 1, per-layer
``rope_parameters``, and a ``sliding_window`` in use -- shorter than
``max_position_embeddings`` (ours never sees a longer span: positions stop there and
generation slides its window at that length) on some layer (Mistral: every layer; Qwen2:
the ``layer_types`` 'sliding_attention' ones, i.e. with ``use_sliding_window``).
Mixture-of-experts types (``mixtral``, ``qwen2_moe``) are read as a Llama with
``moe=dict(...)``: their MoE MLPs, config fields and what is refused are in ``moe_hf.py``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .family import HFFamily, KeyReader, State, linear, read_renamed, register, renames, \
    without_meta
from .moe_hf import (dense_blocks, experts_to_hf, experts_to_ours, moe_config, moe_kwargs,
                     moe_model_type, moe_renames, moe_view)


@dataclass(frozen=True)
class _HFType:
    """What tells one HF model type of the family from another."""
    prefix: str                  # class names: prefix + 'ForCausalLM' / 'Model'
    config: str                  # the transformers config class
    qkv_bias: Optional[bool]     # fixed q/k/v bias; None: the config's attention_bias (+ o_proj)
    window: Optional[str]        # None: no sliding window; 'all' layers; 'layer_types' marks them
    moe: bool = False            # MoE MLPs (Mixtral, Qwen2-MoE: moe_hf.py)
    qkv_bias_field: str = ''     # the config field holding a q/k/v-only bias (Qwen2-MoE)


_TYPES = {
    'llama': _HFType('Llama', 'LlamaConfig', qkv_bias=None, window=None),
    'mistral': _HFType('Mistral', 'MistralConfig', qkv_bias=False, window='all'),
    'qwen2': _HFType('Qwen2', 'Qwen2Config', qkv_bias=True, window='layer_types'),
    'mixtral': _HFType('Mixtral', 'MixtralConfig', qkv_bias=False, window='all', moe=True),
    'qwen2_moe': _HFType('Qwen2Moe', 'Qwen2MoeConfig', qkv_bias=None, window='layer_types',
                         moe=True, qkv_bias_field='qkv_bias'),
}
_CLASSES = {**{t.prefix + 'ForCausalLM': 'model.' for t in _TYPES.values()},
            **{t.prefix + 'Model': '' for t in _TYPES.values()}}
_LLAMA3 = (('factor', 'factor'), ('low_freq_factor', 'low_freq_factor'),
           ('high_freq_factor', 'high_freq_factor'),
           ('original_max_positions', 'original_max_position_embeddings'))
_ARCH = ('hidden', 'layers', 'heads', 'kv_heads', 'intermediate', 'max_positions',
         'rope_theta', 'rope_scaling', 'eps', 'qkv_bias', 'tie_embeddings')


def _layer(qkv_bias: bool, moe: Optional[dict] = None):
    """(our key, HF key) pairs of one block, relative to ``blocks.{i}.`` / ``layers.{i}.``;
    ``moe``: an MoE block's renamed tensors (the stacked experts: :mod:`.moe_hf`)."""
    out = [('attn_norm.weight', 'input_layernorm.weight'),
           ('mlp_norm.weight', 'post_attention_layernorm.weight')]
    for name in ('q', 'k', 'v'):
        out += linear(f'attn.{name}_proj', f'self_attn.{name}_proj', bias=qkv_bias)
    out += linear('attn.o_proj', 'self_attn.o_proj', bias=False)
    if moe is not None:
        return out + moe_renames(moe)
    for name in ('gate', 'up', 'down'):
        out += linear(f'mlp.{name}_proj', f'mlp.{name}_proj', bias=False)
    return out


def _pairs(layers: int, qkv_bias: bool, moe: Optional[dict] = None):
    """(our key, HF body key) pairs of everything but the LM head (and the stacked experts)."""
    out = renames([('embed.weight', 'embed_tokens.weight'), ('norm.weight', 'norm.weight')],
                  layers, [], 'blocks.{i}.', 'layers.{i}.')
    for i in range(layers):
        block = moe if moe is not None and i >= moe.get('first_dense', 0) else None
        out += [(f'blocks.{i}.' + a, f'layers.{i}.' + b) for a, b in _layer(qkv_bias, block)]
    return out


def _moe_blocks(layers: int, moe: Optional[dict]):
    """The indices of the MoE blocks."""
    return [] if moe is None else list(range(moe.get('first_dense', 0), layers))


# ---------------------------------------------------------------- config -> our arguments
def _reject(field: str, value, why: str):
    raise ValueError(f'our Llama cannot represent HF {field}={value!r}: {why}')


def _rope(c) -> tuple:
    """``(rope_theta, rope_scaling)`` of ``c.rope_parameters`` (or the older ``rope_scaling``)."""
    params = getattr(c, 'rope_parameters', None)
    if params is None:
        params = dict(getattr(c, 'rope_scaling', None) or {},
                      rope_theta=getattr(c, 'rope_theta', 10000.0))
    if any(isinstance(v, dict) for v in params.values()):
        _reject('rope_parameters', params, 'one rotary embedding for every layer, not one per '
                                           'layer type')
    kind = params.get('rope_type', params.get('type', 'default'))
    if kind not in ('default', 'llama3'):
        _reject('rope_parameters.rope_type', kind, "the rotary types are 'default' and 'llama3'")
    if params.get('partial_rotary_factor') not in (None, 1, 1.0):
        _reject('partial_rotary_factor', params['partial_rotary_factor'],
                'ours rotates the whole head')
    theta = float(params.get('rope_theta', 10000.0))
    if kind == 'default':
        return theta, None
    missing = [theirs for _, theirs in _LLAMA3 if theirs not in params]
    if missing:
        raise ValueError(f"HF rope_parameters of rope_type 'llama3' lack {missing}")
    return theta, {ours: params[theirs] for ours, theirs in _LLAMA3}


def _check_window(c, hf_type: _HFType):
    """A sliding window shorter than ``max_position_embeddings`` on some layer: a ValueError."""
    window = getattr(c, 'sliding_window', None)
    if hf_type.window is None or window is None or window >= c.max_position_embeddings:
        return
    if hf_type.window == 'layer_types':
        types = list(getattr(c, 'layer_types', None) or [])
        sliding = [i for i, t in enumerate(types) if t == 'sliding_attention']
        if not sliding:
            return
        why = (f'layers {sliding} (use_sliding_window={getattr(c, "use_sliding_window", None)}) '
               f'attend to the last {window} positions only')
    else:
        why = f'every layer attends to the last {window} positions only'
    _reject('sliding_window', window, f'{why}, ours to all earlier ones (a window >= '
                                      f'max_position_embeddings={c.max_position_embeddings} has no '
                                      f'effect and is accepted)')


def _qkv_bias(c, hf_type: _HFType) -> bool:
    if hf_type.qkv_bias_field:
        return bool(getattr(c, hf_type.qkv_bias_field, False))
    if hf_type.qkv_bias is not None:
        return hf_type.qkv_bias
    if getattr(c, 'attention_bias', False):
        _reject('attention_bias', True, 'it also puts a bias on o_proj, which ours has not '
                                        '(q/k/v biases alone are Qwen2)')
    return False


def _kwargs(c, hf_class: str) -> dict:
    hf_type = _TYPES[c.model_type]
    if not hf_class.startswith(hf_type.prefix):
        raise ValueError(f'{hf_class} does not hold model_type {c.model_type!r}')
    if c.hidden_act not in ('silu', 'swish'):
        _reject('hidden_act', c.hidden_act, 'the MLP is SwiGLU (silu)')
    head_dim = getattr(c, 'head_dim', None)
    if head_dim is not None and head_dim * c.num_attention_heads != c.hidden_size:
        _reject('head_dim', head_dim, f'ours has head_dim = hidden_size / num_attention_heads '
                                      f'= {c.hidden_size // c.num_attention_heads}')
    if getattr(c, 'mlp_bias', False):
        _reject('mlp_bias', True, 'the MLP projections have no bias')
    _check_window(c, hf_type)
    theta, scaling = _rope(c)
    extra = dict(moe=moe_kwargs(c)) if hf_type.moe else {}
    return dict(extra, vocab_size=c.vocab_size, hidden=c.hidden_size, layers=c.num_hidden_layers,
                heads=c.num_attention_heads,
                kv_heads=c.num_key_value_heads or c.num_attention_heads,
                intermediate=c.intermediate_size, max_positions=c.max_position_embeddings,
                rope_theta=theta, rope_scaling=scaling, eps=float(c.rms_norm_eps),
                qkv_bias=_qkv_bias(c, hf_type), tie_embeddings=bool(c.tie_word_embeddings),
                dropout=float(c.attention_dropout or 0.0),
                init_std=getattr(c, 'initializer_range', 0.02))


# ---------------------------------------------------------------- weights
def _to_ours(hf: KeyReader, kwargs: dict) -> State:
    moe = kwargs.get('moe')
    state = read_renamed(hf, _pairs(kwargs['layers'], kwargs['qkv_bias'], moe))
    for i in _moe_blocks(kwargs['layers'], moe):
        state.update(experts_to_ours(hf, f'layers.{i}.mlp.experts.', f'blocks.{i}.mlp.experts.'))
    if kwargs['tie_embeddings']:
        if 'lm_head.weight' in hf:
            hf['lm_head.weight']  # noqa: B018 -- HF's tied copy of embed_tokens: read as such
        state['lm_head.weight'] = state['embed.weight']
    elif 'lm_head.weight' in hf:  # a headless *Model leaves ours seeded
        state['lm_head.weight'] = hf['lm_head.weight']
    return state


def _to_hf(state: State, args: dict):
    moe = args.get('moe')
    out = {'model.' + theirs: state[ours]
           for ours, theirs in _pairs(args['layers'], args.get('qkv_bias', False), moe)}
    for i in _moe_blocks(args['layers'], moe):
        out.update(experts_to_hf(state, f'blocks.{i}.mlp.experts.',
                                 f'model.layers.{i}.mlp.experts.'))
    out['lm_head.weight'] = state['embed.weight' if args.get('tie_embeddings') else
                                  'lm_head.weight']
    return None, out  # the class: that of the written config's model type (_class_of)


# ---------------------------------------------------------------- our arguments -> config
def _resolved(args: dict) -> dict:
    """``args`` with the constructor's defaults filled in (kv_heads, intermediate)."""
    out = dict(args)
    out['kv_heads'] = args.get('kv_heads') or args['heads']
    out['intermediate'] = args.get('intermediate') or 256 * -(-(8 * args['hidden'] // 3) // 256)
    return out


def _tokens(value, vocab: int):
    """A special-token id (or list of ids) of a saved config, kept where it fits ``vocab``."""
    if isinstance(value, (list, tuple)):
        kept = [t for t in value if t < vocab]
        return kept or None
    return value if value is not None and value < vocab else None


def _model_type(args: dict, base: dict) -> str:
    if base.get('model_type') in _TYPES and bool(_TYPES[base['model_type']].moe) == bool(
            args.get('moe')):
        return base['model_type']
    if args.get('moe'):
        return moe_model_type(args)
    return 'qwen2' if args.get('qkv_bias') else 'llama'


def _config(args: dict, vocab: int, base: dict):
    import transformers
    args, model_type = _resolved(args), _model_type(args, base)
    hf_type = _TYPES[model_type]
    if args.get('qkv_bias') and hf_type.qkv_bias is not True and not hf_type.qkv_bias_field:
        raise ValueError(f'a model with q/k/v biases (qkv_bias=True) cannot be written as '
                         f'{hf_type.prefix}: its attention has no q/k/v-only biases')
    rope = dict(rope_type='default', rope_theta=float(args['rope_theta']))
    if args.get('rope_scaling'):
        rope.update(rope_type='llama3', **{theirs: args['rope_scaling'][ours]
                                           for ours, theirs in _LLAMA3})
    cfg = {k: v for k, v in without_meta(base).items() if k not in ('rope_scaling', 'rope_theta')}
    cfg.update(vocab_size=vocab, hidden_size=args['hidden'], num_hidden_layers=args['layers'],
               num_attention_heads=args['heads'], num_key_value_heads=args['kv_heads'],
               intermediate_size=args['intermediate'], hidden_act='silu',
               max_position_embeddings=args['max_positions'], rms_norm_eps=args['eps'],
               rope_parameters=rope, tie_word_embeddings=bool(args.get('tie_embeddings')),
               attention_dropout=args.get('dropout', 0.0),
               initializer_range=args.get('init_std', 0.02))
    if hf_type.qkv_bias_field:
        cfg[hf_type.qkv_bias_field] = bool(args.get('qkv_bias'))
    elif hf_type.qkv_bias is None:
        cfg.update(attention_bias=False, mlp_bias=False)
    if hf_type.moe:
        cfg.update(moe_config(model_type, args))
    if model_type not in ('qwen2', 'qwen2_moe'):
        cfg['head_dim'] = args['hidden'] // args['heads']
    for token in ('bos_token_id', 'eos_token_id', 'pad_token_id'):
        if token in cfg:
            cfg[token] = _tokens(cfg[token], vocab)
    config = getattr(transformers, hf_type.config).from_dict(cfg)
    back = _kwargs(config, _class_of(config))  # what we write must read back as ours
    wrong = [k for k in _ARCH if back[k] != args.get(k)
             and not (k == 'intermediate' and not dense_blocks(args))]
    if hf_type.moe and moe_view(back['moe'], back['intermediate']) != moe_view(
            args['moe'], args['intermediate']):
        wrong.append('moe')
    if wrong:
        raise ValueError(f'the {hf_type.config} written would read back differently in '
                         f'{wrong}: ours {[args.get(k) for k in wrong]}, HF '
                         f'{[back[k] for k in wrong]}')
    return config


def _class_of(hf_config) -> str:
    return _TYPES[hf_config.model_type].prefix + 'ForCausalLM'


FAMILY = register(HFFamily(
    name='Llama', model_type=tuple(_TYPES), classes=_CLASSES, kwargs=_kwargs,
    to_ours=_to_ours, to_hf=_to_hf, config=_config,
    vocab_keys=('embed.weight', 'lm_head.weight'),
    vocab_of=lambda hf_config: hf_config.vocab_size,
    # rotary tables: persistent buffers of older transformers releases
    ignored=(r'(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq',),
    seeded={t.prefix + 'Model': ('lm_head.',) for t in _TYPES.values()},
    class_of=_class_of))
