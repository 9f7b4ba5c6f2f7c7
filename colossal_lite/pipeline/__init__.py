"""Pipeline parallelism: settings, partitioning, staged models, schedules as generated and
simulated action lists, and the runtime that executes them (``runtime.PipelineSchedule``,
the Engine's schedule when ``parallel.pipeline`` > 1)."""
from .config import PipelineSettings, parse_pipeline
from .partition import StageSpec, balanced_cut, uniform_cut
from .schedules import (Action, PipeShape, build_schedule, check_shape, compute_orders,
                        lower)
from .simulator import ScheduleError, SimResult, simulate, timeline
from .stages import StagedModel, StagedSequential

__all__ = ['Action', 'PipeShape', 'PipelineSettings', 'StageSpec', 'StagedModel',
           'StagedSequential', 'balanced_cut', 'build_schedule', 'check_shape',
           'compute_orders', 'lower', 'parse_pipeline', 'uniform_cut',
           'ScheduleError', 'SimResult', 'simulate', 'timeline']
