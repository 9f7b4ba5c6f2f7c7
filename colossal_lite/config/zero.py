"""The ``zero`` config section as a frozen :class:`ZeroSettings`.

``zero=dict(stage=1|2|3, ...)``; keys by stage:

* every stage: ``stage`` (required: 1, 2 or 3);
* stages 1 and 2 (low-level ZeRO, ``zero/low_level.py``): ``bucket_mb`` (positive
  number, default 25: size of one flat gradient bucket), ``overlap`` (bool, default
  True: reduce-scatter buckets from autograd hooks while backward goes on),
  ``offload_optimizer`` (bool, default False: fp32 master slice and Adam moments on
  the CPU);
* stage 3 (chunk ZeRO, ``zero/chunk/``): ``placement`` ('device', 'cpu', 'static',
  'auto'; default 'device'), ``device_memory_limit`` (positive number of bytes, or
  None for the free device memory), ``chunk_size_mb`` (positive number, or None to
  search), ``device_fraction`` (0 < f <= 1, the share of chunks kept on the device;
  only with ``placement='static'``), ``device_margin_ratio`` (0 <= r <= 1, default 0:
  after the warm-up step, fp32 master shards homed on the CPU move to the device while
  they fit in r times the margin the warm-up left under ``device_memory_limit`` --
  Colossal-AI's adaptive HybridAdam; not with placement 'device', which homes them all
  there already), ``keep_gathered`` (int >= 0, default 1: gathered chunks whose tensors
  all hold stay gathered, up to this many beyond the ones in use, released farthest next
  use first; 0 releases each chunk as soon as its tensors hold), ``prefetch`` (int >= 0,
  default 1: all_gathers started ahead of use, for the next chunks the previous pass used
  that are not gathered; 0 gathers each chunk when it is needed).

A key of the other family of stages is an error (it would silently do nothing).
Every bad value raises :class:`~colossal_lite.config.ConfigError` naming the key and
the value, before any process group or collective.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Mapping, Optional

from .checks import (ConfigError, check_keys, count, flag, is_positive_finite, mapping,
                     positive_number)

STAGES = (1, 2, 3)
PLACEMENTS = ('device', 'cpu', 'static', 'auto')
LOW_LEVEL_KEYS = ('bucket_mb', 'overlap', 'offload_optimizer')
CHUNK_KEYS = ('placement', 'device_memory_limit', 'chunk_size_mb', 'device_fraction',
              'device_margin_ratio', 'keep_gathered', 'prefetch')
KEYS = ('stage',) + LOW_LEVEL_KEYS + CHUNK_KEYS


@dataclass(frozen=True)
class ZeroSettings:
    stage: int
    bucket_mb: float = 25.0
    overlap: bool = True
    offload_optimizer: bool = False
    placement: str = 'device'
    device_memory_limit: Optional[float] = None
    chunk_size_mb: Optional[float] = None
    device_fraction: float = 1.0
    device_margin_ratio: float = 0.0
    keep_gathered: int = 1
    prefetch: int = 1

    @property
    def bucket_bytes(self) -> int:
        return max(1, int(self.bucket_mb * 1024 * 1024))


def _stage(section: Mapping) -> int:
    if 'stage' not in section:
        raise ConfigError(f"'zero' needs 'zero.stage' (one of {list(STAGES)}), got keys "
                          f"{sorted(section)}")
    stage = section['stage']
    if isinstance(stage, bool) or not isinstance(stage, numbers.Integral) or stage not in STAGES:
        raise ConfigError(f"'zero.stage' must be one of {list(STAGES)}, got {stage!r}")
    return int(stage)


def _reject_other_family(section: Mapping, stage: int):
    foreign = CHUNK_KEYS if stage < 3 else LOW_LEVEL_KEYS
    for key in foreign:
        if key in section:
            applies = 'stage 3 (chunk ZeRO)' if stage < 3 else 'stages 1 and 2'
            raise ConfigError(f"'zero.{key}' = {section[key]!r} applies only to {applies}, "
                              f"but 'zero.stage' = {stage}")


def parse_zero(section: Optional[Mapping]) -> Optional[ZeroSettings]:
    """The validated ``zero`` section (None when the section is None)."""
    if section is None:
        return None
    section = mapping(section, 'zero', 'dict(stage=2)')
    check_keys(section, KEYS, 'zero.')
    stage = _stage(section)
    _reject_other_family(section, stage)
    if stage < 3:
        return ZeroSettings(stage=stage,
                            bucket_mb=positive_number(section.get('bucket_mb', 25.0), 'zero.bucket_mb'),
                            overlap=flag(section.get('overlap', True), 'zero.overlap'),
                            offload_optimizer=flag(section.get('offload_optimizer', False),
                                                   'zero.offload_optimizer'))
    placement = section.get('placement', 'device')
    if placement not in PLACEMENTS:
        raise ConfigError(f"'zero.placement' must be one of {list(PLACEMENTS)}, got {placement!r}")
    fraction = section.get('device_fraction', 1.0)
    if 'device_fraction' in section and placement != 'static':
        raise ConfigError(f"'zero.device_fraction' = {fraction!r} applies only to "
                          f"placement 'static', got placement {placement!r}")
    if not (is_positive_finite(fraction) and fraction <= 1):
        raise ConfigError(f"'zero.device_fraction' must be in (0, 1], got {fraction!r}")
    ratio = section.get('device_margin_ratio', 0.0)
    if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real) or not 0 <= ratio <= 1:
        raise ConfigError(f"'zero.device_margin_ratio' must be in [0, 1], got {ratio!r}")
    if ratio and placement == 'device':
        raise ConfigError(f"'zero.device_margin_ratio' = {ratio!r} moves CPU master shards to "
                          f"the device, but placement 'device' has none on the CPU")
    counts = {key: count(section.get(key, 1), f'zero.{key}') for key in ('keep_gathered', 'prefetch')}
    return ZeroSettings(stage=3, placement=placement, **counts,
                        device_memory_limit=positive_number(section.get('device_memory_limit'),
                                                            'zero.device_memory_limit', True),
                        chunk_size_mb=positive_number(section.get('chunk_size_mb'),
                                                      'zero.chunk_size_mb', True),
                        device_fraction=float(fraction), device_margin_ratio=float(ratio))
