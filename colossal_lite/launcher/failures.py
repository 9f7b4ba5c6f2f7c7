"""Why a run of :func:`~.workers.run_workers` stopped: one line per failed rank, the cause first.

The elastic launcher reports only the first failure it polls, which is often a rank whose
collective broke *because* another rank died. Two records give the real order:

* every worker that raises writes ``<attempt dir>/<local rank>/error.json`` (the launcher's
  ``record`` wrapper), read here oldest first;
* a worker ended by a signal (the out-of-memory killer, ``kill -9``) writes nothing, so
  :class:`FirstExit` watches ``SIGCHLD`` in the launching process and, for each worker pid
  (each worker registers its pid in FirstExit's directory, :func:`run_worker`), peeks at
  its exit with ``waitid(P_PID, pid, WNOWAIT)`` (the child stays for the launcher to
  reap): the workers' exits in the order they happened. This needs the workers to be the
  launching process's own children (spawned, ``start.start_method``). Other children of
  the process are never looked at; a worker the launcher reaped before the handler ran is
  recorded then, its status taken from the launcher's failure record (``exitcode < 0``:
  minus the signal number). :func:`run_worker` also writes each worker's pid beside its
  error file, so a pid names a rank of an attempt (with ``--max-restarts`` only the failed
  last attempt's workers are reported).

A rank killed by a signal is named first, then the ranks that raised, oldest first; the
traceback of the first rank that raised is printed once (not after a kill: the others
only lost their connections). Ranks are named globally (on a node of several, the records
hold local ranks: the launcher's failures give the offset).
"""
from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import shutil
import signal
import tempfile
from typing import List, Optional, Tuple

from .start import dump_stacks_on_sigusr1, setup_process

_PID_FILE = 'pid'
_PID_DIR_ENV = 'COLOSSAL_LITE_WORKER_PIDS'
REAPED = 'reaped'          # FirstExit status: the launcher reaped it before we looked


@contextlib.contextmanager
def stacks_on_sigusr1():
    """While inside, ``kill -USR1`` on this process prints its stacks on stderr
    (``start.dump_stacks_on_sigusr1``; each worker sets the same in :func:`run_worker`), so
    a hung run can tell where each process waits."""
    registered = dump_stacks_on_sigusr1()
    try:
        yield
    finally:
        if registered:
            faulthandler.unregister(signal.SIGUSR1)


def run_worker(entrypoint, *args):
    """Each worker's first call: ``start.setup_process`` (stacks on ``kill -USR1``, torch's
    threads), note this process's pid beside its error file and in :class:`FirstExit`'s
    directory, then run ``entrypoint(*args)``."""
    setup_process()
    pid = str(os.getpid())
    error_file = os.environ.get('TORCHELASTIC_ERROR_FILE')
    if error_file:
        os.makedirs(os.path.dirname(error_file), exist_ok=True)
        with open(os.path.join(os.path.dirname(error_file), _PID_FILE), 'w') as f:
            f.write(pid)
    pid_dir = os.environ.get(_PID_DIR_ENV)
    if pid_dir and os.path.isdir(pid_dir):
        open(os.path.join(pid_dir, pid), 'w').close()
    return entrypoint(*args)


class FirstExit:
    """Context manager recording ``exits``: ``(pid, signal name | None | REAPED)`` of every
    worker process (registered by :func:`run_worker` in a directory named by an environment
    variable the workers inherit) in the order they exited (``SIGCHLD`` +
    ``waitid(P_PID, pid, WNOWAIT)``: nothing is reaped). Exits seen by one handler call
    are ordered killed ones first (the others follow from a kill). Outside the main thread
    it records nothing."""

    def __init__(self):
        self.exits: List[Tuple[int, Optional[str]]] = []
        self._old = self._dir = None

    @property
    def first(self) -> Optional[Tuple[int, Optional[str]]]:
        return self.exits[0] if self.exits else None

    def __enter__(self):
        try:
            self._old = signal.signal(signal.SIGCHLD, self._on_child)
        except ValueError:  # not the main thread
            self._old = None
            return self
        self._dir = tempfile.mkdtemp(prefix='colossal-lite-workers-')
        self._env = os.environ.get(_PID_DIR_ENV)
        os.environ[_PID_DIR_ENV] = self._dir
        return self

    def _on_child(self, signum, frame):
        seen = {pid for pid, _ in self.exits}
        found = []
        for name in os.listdir(self._dir):
            pid = int(name)
            if pid in seen:
                continue
            try:
                info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                found.append((pid, REAPED))
                continue
            if info is not None:
                killed = info.si_code in (os.CLD_KILLED, os.CLD_DUMPED)
                found.append((pid, _signal_name(info.si_status) if killed else None))
        self.exits += sorted(found, key=lambda e: e[1] in (None, REAPED))

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGCHLD, self._old)
            if self._env is None:
                os.environ.pop(_PID_DIR_ENV, None)
            else:
                os.environ[_PID_DIR_ENV] = self._env
            shutil.rmtree(self._dir, ignore_errors=True)
        return False


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f'signal {number}'


def _attempt_dirs(err) -> set:
    return {os.path.dirname(os.path.dirname(f.error_file)) for f in err.failures.values()
            if f.error_file}


def _rank_dirs(err):
    """(local rank, its directory) of every worker of the failed attempt."""
    for attempt in _attempt_dirs(err):
        if os.path.isdir(attempt):
            for name in os.listdir(attempt):
                if name.isdigit():
                    yield int(name), os.path.join(attempt, name)


def error_files(err) -> List[tuple]:
    """(mtime, local rank, message, traceback) of every error file the failed run left,
    oldest first."""
    found = []
    for rank, folder in _rank_dirs(err):
        path = os.path.join(folder, 'error.json')
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        info = data.get('message', data)
        message = info.get('message', '') if isinstance(info, dict) else str(info)
        stack = info.get('extraInfo', {}).get('py_callstack', '') if isinstance(info, dict) else ''
        found.append((os.path.getmtime(path), rank, message.strip(), stack))
    return sorted(found)


def _launcher_signals(err) -> dict:
    """{local rank: signal name} of the failures the launcher recorded with exitcode < 0."""
    out = {}
    for failure in err.failures.values():
        code = failure.exitcode if isinstance(failure.exitcode, int) else 0
        if code < 0:
            out[failure.local_rank] = _signal_name(-code)
    return out


def killed_ranks(err, first_exit: Optional[FirstExit] = None) -> List[tuple]:
    """(local rank, signal name) of the workers a signal ended, the first worker of the
    failed attempt to exit first when a signal ended it (FirstExit's order), then any other
    the launcher's record shows with ``exitcode < 0``, by rank."""
    signals = _launcher_signals(err)
    ranks = {}
    for rank, folder in _rank_dirs(err):
        try:
            with open(os.path.join(folder, _PID_FILE)) as f:
                ranks[int(f.read().strip())] = rank
        except (OSError, ValueError):
            continue
    first = next(((ranks[pid], how) for pid, how in (first_exit.exits if first_exit else ())
                  if pid in ranks), None)
    killed = []
    if first is not None:
        rank, how = first
        name = signals.get(rank) if how == REAPED else how
        if name:
            killed.append((rank, name))
    killed += sorted((r, n) for r, n in signals.items() if r not in dict(killed))
    return killed


def failure_message(err, first_exit: Optional[FirstExit] = None) -> str:
    """One line per failed rank -- a rank killed by a signal first (the others' broken
    connections follow from it), then the ranks that raised, oldest first -- and the
    traceback of the first rank that raised, once."""
    killed = killed_ranks(err, first_exit)
    found = [f for f in error_files(err) if f[1] not in dict(killed)]
    if not found and not killed:
        found = [(0, f.local_rank, f'exit code {f.exitcode}', '') for f in err.failures.values()]
    base = _first_global_rank(err)   # ranks are named globally: on node R, local + R*K
    lines = []
    for rank, name in killed:
        why = ' (the out-of-memory killer, or kill -9)' if name == 'SIGKILL' else ''
        text = f'killed by {name}{why}'
        rank += base
        lines.append(f'rank {rank} failed first: {text}' if not lines else f'  then rank {rank}: {text}')
    for _, rank, message, _ in found:
        text = message.splitlines()[0] if message else '?'
        rank += base
        lines.append(f'rank {rank} failed first: {text}' if not lines else f'  then rank {rank}: {text}')
    if found and found[0][3] and not killed:  # after a kill, the others only lost connections
        lines.append(f'traceback of rank {base + found[0][1]}:\n{found[0][3].rstrip()}')
    return '\n'.join(lines)


def _first_global_rank(err) -> int:
    """The global rank of this node's local rank 0: the launcher's failures are keyed by
    global rank and carry the local one (0 on a single node)."""
    return next((rank - f.local_rank for rank, f in err.failures.items()), 0)
