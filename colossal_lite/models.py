"""The model registry: what a config's ``model=dict(type=NAME, preset=..., **options)`` builds.

The library never imports a model package itself. A package of models registers them
when it is imported::

    from colossal_lite.models import SizeRule, register_model
    register_model('gpt', GPT, presets=GPT_PRESETS, loss=GPTLMLoss, data='shakespeare',
                   rules=lambda o: [SizeRule('model.heads', o['heads'], 'head'), ...])

and the job finds it in one of two ways:

* the config's top-level ``imports=['my_models']`` (modules imported before the job is
  parsed; a config file's own directory is searched too) -- the path for user models and
  for running from a source tree that is not installed;
* the setuptools entry-point group ``colossal_lite.models`` (``setup.py`` declares the
  repository's model zoo there), loaded the first time a name is not yet registered.

A model's options are its preset's values updated by the config's other ``model`` keys;
an option is legal when the preset has it or the builder takes it as a keyword.
"""
from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Union

ENTRY_POINT_GROUP = 'colossal_lite.models'
SPLITS = ('head', 'hidden', 'vocab', 'sequence', 'batch')  # TensorFamily.<kind>_split


@dataclass(frozen=True)
class SizeRule:
    """The config key ``key`` holds (or determines) ``value``, which must be divisible by
    ``by``: an int (``by_key`` names where it comes from) or a split of the layout's tensor
    family, one of :data:`SPLITS` (``families.family(mode).<by>_split(layout)``)."""

    key: str
    value: int
    by: Union[int, str]
    by_key: str = ''
    what: str = ''

    def __post_init__(self):
        if isinstance(self.by, str) and self.by not in SPLITS:
            raise ValueError(f'SizeRule.by must be an int or one of {SPLITS}, got {self.by!r}')


@dataclass(frozen=True)
class ModelEntry:
    """One registered model: ``builder(**options)`` builds it (for the current context),
    ``loss()`` its training criterion; ``data`` the bundled data set a job trains it on
    (None: none); ``rules(options)`` the sizes a layout must divide; ``layers`` the option
    counting its transformer blocks (what a pipeline cuts)."""

    name: str
    builder: Callable[..., Any]
    presets: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    loss: Optional[Callable[[], Any]] = None
    data: Optional[str] = None
    rules: Optional[Callable[[Mapping[str, Any]], Sequence[SizeRule]]] = None
    layers: Optional[str] = 'layers'
    label: str = ''

    def options(self, preset: Optional[str], overrides: Mapping[str, Any]) -> Dict[str, Any]:
        """The preset's options updated by ``overrides``; ValueError on an unknown preset
        or option."""
        label = self.label or self.name.upper()
        if preset is None:
            base = {}
        elif preset in self.presets:
            base = dict(self.presets[preset])
        else:
            raise ValueError(f"unknown {label} preset '{preset}'; presets: {sorted(self.presets)}")
        known = set(base) | _keywords(self.builder)
        unknown = set(overrides) - known
        if unknown and not _takes_any_keyword(self.builder):
            raise ValueError(f'unknown {label} options {sorted(unknown)}; options: {sorted(known)}')
        base.update(overrides)
        return base

    def size_rules(self, options: Mapping[str, Any]) -> Sequence[SizeRule]:
        return list(self.rules(options)) if self.rules else []


_REGISTRY: Dict[str, ModelEntry] = {}
_entry_points_loaded = False


def register_model(name: str, builder: Callable[..., Any], presets: Optional[Mapping] = None,
                   loss: Optional[Callable[[], Any]] = None, data: Optional[str] = None,
                   rules: Optional[Callable] = None, layers: Optional[str] = 'layers',
                   label: str = '', replace: bool = False) -> ModelEntry:
    """Make ``model=dict(type=name, ...)`` build ``builder(**options)``; see :class:`ModelEntry`.
    Registering a taken name with another builder needs ``replace=True``."""
    entry = ModelEntry(name, builder, dict(presets or {}), loss, data, rules, layers, label)
    old = _REGISTRY.get(name)
    if old is not None and old.builder is not builder and not replace:
        raise ValueError(f"model name '{name}' is already registered to {old.builder!r}; "
                         f"pass replace=True to replace it")
    _REGISTRY[name] = entry
    return entry


def unregister_model(name: str):
    _REGISTRY.pop(name, None)


def get_model(name: str) -> ModelEntry:
    """The entry registered as ``name`` (entry points loaded on the first miss)."""
    if name not in _REGISTRY:
        load_entry_points()
    if name not in _REGISTRY:
        raise ValueError(f'{name!r} is not a registered model; registered: {registered_models()} '
                         f"(a module named in the config's 'imports' or an entry point of group "
                         f"'{ENTRY_POINT_GROUP}' registers models with register_model)")
    return _REGISTRY[name]


def registered_models() -> list:
    return sorted(_REGISTRY)


def load_entry_points():
    """Import every module of the entry-point group ``colossal_lite.models`` (once)."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    from importlib.metadata import distributions
    seen = set()
    for dist in distributions():  # every copy of a distribution's metadata (not only the first
        for point in dist.entry_points:  # on sys.path: a stale source-tree egg-info may shadow)
            if point.group == ENTRY_POINT_GROUP and point.value not in seen:
                seen.add(point.value)
                point.load()


def import_modules(names: Sequence[str]):
    """Import each named module (the config's ``imports``); ValueError naming a failure."""
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as err:
            raise ValueError(f'could not import {name!r}: {type(err).__name__}: {err}') from err


def _keywords(fn) -> set:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return set()
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _takes_any_keyword(fn) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.kind == p.VAR_KEYWORD for p in params)
