"""Graph-level auto-parallelism: any single-device model -> an SBP plan -> DTensor execution.

``parallelize(model, example_inputs, ...)`` returns ``(parallel_model, plan)``; see
docs/auto_graph.md and ``api.py``.
"""
from .api import AutoParallelModel, NoPlanFits, parallelize, resolve_mesh
from .plan import Plan
from .trace import GraphBreakError, capture

__all__ = ['AutoParallelModel', 'GraphBreakError', 'NoPlanFits', 'Plan', 'capture',
           'parallelize', 'resolve_mesh']
