"""Configuration: a user's dict or ``.py`` file, parsed once into typed sections.

The user writes a plain dict (or a ``.py`` file whose top-level names form the
dict). :func:`load_config` turns either into a :class:`Config` (a dict with
attribute access) after :func:`parse_settings` has checked every key it knows
and built the typed, frozen sections of ``settings.Settings`` (``cfg.settings``;
the one parser is ``colossal_lite/settings.py``):

* ``layout``   -- :class:`ParallelLayout` (``parallel``, defined here);
* ``amp``      -- ``AmpSettings`` (``fp16``);
* ``engine``   -- ``EngineSettings`` (``num_microbatches`` / ``gradient_accumulation``,
  ``clip_grad_norm``, ``gradient_handler``);
* ``run``      -- ``RunSettings`` (``seed``, ``timeout``, ``backend``);
* ``pipeline`` -- ``pipeline.config.PipelineSettings``; ``zero`` -- ``zero.config.ZeroSettings``;
* ``job``      -- ``job.JobSpec`` (``model``, ``data``, ``train``, ...), parsed on first read.

Upper-case top-level names (``BATCH_SIZE``, ``NUM_EPOCHS``) are the user's own
constants and pass through untouched; an unknown lower-case key is an error that
suggests the closest known key. Every error is a :class:`ConfigError` naming the
key, the constraint and the value.
"""
from __future__ import annotations

import difflib
import math
import numbers
import os
import runpy
import sys
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
    'gradient_handler': {'bucket_mb', 'overlap'},
    'imports': None,
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
    """A dict whose keys can also be read as attributes (``cfg.parallel.tensor.mode``).

    ``cfg.settings`` is the typed :class:`Settings` of the whole config, parsed on first
    read and kept until a key of the config (or of one of its sections) is set or deleted.
    """

    def __init__(self, data: Optional[Mapping] = None):
        super().__init__()
        for key, value in (data or {}).items():
            self[key] = value

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"config has no key '{name}'") from None

    def __setattr__(self, name, value):
        self[name] = value

    def __setitem__(self, key, value):
        value = _wrap(value)
        if isinstance(value, Config):
            value.__dict__['_parent'] = self
        super().__setitem__(key, value)
        self._changed()

    def __delitem__(self, key):
        super().__delitem__(key)
        self._changed()

    def update(self, *args, **kwargs):
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def pop(self, *args):
        value = super().pop(*args)
        self._changed()
        return value

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = default
        return self[key]

    def clear(self):
        super().clear()
        self._changed()

    def _changed(self):
        node = self
        while node is not None:
            node.__dict__.pop('_settings', None)
            node = node.__dict__.get('_parent')

    @property
    def settings(self) -> 'Settings':
        """The typed sections of this (top-level) config: :func:`parse_settings`."""
        if 'settings' in self:  # a section's own key called 'settings'
            return self['settings']
        return parse_settings(self)


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
    pipeline = parallel.get('pipeline', 1)
    if isinstance(pipeline, Mapping):  # dict(size=P, chunks=..., ...): the rest is parse_pipeline's
        pipeline = _positive_int(pipeline.get('size', 1), 'parallel.pipeline.size')
    else:
        pipeline = _positive_int(pipeline, 'parallel.pipeline')
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
    """Check every known key (:func:`~colossal_lite.settings.parse_settings`); returns the
    config as a :class:`Config` holding its typed sections."""
    from .settings import parse_settings
    if not isinstance(config, Mapping):
        raise ConfigError(f"a config must be a dict or a path to a .py file, got {type(config).__name__}")
    cfg = config if isinstance(config, Config) else Config(config)
    parse_settings(cfg)
    return cfg


def parse_settings(config: Mapping):
    """The typed sections of ``config`` (see ``colossal_lite/settings.py``)."""
    from .settings import parse_settings as parse
    return parse(config)


def _read_config_file(path: str, chain: tuple = ()) -> dict:
    """The top-level names of a config file, on top of those of its ``_base_`` file."""
    if not path.endswith('.py'):
        raise ConfigError(f"a config file must be a .py file, got '{path}'")
    if not os.path.isfile(path):
        if chain:  # a copied config whose base stayed behind
            raise ConfigError(f"config file not found: '{path}', the _base_ of '{chain[-1]}' "
                              f"(_base_ paths are relative to the file that names them: copy "
                              f"the base too, or give its full path)")
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
    """A dict, a :class:`Config` or a path to a ``.py`` file -> a validated :class:`Config`
    whose typed sections are ``cfg.settings`` (parsed here, once).

    A file may name another with ``_base_ = 'file.py'`` (relative to itself): the base's
    top-level names come first and the file's own names replace them key by key. The
    modules a file names in ``imports`` are also looked up in the file's directory.
    """
    if isinstance(config, Config) and config.__dict__.get('_settings') is not None:
        return config  # already parsed, unchanged since
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        config = _read_config_file(path)
        folder = os.path.dirname(os.path.abspath(path))
        if config.get('imports') and folder not in sys.path:
            sys.path.append(folder)
    return validate_config(config)
