"""Hugging Face GPT-2 <-> model_zoo GPT.

HF ``GPT2LMHeadModel`` stores its projections as ``Conv1D`` with weight
``[in, out]`` (y = x W + b), and fuses q, k, v into one ``c_attn`` of width 3h.
Our GPT uses ``torch.nn.Linear`` layout ``[out, in]`` (y = x W^T + b) and separate
``query``/``key``/``value``. So, per block ``i``:

======================================  ==========================================
ours (``blocks.{i}.``)                  HF (``transformer.h.{i}.``)
======================================  ==========================================
attn.query/key/value.weight  [h, h]     ``attn.c_attn.weight[:, j*h:(j+1)*h].T``, j = 0, 1, 2
attn.query/key/value.bias    [h]        ``attn.c_attn.bias[j*h:(j+1)*h]``
attn.dense.weight / bias     [h, h]     ``attn.c_proj.weight.T`` / ``attn.c_proj.bias``
mlp.fc1.weight / bias        [r*h, h]   ``mlp.c_fc.weight.T`` / ``mlp.c_fc.bias``
mlp.fc2.weight / bias        [h, r*h]   ``mlp.c_proj.weight.T`` / ``mlp.c_proj.bias``
ln1 / ln2                    [h]        ``ln_1`` / ``ln_2``
======================================  ==========================================

plus ``wte`` <-> ``transformer.wte``, ``wpe`` <-> ``transformer.wpe``, ``ln_f`` <->
``transformer.ln_f``; the LM head is tied to ``wte`` on both sides (``lm_head.weight``).
Head ``n`` of both models reads the same columns ``n*d:(n+1)*d`` of q, k, v, so no
permutation is needed. Read: ``GPT2LMHeadModel``, ``GPT2Model`` (the same weights without
the tied head); written: ``GPT2LMHeadModel``.

Both are pre-LN with a final LayerNorm, learned positions, tanh-GELU and scaled
dot-product attention. Config fields ours cannot represent raise a ValueError naming
them: ``activation_function`` other than tanh-GELU, ``scale_attn_weights=False``,
``scale_attn_by_inverse_layer_idx=True``, ``add_cross_attention=True``,
``tie_word_embeddings=False``, ``n_inner`` not a multiple of ``n_embd``. Dropout:
ours has one rate, taken from ``resid_pdrop`` (HF's ``embd_pdrop``/``attn_pdrop`` only
matter in training; ``dropout=`` overrides it).
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from .family import HFFamily, KeyReader, State, keep_token, register, without_meta

_ACTIVATIONS = ('gelu_new', 'gelu_pytorch_tanh')
_PAIRS = {'attn.dense': 'attn.c_proj', 'mlp.fc1': 'mlp.c_fc', 'mlp.fc2': 'mlp.c_proj'}
_NORMS = {'ln1': 'ln_1', 'ln2': 'ln_2'}


def gpt_kwargs_from_hf(hf_config, vocab_size: Optional[int] = None) -> dict:
    """``GPT(**kwargs)`` arguments equal to a ``GPT2Config`` (errors for what we do not model)."""
    if hf_config.activation_function not in _ACTIVATIONS:
        raise ValueError(f"our GPT uses tanh-GELU ({_ACTIVATIONS}); HF config has "
                         f"activation_function={hf_config.activation_function!r}")
    for field, ours in (('scale_attn_weights', True), ('scale_attn_by_inverse_layer_idx', False),
                        ('add_cross_attention', False), ('tie_word_embeddings', True)):
        if bool(getattr(hf_config, field, ours)) != ours:
            raise ValueError(f'our GPT has {field}={ours}; HF config has '
                             f'{field}={getattr(hf_config, field)!r}')
    inner = hf_config.n_inner or 4 * hf_config.n_embd
    if inner % hf_config.n_embd:
        raise ValueError(f'n_inner={inner} must be a multiple of n_embd={hf_config.n_embd}')
    vocab = vocab_size or hf_config.vocab_size
    if vocab < hf_config.vocab_size:
        raise ValueError(f'vocab_size={vocab} is smaller than the HF vocabulary '
                         f'{hf_config.vocab_size}')
    return dict(vocab_size=vocab, max_positions=hf_config.n_positions, hidden=hf_config.n_embd,
                layers=hf_config.n_layer, heads=hf_config.n_head,
                mlp_ratio=inner // hf_config.n_embd, dropout=hf_config.resid_pdrop,
                eps=hf_config.layer_norm_epsilon)


def _renames():
    """``(our key, HF key, transposed)`` of every block tensor but q/k/v, relative to the
    block: Conv1D weights ``[in, out]`` are our Linear weights transposed."""
    for ours, theirs in _PAIRS.items():
        yield ours + '.weight', theirs + '.weight', True
        yield ours + '.bias', theirs + '.bias', False
    for ours, theirs in _NORMS.items():
        yield ours + '.weight', theirs + '.weight', False
        yield ours + '.bias', theirs + '.bias', False


def _block_to_ours(hf, i: int, hidden: int) -> State:
    p, q, out = f'h.{i}.', f'blocks.{i}.', {}
    qkv_w, qkv_b = hf[p + 'attn.c_attn.weight'], hf[p + 'attn.c_attn.bias']
    for j, name in enumerate(('query', 'key', 'value')):
        out[q + f'attn.{name}.weight'] = qkv_w[:, j * hidden:(j + 1) * hidden].t()
        out[q + f'attn.{name}.bias'] = qkv_b[j * hidden:(j + 1) * hidden]
    for ours, theirs, transpose in _renames():
        out[q + ours] = hf[p + theirs].t() if transpose else hf[p + theirs]
    return out


def _block_to_hf(state: State, i: int) -> State:
    p, q, out = f'transformer.h.{i}.', f'blocks.{i}.', {}
    names = ('query', 'key', 'value')
    out[p + 'attn.c_attn.weight'] = torch.cat([state[q + f'attn.{n}.weight'].t() for n in names], 1)
    out[p + 'attn.c_attn.bias'] = torch.cat([state[q + f'attn.{n}.bias'] for n in names])
    for ours, theirs, transpose in _renames():
        out[p + theirs] = state[q + ours].t() if transpose else state[q + ours]
    return out


def hf_gpt2_to_state_dict(hf_state: Dict[str, torch.Tensor], layers: int,
                          vocab_size: Optional[int] = None) -> Dict[str, torch.Tensor]:
    """Our GPT's full state dict from ``GPT2LMHeadModel.state_dict()`` (or ``GPT2Model``'s),
    ``wte`` padded with zero rows to ``vocab_size`` (``lm_head.weight``, tied, not included)."""
    from .convert import pad_rows
    state = _to_ours(KeyReader(hf_state, 'transformer.'), dict(layers=layers))
    state.pop('lm_head.weight')
    if vocab_size is not None:
        state = pad_rows(state, ('wte.weight',), vocab_size)
    return {k: v.detach().clone().contiguous() for k, v in state.items()}


def _to_ours(hf: KeyReader, kwargs: dict) -> State:
    wte = hf['wte.weight']
    out = {'wte.weight': wte, 'lm_head.weight': wte, 'wpe.weight': hf['wpe.weight'],
           'ln_f.weight': hf['ln_f.weight'], 'ln_f.bias': hf['ln_f.bias']}
    for i in range(kwargs['layers']):
        out.update(_block_to_ours(hf, i, wte.shape[1]))
    return out


def _to_hf(state: State, args: dict):
    out = {'transformer.wte.weight': state['wte.weight'], 'lm_head.weight': state['wte.weight'],
           'transformer.wpe.weight': state['wpe.weight'],
           'transformer.ln_f.weight': state['ln_f.weight'],
           'transformer.ln_f.bias': state['ln_f.bias']}
    for i in range(args['layers']):
        out.update(_block_to_hf(state, i))
    return 'GPT2LMHeadModel', out


def _config(args: dict, vocab: int, base: dict):
    import transformers
    cfg = dict(base, vocab_size=vocab, n_positions=args['max_positions'], n_embd=args['hidden'],
               n_layer=args['layers'], n_head=args['heads'],
               n_inner=args.get('mlp_ratio', 4) * args['hidden'],
               activation_function=base.get('activation_function', 'gelu_new'),
               resid_pdrop=args.get('dropout', 0.1), embd_pdrop=args.get('dropout', 0.1),
               attn_pdrop=args.get('dropout', 0.1), layer_norm_epsilon=args.get('eps', 1e-5),
               tie_word_embeddings=True)
    for token in ('bos_token_id', 'eos_token_id'):  # GPT-2's 50256 only fits its own vocabulary
        cfg[token] = keep_token(cfg.get(token, 50256), vocab)
    return transformers.GPT2Config.from_dict(without_meta(cfg))


def gpt_from_hf(hf_model, vocab_size: Optional[int] = None):
    """A model_zoo GPT (for the launched layout) holding ``hf_model``'s weights, with
    exactly HF's vocabulary unless ``vocab_size`` is given (``GPT.from_hf`` pads it to the
    layout's vocabulary split instead)."""
    from ..gpt import GPT
    return GPT.from_hf(hf_model, vocab_size=vocab_size or hf_model.config.vocab_size)


FAMILY = register(HFFamily(
    name='GPT', model_type='gpt2',
    classes={'GPT2LMHeadModel': 'transformer.', 'GPT2Model': ''},
    kwargs=lambda hf_config, hf_class: gpt_kwargs_from_hf(hf_config),
    to_ours=_to_ours, to_hf=_to_hf, config=_config,
    vocab_keys=('wte.weight', 'lm_head.weight'),
    vocab_of=lambda hf_config: hf_config.vocab_size,
    # the head is tied to wte (tie_word_embeddings checked); causal-mask buffers of older
    # transformers releases
    ignored=(r'lm_head\.weight', r'h\.\d+\.attn\.(masked_)?bias')))
