"""Memory measurement on CPU for benchmarks: live tensor bytes, RSS, and a resettable peak RSS.

* :func:`live_tensor_bytes` -- bytes of every live tensor storage (each once; DTensors through
  their local tensor), found through ``gc`` after a collection;
* :func:`reset_peak` -- ``gc`` + ``malloc_trim`` + ``/proc/self/clear_refs`` 5, which resets the
  peak RSS (``VmHWM``, what ``getrusage`` reports as ``ru_maxrss``) to the current RSS;
* :func:`rss_bytes` / :func:`peak_rss` -- the current and the peak resident set size.
Linux only (``/proc``, glibc).
"""
from __future__ import annotations

import ctypes
import gc
import os
import resource

from colossal_lite.testing.memory import live_tensor_bytes  # noqa: F401 -- shared with the tests

_LIBC = ctypes.CDLL('libc.so.6')


def rss_bytes() -> int:
    with open('/proc/self/statm') as f:
        return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE')


def reset_peak():
    gc.collect()
    _LIBC.malloc_trim(0)
    with open('/proc/self/clear_refs', 'w') as f:
        f.write('5')


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
