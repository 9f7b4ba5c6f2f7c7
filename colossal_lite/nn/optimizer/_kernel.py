"""Loading the C++ CPU Adam kernel (``csrc/cpu_adam.cpp``) and choosing a backend.

Order: the module built at install (``COLOSSAL_LITE_BUILD_CPU_ADAM=1 pip install -e .``
puts ``colossal_lite._cpu_adam`` next to the package), else a JIT build of the sources in
``csrc/`` by ``torch.utils.cpp_extension.load`` into torch's extension cache
(``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``; ~25 s once, then
cached), else the torch implementation (``_torch_adam``) with one warning.

``COLOSSAL_LITE_CPU_ADAM`` forces a backend for every call that does not name one:
``torch`` (the fallback), ``scalar``, ``avx2``, ``avx512`` or ``auto`` (the default: the
widest SIMD path this CPU runs).
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import os
import warnings
from typing import List, Optional

import torch

ENV_BACKEND = 'COLOSSAL_LITE_CPU_ADAM'
SIMD_NAMES = ('auto', 'avx512', 'avx2', 'scalar')
BACKENDS = SIMD_NAMES + ('torch',)
_CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..', '..', 'csrc')
_CFLAGS = ['-O3', '-fno-math-errno', '-fopenmp']  # torch picks the C++ standard


def _sources() -> List[str]:
    return [os.path.normpath(os.path.join(_CSRC, 'cpu_adam.cpp'))]


def _sources_digest() -> str:
    """A hash of the .cpp and its headers: torch's JIT cache only hashes the listed sources,
    so the headers' digest goes into the flags to rebuild when any of them changes."""
    digest = hashlib.sha1()
    root = os.path.normpath(_CSRC)
    for dirpath, _, files in sorted(os.walk(root)):
        for name in sorted(files):
            if name.endswith(('.cpp', '.h')):
                with open(os.path.join(dirpath, name), 'rb') as f:
                    digest.update(name.encode() + f.read())
    return digest.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def load_extension():
    """The compiled module (built at install, else JIT-built once per process and cached on
    disk), or None after one warning when it cannot be had."""
    try:
        # a compiled module beside the package's sources: loaded by name
        return importlib.import_module('colossal_lite._cpu_adam')  # built at install
    except ImportError:
        return build_extension(_sources())


def build_extension(sources: List[str], verbose: bool = False):
    """JIT-builds ``sources`` with torch.utils.cpp_extension; None (and a warning) on failure."""
    try:
        from torch.utils import cpp_extension
        if not os.path.exists(sources[0]):
            raise FileNotFoundError(f'no kernel sources at {sources[0]} (a wheel without csrc/; '
                                    'build at install with COLOSSAL_LITE_BUILD_CPU_ADAM=1)')
        cflags = _CFLAGS + [f'-DCPU_ADAM_SOURCES={_sources_digest()}']
        return cpp_extension.load(name='colossal_lite_cpu_adam', sources=sources,
                                  extra_cflags=cflags, extra_ldflags=['-fopenmp'],
                                  verbose=verbose)
    except Exception as exc:  # no compiler, no ninja, no headers: the torch path takes over
        warnings.warn(f'colossal_lite: the C++ CPU Adam kernel could not be built ({exc!r}); '
                      'using the torch implementation (slower, same results)', RuntimeWarning,
                      stacklevel=3)
        return None


def resolve_backend(backend: Optional[str] = None) -> str:
    """``backend`` if given, else ``$COLOSSAL_LITE_CPU_ADAM``, else ``'auto'``; checked."""
    name = backend if backend is not None else os.environ.get(ENV_BACKEND, 'auto')
    if name not in BACKENDS:
        raise ValueError(f'CPU Adam backend must be one of {BACKENDS}, got {name!r}'
                         f'{" (from $" + ENV_BACKEND + ")" if backend is None else ""}')
    return name


def kernel_for(backend: Optional[str] = None):
    """(module, simd name) to run, or (None, 'torch') for the torch implementation."""
    name = resolve_backend(backend)
    if name == 'torch':
        return None, 'torch'
    ext = load_extension()
    if ext is None:
        return None, 'torch'
    if name != 'auto' and name not in ext.supported_simd():
        raise ValueError(f'CPU Adam backend {name!r} is not supported by this CPU; it runs '
                         f'{ext.supported_simd()}')
    return ext, name


def supported_backends() -> List[str]:
    """The backends that run here: this CPU's SIMD paths (if the kernel builds), 'torch'."""
    ext = load_extension()
    return (list(ext.supported_simd()) if ext is not None else []) + ['torch']


def active_backend(backend: Optional[str] = None) -> str:
    """The concrete path ``backend`` (or the environment) resolves to on this machine."""
    ext, name = kernel_for(backend)
    if ext is None:
        return 'torch'
    return ext.best_simd() if name == 'auto' else name


def any_nonfinite(grad: torch.Tensor, backend: Optional[str] = None) -> bool:
    """True when ``grad`` holds an inf or a nan (a read-only scan)."""
    ext, name = kernel_for(backend)
    if ext is None or grad.device.type != 'cpu' or not grad.is_contiguous():
        return not bool(torch.isfinite(grad).all())
    return bool(ext.any_nonfinite(grad, name))
