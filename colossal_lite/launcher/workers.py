"""``run_workers(nproc, port, entrypoint, *args, nodes=None)``: the ``colossal-lite`` commands'
workers, started through torch's elastic launcher (``elastic_launch``, what ``torchrun`` runs):
``nproc`` spawned workers on this node (:func:`~.start.start_method`), ``OMP_NUM_THREADS=1``,
gloo on CPU, restarts with ``max_restarts``. The agents meet in torch's c10d rendezvous
(:mod:`.rendezvous`: the nodes ordered by their ``--node-rank``): on one node at
``127.0.0.1:port`` (``torchrun --standalone``), on ``nodes.nnodes`` nodes at
``nodes.endpoint`` under ``nodes.rdzv_id`` (:mod:`.nodes`), each node running this once.

The exit status: 0; 1 when a worker failed, with one line per failed rank on stderr (a rank
killed by a signal first, then the rank that raised first, and its traceback once:
:mod:`.failures`; global ranks), or when the rendezvous failed (a node missing past c10d's
join timeout, 600 s; nodes that disagree on their ranks); 130 on Ctrl-C. Meanwhile
``kill -USR1`` on the launching process or on a worker prints that process's Python stacks
on stderr.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import uuid
from typing import Optional

from .failures import FirstExit, failure_message, run_worker, stacks_on_sigusr1
from .nodes import Nodes
from .rendezvous import ATTEMPT_ENV, BACKEND, rdzv_configs, register
from .start import WORKERS, start_method


def run_workers(nproc: int, port: int, entrypoint, *entry_args, what: str = 'the run',
                max_restarts: int = 0, nodes: Optional[Nodes] = None) -> int:
    """Run ``entrypoint(*entry_args)`` on ``nproc`` workers of this node (module doc; one
    node at ``127.0.0.1:port`` unless ``nodes`` says otherwise, ``port`` 0: a free one);
    the exit status. ``what`` names the run in the failure line."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    nodes = nodes if nodes is not None else Nodes(port=port)
    os.environ['OMP_NUM_THREADS'] = '1'
    logging.getLogger('torch.distributed.elastic').setLevel(logging.CRITICAL)  # we report failures
    register()
    launch_config = LaunchConfig(
        min_nodes=nodes.nnodes, max_nodes=nodes.nnodes, nproc_per_node=nproc,
        run_id=nodes.rdzv_id or str(uuid.uuid4()), rdzv_backend=BACKEND,
        rdzv_endpoint=nodes.endpoint, rdzv_configs=rdzv_configs(nodes, nproc),
        max_restarts=max_restarts, monitor_interval=0.2, start_method=start_method(WORKERS))
    # with restarts, each attempt's workers get a new TCPStore (hosted by rank 0) instead of
    # the agent's shared one, whose keys from the failed attempt (the old gloo addresses)
    # would make the restarted ranks connect to dead peers
    fresh_store = '1' if max_restarts else None
    here = f' on node {nodes.node_rank}' if nodes.nnodes > 1 and nodes.node_rank is not None else ''
    try:
        with FirstExit() as first_exit, _env('TORCH_DISABLE_SHARE_RDZV_TCP_STORE', fresh_store), \
                _env(ATTEMPT_ENV, None), stacks_on_sigusr1():
            elastic_launch(launch_config, run_worker)(entrypoint, *entry_args)
    except ChildFailedError as err:
        ended = 'every process was ended' if nodes.nnodes == 1 else \
            'every process of this node was ended'
        print(f'colossal-lite: {what} stopped{here}, {ended}:\n'
              f'{failure_message(err, first_exit)}', file=sys.stderr)
        return 1
    except RendezvousError as err:
        print(f'colossal-lite: {what}{here}: the rendezvous of {nodes.nnodes} node(s) at '
              f'{nodes.endpoint} (id {nodes.rdzv_id}) failed: {type(err).__name__}: {err}',
              file=sys.stderr)
        return 1
    except (KeyboardInterrupt, SignalException) as exc:
        print(f'colossal-lite: interrupted ({exc}); every process was ended', file=sys.stderr)
        return 130
    return 0


@contextlib.contextmanager
def _env(key: str, value: Optional[str]):
    """``os.environ[key]`` set to ``value`` (None: left as it is) inside -- the workers spawned
    inside inherit it -- and restored after."""
    old = os.environ.get(key)
    if value is not None:
        os.environ[key] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old
