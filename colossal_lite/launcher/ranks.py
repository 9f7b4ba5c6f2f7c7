"""``run_ranks(fn, world_size, config, *args)``: ``fn(rank, *args)`` on ``world_size`` local
processes, each launched with ``config`` (gloo, a free port, one thread), results by rank.

The ranks are forked from the launcher's fork server (:func:`~.start.start_method`), so
``fn`` and ``args`` are pickled: ``fn`` must be importable by name (a module-level
function). A rank gets the environment, working directory, ``sys.path``, stdout and stderr
of the call. A rank's exception is raised here (:class:`ChildFailed`, with its traceback);
a rank that a signal ended is named with the signal; a run that passes ``timeout``
seconds raises ``TimeoutError`` carrying every live rank's Python stacks (each rank dumps
them on SIGUSR1), never hangs. Results travel through a pipe (serialized with
``torch.save``), so return small values: CPU tensors, numbers, dicts and lists of them.
"""
from __future__ import annotations

import io
import os
import queue as queue_module
import signal
import tempfile
import time
import traceback
from typing import Any, Callable, List, Optional

from ..context import global_context as gpc
from ..launch import launch
from .start import free_port, rank_context, setup_process


class ChildFailed(RuntimeError):
    """A rank raised or died; the message names it and carries its traceback."""


def _to_bytes(obj) -> bytes:
    # torch.save, not the queue's pickle: tensors pickled by a Queue travel as shared-memory
    # handles tied to the sender's lifetime, which can deadlock once it exits
    import torch
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _from_bytes(data: bytes):
    import torch
    return torch.load(io.BytesIO(data), weights_only=False)


def _detach(dup) -> int:
    return dup.detach()


class _CallersFd:
    """A file descriptor of the calling process that the rank receives as a duplicate
    (``multiprocessing.reduction.DupFd`` while the rank's start pickles it)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import reduction
        return _detach, (reduction.DupFd(self.fd),)


# the variables by which an elastic agent tells its workers they were restarted
# (``run_state.restart_count``); a caller's stale copy must not make ranks resume
RESTART_ENV = ('COLOSSAL_LITE_ATTEMPT', 'TORCHELASTIC_RESTART_COUNT')


def _rank_main(rank, world_size, port, payload, queue, collective_timeout, env, stack_dir,
               stdout_fd, stderr_fd):
    """One rank: the caller's stdout/stderr and environment, stacks to ``stack_dir/rank`` on
    SIGUSR1, one thread, ``launch``, ``fn(rank, *args)``; the result or the traceback to
    the caller."""
    os.dup2(stdout_fd, 1)
    os.dup2(stderr_fd, 2)
    os.environ.clear()
    os.environ.update(env, OMP_NUM_THREADS='1')
    for key in RESTART_ENV:   # these ranks are never an elastic agent's restarted workers
        os.environ.pop(key, None)
    stacks = open(os.path.join(stack_dir, str(rank)), 'w')   # open while the rank runs
    setup_process(stacks)
    try:
        fn, config, args = _from_bytes(payload)
        cfg = dict(config or {})
        cfg.setdefault('timeout', collective_timeout)
        launch(cfg, rank=rank, world_size=world_size, host='127.0.0.1', port=port,
               backend='gloo')
        result = fn(rank, *args)
        queue.put((rank, 'ok', _to_bytes(result)))
    except BaseException:  # report every failure to the caller, then exit
        queue.put((rank, 'error', traceback.format_exc()))
    finally:
        try:
            gpc.destroy()
        except Exception:
            pass


_EXIT_GRACE_S = 10.0   # a rank that exited 0 may still have its result in the pipe
_STACKS_WAIT_S = 3.0


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f'signal {-code}'


def _killed(procs, ranks) -> Optional[str]:
    """'rank R of N was killed by SIG...' for the first of ``ranks`` a signal ended, or None."""
    for r in sorted(ranks):
        code = procs[r].exitcode
        if code is not None and code < 0:
            return f'rank {r} of {len(procs)} was killed by {_signal_name(code)}'
    return None


def _exit_error(procs, ranks, exited_at) -> Optional[str]:
    """Why one of ``ranks`` (not reported yet) failed by exiting, or None: a signal (named
    first) or a non-zero code at once, code 0 after :data:`_EXIT_GRACE_S` without a result."""
    killed = _killed(procs, ranks)
    if killed:
        return killed
    now = time.monotonic()
    for r in sorted(ranks):
        code = procs[r].exitcode
        if code is None:
            continue
        if code > 0:
            return f'rank {r} of {len(procs)} exited with code {code} without reporting'
        if now - exited_at.setdefault(r, now) > _EXIT_GRACE_S:
            return f'rank {r} of {len(procs)} exited normally but its result never arrived'
    return None


def _stacks(procs, stack_dir: str) -> str:
    """Every live rank's Python stacks: SIGUSR1 to each, then what each wrote."""
    alive = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in alive:
        try:
            os.kill(procs[r].pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + _STACKS_WAIT_S
    paths = {r: os.path.join(stack_dir, str(r)) for r in alive}
    while time.monotonic() < deadline and not all(
            os.path.exists(p) and os.path.getsize(p) for p in paths.values()):
        time.sleep(0.1)
    time.sleep(0.2)   # let the last writer finish
    parts = []
    for r, path in paths.items():
        try:
            with open(path) as f:
                text = f.read().rstrip()
        except OSError:
            text = ''
        parts.append(f'--- rank {r} (pid {procs[r].pid}) ---\n{text or "(no stacks written)"}')
    return '\n'.join(parts)


def run_ranks(fn: Callable, world_size: int, config: Optional[dict] = None, *args,
              timeout: float = 120.0, collective_timeout: float = 60.0) -> List[Any]:
    """``fn(rank, *args)`` on ``world_size`` launched ranks; their results by rank (module
    doc). ``collective_timeout``: the ranks' collective timeout unless ``config`` sets
    ``timeout``."""
    try:
        payload = _to_bytes((fn, config, args))
    except Exception as err:
        raise TypeError(f'run_ranks pickles fn and its arguments for the ranks: {fn!r} and '
                        f'its arguments must be picklable, fn by reference (a module-level '
                        f'function, no lambda or local function): {err}') from err
    ctx = rank_context()
    queue, port, env = ctx.Queue(), free_port(), dict(os.environ)
    results: List[Any] = [None] * world_size
    pending = set(range(world_size))
    with tempfile.TemporaryDirectory(prefix='colossal-lite-stacks-') as stack_dir:
        procs = [ctx.Process(target=_rank_main, daemon=True, name=f'rank{r}',
                             args=(r, world_size, port, payload, queue, collective_timeout,
                                   env, stack_dir, _CallersFd(1), _CallersFd(2)))
                 for r in range(world_size)]
        try:
            for p in procs:
                p.start()
            exited_at: dict = {}
            deadline = time.monotonic() + timeout
            while pending:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(
                        f'ranks {sorted(pending)} of {world_size} did not finish within '
                        f'{timeout:.0f} s; the Python stacks of every live rank:\n'
                        f'{_stacks(procs, stack_dir)}')
                try:
                    rank, status, data = queue.get(timeout=min(remaining, 1.0))
                except queue_module.Empty:
                    why = _exit_error(procs, pending, exited_at)
                    if why:
                        raise ChildFailed(why)
                    continue
                if status == 'error':
                    time.sleep(0.2)   # a rank a signal ended (the cause) has exited by now
                    killed = _killed(procs, pending - {rank})
                    raise ChildFailed(f'{killed + "; then " if killed else ""}rank {rank} of '
                                      f'{world_size} raised:\n{data}')
                results[rank] = _from_bytes(data)
                pending.discard(rank)
        finally:
            for p in procs:
                if p.pid is not None:
                    p.join(timeout=5 if not pending else 0.1)
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
    return results
