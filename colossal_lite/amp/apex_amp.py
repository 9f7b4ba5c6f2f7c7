"""NVIDIA apex amp (``fp16=dict(mode='apex')``), used only when ``apex.amp`` imports.

apex is detected at run time; the registry package named ``apex`` is unrelated and
never a dependency. Backward runs under ``amp.scale_loss``; apex skips overflowing
steps itself.
"""
from __future__ import annotations

import importlib

from ..config import ConfigError
from .base import FullPrecision


def apex_amp_module():
    """``apex.amp`` when NVIDIA apex is installed, else None."""
    try:
        module = importlib.import_module('apex.amp')
    except Exception:
        return None
    return module if hasattr(module, 'initialize') and hasattr(module, 'scale_loss') else None


class ApexAmp(FullPrecision):
    name = 'apex'

    def __init__(self, model, optimizer, opt_level: str = 'O1'):
        amp = apex_amp_module()
        if amp is None:
            raise ConfigError("fp16 mode 'apex' needs NVIDIA apex (module apex.amp), which is not "
                              "importable here; install apex from github.com/NVIDIA/apex or use "
                              "fp16=dict(mode='torch') or fp16=dict(mode='naive')")
        model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
        super().__init__(model, optimizer)
        self.amp = amp

    def backward(self, loss):
        with self.amp.scale_loss(loss, self.optimizer) as scaled:
            scaled.backward()
