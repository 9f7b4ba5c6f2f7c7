"""``from_hf`` / ``save_hf`` on our model classes: :class:`HFConvertible`."""
from __future__ import annotations

from typing import Any, Dict

from .family import family_for


def constructor_args(frame_locals: Dict[str, Any]) -> Dict[str, Any]:
    """A model's constructor arguments from ``locals()`` taken at the top of its
    ``__init__`` (kept as ``model.arch_args``: ``save_hf`` writes the HF config from them,
    and rebuilds the serial model on meta to know every key's shape)."""
    return {k: v for k, v in frame_locals.items() if k not in ('self', '__class__')}


class HFConvertible:
    """Mixin of GPT, BERT, ViT and Llama: Hugging Face import and export (``model_zoo.hf``)."""

    @classmethod
    def from_hf(cls, path_or_model, **overrides):
        """Our model for the launched layout (serial, data, any tensor mode, pipeline
        stages) with the weights of a transformers model: a local directory written by
        ``save_pretrained`` or an in-memory model (never the network). ``overrides`` go to
        the constructor (``dropout=0.0``, a larger ``vocab_size``; architecture options must
        equal HF's). The vocabulary is padded with zero rows to a multiple of the layout's
        vocabulary split (``model_zoo.hf.convert``). Family tables: ``model_zoo.hf.gpt2``,
        ``.bert``, ``.vit``, ``.llama``. No collective beyond building the model."""
        from .convert import build
        return build(cls, path_or_model, overrides, family_for(cls))

    def save_hf(self, directory) -> None:
        """Collective, from any layout: global rank 0 writes ``directory`` (``config.json``
        + ``model.safetensors``) that ``transformers`` ``from_pretrained`` loads, with the
        vocabulary cut back to ``self.hf_vocab_size``: the HF size for a model read by
        ``from_hf``, else the model's own ``vocab_size`` unless set by the caller (e.g. 50257
        for a GPT-2 trained with 50304 rows). ``model_zoo.hf.export``."""
        from .export import save_hf
        save_hf(family_for(type(self)), self, directory)
