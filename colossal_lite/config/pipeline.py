"""The pipeline section of a config, checked once into a frozen :class:`PipelineSettings`.

Two spellings::

    parallel = dict(pipeline=2, ...)                         # P stages, defaults below
    parallel = dict(pipeline=dict(size=2, chunks=1, schedule='1f1b', partition='uniform'), ...)
    num_microbatches = 4                                     # top level (alias: gradient_accumulation)

``chunks`` (V) is the number of model chunks (virtual stages) per pipeline rank: only the
``interleaved`` schedule runs V > 1. ``partition`` says how the layers are cut into P*V
stages: ``uniform`` (equal numbers of blocks), ``parameters`` (balanced parameter counts,
embeddings on the first stage and heads on the last counted), ``cost`` (balanced measured
forward+backward time per layer) or an explicit list ``[n_0, ..., n_{P*V-1}]`` of blocks per
stage (kept as a tuple; its length is checked here). What needs the model (more stages than
layers, an explicit cut summing to the layer count) is checked where the model is known
(``job.checks.check_layout`` in the CLI's parent and the model's constructor).
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, Mapping, Tuple, Union

from .checks import ConfigError, check_keys, positive_int
from .schedules import DEFAULT as DEFAULT_SCHEDULE
from .schedules import SCHEDULES, check_schedule, default_schedule

PARTITIONS = ('uniform', 'parameters', 'cost')
_KEYS = {'size', 'chunks', 'schedule', 'partition'}


@dataclass(frozen=True)
class PipelineSettings:
    """P = ``size`` ranks, V = ``chunks`` stages per rank, M = ``num_microbatches``."""

    size: int = 1
    chunks: int = 1
    schedule: str = DEFAULT_SCHEDULE
    partition: Union[str, Tuple[int, ...]] = 'uniform'
    num_microbatches: int = 1

    @property
    def stages(self) -> int:
        """S = P * V: the number of pieces the model is cut into."""
        return self.size * self.chunks


def parse_pipeline(config: Mapping) -> PipelineSettings:
    """The pipeline settings of a whole config (``parallel.pipeline`` and ``num_microbatches``
    or its alias ``gradient_accumulation``); every impossible value is a ConfigError."""
    parallel = config.get('parallel') or {}
    raw = parallel.get('pipeline', 1) if isinstance(parallel, Mapping) else 1
    if isinstance(raw, Mapping):
        check_keys(raw, _KEYS, 'parallel.pipeline.')
        size = positive_int(raw.get('size', 1), 'parallel.pipeline.size')
        chunks = positive_int(raw.get('chunks', 1), 'parallel.pipeline.chunks')
        schedule = raw.get('schedule', default_schedule(chunks))
        partition = raw.get('partition', 'uniform')
    else:
        size = positive_int(raw, 'parallel.pipeline')
        chunks, schedule, partition = 1, default_schedule(), 'uniform'
    if schedule not in SCHEDULES:
        raise ConfigError(check_schedule(schedule, size, chunks, 1))
    partition = _partition(partition, size * chunks)
    micro = resolve_microbatches(config.get('num_microbatches'),
                                 config.get('gradient_accumulation'))
    problem = check_schedule(schedule, size, chunks, micro)
    if problem:
        raise ConfigError(problem)
    return PipelineSettings(size, chunks, schedule, partition, micro)


def _partition(value: Any, stages: int) -> Union[str, Tuple[int, ...]]:
    """A partition name, or an explicit cut: a list/tuple of ``stages`` positive block counts."""
    key = 'parallel.pipeline.partition'
    if isinstance(value, (list, tuple)):
        if len(value) != stages:
            raise ConfigError(f"'{key}' = {list(value)} must list the blocks of each of the "
                                f"{stages} pipeline stages (size x chunks), got {len(value)} "
                                f"entries")
        bad = [n for n in value if isinstance(n, bool) or not isinstance(n, numbers.Integral)
               or n < 1]
        if bad:
            raise ConfigError(f"'{key}' = {list(value)}: every stage needs a positive integer "
                                f"number of blocks, got {bad[0]!r}")
        return tuple(int(n) for n in value)
    if not isinstance(value, str) or value not in PARTITIONS:
        raise ConfigError(f"'{key}' must be one of {list(PARTITIONS)} or a list of blocks per "
                            f"stage, got {value!r}")
    return value


def resolve_microbatches(num_microbatches=None, gradient_accumulation=None) -> int:
    """M from ``num_microbatches`` or its alias ``gradient_accumulation`` (1 when neither):
    the one place the alias is resolved (the config's keys and ``Engine``'s arguments)."""
    given = {key: positive_int(value, key) for key, value in
             (('num_microbatches', num_microbatches), ('gradient_accumulation', gradient_accumulation))
             if value is not None}
    if len(set(given.values())) > 1:
        raise ConfigError(f"'num_microbatches' = {given['num_microbatches']} and its alias "
                          f"'gradient_accumulation' = {given['gradient_accumulation']} differ; "
                          f"give one")
    return next(iter(given.values()), 1)
