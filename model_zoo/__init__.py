"""Parallel GPT, BERT, ViT and Llama built only from colossal_lite.nn facades.

Each model is built for the layout of the launched context (serial when none).
Importing this package registers ``gpt``, ``bert``, ``vit`` and ``llama`` in
``colossal_lite.models`` (``setup.py`` names this package in the entry-point group
``colossal_lite.models``, so ``model=dict(type='gpt', ...)`` finds it), each with its
planner descriptor (``PlannerShape``, ``ModelTraits``: how ``colossal_lite.auto`` costs it)
and its Hugging Face adapter; GPT is the model ``colossal_lite.auto.profile`` times.
"""
from colossal_lite.models import HFAdapter, ModelTraits, PlannerShape, SizeRule, register_model
import colossal_lite.nn as col_nn

from .bert import BERT, BERT_PRESETS, BertPretrainingLoss
from .gpt import GPT, GPT_PRESETS, GPTLMLoss
from .llama import LLAMA_PRESETS, Llama, check_moe
from .vit import VIT_PRESETS, ViT

__all__ = ['BERT', 'BERT_PRESETS', 'BertPretrainingLoss', 'GPT', 'GPT_PRESETS', 'GPTLMLoss',
           'LLAMA_PRESETS', 'Llama', 'VIT_PRESETS', 'ViT']


def _transformer_rules(o):
    """Sizes the tensor split must divide: heads, hidden (also by heads), vocabulary."""
    rules = [SizeRule('model.heads', o['heads'], 'head', what='attention heads'),
             SizeRule('model.hidden', o['hidden'], o['heads'], 'model.heads'),
             SizeRule('model.hidden', o['hidden'], 'hidden', what='hidden size')]
    if 'vocab_size' in o:
        rules.append(SizeRule('model.vocab_size', o['vocab_size'], 'vocab', what='vocabulary'))
    return rules


def _llama_rules(o):
    """Llama's sizes: the transformer's, the kv heads (heads divisible by them; split with
    the heads, or dividing the split where the family replicates them, 1D:
    ``col_nn.KeyValueLinear``) and the SwiGLU width."""
    kv = o.get('kv_heads') or o['heads']
    return _transformer_rules(o) + [
        SizeRule('model.heads', o['heads'], kv, 'model.kv_heads'),
        SizeRule('model.kv_heads', kv, 'head', what='key/value heads', or_divides=True),
        SizeRule('model.intermediate', o.get('intermediate') or 256 * -(-(8 * o['hidden'] // 3)
                                                                       // 256),
                 'hidden', what='SwiGLU width')]


def _llama_check(o, layout):
    """``model.moe`` against ``parallel.expert`` (top_k, experts, capacity_factor)."""
    tensor_1d = getattr(layout, 'tensor', 1) if getattr(layout, 'mode', None) == '1d' else 1
    check_moe(o.get('moe'), o.get('layers'), getattr(layout, 'expert', 1), tensor_1d,
              o.get('intermediate'))


def _vit_rules(o):
    tokens = 1 + (o['img_size'] // o['patch_size']) ** 2
    return _transformer_rules(o) + [
        SizeRule('model.img_size', o['img_size'], o['patch_size'], 'model.patch_size'),
        SizeRule('model.img_size', tokens, 'sequence',
                 what=f"tokens = 1 class token + (img_size / patch_size)^2 = "
                      f"1 + ({o['img_size']} / {o['patch_size']})^2")]


register_model('gpt', GPT, GPT_PRESETS, loss=GPTLMLoss, data='shakespeare',
               rules=_transformer_rules, label='GPT', shape=PlannerShape(),
               traits=ModelTraits(causal=True, causal_mask=True, tied_head=True),
               hf=HFAdapter(GPT.from_hf, GPT.save_hf), profile=True)
register_model('bert', BERT, BERT_PRESETS, loss=BertPretrainingLoss, rules=_transformer_rules,
               label='BERT', shape=PlannerShape(segments='type_vocab_size', pair_head='nsp'),
               traits=ModelTraits(final_norm=False, embedding_norm=True, head_transform=True,
                                  head_bias=True, tied_head=True),
               hf=HFAdapter(BERT.from_hf, BERT.save_hf))
register_model('vit', ViT, VIT_PRESETS, loss=col_nn.CrossEntropyLoss, data='digits',
               rules=_vit_rules, label='ViT',
               shape=PlannerShape(vocab=None, seq=None, positions=None, classes='num_classes',
                                  image='img_size', patch='patch_size', channels='in_chans'),
               traits=ModelTraits(inputs='images', head_per_token=False, head_bias=True),
               hf=HFAdapter(ViT.from_hf, ViT.save_hf))
register_model('llama', Llama, LLAMA_PRESETS, loss=GPTLMLoss, data='shakespeare',
               rules=_llama_rules, label='Llama',
               shape=PlannerShape(kv_heads='kv_heads', ffn='intermediate', mlp_ratio=None,
                                  positions=None, tie_head='tie_embeddings',
                                  qkv_bias='qkv_bias', moe='moe'),
               traits=ModelTraits(causal=True, causal_mask=True, gated_mlp=True, rms_norm=True,
                                  linear_bias=False, rotary=True),
               hf=HFAdapter(Llama.from_hf, Llama.save_hf), check=_llama_check)
