"""ZeRO: sharded optimizer states (stage 1), gradients (stage 2) -- ``low_level.py`` --
and chunk-based ZeRO with device/cpu/static/auto placement (stage 3) -- ``chunk/``.
``docs/zero.md`` has the memory and communication formulas.

Only the config section is imported here (``colossal_lite.config`` reads it); import
``colossal_lite.zero.low_level`` for the optimizer and the gradient handler.
"""
from ..config.zero import ZeroSettings, parse_zero

__all__ = ['ZeroSettings', 'parse_zero']
