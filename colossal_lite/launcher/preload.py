"""Imported once, in the fork server of :func:`~.start.rank_context` (never elsewhere): the
server imports the modules the launching process had imported (the file named by
``COLOSSAL_LITE_PRELOAD``, in their import order), every module of the library and what
torch imports at a rank's first optimizer (:data:`TORCH_LAZY`), so a rank forked from it
starts with them, as a forked child of the launching process would, without that
process's threads. A module the launching process imports after the server started is
imported by each rank that uses it.

A module that fails to import is left to the rank (it fails there, reported). The server
must stay single-threaded for its forks to be safe: torch runs on one thread
(``OMP_NUM_THREADS=1``), and a warning on stderr names the thread count if an import
started threads anyway.
"""
import os
import sys
import warnings

# imported lazily by torch at a first use that every training rank makes: the first
# optimizer's construction imports torch._dynamo (about 1 s, 400 modules)
TORCH_LAZY = ('torch._dynamo',)


def _library_modules() -> list:
    """Every module of the library but this one, listed from its files (no import statement:
    the server imports them by name, as the others): what a rank may import on its own."""
    import pkgutil
    top = __name__.split('.')[0]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        return [m.name for m in pkgutil.walk_packages([root], f'{top}.',
                                                        onerror=lambda name: None)
                if m.name != __name__]
    except Exception:   # a package that fails to import: the ranks import on their own
        return []


def _preload() -> None:
    path = os.environ.pop('COLOSSAL_LITE_PRELOAD', None)
    if not path:
        return
    try:
        with open(path) as f:
            names = f.read().split()
    except OSError:
        return
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')   # the launching process showed them already
        for name in names + _library_modules() + list(TORCH_LAZY):
            try:
                __import__(name)
            except KeyboardInterrupt:
                raise
            except BaseException:   # noqa: B036 -- pytest's Skipped, SystemExit: not ours
                pass
    import torch
    torch.set_num_threads(1)
    try:
        threads = len(os.listdir('/proc/self/task'))
    except OSError:
        return
    if threads > 1:
        print(f'colossal-lite launcher: the fork server runs {threads} threads after its '
              f'imports; a rank forked from it may inherit a held lock', file=sys.stderr)


_preload()
