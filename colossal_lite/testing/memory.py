"""Exact memory on CPU: the bytes of live tensors, and the peak torch's allocator handed out.

:func:`live_tensor_bytes` sums the storages of every live tensor (each once).

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
import warnings
from typing import Callable, List, Sequence

import torch


def live_tensor_bytes(scalars: bool = True) -> int:
    """Bytes of the storages of every live tensor (found through gc after a collection, so
    tensors left in unreachable cycles do not count; a DTensor through its local tensor),
    each storage once. ``scalars=False`` leaves out 0-dim tensors (e.g. AdamW's
    per-parameter step counters)."""
    from torch.distributed.tensor import DTensor
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
