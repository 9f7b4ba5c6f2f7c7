"""Which layer family implements each facade, by tensor-parallel mode.

A family module registers its implementations with ``@register(mode, kind)``
when imported (``config/families.py`` names the module of each mode; a family that reuses another family's layer registers it
under its own mode explicitly; there is no silent fallback);
:func:`implementation` imports the family of the launched mode on first use. Serial runs and pure data parallelism use the 1D family
over a one-rank group, which computes exactly what plain torch layers do.
"""
from __future__ import annotations

import importlib
from typing import Callable, Dict, Optional, Tuple

from ..context import current_context
from ..config.families import family as family_of
KINDS = ('linear', 'layernorm', 'embedding', 'vocab_parallel_embedding', 'classifier',
         'vocab_parallel_classifier', 'patch_embedding', 'dropout', 'cross_entropy',
         'attention_core', 'gather_logits', 'first_token', 'qkv', 'kv_linear', 'positions')

_REGISTRY: Dict[Tuple[Optional[str], str], Callable] = {}


def register(mode: Optional[str], kind: str):
    if kind not in KINDS:
        raise ValueError(f"unknown layer kind '{kind}'; kinds: {KINDS}")

    def deco(obj):
        _REGISTRY[(mode, kind)] = obj
        return obj
    return deco


def current_mode() -> Optional[str]:
    """The tensor mode layers are built for now (``use_context`` or the launched one)."""
    return current_context().tensor_mode


def implementation(kind: str, mode: Optional[str] = '__current__') -> Callable:
    """The class or function implementing ``kind`` for ``mode`` (default: the launched mode)."""
    if mode == '__current__':
        mode = current_mode()
    family = family_of(mode).layers
    try:
        importlib.import_module(family)
    except ModuleNotFoundError as err:
        if err.name != family:
            raise
        raise NotImplementedError(f"tensor mode '{mode}' has no layer family yet "
                                  f"(module {family} is missing)") from None
    if (mode, kind) not in _REGISTRY:
        raise NotImplementedError(f"tensor mode '{mode}' has no '{kind}' implementation yet")
    return _REGISTRY[(mode, kind)]
