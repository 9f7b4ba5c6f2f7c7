"""Parallel GPT, BERT and ViT built only from colossal_lite.nn facades.

Each model is built for the layout of the launched context (serial when none).
"""
from .bert import BERT, BERT_PRESETS, BertPretrainingLoss
from .gpt import GPT, GPT_PRESETS, GPTLMLoss
from .vit import VIT_PRESETS, ViT

__all__ = ['BERT', 'BERT_PRESETS', 'BertPretrainingLoss', 'GPT', 'GPT_PRESETS', 'GPTLMLoss',
           'VIT_PRESETS', 'ViT']
