"""Sharded checkpoints on ``torch.distributed.checkpoint`` that load into any layout:
``save(dir, engine, lr_scheduler=None, dataloader=None, extra=None)`` and
``load(dir, engine, lr_scheduler=None, dataloader=None)`` (both collective;
see docs/checkpoint.md)."""
from .io import load, save

__all__ = ['load', 'save']
