"""Why a ``colossal-lite train`` run stopped: one line per failed rank, the cause first.

The elastic launcher reports only the first failure it polls, which is often a rank whose
collective broke *because* another rank died. Two records give the real order:

* every worker that raises writes ``<attempt dir>/<local rank>/error.json`` (the launcher's
  ``record`` wrapper), read here oldest first;
* a worker ended by a signal (the out-of-memory killer, ``kill -9``) writes nothing, so
  :class:`FirstExit` watches ``SIGCHLD`` in the launching process and peeks at the first
  worker that exits with ``waitid(..., WNOWAIT)`` (the child stays for the launcher to
  reap); :func:`run_worker` writes each worker's pid beside its error file so the pid
  names a rank. The launcher's own failure record (``exitcode < 0``: minus the signal
  number) is read too.

A rank killed by a signal is named first, then the ranks that raised, oldest first; the
traceback of the first rank that raised is printed once (not after a kill: the others
only lost their connections).
"""
from __future__ import annotations

import json
import os
import signal
from typing import List, Optional, Tuple

_PID_FILE = 'pid'


def run_worker(entrypoint, *args):
    """Each worker's first call: note this process's pid beside its error file, then run
    ``entrypoint(*args)``."""
    error_file = os.environ.get('TORCHELASTIC_ERROR_FILE')
    if error_file:
        os.makedirs(os.path.dirname(error_file), exist_ok=True)
        with open(os.path.join(os.path.dirname(error_file), _PID_FILE), 'w') as f:
            f.write(str(os.getpid()))
    return entrypoint(*args)


class FirstExit:
    """Context manager recording ``(pid, signal name or None)`` of the first child process of
    this process that exits (``SIGCHLD`` + ``waitid(P_ALL, WNOWAIT)``: nothing is reaped).
    Outside the main thread it records nothing."""

    def __init__(self):
        self.first: Optional[Tuple[int, Optional[str]]] = None
        self._old = None

    def __enter__(self):
        try:
            self._old = signal.signal(signal.SIGCHLD, self._on_child)
        except ValueError:  # not the main thread
            self._old = None
        return self

    def _on_child(self, signum, frame):
        if self.first is not None:
            return
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        if info is None:
            return
        killed = info.si_code in (os.CLD_KILLED, os.CLD_DUMPED)
        self.first = (info.si_pid, _signal_name(info.si_status) if killed else None)

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGCHLD, self._old)
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


def killed_ranks(err, first_exit: Optional[FirstExit] = None) -> List[tuple]:
    """(local rank, signal name) of the workers a signal ended: the first worker to exit
    when a signal ended it, and any the launcher's record shows with ``exitcode < 0``."""
    killed = {}
    if first_exit is not None and first_exit.first and first_exit.first[1]:
        pid, name = first_exit.first
        for rank, folder in _rank_dirs(err):
            try:
                with open(os.path.join(folder, _PID_FILE)) as f:
                    if int(f.read().strip()) == pid:
                        killed[rank] = name
            except (OSError, ValueError):
                continue
    for failure in err.failures.values():
        code = failure.exitcode if isinstance(failure.exitcode, int) else 0
        if code < 0:
            killed.setdefault(failure.local_rank, _signal_name(-code))
    return sorted(killed.items())


def failure_message(err, first_exit: Optional[FirstExit] = None) -> str:
    """One line per failed rank -- a rank killed by a signal first (the others' broken
    connections follow from it), then the ranks that raised, oldest first -- and the
    traceback of the first rank that raised, once."""
    killed = killed_ranks(err, first_exit)
    found = [f for f in error_files(err) if f[1] not in dict(killed)]
    if not found and not killed:
        found = [(0, f.local_rank, f'exit code {f.exitcode}', '') for f in err.failures.values()]
    lines = []
    for rank, name in killed:
        why = ' (the out-of-memory killer, or kill -9)' if name == 'SIGKILL' else ''
        text = f'killed by {name}{why}'
        lines.append(f'rank {rank} failed first: {text}' if not lines else f'  then rank {rank}: {text}')
    for _, rank, message, _ in found:
        text = message.splitlines()[0] if message else '?'
        lines.append(f'rank {rank} failed first: {text}' if not lines else f'  then rank {rank}: {text}')
    if found and found[0][3] and not killed:  # after a kill, the others only lost connections
        lines.append(f'traceback of rank {found[0][1]}:\n{found[0][3].rstrip()}')
    return '\n'.join(lines)
