"""The typed sections of a config, parsed once.

:func:`parse_settings` is the one place a config's keys are checked and turned into
frozen sections; ``load_config`` calls it and keeps the result on the
:class:`~colossal_lite.config.Config` (``cfg.settings``). ``launch``, ``initialize``,
the engine's gradient handler, the CLI and the job builder read these sections and
never re-parse the user's dicts:

=============  ===================================  ========================================
section        type                                 config keys
=============  ===================================  ========================================
``layout``     :class:`~.config.ParallelLayout`     ``parallel`` (data size derived at launch)
``pipeline``   ``pipeline.config.PipelineSettings`` ``parallel.pipeline``, ``num_microbatches``
``engine``     :class:`EngineSettings`              ``num_microbatches`` (alias
                                                    ``gradient_accumulation``),
                                                    ``clip_grad_norm``, ``gradient_handler``
``amp``        :class:`AmpSettings`                 ``fp16``
``zero``       ``zero.config.ZeroSettings`` / None  ``zero``
``run``        :class:`RunSettings`                 ``seed``, ``timeout``, ``backend``
``job``        ``job.JobSpec``                      ``model``, ``data``, ``train``,
                                                    ``optimizer``, ``lr_scheduler``,
                                                    ``checkpoint``, ``log``, ``imports``
=============  ===================================  ========================================

``job`` is parsed on first read (``colossal-lite train`` reads it; a library user who
launches with only ``parallel`` never needs a ``model`` section). Every bad value is a
:class:`~colossal_lite.config.ConfigError` naming the key, the constraint and the value.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Dict, Mapping, Optional

from .config import (_TOP_LEVEL_KEYS, FP16_MODES, Config, ConfigError, ParallelLayout,
                     _check_keys, _positive_finite, _positive_int, _suggest, parse_parallel)

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


@dataclass(frozen=True)
class Settings:
    """Every typed section of one config (see the module doc)."""

    layout: ParallelLayout
    pipeline: Any            # colossal_lite.pipeline.config.PipelineSettings
    engine: EngineSettings
    amp: AmpSettings
    zero: Any                # colossal_lite.zero.config.ZeroSettings, or None
    run: RunSettings
    source: Mapping = field(repr=False, compare=False)

    @cached_property
    def job(self):
        """The job sections as a ``job.JobSpec``, parsed (and the ``imports`` imported) on
        first read."""
        from .job import parse_job
        return parse_job(self.source)


def parse_settings(config: Mapping) -> Settings:
    """The typed sections of ``config``; cached on a :class:`Config` until it changes."""
    if isinstance(config, Config) and config.__dict__.get('_settings') is not None:
        return config.__dict__['_settings']
    settings = _parse(config)
    if isinstance(config, Config):
        config.__dict__['_settings'] = settings
    return settings


def _parse(config: Mapping) -> Settings:
    from .pipeline.config import parse_pipeline
    from .zero.config import parse_zero
    _check_top_level(config)
    pipeline = parse_pipeline(config)
    return Settings(layout=parse_parallel(config.get('parallel')), pipeline=pipeline,
                    engine=_parse_engine(config, pipeline.num_microbatches),
                    amp=_parse_amp(config.get('fp16')), zero=parse_zero(config.get('zero')),
                    run=_parse_run(config), source=config)


def _check_top_level(config: Mapping):
    if not isinstance(config, Mapping):
        raise ConfigError(f"a config must be a dict or a path to a .py file, "
                          f"got {type(config).__name__}")
    for key in config:
        if not isinstance(key, str):
            raise ConfigError(f"config keys must be strings, got {key!r}")
        if key.isupper() or key.startswith('_'):
            continue  # the user's own constants
        if key not in _TOP_LEVEL_KEYS:
            raise ConfigError(f"unknown config key '{key}'{_suggest(key, _TOP_LEVEL_KEYS)}")
    parallel = config.get('parallel')
    if isinstance(parallel, Mapping) and 'sequence' in parallel:
        raise ConfigError("sequence parallelism is a tensor mode: write "
                          "parallel=dict(tensor=dict(mode='sequence', size=P)); it cannot be "
                          "combined with another tensor-parallel mode")


def _parse_amp(fp16: Optional[Mapping]) -> AmpSettings:
    if fp16 is None:
        return AmpSettings()
    if not isinstance(fp16, Mapping):
        raise ConfigError(f"'fp16' must be a dict like dict(mode='torch'), got {fp16!r}")
    _check_keys(fp16, _TOP_LEVEL_KEYS['fp16'], 'fp16.')
    if fp16.get('mode') not in FP16_MODES:
        raise ConfigError(f"'fp16.mode' must be one of {list(FP16_MODES)}, got {fp16.get('mode')!r}")
    if fp16.get('dtype', 'float16') not in ('float16', 'bfloat16'):
        raise ConfigError(f"'fp16.dtype' must be 'float16' or 'bfloat16', got {fp16.get('dtype')!r}")
    for key in ('initial_scale', 'growth_factor', 'min_scale', 'max_scale'):
        if key in fp16 and not _positive_finite(fp16[key]):
            raise ConfigError(f"'fp16.{key}' must be a positive finite number, got {fp16[key]!r}")
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
            _positive_int(fp16[key], f'fp16.{key}')
    scaler = {k: v for k, v in fp16.items() if k not in ('mode', 'dtype')}
    return AmpSettings(fp16['mode'], fp16.get('dtype', 'float16'), scaler)


def _parse_engine(config: Mapping, num_microbatches: int) -> EngineSettings:
    clip = config.get('clip_grad_norm')
    if clip is not None and not _positive_finite(clip):
        raise ConfigError(f"'clip_grad_norm' must be a positive finite number, got {clip!r}")
    handler = config.get('gradient_handler')
    handler = {} if handler is None else handler
    if not isinstance(handler, Mapping):
        raise ConfigError(f"'gradient_handler' must be a dict like dict(bucket_mb=25, "
                          f"overlap=True), got {handler!r}")
    _check_keys(handler, _TOP_LEVEL_KEYS['gradient_handler'], 'gradient_handler.')
    bucket_mb = handler.get('bucket_mb', DEFAULT_BUCKET_MB)
    if not _positive_finite(bucket_mb):
        raise ConfigError(f"'gradient_handler.bucket_mb' must be a positive number, "
                          f"got {bucket_mb!r}")
    overlap = handler.get('overlap', True)
    if not isinstance(overlap, bool):
        raise ConfigError(f"'gradient_handler.overlap' must be True or False, got {overlap!r}")
    return EngineSettings(num_microbatches=num_microbatches, clip_grad_norm=float(clip or 0.0),
                          bucket_bytes=max(1, int(bucket_mb * 1024 * 1024)), overlap=overlap)


def _parse_run(config: Mapping) -> RunSettings:
    seed = config.get('seed')
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)):
        raise ConfigError(f"'seed' must be an integer, got {seed!r}")
    timeout = config.get('timeout', DEFAULT_TIMEOUT_S)
    if not _positive_finite(timeout):
        raise ConfigError(f"'timeout' must be a positive finite number of seconds, "
                          f"got {timeout!r}")
    backend = config.get('backend')
    if backend not in ('gloo', 'nccl', None):
        raise ConfigError(f"'backend' must be 'gloo' or 'nccl', got {backend!r}")
    return RunSettings(None if seed is None else int(seed), float(timeout), backend)
