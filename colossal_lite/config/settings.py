"""The typed sections of a config, parsed once: :class:`Settings`, the only reader of the
user's dict.

:func:`parse_settings` copies the user's dict into plain data once
(:func:`~.loader.snapshot`, the one accessor of the raw dict), checks every top-level key,
parses each registered section (``registry.py``) and runs the cross-section checks. Every
other module takes the typed section it needs (``settings.zero``, ...); the launched context
carries the settings (``gpc.settings``).

=============  ======================================  =====================================
section        type                                    config keys
=============  ======================================  =====================================
``layout``     :class:`~.layout.ParallelLayout`        ``parallel`` (data size derived at launch)
``auto``       :class:`~.layout.AutoSettings` / None   ``parallel.auto``
``pipeline``   :class:`~.pipeline.PipelineSettings`    ``parallel.pipeline``, ``num_microbatches``
                                                       (alias ``gradient_accumulation``)
``engine``     :class:`~.sections.EngineSettings`      ``clip_grad_norm``, ``gradient_handler``
                                                       (and the pipeline's M)
``amp``        :class:`~.sections.AmpSettings`         ``fp16``
``zero``       :class:`~.zero.ZeroSettings` / None     ``zero``
``run``        :class:`~.sections.RunSettings`         ``seed``, ``timeout``, ``backend``
``job``        :class:`~.job.JobSpec`                  ``model``, ``data``, ``train``,
                                                       ``optimizer``, ``lr_scheduler``,
                                                       ``checkpoint``, ``log``, ``imports``
=============  ======================================  =====================================

``job`` is parsed on first read (``colossal-lite train`` reads it; a library user who
launches with only ``parallel`` never needs a ``model`` section). Upper-case top-level names
(``BATCH_SIZE``) are the user's own constants and pass through; an unknown lower-case key
is an error that suggests the closest known key.
"""
from __future__ import annotations

import copy
from typing import Any, Dict, Mapping

import colossal_lite.config.registry as registry

from .checks import ConfigError, suggest
from .job import JOB_KEYS, parse_job
from .layout import ParallelLayout, parse_auto, parse_parallel
from .pipeline import PipelineSettings, parse_pipeline
from .registry import Section, register_check, register_section
from .schedules import SCHEDULES
from .sections import parse_amp, parse_engine, parse_run
from .zero import parse_zero


class Settings:
    """Every typed section of one config: ``settings.<section>`` (module doc). Frozen."""

    __slots__ = ('_values', '_raw')

    def __init__(self, raw: Mapping, values: Dict[str, Any]):
        object.__setattr__(self, '_raw', raw)
        object.__setattr__(self, '_values', values)

    def __getattr__(self, name: str):
        values = object.__getattribute__(self, '_values')
        if name in values:
            return values[name]
        try:
            section = registry.section(name)
        except KeyError:
            raise AttributeError(f"settings have no section '{name}'; sections: "
                                 f"{[s.name for s in registry.sections()]}") from None
        values[name] = section.parse(object.__getattribute__(self, '_raw'), dict(values))
        return values[name]

    def __setattr__(self, name, value):
        raise AttributeError('Settings are frozen; build new ones from a changed config')

    def to_dict(self) -> dict:
        """A copy of the plain config these settings were parsed from (what a checkpoint
        stores to rebuild the job)."""
        return copy.deepcopy(object.__getattribute__(self, '_raw'))

    def __repr__(self):
        values = object.__getattribute__(self, '_values')
        return f'Settings({", ".join(f"{k}={v!r}" for k, v in values.items())})'

    # typed views of the built-in sections, for readers and tools
    layout: ParallelLayout
    pipeline: PipelineSettings


def parse_settings_from(raw: Mapping) -> Settings:
    """Parse a plain config (a snapshot, never the user's object): every eager section, then
    the checks."""
    _check_top_level(raw)
    values: Dict[str, Any] = {}
    for section in registry.sections():
        if not section.lazy:
            values[section.name] = section.parse(raw, dict(values))
    settings = Settings(raw, values)
    for check in registry.checks():
        check(settings)
    return settings


def _check_top_level(config: Mapping):
    known = registry.top_level_keys()
    for key in config:
        if not isinstance(key, str):
            raise ConfigError(f"config keys must be strings, got {key!r}")
        if key.isupper() or key.startswith('_'):
            continue  # the user's own constants
        if key not in known:
            raise ConfigError(f"unknown config key '{key}'{suggest(key, known)}")


# ------------------------------------------------------------------ the built-in sections
def _zero_runs_with(settings: Settings):
    """What ZeRO does not run yet: NotImplementedError, once, when the config is parsed."""
    zero = settings.zero
    if zero is None:
        return
    if settings.amp.mode == 'apex':
        raise NotImplementedError("fp16 mode 'apex' is not supported with ZeRO (apex amp keeps "
                                  "its own unsharded master weights); use mode 'torch' or 'naive'")
    pipe = settings.pipeline
    problem = zero.stage == 3 and SCHEDULES[pipe.schedule].zero3_check(pipe.size, pipe.chunks)
    if problem:
        raise NotImplementedError(problem)


def _auto_runs_with(settings: Settings):
    """``parallel.auto`` shards what its plan shards: ZeRO beside it is not built yet."""
    if settings.auto is not None and settings.zero is not None:
        raise NotImplementedError(f"'zero' (stage {settings.zero.stage}) with 'parallel.auto': "
                                  f"the graph plan already shards what it shards; drop 'zero' "
                                  f"or use a hand layout")


for _section in (
        Section('layout', ('parallel',), lambda c, _: parse_parallel(c.get('parallel'))),
        Section('auto', ('parallel',), lambda c, _: parse_auto(c.get('parallel'))),
        Section('pipeline', ('parallel', 'num_microbatches', 'gradient_accumulation'),
                lambda c, _: parse_pipeline(c)),
        Section('engine', ('clip_grad_norm', 'gradient_handler'),
                lambda c, done: parse_engine(c, done['pipeline'].num_microbatches)),
        Section('amp', ('fp16',), lambda c, _: parse_amp(c.get('fp16'))),
        Section('zero', ('zero',), lambda c, _: parse_zero(c.get('zero'))),
        Section('run', ('seed', 'timeout', 'backend'), lambda c, _: parse_run(c)),
        Section('job', JOB_KEYS, lambda c, _: parse_job(c), lazy=True)):
    register_section(_section)
register_check(_zero_runs_with)
register_check(_auto_runs_with)
