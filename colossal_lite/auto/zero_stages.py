"""The ZeRO stages the runtime runs with a layout (what the search and the offload model
both enumerate; below them, so neither imports the other for it)."""
from __future__ import annotations

from typing import Tuple


def runtime_zero_stages(layout) -> Tuple[int, ...]:
    """The ZeRO stages the runtime runs with ``layout`` (0: none): none with sequence
    parallelism (the ring and Ulysses); 3 (chunk ZeRO) only without pipeline, for no tensor
    mode or 1D."""
    if layout.mode in ('sequence', 'ulysses'):
        return (0,)
    return (0, 1, 2, 3) if layout.pipeline == 1 and layout.mode in (None, '1d') else (0, 1, 2)
