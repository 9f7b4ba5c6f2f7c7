"""``run_distributed(fn, world_size, config, *args)``: the test harness's way to run
``fn(rank, *args)`` on ``world_size`` launched ranks (gloo, one thread each) and get their
results by rank -- ``colossal_lite.launcher.run_ranks``, which starts the ranks (from its
fork server, never a fork of the test process), re-raises a rank's exception with its
traceback (:class:`ChildFailed`) and fails a run that passes ``timeout`` seconds with every
rank's Python stacks instead of hanging.

``fn`` and ``args`` are pickled: pass a module-level function. A rank sees the test's
environment variables, working directory and ``sys.path``, and writes to its stdout and
stderr, but not what the test changed in memory (a monkeypatch, a module global).
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional

from ..launcher import ChildFailed, free_port, run_ranks

__all__ = ['ChildFailed', 'free_port', 'run_distributed']


def run_distributed(fn: Callable, world_size: int, config: Optional[dict] = None, *args,
                    timeout: float = 120.0, collective_timeout: float = 60.0) -> List[Any]:
    """``fn(rank, *args)`` on ``world_size`` ranks launched with ``config``; results by rank."""
    return run_ranks(fn, world_size, config, *args, timeout=timeout,
                     collective_timeout=collective_timeout)
