"""``load_model(path, model)``: only the ``model.*`` tensors of a checkpoint, into a model
built for the current layout (no engine, optimizer or training state).

It is ``checkpoint.load`` restricted to the model: an engine-like view of the model with
no optimizer and no AMP (:class:`_ModelOnly`) goes through the same ``io.load_tensors`` --
launched: ``sharded_targets`` (a ``DTensor`` of this rank's shard where the
parameter's placement has one, so DCP reads only the saved chunks overlapping it; full
tensors otherwise) then ``load_sharded_tensor_state``; serial with no process group: full
tensors and ``load_tensor_state``. The saved ``optim.*`` keys, side files and RNG states
are not read; the index is read as data (``files.SafeReader``). Collective in a launched
run (DCP's load plan and a final GLOBAL barrier).
"""
from __future__ import annotations

import torch

from .files import resolve
from .io import _barrier, load_tensors


class _NoOptimizer:
    """An optimizer that steps nothing: no parameter groups, no state."""

    param_groups: list = []
    state: dict = {}


class _ModelOnly:
    """What ``state.py`` reads of an engine, for a bare model."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.optimizer, self.amp = model, _NoOptimizer(), None


def load_model(path: str, model: torch.nn.Module) -> None:
    """Load the ``model.<key>`` tensors of the checkpoint at ``path`` into ``model`` (built
    for this rank's layout: serial, any tensor mode, a pipeline stage); collective."""
    load_tensors(resolve(path), _ModelOnly(model))  # or its path.old-<uuid> (files.py)
    _barrier()
