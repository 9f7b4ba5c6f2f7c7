"""Pipeline parallelism: schedules as generated, simulated action lists (the runtime that
executes them on stages is the pipeline issue's next step)."""
from .schedules import (Action, PipeShape, build_schedule, check_shape, compute_orders,
                        lower)
from .simulator import ScheduleError, SimResult, simulate, timeline

__all__ = ['Action', 'PipeShape', 'build_schedule', 'check_shape', 'compute_orders', 'lower',
           'ScheduleError', 'SimResult', 'simulate', 'timeline']
