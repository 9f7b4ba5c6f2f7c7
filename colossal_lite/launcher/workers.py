"""``run_workers(nproc, port, entrypoint, *args)``: the ``colossal-lite`` commands' workers,
started through torch's elastic launcher (the code path of ``torchrun --standalone
--nproc-per-node N``: c10d rendezvous on 127.0.0.1, restarts with ``max_restarts``),
spawned (:func:`~.start.start_method`), ``OMP_NUM_THREADS=1``, gloo on CPU.

The exit status: 0; 1 when a worker failed, with one line per failed rank on stderr (a rank
killed by a signal first, then the rank that raised first, and its traceback once:
:mod:`.failures`); 130 on Ctrl-C. Meanwhile ``kill -USR1`` on the launching process or on
a worker prints that process's Python stacks on stderr.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import uuid

from .failures import FirstExit, failure_message, run_worker, stacks_on_sigusr1
from .start import WORKERS, start_method


def run_workers(nproc: int, port: int, entrypoint, *entry_args, what: str = 'the run',
                max_restarts: int = 0) -> int:
    """Run ``entrypoint(*entry_args)`` on ``nproc`` local workers (module doc; ``port`` 0:
    a free one); the exit status. ``what`` names the run in the failure line."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ['OMP_NUM_THREADS'] = '1'
    logging.getLogger('torch.distributed.elastic').setLevel(logging.CRITICAL)  # we report failures
    launch_config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
        rdzv_backend='c10d', rdzv_endpoint=f'127.0.0.1:{port}', max_restarts=max_restarts,
        monitor_interval=0.2, start_method=start_method(WORKERS))
    try:
        with FirstExit() as first_exit, _fresh_store_per_attempt(max_restarts), \
                stacks_on_sigusr1():
            elastic_launch(launch_config, run_worker)(entrypoint, *entry_args)
    except ChildFailedError as err:
        print(f'colossal-lite: {what} stopped, every process was ended:\n'
              f'{failure_message(err, first_exit)}', file=sys.stderr)
        return 1
    except (KeyboardInterrupt, SignalException) as exc:
        print(f'colossal-lite: interrupted ({exc}); every process was ended', file=sys.stderr)
        return 130
    return 0


@contextlib.contextmanager
def _fresh_store_per_attempt(max_restarts: int):
    """With restarts, each attempt's workers get a new TCPStore (hosted by rank 0) instead
    of the agent's shared one, whose keys from the failed attempt (the old gloo addresses)
    would make the restarted ranks connect to dead peers: torch's
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` for the duration of the launch."""
    key = 'TORCH_DISABLE_SHARE_RDZV_TCP_STORE'
    old = os.environ.get(key)
    if max_restarts:
        os.environ[key] = '1'
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old
