"""Parallel context: ParallelMode, the process groups (``global_context``) and RNG seeds."""
from .parallel_mode import ParallelMode
from .parallel_context import (ParallelContext, ProcessGroupAxis, current_context, global_context,
                               use_context)
from .random import seed, seed_manager

gpc = global_context

__all__ = ['ParallelMode', 'ParallelContext', 'ProcessGroupAxis', 'current_context', 'use_context',
           'global_context', 'gpc',
           'seed', 'seed_manager']
