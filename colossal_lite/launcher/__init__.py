"""The one way colossal_lite starts local processes.

* :func:`run_workers` (``workers.py``): ``entrypoint(*args)`` on N workers through torch's
  elastic launcher -- ``colossal-lite train``, ``generate`` and ``eval`` -- on this node of
  a run's :class:`~.nodes.Nodes` (``nodes.py``: the multi-node flags and SLURM's variables;
  ``rendezvous.py``: c10d's rendezvous with the nodes ordered by ``--node-rank``). Returns
  the exit status; a failure names the rank that failed first (a rank killed by a signal
  first) and its traceback (``failures.py``), Ctrl-C gives 130.
* :func:`run_ranks` (``ranks.py``): ``fn(rank, *args)`` on N ranks launched with a config
  (gloo) -- the planner's profiler and the test harness (``testing.run_distributed``).
  Returns the results by rank; a rank's exception or death is raised, a run past its
  timeout raises with every rank's Python stacks.

:func:`start_method` (``start.py``) decides how each starts its processes, and why: never a
plain fork of the (threaded) launching process. Every process started either way prints
its Python stacks on ``kill -USR1``.
"""
from .ranks import ChildFailed, run_ranks
from .start import RANKS, WORKERS, free_port, start_method
from .workers import run_workers

__all__ = ['ChildFailed', 'RANKS', 'WORKERS', 'free_port', 'run_ranks', 'run_workers',
           'start_method']
