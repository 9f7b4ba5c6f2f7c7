"""Hugging Face transformers import and export for GPT, BERT, ViT and Llama (docs/hf.md).

``GPT.from_hf(path_or_model, **overrides)`` / ``BERT.from_hf`` / ``ViT.from_hf`` /
``Llama.from_hf`` (Llama, Mistral, Qwen2) build our
model for the launched layout from a local ``save_pretrained`` directory or an in-memory
transformers model; ``model.save_hf(dir)`` (collective) writes a directory transformers
``from_pretrained`` loads. Modules: ``mixin`` (the two methods), ``convert`` (import,
vocabulary padding rule), ``export`` (gathering a pipelined model, writing), ``family``
(what a family provides, shared renaming helpers) and one table per family (``gpt2``,
``bert``, ``vit``, ``llama``, each with its key-mapping table and the HF config fields it
rejects).
"""
from . import bert, gpt2, llama, vit  # noqa: F401  (each registers its family)
from .gpt2 import gpt_from_hf, gpt_kwargs_from_hf, hf_gpt2_to_state_dict
from .mixin import HFConvertible, constructor_args

__all__ = ['HFConvertible', 'constructor_args', 'gpt_from_hf', 'gpt_kwargs_from_hf',
           'hf_gpt2_to_state_dict']
