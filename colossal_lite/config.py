"""Configuration: a user's dict or ``.py`` file, checked before any process group exists.

The user writes a plain dict (or a ``.py`` file whose top-level names form the
dict). :func:`load_config` turns either into a :class:`Config` (a dict with
attribute access) after :func:`validate_config` has checked every key it
knows. Upper-case top-level names (``BATCH_SIZE``, ``NUM_EPOCHS``) are the
user's own constants and pass through untouched; an unknown lower-case key is
an error that suggests the closest known key.

:class:`ParallelLayout` is the typed, validated description of the parallel
layout from which every process group is derived.
"""
from __future__ import annotations

import difflib
import math
import numbers
import os
import runpy
from dataclasses import dataclass
from typing import Any, Mapping, Optional


class ConfigError(ValueError):
    """A configuration value breaks a constraint; the message names key, constraint and value."""


FP16_MODES = ('torch', 'naive', 'apex')

# top-level keys and, for dict-valued sections, their allowed sub-keys (None = free-form)
_TOP_LEVEL_KEYS = {
    'parallel': {'data', 'pipeline', 'tensor'},
    'fp16': {'mode', 'dtype', 'initial_scale', 'growth_factor', 'backoff_factor',
             'growth_interval', 'hysteresis', 'min_scale', 'max_scale', 'verbose'},
    'zero': None,
    'gradient_accumulation': None,
    'clip_grad_norm': None,
    'num_microbatches': None,
    'gradient_handler': None,
    'seed': None,
    'timeout': None,
    'backend': None,
    'model': None,
    'data': None,
    'train': None,
    'optimizer': None,
    'lr_scheduler': None,
    'checkpoint': None,
    'log': None,
}
_TENSOR_KEYS = {'size', 'mode', 'depth'}


class Config(dict):
    """A dict whose keys can also be read as attributes (``cfg.parallel.tensor.mode``)."""

    def __init__(self, data: Optional[Mapping] = None):
        super().__init__()
        for key, value in (data or {}).items():
            self[key] = _wrap(value)

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"config has no key '{name}'") from None

    def __setattr__(self, name, value):
        self[name] = _wrap(value)


def _wrap(value):
    if isinstance(value, Mapping) and not isinstance(value, Config):
        return Config(value)
    return value


def _suggest(key: str, known) -> str:
    match = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    return f"; did you mean '{match[0]}'?" if match else f"; known keys: {sorted(known)}"


def _check_keys(section: Mapping, known, where: str):
    for key in section:
        if key not in known:
            raise ConfigError(f"unknown config key '{where}{key}'{_suggest(key, known)}")


def _positive_int(value, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ConfigError(f"'{key}' must be a positive integer, got {value!r}")
    return int(value)


def _positive_finite(value) -> bool:
    return (not isinstance(value, bool) and isinstance(value, numbers.Real)
            and math.isfinite(value) and value > 0)


def _integer_root(n: int, power: int) -> Optional[int]:
    from .families import integer_root
    return integer_root(n, power)


def _tensor_modes() -> tuple:
    from .families import TENSOR_MODES  # imported late: families imports the context package
    return TENSOR_MODES


@dataclass(frozen=True)
class ParallelLayout:
    """Validated degrees of every parallel axis; ``world = data * pipeline * tensor``.

    ``mode`` is the tensor-parallel family (None when tensor == 1 and no mode
    was asked for). ``depth`` is the 2.5D depth d (1 otherwise). ``data`` may be
    None until the world size is known (see :meth:`with_world_size`).
    """

    pipeline: int = 1
    tensor: int = 1
    mode: Optional[str] = None
    depth: int = 1
    data: Optional[int] = None

    @property
    def tensor_grid(self) -> int:
        """q: the side of the 2D/2.5D grid or of the 3D cube (1 for other modes)."""
        if self.mode == '2d':
            return _integer_root(self.tensor, 2)
        if self.mode == '2.5d':
            return _integer_root(self.tensor // self.depth, 2)
        if self.mode == '3d':
            return _integer_root(self.tensor, 3)
        return 1

    @property
    def world_size(self) -> Optional[int]:
        return None if self.data is None else self.data * self.pipeline * self.tensor

    def with_world_size(self, world_size: int) -> 'ParallelLayout':
        """Derive the data-parallel degree; error if world is not divisible by pipeline*tensor."""
        world_size = _positive_int(world_size, 'world_size')
        model_parallel = self.pipeline * self.tensor
        if world_size % model_parallel:
            raise ConfigError(
                f"world size must be divisible by pipeline*tensor = {self.pipeline}*{self.tensor} "
                f"= {model_parallel}, got world size {world_size}")
        data = world_size // model_parallel
        if self.data is not None and self.data != data:
            raise ConfigError(
                f"'parallel.data' = {self.data} disagrees with world size {world_size} / "
                f"(pipeline*tensor = {model_parallel}) = {data}")
        return ParallelLayout(self.pipeline, self.tensor, self.mode, self.depth, data)


def parse_parallel(parallel: Optional[Mapping]) -> ParallelLayout:
    """Build a :class:`ParallelLayout` from the ``parallel`` section, with clear errors."""
    parallel = parallel or {}
    if not isinstance(parallel, Mapping):
        raise ConfigError(f"'parallel' must be a dict, got {parallel!r}")
    _check_keys(parallel, _TOP_LEVEL_KEYS['parallel'], 'parallel.')
    pipeline = _positive_int(parallel.get('pipeline', 1), 'parallel.pipeline')
    data = parallel.get('data')
    if data is not None:
        data = _positive_int(data, 'parallel.data')

    tensor = parallel.get('tensor', None)
    if tensor is None:
        tensor = {}
    if not isinstance(tensor, Mapping):
        raise ConfigError(f"'parallel.tensor' must be a dict like dict(size=4, mode='1d'), "
                          f"got {tensor!r}")
    _check_keys(tensor, _TENSOR_KEYS, 'parallel.tensor.')
    size = _positive_int(tensor.get('size', 1), 'parallel.tensor.size')
    mode = tensor.get('mode', None)
    if isinstance(mode, str):
        mode = mode.lower()
    if mode not in _tensor_modes():
        raise ConfigError(f"'parallel.tensor.mode' must be one of {list(_tensor_modes())}, "
                          f"got {tensor.get('mode')!r}")
    if mode is None and size > 1:
        raise ConfigError(f"'parallel.tensor.size' = {size} needs a 'parallel.tensor.mode' "
                          f"(one of '1d', '2d', '2.5d', '3d', 'sequence')")
    depth = tensor.get('depth', None)
    if depth is not None and mode != '2.5d':
        raise ConfigError(f"'parallel.tensor.depth' applies only to mode '2.5d', "
                          f"got depth={depth!r} with mode {mode!r}")
    if mode == '2d' and _integer_root(size, 2) is None:
        raise ConfigError(f"2D tensor parallelism needs 'parallel.tensor.size' = q*q, got {size}")
    if mode == '3d' and _integer_root(size, 3) is None:
        raise ConfigError(f"3D tensor parallelism needs 'parallel.tensor.size' = d*d*d, got {size}")
    if mode == '2.5d':
        if depth is None:
            raise ConfigError("2.5D tensor parallelism needs 'parallel.tensor.depth' (d in size = d*q*q)")
        depth = _positive_int(depth, 'parallel.tensor.depth')
        if size % depth or _integer_root(size // depth, 2) is None:
            raise ConfigError(f"2.5D tensor parallelism needs 'parallel.tensor.size' = depth*q*q; "
                              f"got size={size}, depth={depth}")
    return ParallelLayout(pipeline=pipeline, tensor=size, mode=mode, depth=depth or 1, data=data)


def validate_config(config: Mapping) -> Config:
    """Check every known key; returns the config as a :class:`Config`."""
    if not isinstance(config, Mapping):
        raise ConfigError(f"a config must be a dict or a path to a .py file, got {type(config).__name__}")
    for key in config:
        if not isinstance(key, str):
            raise ConfigError(f"config keys must be strings, got {key!r}")
        if key.isupper() or key.startswith('_'):
            continue  # the user's own constants
        if key not in _TOP_LEVEL_KEYS:
            raise ConfigError(f"unknown config key '{key}'{_suggest(key, _TOP_LEVEL_KEYS)}")
    if 'sequence' in (config.get('parallel') or {}):
        raise ConfigError("sequence parallelism is a tensor mode: write "
                          "parallel=dict(tensor=dict(mode='sequence', size=P)); it cannot be "
                          "combined with another tensor-parallel mode")
    parse_parallel(config.get('parallel'))

    fp16 = config.get('fp16')
    if fp16 is not None:
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
        low, high = fp16.get('min_scale'), fp16.get('max_scale')
        start = fp16.get('initial_scale')
        if low is not None and high is not None and low > high:
            raise ConfigError(f"'fp16.min_scale' = {low} must not exceed 'fp16.max_scale' = {high}")
        if start is not None and ((low is not None and start < low)
                                  or (high is not None and start > high)):
            raise ConfigError(f"'fp16.initial_scale' = {start} must lie in "
                              f"[min_scale, max_scale] = [{low}, {high}]")
        if 'backoff_factor' in fp16 and not (isinstance(fp16['backoff_factor'], numbers.Real)
                                             and 0 < fp16['backoff_factor'] < 1):
            raise ConfigError(f"'fp16.backoff_factor' must be in (0, 1), got {fp16['backoff_factor']!r}")
        for key in ('growth_interval', 'hysteresis'):
            if key in fp16:
                _positive_int(fp16[key], f'fp16.{key}')

    for key in ('gradient_accumulation', 'num_microbatches'):
        if key in config:
            _positive_int(config[key], key)
    if 'clip_grad_norm' in config and not _positive_finite(config['clip_grad_norm']):
        raise ConfigError(f"'clip_grad_norm' must be a positive finite number, "
                          f"got {config['clip_grad_norm']!r}")
    if 'seed' in config and (isinstance(config['seed'], bool)
                             or not isinstance(config['seed'], numbers.Integral)):
        raise ConfigError(f"'seed' must be an integer, got {config['seed']!r}")
    if 'timeout' in config and not _positive_finite(config['timeout']):
        raise ConfigError(f"'timeout' must be a positive finite number of seconds, "
                          f"got {config['timeout']!r}")
    if 'backend' in config and config['backend'] not in ('gloo', 'nccl', None):
        raise ConfigError(f"'backend' must be 'gloo' or 'nccl', got {config['backend']!r}")
    return Config(config)


def _read_config_file(path: str, chain: tuple = ()) -> dict:
    """The top-level names of a config file, on top of those of its ``_base_`` file."""
    if not path.endswith('.py'):
        raise ConfigError(f"a config file must be a .py file, got '{path}'")
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: '{path}'")
    if os.path.abspath(path) in chain:
        raise ConfigError(f"config files include each other in a loop: {' -> '.join(chain + (path,))}")
    try:
        names = runpy.run_path(path)
    except Exception as err:  # a config is user code: report its failure as a config error
        raise ConfigError(f"config file '{path}' could not be run: "
                          f"{type(err).__name__}: {err}") from err
    own = {k: v for k, v in names.items()
           if not k.startswith('_') and not callable(v) and not hasattr(v, '__file__')}
    base = names.get('_base_')
    if base is None:
        return own
    merged = _read_config_file(os.path.join(os.path.dirname(path), base),
                               chain + (os.path.abspath(path),))
    merged.update(own)
    return merged


def load_config(config: Any) -> Config:
    """A dict, a :class:`Config` or a path to a ``.py`` file -> a validated :class:`Config`.

    A file may name another with ``_base_ = 'file.py'`` (relative to itself): the base's
    top-level names come first and the file's own names replace them key by key.
    """
    if isinstance(config, (str, os.PathLike)):
        config = _read_config_file(os.fspath(config))
    return validate_config(config)
