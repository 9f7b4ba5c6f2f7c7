"""Loading a config: a user's dict or ``.py`` file -> a :class:`Config` whose typed sections
are ``cfg.settings`` (:class:`~.settings.Settings`, parsed here once and cached until a key
changes).

:func:`snapshot` is the one accessor of the user's dict: it copies it into plain data, and
the settings are parsed from that copy, so after :func:`load_config` nothing reads the
user's object again. A config file may name another with ``_base_ = 'file.py'``; its
``imports`` are looked up in the file's directory too.
"""
from __future__ import annotations

import os
import runpy
import sys
from typing import Any, Mapping, Optional

from .checks import ConfigError
from .settings import Settings, parse_settings_from


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
    def settings(self) -> Settings:
        """The typed sections of this (top-level) config: :func:`parse_settings`."""
        if 'settings' in self:  # a section's own key called 'settings'
            return self['settings']
        return parse_settings(self)


def _wrap(value):
    if isinstance(value, Mapping) and not isinstance(value, Config):
        return Config(value)
    return value


def snapshot(config: Mapping) -> dict:
    """The user's config as plain data (dicts, lists, values; deep copies): the one place the
    user's dict is read."""
    def plain(value):
        if isinstance(value, Mapping):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, list):
            return [plain(v) for v in value]
        if isinstance(value, tuple):
            return tuple(plain(v) for v in value)
        return value
    return plain(config)


def parse_settings(config: Mapping) -> Settings:
    """The typed sections of ``config``; cached on a :class:`Config` until it changes."""
    if isinstance(config, Config) and config.__dict__.get('_settings') is not None:
        return config.__dict__['_settings']
    if not isinstance(config, Mapping):
        raise ConfigError(f"a config must be a dict or a path to a .py file, "
                          f"got {type(config).__name__}")
    settings = parse_settings_from(snapshot(config))
    if isinstance(config, Config):
        config.__dict__['_settings'] = settings
    return settings


def validate_config(config: Mapping) -> Config:
    """Check every known key (:func:`parse_settings`); returns the config as a :class:`Config`
    holding its typed sections."""
    if not isinstance(config, Mapping):
        raise ConfigError(f"a config must be a dict or a path to a .py file, got {type(config).__name__}")
    cfg = config if isinstance(config, Config) else Config(config)
    parse_settings(cfg)
    return cfg


def read_config_file(path: str, chain: tuple = ()) -> dict:
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
    merged = read_config_file(os.path.join(os.path.dirname(path), base),
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
        config = read_config_file(path)
        folder = os.path.dirname(os.path.abspath(path))
        if config.get('imports') and folder not in sys.path:
            sys.path.append(folder)
    return validate_config(config)
