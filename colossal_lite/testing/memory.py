"""Exact memory on CPU: the bytes of live tensors, and the peak torch's allocator handed out.

:func:`live_tensor_bytes` sums the storages of every live tensor (each once).

:func:`peak_live_bytes` runs calls one after another under :class:`LiveStorages`, a
``TorchDispatchMode`` that counts each storage an op allocates from that op until the
storage is freed, by whichever thread frees it (a weak-reference finalizer on the storage,
which torch keeps alive as long as any tensor, view or autograd-saved copy uses it), on
top of the storages of the tensors it is told are held (parameters, inputs). Each storage
counts once. Use it where collectives run: gloo and DTensor's functional collectives free
buffers on their own threads, which the profiler's record below misses (it then sees the
live bytes grow step after step). What it does not see: scratch memory inside one kernel
and buffers the communication library allocates itself.

:func:`peak_allocated` runs calls one after another under ``torch.profiler`` with
``profile_memory``: the CPU allocator then reports every allocation, and every free of a
block allocated since the record began, in order. The running sum of those reports is
the bytes of tensors made since the record began and still alive; for each call, its
maximum during the call minus its value at the call's start is the call's peak above
what was live before it. A block allocated before the record and freed inside it is not
reported, so run a warm-up call first (a step replaces the previous step's buffers: the
second call's peak is exact). Deterministic: no RSS, no allocator slack, no non-tensor
memory (gloo's buffers, Python objects).
"""
from __future__ import annotations

import gc
import threading
import warnings
import weakref
from typing import Callable, Iterable, List, Sequence

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def live_tensor_bytes(scalars: bool = True) -> int:
    """Bytes of the storages of every live tensor (found through gc after a collection, so
    tensors left in unreachable cycles do not count; a DTensor through its local tensor),
    each storage once. ``scalars=False`` leaves out 0-dim tensors (e.g. AdamW's
    per-parameter step counters)."""
    gc.collect()
    seen, total = set(), 0
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        objects = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for obj in objects:
        try:
            t = obj._local_tensor if isinstance(obj, DTensor) else obj
            if not scalars and not t.dim():
                continue
            storage = t.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
            if storage.data_ptr() == 0 or key in seen:
                continue
            seen.add(key)
            total += storage.nbytes()
        except Exception:   # noqa: BLE001 -- meta/fake tensors and the like hold no bytes
            continue
    return total


def peak_allocated(calls: Sequence[Callable[[], object]]) -> List[int]:
    """For each of ``calls`` (run in order, in one record): the peak over the call of the
    CPU tensor bytes allocated since the call began and not yet freed."""
    from torch.profiler import ProfilerActivity, profile, record_function
    names = [f'peak_allocated_call_{i}' for i in range(len(calls))]
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for name, call in zip(names, calls):
            with record_function(name):
                call()
    events = prof.profiler.kineto_results.events()
    windows = {e.name(): (e.start_ns(), e.end_ns()) for e in events if e.name() in names}
    memory = sorted(((e.start_ns(), e.nbytes()) for e in events if e.name() == '[memory]'
                     and e.device_type() == torch.autograd.DeviceType.CPU))
    peaks = []
    for name in names:
        start, end = windows[name]
        live = sum(n for t, n in memory if t < start)
        base = peak = live
        for t, n in memory:
            if start <= t <= end:
                live += n
                peak = max(peak, live)
        peaks.append(peak - base)
    return peaks


def _storage(t: torch.Tensor):
    """The storage of a plain tensor holding bytes, else None (meta, fake, subclasses)."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.device.type == 'meta':
        return None
    try:
        storage = t.untyped_storage()
    except Exception:   # noqa: BLE001 -- tensors without storage (sparse, functional wrappers)
        return None
    return storage if storage.nbytes() and storage.data_ptr() else None


class LiveStorages(TorchDispatchMode):
    """While active, ``live`` is the bytes of the storages of ``held`` tensors plus those
    the ops run since allocated and not yet freed; ``peak`` its maximum since the start or
    the last :meth:`reset_peak`. A tensor subclass (DTensor) is left to its own dispatch,
    whose ops on local tensors are then counted (fake tensors hold no bytes). An op output
    shares an input's storage (a view, an in-place op) or holds a new one: only the new ones
    are counted."""

    _PLAIN = (torch.Tensor, torch.nn.Parameter)

    def __init__(self, held: Iterable[torch.Tensor] = ()):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._refs = {}                 # id() of a counted storage -> its weak reference
        self._lock = threading.RLock()  # frees come from any thread
        for t in held:
            storage = _storage(getattr(t, '_local_tensor', t))
            if storage is not None:
                self._track(storage)

    def _track(self, storage) -> None:
        key, n = id(storage), storage.nbytes()
        with self._lock:
            self._refs[key] = weakref.ref(storage, lambda _, key=key, n=n: self._free(key, n))
            self.live += n
            self.peak = max(self.peak, self.live)

    def _free(self, key: int, n: int) -> None:
        with self._lock:
            self._refs.pop(key, None)
            self.live -= n

    def reset_peak(self) -> None:
        self.peak = self.live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented       # DTensor runs its local ops, counted here
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not all(t in self._PLAIN for t in types):
            return out                  # fake tensors and other subclasses
        inputs = None
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = _storage(t)
            if storage is None or id(storage) in self._refs:
                continue
            if inputs is None:
                inputs = {id(s) for s in (_storage(a) for a in tree_leaves((args, kwargs))
                                          if isinstance(a, torch.Tensor)) if s is not None}
            if id(storage) not in inputs:
                self._track(storage)
        return out


def peak_live_bytes(calls: Sequence[Callable[[], object]],
                    held: Iterable[torch.Tensor] = ()) -> List[int]:
    """For each of ``calls`` (run in order under one :class:`LiveStorages` over ``held``):
    the peak over the call of the live bytes, those of ``held`` included."""
    peaks = []
    with LiveStorages(held) as tracker:
        for call in calls:
            tracker.reset_peak()
            call()
            peaks.append(tracker.peak)
    return peaks
