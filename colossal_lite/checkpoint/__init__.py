"""Sharded checkpoints on ``torch.distributed.checkpoint`` that load into any layout:
``save(dir, engine, lr_scheduler=None, dataloader=None, extra=None)`` and
``load(dir, engine, lr_scheduler=None, dataloader=None)`` (both collective; ``save(...,
async_save=True)`` returns an :class:`AsyncSave` whose ``wait()`` completes it;
see docs/checkpoint.md); ``load_model(dir, model)`` loads only the model's tensors
(docs/generation.md)."""
from .io import AsyncSave, load, save, wait
from .model_only import load_model

__all__ = ['AsyncSave', 'load', 'load_model', 'save', 'wait']
