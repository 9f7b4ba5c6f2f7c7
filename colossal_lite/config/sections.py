"""The small run-wide sections: ``fp16`` (:class:`AmpSettings`), the engine's step policy
(:class:`EngineSettings`: ``num_microbatches``, ``clip_grad_norm``, ``gradient_handler``)
and the run's ``seed`` / ``timeout`` / ``backend`` (:class:`RunSettings`)."""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional

from .checks import (ConfigError, check_keys, flag, is_positive_finite, mapping, positive_int,
                     positive_number)

FP16_MODES = ('torch', 'naive', 'apex')
FP16_KEYS = ('mode', 'dtype', 'initial_scale', 'growth_factor', 'backoff_factor',
             'growth_interval', 'hysteresis', 'min_scale', 'max_scale', 'verbose')
HANDLER_KEYS = ('bucket_mb', 'overlap')
DEFAULT_TIMEOUT_S = 1800.0
DEFAULT_BUCKET_MB = 25


@dataclass(frozen=True)
class AmpSettings:
    """``fp16``: ``mode`` None (full precision), 'torch', 'naive' or 'apex'; ``dtype``
    'float16' or 'bfloat16'; ``scaler``: the loss-scaler options given."""

    mode: Optional[str] = None
    dtype: str = 'float16'
    scaler: Dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> Optional[dict]:
        """The ``fp16`` dict ``amp.build_amp`` takes (None for full precision)."""
        if self.mode is None:
            return None
        return dict(self.scaler, mode=self.mode, dtype=self.dtype)


@dataclass(frozen=True)
class EngineSettings:
    """Per-step policy: M micro-batches per optimizer step, gradient clipping (0 = off),
    and the data-parallel gradient all-reduce's bucket size and overlap."""

    num_microbatches: int = 1
    clip_grad_norm: float = 0.0
    bucket_bytes: int = DEFAULT_BUCKET_MB * 1024 * 1024
    overlap: bool = True

    def handler_options(self) -> dict:
        """Keyword arguments of ``engine.GradientReducer``."""
        return dict(bucket_bytes=self.bucket_bytes, overlap=self.overlap)


@dataclass(frozen=True)
class RunSettings:
    """``seed`` (None: launch's argument), ``timeout`` of every collective in seconds,
    ``backend`` (None: nccl with CUDA, else gloo)."""

    seed: Optional[int] = None
    timeout: float = DEFAULT_TIMEOUT_S
    backend: Optional[str] = None


def parse_amp(fp16: Optional[Mapping]) -> AmpSettings:
    if fp16 is None:
        return AmpSettings()
    fp16 = mapping(fp16, 'fp16', "dict(mode='torch')")
    check_keys(fp16, FP16_KEYS, 'fp16.')
    if fp16.get('mode') not in FP16_MODES:
        raise ConfigError(f"'fp16.mode' must be one of {list(FP16_MODES)}, got {fp16.get('mode')!r}")
    if fp16.get('dtype', 'float16') not in ('float16', 'bfloat16'):
        raise ConfigError(f"'fp16.dtype' must be 'float16' or 'bfloat16', got {fp16.get('dtype')!r}")
    for key in ('initial_scale', 'growth_factor', 'min_scale', 'max_scale'):
        if key in fp16:
            positive_number(fp16[key], f'fp16.{key}')
    if 'growth_factor' in fp16 and not fp16['growth_factor'] > 1:
        raise ConfigError(f"'fp16.growth_factor' must be > 1, got {fp16['growth_factor']!r}")
    low, high, start = fp16.get('min_scale'), fp16.get('max_scale'), fp16.get('initial_scale')
    if low is not None and high is not None and low > high:
        raise ConfigError(f"'fp16.min_scale' = {low} must not exceed 'fp16.max_scale' = {high}")
    if start is not None and ((low is not None and start < low)
                              or (high is not None and start > high)):
        raise ConfigError(f"'fp16.initial_scale' = {start} must lie in "
                          f"[min_scale, max_scale] = [{low}, {high}]")
    backoff = fp16.get('backoff_factor')
    if 'backoff_factor' in fp16 and not (isinstance(backoff, numbers.Real) and 0 < backoff < 1):
        raise ConfigError(f"'fp16.backoff_factor' must be in (0, 1), got {backoff!r}")
    for key in ('growth_interval', 'hysteresis'):
        if key in fp16:
            positive_int(fp16[key], f'fp16.{key}')
    scaler = {k: v for k, v in fp16.items() if k not in ('mode', 'dtype')}
    return AmpSettings(fp16['mode'], fp16.get('dtype', 'float16'), scaler)


def parse_engine(config: Mapping, num_microbatches: int) -> EngineSettings:
    """The engine's section; ``num_microbatches`` is the pipeline section's M (the one place
    its alias ``gradient_accumulation`` is resolved: ``pipeline.parse_pipeline``)."""
    clip = config.get('clip_grad_norm')
    if clip is not None:
        positive_number(clip, 'clip_grad_norm')
    handler = mapping(config.get('gradient_handler'), 'gradient_handler',
                      'dict(bucket_mb=25, overlap=True)')
    check_keys(handler, HANDLER_KEYS, 'gradient_handler.')
    bucket_mb = positive_number(handler.get('bucket_mb', DEFAULT_BUCKET_MB),
                                'gradient_handler.bucket_mb')
    overlap = flag(handler.get('overlap', True), 'gradient_handler.overlap')
    return EngineSettings(num_microbatches=num_microbatches, clip_grad_norm=float(clip or 0.0),
                          bucket_bytes=max(1, int(bucket_mb * 1024 * 1024)), overlap=overlap)


def parse_run(config: Mapping) -> RunSettings:
    seed = config.get('seed')
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)):
        raise ConfigError(f"'seed' must be an integer, got {seed!r}")
    timeout = config.get('timeout', DEFAULT_TIMEOUT_S)
    if not is_positive_finite(timeout):
        raise ConfigError(f"'timeout' must be a positive finite number of seconds, got {timeout!r}")
    backend = config.get('backend')
    if backend not in ('gloo', 'nccl', None):
        raise ConfigError(f"'backend' must be 'gloo' or 'nccl', got {backend!r}")
    return RunSettings(None if seed is None else int(seed), float(timeout), backend)

