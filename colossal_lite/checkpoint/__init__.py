"""Sharded checkpoints on ``torch.distributed.checkpoint`` that load into any layout:
``save(dir, engine, lr_scheduler=None, dataloader=None, extra=None)`` and
``load(dir, engine, lr_scheduler=None, dataloader=None)`` (both collective; ``save(...,
async_save=True)`` returns an :class:`AsyncSave` whose ``wait()`` completes it;
see docs/checkpoint.md); ``load_model(dir, model)`` loads only the model's tensors
(docs/generation.md). A checkpoint is data: loading one never runs code from it
(:class:`UnsafeCheckpointError` for a file that would need to; ``upgrade(dir)`` rewrites a
trusted checkpoint of an earlier colossal_lite; ``files.py``)."""
from .files import UnsafeCheckpointError, upgrade
from .io import AsyncSave, load, save, wait
from .model_only import load_model

__all__ = ['AsyncSave', 'UnsafeCheckpointError', 'load', 'load_model', 'save', 'upgrade', 'wait']
