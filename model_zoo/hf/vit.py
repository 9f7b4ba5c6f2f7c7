"""Hugging Face ViT <-> model_zoo ViT.

Both are pre-LN encoders (LayerNorm before attention and MLP, residuals after) over a
class token + conv patch embeddings + learned positions (``[CLS] ++ patches``, then
``+ positions``), exact (erf) GELU, a final LayerNorm, and a linear classifier on the
class token. All projections are ``nn.Linear`` (``[out, in]``), the patch projection a
``Conv2d`` ``[h, C, p, p]`` on both sides, so every map is a rename:

==========================  ======================================================
ours                        HF (body keys under ``vit.`` in ``ViTForImageClassification``)
==========================  ======================================================
patch_embed.cls_token       ``embeddings.cls_token`` ``[1, 1, h]``
patch_embed.pos_embed       ``embeddings.position_embeddings`` ``[1, 1 + n, h]``
patch_embed.proj            ``embeddings.patch_embeddings.projection``
blocks.{i}.ln1 / ln2        ``layers.{i}.layernorm_before`` / ``layernorm_after``
blocks.{i}.attn.query       ``layers.{i}.attention.q_proj`` (key: k_proj, value: v_proj)
blocks.{i}.attn.dense       ``layers.{i}.attention.o_proj``
blocks.{i}.mlp.fc1 / fc2    ``layers.{i}.mlp.fc1`` / ``fc2``
norm                        ``layernorm``
head                        ``classifier``
==========================  ======================================================

(the key names of transformers 5; older releases' ``encoder.layer.{i}.attention.attention.
query`` names are converted by transformers itself when it loads a directory).
Read: ``ViTForImageClassification``; ``ViTModel`` (its unused ``pooler`` ignored; our
``head`` keeps its seeded initial weights, ``num_classes`` from ``config.num_labels``).
Written: ``ViTForImageClassification``. ``qkv_bias=False`` is read as zero q/k/v biases
(exact; they then train); HF's ``layer_norm_eps`` (1e-12 by default) becomes ``eps``.

Config fields ours cannot represent raise a ValueError naming them: ``hidden_act`` other
than ``'gelu'``, non-square ``image_size`` / ``patch_size``, ``head_dim`` other than
``hidden_size / num_attention_heads``, ``intermediate_size`` not a multiple of
``hidden_size``, ``num_labels=0`` (no classifier). Dropout: ``hidden_dropout_prob``.
"""
from __future__ import annotations

import torch

from .family import (HFFamily, KeyReader, State, linear, read_renamed, register, renames,
                     square_size, without_meta)

_LAYER = (linear('ln1', 'layernorm_before') + linear('ln2', 'layernorm_after')
          + linear('attn.query', 'attention.q_proj') + linear('attn.key', 'attention.k_proj')
          + linear('attn.value', 'attention.v_proj') + linear('attn.dense', 'attention.o_proj')
          + linear('mlp.fc1', 'mlp.fc1') + linear('mlp.fc2', 'mlp.fc2'))
_EMBED = ([('patch_embed.cls_token', 'embeddings.cls_token'),
           ('patch_embed.pos_embed', 'embeddings.position_embeddings')]
          + linear('patch_embed.proj', 'embeddings.patch_embeddings.projection'))
_QKV_BIAS = ('attn.query.bias', 'attn.key.bias', 'attn.value.bias')


def _kwargs(c, hf_class: str) -> dict:
    (img, img_w), (patch, patch_w) = square_size(c.image_size), square_size(c.patch_size)
    head_dim = getattr(c, 'head_dim', None) or c.hidden_size // c.num_attention_heads
    for field, value, ours in (('hidden_act', c.hidden_act, 'gelu'), ('image_size', img_w, img),
                               ('patch_size', patch_w, patch),
                               ('head_dim', head_dim * c.num_attention_heads, c.hidden_size)):
        if value != ours:
            raise ValueError(f'our ViT needs {field} = {ours!r}; HF config has '
                             f'{field}={getattr(c, field)!r}')
    if c.intermediate_size % c.hidden_size:
        raise ValueError(f'intermediate_size={c.intermediate_size} must be a multiple of '
                         f'hidden_size={c.hidden_size}')
    if c.num_labels < 1:
        raise ValueError(f'our ViT ends in a classifier; HF config has num_labels={c.num_labels}')
    return dict(img_size=img, patch_size=patch, in_chans=c.num_channels,
                num_classes=c.num_labels, hidden=c.hidden_size, layers=c.num_hidden_layers,
                heads=c.num_attention_heads, mlp_ratio=c.intermediate_size // c.hidden_size,
                dropout=c.hidden_dropout_prob, eps=c.layer_norm_eps)


def _pairs(layers: int, head: bool = True):
    pairs = renames(_EMBED, layers, _LAYER, 'blocks.{i}.', 'layers.{i}.')
    return pairs + linear('norm', 'layernorm') + (linear('head', 'classifier') if head else [])


def _to_ours(hf: KeyReader, kwargs: dict) -> State:
    state = read_renamed(hf, _pairs(kwargs['layers'], head='classifier.weight' in hf),
                         optional=lambda key: key.endswith(_QKV_BIAS))
    for i in range(kwargs['layers']):  # qkv_bias=False: zero biases compute the same
        for name in _QKV_BIAS:
            state.setdefault(f'blocks.{i}.{name}', torch.zeros(kwargs['hidden']))
    return state


def _to_hf(state: State, args: dict):
    out = {(k if k.startswith('classifier.') else 'vit.' + k): state[ours]
           for ours, k in _pairs(args['layers'])}
    return 'ViTForImageClassification', out


def _config(args: dict, vocab, base: dict):
    import transformers
    dropout = args.get('dropout', 0.1)
    cfg = dict(base, image_size=args['img_size'], patch_size=args['patch_size'],
               num_channels=args['in_chans'], hidden_size=args['hidden'],
               num_hidden_layers=args['layers'], num_attention_heads=args['heads'],
               intermediate_size=args.get('mlp_ratio', 4) * args['hidden'], hidden_act='gelu',
               hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
               layer_norm_eps=args.get('eps', 1e-6), qkv_bias=True)
    if len(cfg.get('id2label') or {}) != args['num_classes']:
        cfg.pop('id2label', None)
        cfg.pop('label2id', None)
        cfg['num_labels'] = args['num_classes']
    cfg.pop('head_dim', None)
    return transformers.ViTConfig.from_dict(without_meta(cfg))


FAMILY = register(HFFamily(
    name='ViT', model_type='vit',
    classes={'ViTForImageClassification': 'vit.', 'ViTModel': ''},
    kwargs=_kwargs, to_ours=_to_ours, to_hf=_to_hf, config=_config,
    ignored=(r'pooler\.dense\.(weight|bias)',),  # ViTModel's pooler: no classifier reads it
    seeded={'ViTModel': ('head.',)}))
