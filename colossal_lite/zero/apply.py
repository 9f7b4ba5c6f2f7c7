"""``apply_zero``: the ZeRO stage a config's ``zero`` section asks for, built on a model and
its optimizer (what ``initialize`` calls). Stages 1 and 2: ``low_level.py``; stage 3: the
chunk engine (``chunk/engine.py``). What ZeRO does not run yet was rejected when the config
was parsed (``config/settings.py``)."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..amp import FullPrecision
from ..config import Settings
from .chunk.engine import build_chunk_zero
from .low_level import build_low_level_zero


def apply_zero(settings: Settings, model: torch.nn.Module, optimizer: torch.optim.Optimizer
               ) -> Optional[Tuple[FullPrecision, object]]:
    """``(amp, gradient_handler)`` when the settings have a ``zero`` section, else None."""
    zero = settings.zero
    if zero is None:
        return None
    build = build_chunk_zero if zero.stage == 3 else build_low_level_zero
    return build(zero, settings.amp, model, optimizer)
