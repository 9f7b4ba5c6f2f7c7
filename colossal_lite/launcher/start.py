"""How the launcher starts a process -- decided once, here (:func:`start_method`) -- and what
every process it starts does first (:func:`setup_process`)."""
from __future__ import annotations

import atexit
import faulthandler
import os
import signal
import socket
import sys
import tempfile
import threading

WORKERS = 'workers'   # run_workers: the colossal-lite commands, through torch's elastic agent
RANKS = 'ranks'       # run_ranks: the planner's profiler and the test harness

PRELOAD_ENV = 'COLOSSAL_LITE_PRELOAD'   # the file listing what the fork server imports


def start_method(use: str) -> str:
    """The multiprocessing start method of ``use`` (:data:`WORKERS` or :data:`RANKS`).

    Never a plain ``fork`` of the launching process. A fork copies the process but only
    the calling thread: a lock that another thread held at that moment stays held in the
    child for good, and launching processes run threads (pytest after a test ran torch's
    OpenMP team, the elastic agent its store's threads, a notebook its own). Both hung our
    runs: a worker stuck in ``getaddrinfo`` on glibc's resolver lock while its peers
    waited for it in gloo's rendezvous, and a child of a process that had run a 2-thread
    OpenMP region hanging in its own first 2-thread op (libgomp); and CUDA cannot be
    forked at all.

    * ``WORKERS`` -> ``'spawn'``: every worker a fresh interpreter and a direct child of
      the launching process, which :class:`~.failures.FirstExit` needs (``waitid`` sees
      only one's own children) to name a rank killed by a signal; torchrun's choice too.
      Each worker imports torch itself, about 1-2 s once per command.
    * ``RANKS`` -> ``'forkserver'``: one server per launching process, a fresh
      single-threaded interpreter (torch on one thread) that imports the modules the
      launching process had imported (:mod:`.preload`) and forks every rank from itself:
      as safe as spawn and as cheap as a fork, which matters to a test suite that starts
      ranks some hundreds of times (2 cores, a call of 2/4/8 ranks: fork 0.1/0.2/0.3 s,
      forkserver the same after a 2 s server start once per process, spawn 2.3/5.2/12.8 s;
      whole test files run faster than forked: docs/cli_and_data.md). ``fn`` and its
      arguments are pickled (``fn`` by reference: a module-level function); the rank gets
      the call's environment, working directory, ``sys.path``, stdout and stderr, and no
      other state of the launching process's memory (a monkeypatch, a global set at run
      time).
    """
    methods = {WORKERS: 'spawn', RANKS: 'forkserver'}
    if use not in methods:
        raise ValueError(f'start_method: use must be one of {sorted(methods)}, got {use!r}')
    return methods[use]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def dump_stacks_on_sigusr1(file=2) -> bool:
    """``kill -USR1 PID`` makes this process write every thread's Python stack to ``file``
    (a descriptor or an open file; default fd 2, which pytest's capture keeps) and run on
    (``faulthandler``); False (nothing done) when a SIGUSR1 handler is already set."""
    if signal.getsignal(signal.SIGUSR1) is not signal.SIG_DFL:
        return False
    faulthandler.register(signal.SIGUSR1, file=file, all_threads=True)
    return True


def setup_process(stack_file=2) -> None:
    """What every started process does first: its stacks on ``kill -USR1``
    (:func:`dump_stacks_on_sigusr1`) and torch's intra-op threads set to
    ``OMP_NUM_THREADS`` (the launcher exports 1)."""
    dump_stacks_on_sigusr1(stack_file)
    threads = os.environ.get('OMP_NUM_THREADS', '')
    if threads.isdigit() and int(threads) > 0:
        import torch
        torch.set_num_threads(int(threads))


_server_lock = threading.Lock()
_preload_file = None


def _preload_names() -> list:
    """The modules of this process that are not the standard library's, in import order."""
    stdlib = sys.stdlib_module_names
    return [name for name, module in list(sys.modules.items())
            if module is not None and name not in ('__main__', '__mp_main__')
            and name.partition('.')[0] not in stdlib]


def rank_context():
    """The multiprocessing context of :data:`RANKS`, its fork server running: started once
    per process with ``OMP_NUM_THREADS=1`` and told (:data:`PRELOAD_ENV`) to import what
    this process has imported by now (:mod:`.preload`)."""
    import multiprocessing
    from multiprocessing import forkserver
    global _preload_file
    ctx = multiprocessing.get_context(start_method(RANKS))
    with _server_lock:
        if _preload_file is None:
            fd, _preload_file = tempfile.mkstemp(prefix='colossal-lite-preload-', suffix='.txt')
            with os.fdopen(fd, 'w') as f:
                f.write('\n'.join(['torch', 'colossal_lite'] + _preload_names()))
            atexit.register(_remove, _preload_file)
        ctx.set_forkserver_preload([f'{__package__}.preload'])
        saved = {k: os.environ.get(k) for k in ('OMP_NUM_THREADS', PRELOAD_ENV)}
        os.environ.update(OMP_NUM_THREADS='1', **{PRELOAD_ENV: _preload_file})
        try:
            forkserver.ensure_running()   # a no-op while it runs
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
    return ctx


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
