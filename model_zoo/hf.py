"""Hugging Face GPT-2 -> model_zoo GPT: config and weights.

HF ``GPT2LMHeadModel`` stores its projections as ``Conv1D`` with weight
``[in, out]`` (y = x W + b), and fuses q, k, v into one ``c_attn`` of width 3h.
Our GPT uses ``torch.nn.Linear`` layout ``[out, in]`` (y = x W^T + b) and separate
``query``/``key``/``value``. So, per block ``i``:

======================================  ==========================================
ours                                    HF (``transformer.h.{i}.``)
======================================  ==========================================
query/key/value.weight  [h, h]          ``attn.c_attn.weight[:, j*h:(j+1)*h].T``, j = 0, 1, 2
query/key/value.bias    [h]             ``attn.c_attn.bias[j*h:(j+1)*h]``
attn.dense.weight       [h, h]          ``attn.c_proj.weight.T``
mlp.fc1.weight          [r*h, h]        ``mlp.c_fc.weight.T``
mlp.fc2.weight          [h, r*h]        ``mlp.c_proj.weight.T``
ln1 / ln2               [h]             ``ln_1`` / ``ln_2``
======================================  ==========================================

plus ``wte``, ``wpe``, ``ln_f``; the LM head is tied to ``wte``. Head ``n`` of both
models reads the same columns ``n*d:(n+1)*d`` of q, k, v, so no permutation is needed.
The vocabulary may be padded with zero rows (``vocab_size`` > HF's): the extra
logits are then 0 * x = 0 and the first ``V_hf`` logits equal HF's.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

_ACTIVATIONS = ('gelu_new', 'gelu_pytorch_tanh')


def gpt_kwargs_from_hf(hf_config, vocab_size: Optional[int] = None) -> dict:
    """``GPT(**kwargs)`` arguments equal to a ``GPT2Config`` (errors for what we do not model)."""
    if hf_config.activation_function not in _ACTIVATIONS:
        raise ValueError(f"our GPT uses tanh-GELU ({_ACTIVATIONS}); HF config has "
                         f"activation_function={hf_config.activation_function!r}")
    inner = hf_config.n_inner or 4 * hf_config.n_embd
    if inner % hf_config.n_embd:
        raise ValueError(f'n_inner={inner} must be a multiple of n_embd={hf_config.n_embd}')
    vocab = vocab_size or hf_config.vocab_size
    if vocab < hf_config.vocab_size:
        raise ValueError(f'vocab_size={vocab} is smaller than the HF vocabulary {hf_config.vocab_size}')
    return dict(vocab_size=vocab, max_positions=hf_config.n_positions, hidden=hf_config.n_embd,
                layers=hf_config.n_layer, heads=hf_config.n_head, mlp_ratio=inner // hf_config.n_embd,
                dropout=hf_config.resid_pdrop, eps=hf_config.layer_norm_epsilon)


def _strip_prefix(hf_state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    return {k[len('transformer.'):] if k.startswith('transformer.') else k: v
            for k, v in hf_state.items()}


def _block(hf: Dict[str, torch.Tensor], i: int, hidden: int) -> Dict[str, torch.Tensor]:
    p, out = f'h.{i}.', {}
    q = f'blocks.{i}.'
    qkv_w, qkv_b = hf[p + 'attn.c_attn.weight'], hf[p + 'attn.c_attn.bias']
    for j, name in enumerate(('query', 'key', 'value')):
        out[q + f'attn.{name}.weight'] = qkv_w[:, j * hidden:(j + 1) * hidden].t()
        out[q + f'attn.{name}.bias'] = qkv_b[j * hidden:(j + 1) * hidden]
    pairs = {'attn.dense': 'attn.c_proj', 'mlp.fc1': 'mlp.c_fc', 'mlp.fc2': 'mlp.c_proj'}
    for ours, theirs in pairs.items():
        out[q + ours + '.weight'] = hf[p + theirs + '.weight'].t()
        out[q + ours + '.bias'] = hf[p + theirs + '.bias']
    for ours, theirs in (('ln1', 'ln_1'), ('ln2', 'ln_2')):
        out[q + ours + '.weight'] = hf[p + theirs + '.weight']
        out[q + ours + '.bias'] = hf[p + theirs + '.bias']
    return out


def hf_gpt2_to_state_dict(hf_state: Dict[str, torch.Tensor], layers: int,
                          vocab_size: Optional[int] = None) -> Dict[str, torch.Tensor]:
    """Our GPT's full state dict from ``GPT2LMHeadModel.state_dict()`` (or ``GPT2Model``'s)."""
    hf = _strip_prefix(hf_state)
    wte = hf['wte.weight']
    hidden = wte.shape[1]
    if vocab_size is not None and vocab_size > wte.shape[0]:
        wte = torch.cat([wte, wte.new_zeros(vocab_size - wte.shape[0], hidden)])
    out = {'wte.weight': wte, 'wpe.weight': hf['wpe.weight'],
           'ln_f.weight': hf['ln_f.weight'], 'ln_f.bias': hf['ln_f.bias']}
    for i in range(layers):
        out.update(_block(hf, i, hidden))
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def gpt_from_hf(hf_model, vocab_size: Optional[int] = None):
    """A model_zoo GPT (for the launched layout) holding ``hf_model``'s weights."""
    from .gpt import GPT
    kwargs = gpt_kwargs_from_hf(hf_model.config, vocab_size)
    model = GPT(**kwargs)
    state = hf_gpt2_to_state_dict(hf_model.state_dict(), kwargs['layers'], kwargs['vocab_size'])
    if 'lm_head.weight' in model.state_dict():
        state['lm_head.weight'] = state['wte.weight']
    model.load_state_dict(state)
    return model
