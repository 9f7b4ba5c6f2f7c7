"""Pipeline parallelism: partitioning, staged models, schedules as generated and simulated
action lists, and the runtime that executes them (``runtime.PipelineSchedule``, the
Engine's schedule when ``parallel.pipeline`` > 1). The settings and the schedule table live
in ``colossal_lite.config`` (``config/pipeline.py``, ``config/schedules.py``).

Layers inside: ``actions`` (vocabulary) <- ``generators``, ``simulator`` <- ``zero_bubble``
<- ``schedules`` (by name: generate, lower, dry-run) <- ``p2p``, ``runtime``;
``partition`` <- ``stages`` (staged models; :func:`resolve_partition`, the explicit step
before building a model under ``partition='cost'``)."""
from ..config.pipeline import PipelineSettings, parse_pipeline
from .actions import Action, PipeShape
from .partition import StageSpec, balanced_cut, uniform_cut
from .schedules import build_schedule, check_shape, compute_orders, lower
from .simulator import ScheduleError, SimResult, simulate, timeline
from .stages import StagedModel, StagedSequential, resolve_partition

__all__ = ['Action', 'PipeShape', 'PipelineSettings', 'StageSpec', 'StagedModel',
           'StagedSequential', 'balanced_cut', 'build_schedule', 'check_shape',
           'compute_orders', 'lower', 'parse_pipeline', 'resolve_partition', 'uniform_cut',
           'ScheduleError', 'SimResult', 'simulate', 'timeline']
