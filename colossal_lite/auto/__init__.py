"""The planner: cluster profiles, the cost model and the layout search.

``plan(model='gpt2-small', devices=8, memory_gb=16, cluster=None, batch=8, seq=None)``
returns a :class:`~colossal_lite.auto.planner.Plan` whose ``config`` ``colossal-lite train``
and ``launch`` load. See docs/planner.md.

``parallelize(model, example_inputs, ...)`` plans any model graph by graph (``auto/graph``,
docs/auto_graph.md).
"""
from .cluster import ClusterProfile, load_profile
from .graph import parallelize
from .planner import Plan, plan

__all__ = ['ClusterProfile', 'Plan', 'load_profile', 'parallelize', 'plan']
