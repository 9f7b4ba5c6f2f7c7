"""Where chunk shards live, and the exact byte accounting of device memory.

:class:`DeviceLedger` counts the *model data* on the run's device, in bytes, at every chunk
move (on a CPU-only run the device is the CPU, so the policies are exercised and tested
there): per chunk (``s`` = shard elements, ``c`` = capacity, ``b`` = bytes per element of
the parameters' dtype)

* a shard living on the device: ``16 s`` (fp32 master 4 s, its gradient 4 s, Adam moments
  8 s), for as long as it lives there;
* a shard copied to the device to be gathered (``cpu``/``auto``, or a device shard cast to
  fp16/bf16): ``s b``, until gathered (``auto`` keeps it as a cache);
* the gathered chunk: ``c b`` while any tensor in it computes, then as the gradient buffer
  (gradients are written over the weights: storage reuse) until its reduce-scatter
  completes; the reduce-scatter output ``s b`` until it is added into the master's
  gradient (counted as moved device-to-host for CPU masters).

``device_memory_limit`` caps the total: an allocation that would pass it first asks the
policy to evict, then raises :class:`DeviceBudgetExceeded` naming the bytes. ``moved_h2d``
/ ``moved_d2h`` count the bytes copied between the CPU and the device.

Policies (chosen by ``zero.placement``): ``device`` (every shard on the device), ``cpu``
(every shard and master on the CPU, copied to the device to compute), ``static`` (the first
``ceil(device_fraction * chunks)`` chunks on the device, the rest as ``cpu``) and ``auto``
(masters on the CPU; shard copies cached on the device under the budget left after the
traced non-model peak, evicting the cached shard whose next use is farthest in the future
-- Belady, from the access order of the warm-up step -- and prefetching the next chunk's
shard when it fits). ``promote`` (adaptive HybridAdam, ``zero.device_margin_ratio``) homes a
CPU-homed chunk on the device from then on (``on_device``), accounted like ``device``.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Sequence

import torch

from .forecast import Forecast


class DeviceBudgetExceeded(RuntimeError):
    """The device budget cannot hold what must be on the device now."""


class DeviceLedger:
    """Model-data bytes on the device (module docstring); ``peak`` and ``used`` are exact."""

    def __init__(self, limit: Optional[float]):
        self.limit = None if limit is None else int(limit)
        self.used = self.peak = 0
        self.moved_h2d = self.moved_d2h = 0
        self.checks = 0            # allocations checked against the limit
        # callables(nbytes) -> bool (freed something), asked in order before an allocation
        # would pass the limit: gathered chunks kept idle first, then a policy's cache
        self.evictors: List[Callable[[int], bool]] = []

    def alloc(self, nbytes: int, what: str):
        if self.limit is not None and self.used + nbytes > self.limit:
            for evict in self.evictors:
                while self.used + nbytes > self.limit and evict(self.used + nbytes - self.limit):
                    pass
            if self.used + nbytes > self.limit:
                raise DeviceBudgetExceeded(
                    f'zero.device_memory_limit = {self.limit} bytes cannot hold {what} '
                    f'({nbytes} bytes) on top of {self.used} bytes of model data already on '
                    f'the device; raise the limit, use smaller chunks (zero.chunk_size_mb) or '
                    f"placement 'cpu'/'auto'")
        self.used += nbytes
        self.checks += 1
        self.peak = max(self.peak, self.used)

    def free(self, nbytes: int):
        self.used -= nbytes
        if self.used < 0:
            raise RuntimeError(f'device ledger went negative ({self.used} bytes)')

    def stats(self) -> dict:
        return {'limit': self.limit, 'used': self.used, 'peak': self.peak,
                'moved_h2d': self.moved_h2d, 'moved_d2h': self.moved_d2h,
                'checks': self.checks}


class Placement:
    """Base policy: every chunk's shard homed on the device (``device``)."""

    name = 'device'

    def __init__(self, chunks: Sequence, ledger: DeviceLedger, device: torch.device):
        self.chunks, self.ledger, self.device = list(chunks), ledger, device
        self._copies: Dict[int, int] = {}   # chunk index -> bytes of its shard copy
        self.promoted: set = set()          # CPU-homed chunks moved to the device (adaptive)

    def reset(self, chunks: Sequence):
        """New chunks (re-packed; nothing of the old ones on the device but their homed
        shards, which the caller frees)."""
        self.chunks = list(chunks)
        self._copies.clear()
        self.promoted.clear()

    # --------------------------------------------------------------- homes
    def on_device(self, chunk) -> bool:
        """Whether ``chunk``'s master (and its moments) live on the device."""
        return self.homed_on_device(chunk) or chunk.index in self.promoted

    def homed_on_device(self, chunk) -> bool:
        """The policy's own rule (``device``: every chunk)."""
        return True

    def promote(self, chunk):
        """From now on ``chunk``'s master, its gradient and its moments live on the device
        (adaptive HybridAdam): 16 s accounted; the master and moments (12 s) count as moved
        host-to-device. The caller moves the tensors."""
        self.ledger.alloc(16 * chunk.shard_numel, f'the promoted shard of chunk {chunk.index}')
        self.ledger.moved_h2d += 12 * chunk.shard_numel
        self.promoted.add(chunk.index)

    def master_device(self, chunk) -> torch.device:
        return self.device if self.on_device(chunk) else torch.device('cpu')

    def settle(self):
        """Account the shards homed on the device (called once the chunks exist)."""
        for chunk in self.chunks:
            if self.on_device(chunk):
                self.ledger.alloc(16 * chunk.shard_numel, f'the resident shard of chunk {chunk.index}')

    # --------------------------------------------------------------- per access
    def shard_for_gather(self, chunk) -> torch.Tensor:
        """The shard on the device, in the parameters' dtype, ready to all_gather: the master
        itself (fp32 on the device), else a copy, accounted until :meth:`after_gather`."""
        if self.on_device(chunk) and chunk.dtype == torch.float32:
            return chunk.master.detach()
        nbytes = chunk.payload_bytes
        self.ledger.alloc(nbytes, f'the shard of chunk {chunk.index}')
        if not self.on_device(chunk):
            self.ledger.moved_h2d += nbytes
        self._copies[chunk.index] = nbytes
        return chunk.master.detach().to(self.device, chunk.dtype)

    def after_gather(self, chunk):
        nbytes = self._copies.pop(chunk.index, 0)
        if nbytes:
            self.ledger.free(nbytes)

    def grad_to_master(self, chunk, grad_shard: torch.Tensor):
        """Add a reduce-scattered gradient shard (on the device) into ``master.grad``."""
        if not self.on_device(chunk):
            self.ledger.moved_d2h += chunk.payload_bytes
        chunk.add_grad(grad_shard)

    def after_step(self):
        """The masters changed (optimizer step or load)."""


class CpuPlacement(Placement):
    name = 'cpu'

    def homed_on_device(self, chunk) -> bool:
        return False


class StaticPlacement(Placement):
    """The first ``ceil(fraction * n)`` chunks (first-use order) on the device."""

    name = 'static'

    def __init__(self, chunks, ledger, device, fraction: float):
        super().__init__(chunks, ledger, device)
        self.fraction = fraction
        self.reset(chunks)

    def reset(self, chunks):
        super().reset(chunks)
        self.kept = math.ceil(self.fraction * len(self.chunks) - 1e-9)

    def homed_on_device(self, chunk) -> bool:
        return chunk.index < self.kept


class AutoPlacement(Placement):
    """Masters on the CPU, shard copies cached on the device with Belady eviction."""

    name = 'auto'

    def __init__(self, chunks, ledger, device):
        super().__init__(chunks, ledger, device)
        self.cache: Dict[int, torch.Tensor] = {}
        self.forecast = Forecast()          # the gather order of the traced warm-up step
        self.non_model_bytes = 0            # traced; kept free of model data
        self.hits = self.misses = self.prefetches = self.evictions = 0
        self.pinned: set = set()            # chunks being gathered right now
        ledger.evictors.append(self._evict)

    def homed_on_device(self, chunk) -> bool:
        return False

    def promote(self, chunk):
        if chunk.index in self.cache:
            self._drop(chunk.index)
        super().promote(chunk)

    @property
    def cache_budget(self) -> Optional[int]:
        if self.ledger.limit is None:
            return None
        return self.ledger.limit - self.non_model_bytes

    def reset(self, chunks):
        for index in list(self.cache):
            self._drop(index)
        super().reset(chunks)
        self.forecast.clear()
        self.set_trace([], 0)   # the next warm-up step traces the new chunks

    def set_trace(self, order: Sequence[int], non_model_bytes: int):
        self.forecast.set_order(order)
        self.non_model_bytes = int(non_model_bytes)

    def shard_for_gather(self, chunk) -> torch.Tensor:
        self.forecast.use(chunk.index)
        if self.on_device(chunk):   # promoted: the master itself (or its cast copy)
            return Placement.shard_for_gather(self, chunk)
        if chunk.index in self.cache:
            self.hits += 1
        else:
            self.misses += 1
            self._load(chunk)
        shard = self.cache[chunk.index]
        self._prefetch()
        return shard

    def after_gather(self, chunk):
        Placement.after_gather(self, chunk)   # a promoted chunk's cast copy, if any

    def after_step(self):
        for index in list(self.cache):
            self._drop(index)

    # --------------------------------------------------------------- cache
    def _load(self, chunk, evict: bool = True) -> bool:
        nbytes = chunk.payload_bytes
        budget = self.cache_budget
        if budget is not None and self.ledger.used + nbytes > budget:
            if not evict:
                return False
            while self.ledger.used + nbytes > budget and self._evict(nbytes, keep=chunk.index):
                pass
        self.ledger.alloc(nbytes, f'the shard of chunk {chunk.index}')
        self.ledger.moved_h2d += nbytes
        self.cache[chunk.index] = chunk.master.detach().to(self.device, chunk.dtype, copy=True)
        return True

    def _drop(self, index: int):
        del self.cache[index]
        self.ledger.free(self.chunks[index].payload_bytes)

    def _evict(self, nbytes: int, keep: int = -1) -> bool:
        candidates = [i for i in self.cache if i != keep and i not in self.pinned]
        if not candidates:
            return False
        self._drop(max(candidates, key=self.forecast.next_use))
        self.evictions += 1
        return True

    def _prefetch(self):
        nxt = self.forecast.upcoming()
        if nxt is None:
            return
        if nxt not in self.cache and self._load(self.chunks[nxt], evict=False):
            self.prefetches += 1


def build_placement(settings, chunks, ledger: DeviceLedger, device: torch.device) -> Placement:
    name = settings.placement
    if name == 'device':
        return Placement(chunks, ledger, device)
    if name == 'cpu':
        return CpuPlacement(chunks, ledger, device)
    if name == 'static':
        return StaticPlacement(chunks, ledger, device, settings.device_fraction)
    return AutoPlacement(chunks, ledger, device)
