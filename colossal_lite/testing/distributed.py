"""Run a function on N local processes (fork, one thread each) with a launched context.

``run_distributed(fn, world_size, config, *args)`` forks ``world_size``
processes, launches each with ``config`` on a free port (gloo), calls
``fn(rank, *args)`` and returns the list of return values by rank. A child's
exception is re-raised in the parent with its traceback; a child that does not
finish within ``timeout`` seconds makes the call fail, never hang. Results
travel through a pipe (serialized with torch.save), so return small values: CPU
tensors, numbers, dicts and lists of them.
"""
from __future__ import annotations

import multiprocessing as mp
import queue as queue_module
import os
import socket
import time
import traceback
from typing import Any, Callable, List, Optional


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


class ChildFailed(RuntimeError):
    """A rank raised; the message carries that rank's traceback."""


def _to_bytes(obj) -> bytes:
    # torch.save, not pickle: tensors pickled by a Queue travel as shared-memory handles
    # tied to the child's lifetime, which can deadlock once the child exits
    import io
    import torch
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _from_bytes(data: bytes):
    import io
    import torch
    return torch.load(io.BytesIO(data), weights_only=False)


def _child(rank, world_size, port, config, fn, args, queue, collective_timeout):
    os.environ['OMP_NUM_THREADS'] = '1'
    import torch
    torch.set_num_threads(1)
    from .. import launch
    from ..context import global_context as gpc
    try:
        cfg = dict(config or {})
        cfg.setdefault('timeout', collective_timeout)
        launch(cfg, rank=rank, world_size=world_size, host='127.0.0.1', port=port,
               backend='gloo')
        result = fn(rank, *args)
        queue.put((rank, 'ok', _to_bytes(result)))
    except BaseException:  # report every failure to the parent, then exit
        queue.put((rank, 'error', traceback.format_exc()))
    finally:
        try:
            gpc.destroy()
        except Exception:
            pass


_EXIT_GRACE_S = 10.0


def _check_exited(procs, pending, exited_at):
    """Fail for a pending rank that exited: at once on a non-zero code, and after a grace
    period (its result may still be in the pipe) on code 0."""
    now = time.monotonic()
    for r in sorted(pending):
        code = procs[r].exitcode
        if code is None:
            continue
        if code != 0:
            raise ChildFailed(f'rank {r} exited with code {code} without reporting')
        if now - exited_at.setdefault(r, now) > _EXIT_GRACE_S:
            raise ChildFailed(f'rank {r} exited normally but its result never arrived')


def run_distributed(fn: Callable, world_size: int, config: Optional[dict] = None, *args,
                    timeout: float = 120.0, collective_timeout: float = 60.0) -> List[Any]:
    """Fork ``world_size`` launched ranks running ``fn(rank, *args)``; results by rank."""
    ctx = mp.get_context('fork')
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, daemon=True,
                         args=(r, world_size, port, config, fn, args, queue, collective_timeout))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: List[Any] = [None] * world_size
    pending = set(range(world_size))
    exited_at: dict = {}
    deadline = time.monotonic() + timeout
    try:
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f'ranks {sorted(pending)} of {world_size} did not finish '
                                   f'within {timeout:.0f} s')
            try:
                rank, status, payload = queue.get(timeout=min(remaining, 1.0))
            except queue_module.Empty:
                _check_exited(procs, pending, exited_at)
                continue
            if status == 'error':
                raise ChildFailed(f'rank {rank} of {world_size} raised:\n{payload}')
            results[rank] = _from_bytes(payload)
            pending.discard(rank)
    finally:
        for p in procs:
            p.join(timeout=5 if not pending else 0.1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return results
