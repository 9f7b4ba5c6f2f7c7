"""Host offload in the cost model: ZeRO-3 chunk placements and ZeRO-1/2 ``offload_optimizer``.

For a rank's local parameters, its ZeRO stage, data size D, chunk (or bucket) layout and
placement, :class:`Offload` gives what the runtime keeps on the device and moves per step
(``s_i`` the shard elements of chunk/bucket i, ``c_i = D s_i`` its capacity, ``b`` bytes per
element, M micro-batches):

* **ZeRO-3** (``zero/chunk/``), following ``DeviceLedger``'s accounting (placement.py's doc):
  chunks homed on the device (``device``: all; ``cpu``: none; ``static``: the first
  ``ceil(f n)``) keep ``16 s_i`` resident. Per micro-step every chunk is gathered in the
  forward; the backward re-gathers all but the ``keep_gathered + 1`` it uses first (the
  forward's last chunk and the idle ones Belady kept -- with a tied head the embedding chunk,
  used at both ends, is one of them). A CPU-homed chunk's gather copies ``s_i b`` host->device
  (``moved_h2d``); its reduce-scatter output ``s_i b`` goes device->host (``moved_d2h``, once
  per chunk and micro-step). The ledger's **peak** comes at the end of the backward: every
  chunk's gradient buffer ``sum c_i b`` plus the first finished reduce-scatter's output
  ``s_{n-1} b``, or, at a backward re-gather of a CPU-homed chunk j, every chunk gathered
  but the later re-gathers, plus the copy ``s_j b``, or at a forward gather of chunk j
  (``zero.prefetch`` 1: started while j-1 computes) ``c_j``, ``c_{j-1}``, the
  ``keep_gathered`` idle chunks Belady keeps (the tied embedding chunk first, then the most
  recent) and the copy. Exact for the defaults the planner writes (``keep_gathered`` 1,
  ``prefetch`` 1, no ``device_memory_limit``; tests/test_planner_offload.py). Host bytes:
  ``16 s_i`` per CPU-homed chunk.
* **ZeRO-1/2 offload_optimizer** (``zero/buckets.py``): the fp32 master slice, its gradient
  and the Adam moments, ``16 s_i`` per bucket, live on the host; per step each
  reduce-scatter output ``s_i b`` moves device->host (ZeRO-2: once per micro-step; ZeRO-1:
  once) and the updated slice ``s_i b`` host->device for the all_gather.

Time (:func:`offload_time`): the moved bytes over the host link (``links['host']``:
``latency_s`` per copy + bytes / ``bandwidth_Bps``; :data:`DEFAULT_HOST_LINK` when the profile
has none), not overlapped (the runtime copies synchronously), plus the Adam step of the
offloaded elements at ``compute['cpu_adam_s_per_param']`` instead of ``adam_s_per_param``.

Not modelled (kept out of the search; :func:`zero3_offload` raises NotImplementedError):
``auto``, whose cache holds what fits under the limit minus the traced non-model peak, known
only after the warm-up step; ``device_margin_ratio`` (adaptive promotion), which depends on
that same warm-up margin.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Iterator, List, Sequence, Tuple

from ..zero.chunk.search import search_chunk_size
from .cluster import ClusterProfile
from .memory import ZERO_BUCKET_BYTES
from .zero_stages import runtime_zero_stages

DEFAULT_HOST_LINK = {'latency_s': 1e-5, 'bandwidth_Bps': 25e9}   # PCIe 4.0 x16, one direction
STATIC_FRACTIONS = (0.25, 0.5, 0.75)    # the 'static' device fractions the search tries


@dataclass(frozen=True)
class Offload:
    """Device model data (``peak``, ``resident``), host bytes, bytes and copies moved per step,
    and elements the host's Adam steps (see the module doc)."""

    peak: int
    resident: int
    host_bytes: int
    moved_h2d: int
    moved_d2h: int
    copies: int
    host_params: int


# ------------------------------------------------------------------------------- layouts
def pack_shards(numels: Sequence[int], capacity: int, data: int) -> Tuple[int, ...]:
    """Shard elements per chunk of ``numels`` packed in order into chunks of ``capacity``
    elements, each rounded up to a multiple of ``data`` (``ChunkManager.pack`` for one key:
    a tensor larger than the capacity alone in its chunk)."""
    sizes: List[int] = []
    fill = None
    for n in numels:
        if n > capacity:
            sizes.append(n)
            continue
        if fill is None or fill + n > capacity:
            if fill is not None:
                sizes.append(fill)
            fill = 0
        fill += n
    if fill is not None:
        sizes.append(fill)
    return tuple(-(-n // data) for n in sizes)


def bucket_shards(numels: Sequence[int], data: int, bucket_bytes: int, elem: int = 4
                  ) -> Tuple[int, ...]:
    """Shard elements per ZeRO-1/2 flat bucket: tensors in reverse order, a bucket closed when
    the next would pass ``bucket_bytes`` (``buckets.build_buckets`` for one key)."""
    sizes, fill = [], None
    for n in reversed(numels):
        if fill is not None and (fill + n) * elem > bucket_bytes:
            sizes.append(fill)
            fill = None
        fill = (fill or 0) + n
    sizes.append(fill or 0)
    return tuple(-(-n // data) for n in sizes)


def model_numels(shape, tensor: int = 1) -> List[int]:
    """The model's parameter tensors in model (= first-use) order, serial sizes / t (1D splits
    each weight about evenly: an estimate of the local shards; exact for t = 1)."""
    return [-(-n // tensor) for n in shape.model_numels()]


@lru_cache(maxsize=256)
def chunk_shards(shape, data: int, tensor: int = 1) -> Tuple[int, ...]:
    """The chunk layout the runtime builds with ``chunk_size_mb=None``: the searched capacity
    (``search_chunk_size``, as ``cost.zero3_chunks``), tensors packed in model order."""
    numels = model_numels(shape, tensor)
    return pack_shards(numels, search_chunk_size(numels, dp_sizes=(data,)).capacity, data)


# ------------------------------------------------------------------------------- ZeRO-3
def static_kept(chunks: int, fraction: float) -> int:
    """Chunks ``static`` homes on the device (``StaticPlacement``)."""
    return math.ceil(fraction * chunks - 1e-9)


def zero3_offload(shards: Sequence[int], data: int, placement: str, microbatches: int,
                  device_fraction: float = 1.0, keep_gathered: int = 1, tied: bool = False,
                  elem: int = 4) -> Offload:
    """The device ledger of chunk ZeRO over one step (module doc) for chunks of ``shards``
    elements per rank in first-use order; ``tied``: the head reuses the first chunk's
    embedding (``ModelShape.tied_head``)."""
    n = len(shards)
    if placement == 'auto':
        raise NotImplementedError("placement 'auto' caches what fits under the limit minus the "
                                  "non-model peak traced in the warm-up step, which the planner "
                                  "cannot predict exactly")
    kept = {'device': n, 'cpu': 0}.get(placement)
    if kept is None:
        if placement != 'static':
            raise ValueError(f"placement must be 'device', 'cpu' or 'static', got {placement!r}")
        kept = static_kept(n, device_fraction)
    home = [i < kept for i in range(n)]
    caps = [s * data * elem for s in shards]
    backward = ([0] if tied and n > 1 else []) + [i for i in reversed(range(n))
                                                  if not (tied and i == 0 and n > 1)]
    regather = backward[keep_gathered + 1:]
    host = [i for i in range(n) if not home[i]]
    resident = 16 * sum(shards[i] for i in range(n) if home[i])
    h2d = microbatches * elem * (sum(shards[i] for i in host)
                                 + sum(shards[i] for i in regather if not home[i]))
    d2h = microbatches * elem * sum(shards[i] for i in host)
    copies = microbatches * (len(host) + sum(1 for i in regather if not home[i]) + len(host))
    peak = sum(caps) + shards[n - 1] * elem         # every gradient buffer + the first output
    later = 0
    for j in reversed(regather):                     # the last re-gather first
        if not home[j]:
            peak = max(peak, sum(caps) - later + shards[j] * elem)
        later += caps[j]
    for j in range(n):   # a forward gather: j, the chunk computing before it, the idle kept
        idle = ([0] if tied and j > 1 else []) + list(range(j - 2, -1, -1))
        held = [j] + ([j - 1] if j else []) + [i for i in idle if i != 0 or tied][:keep_gathered]
        copy = 0 if home[j] else shards[j] * elem
        peak = max(peak, sum(caps[i] for i in dict.fromkeys(held)) + copy)
    return Offload(resident + peak, resident, 16 * sum(shards[i] for i in host), h2d, d2h,
                   copies, sum(shards[i] for i in host))


# ------------------------------------------------------------------------------- ZeRO-1/2
def low_level_offload(shards: Sequence[int], stage: int, microbatches: int, elem: int = 4
                      ) -> Offload:
    """ZeRO-1/2 with ``offload_optimizer`` (module doc): ``peak``/``resident`` are the fp32
    states that left the device (the planner subtracts them), ``host_bytes`` the same."""
    total = sum(shards)
    calls = microbatches if stage == 2 else 1
    return Offload(16 * total, 16 * total, 16 * total, elem * total, calls * elem * total,
                   (calls + 1) * len(shards), total)


# ------------------------------------------------------------------------------- time
def host_link(cluster: ClusterProfile) -> Tuple[float, float]:
    """(latency s per copy, bytes/s) of the host<->device link (``links['host']``)."""
    link = cluster.links.get('host') or DEFAULT_HOST_LINK
    return float(link['latency_s']), float(link['bandwidth_Bps'])


def offload_time(cluster: ClusterProfile, off: Offload) -> float:
    """Seconds offloading adds to a step: the copies over the host link and the host's Adam
    step of its elements in place of the device's (module doc)."""
    latency, bandwidth = host_link(cluster)
    device_rate = float(cluster.compute.get('adam_s_per_param', 0.0))
    cpu_rate = float(cluster.compute.get('cpu_adam_s_per_param', device_rate))
    return (off.copies * latency + (off.moved_h2d + off.moved_d2h) / bandwidth
            + (cpu_rate - device_rate) * off.host_params)


# ------------------------------------------------------------------------------- estimates
def offload_only_stages(layout) -> Tuple[int, ...]:
    """ZeRO stages the search costs offloaded only: with one data replica ZeRO shards
    nothing (its device placement holds what no ZeRO holds, and is slower), but moving the
    states to the host is what fits a model larger than the device (Colossal-AI's GPT-2 on
    one GPU): the stages the runtime runs there (``zero_stages.runtime_zero_stages``)."""
    return tuple(z for z in runtime_zero_stages(layout) if z) if layout.data == 1 else ()


def is_offloaded(cand) -> bool:
    return (cand.zero == 3 and cand.placement != 'device') or (
        cand.zero in (1, 2) and cand.offload_optimizer)


def normalized(cand):
    """``cand`` without the offload settings its ZeRO stage does not have."""
    if cand.zero != 3 and cand.placement != 'device':
        cand = replace(cand, placement='device', device_fraction=1.0)
    if cand.zero not in (1, 2) and cand.offload_optimizer:
        cand = replace(cand, offload_optimizer=False)
    return cand


def apply(est, shape, cluster: ClusterProfile, elem: int = 4):
    """The :class:`~.cost.Estimate` of an offloaded candidate from its device-placement
    estimate ``est`` (whose candidate names the placement): the device memory with the model
    data the runtime keeps there (ZeRO-3: the estimate's non-model part, i.e. minus the
    device placement's ledger peak, plus this placement's; ZeRO-1/2: the fp32 states that
    left), the step time plus :func:`offload_time`; ``terms`` gains ``offload`` (s),
    ``host_bytes`` and ``offload_detail`` (the busiest rank's :class:`Offload`)."""
    cand = est.candidate
    l = cand.layout
    memory, detail = list(est.memory), None
    if cand.zero == 3:
        shards = chunk_shards(shape, l.data, l.tensor if l.mode else 1)
        tied = shape.tied_head
        device = zero3_offload(shards, l.data, 'device', cand.microbatches, tied=tied, elem=elem)
        detail = zero3_offload(shards, l.data, cand.placement, cand.microbatches,
                               cand.device_fraction, tied=tied, elem=elem)
        memory = [m - device.peak + detail.peak for m in memory]
        details = [detail]
    else:
        details = []
        for r, params in enumerate(est.terms['params']):
            buckets = max(1, -(-int(params) * elem // ZERO_BUCKET_BYTES))
            shards = [-(-int(params) // buckets // l.data)] * buckets
            off = low_level_offload(shards, cand.zero, cand.microbatches, elem)
            buffers = est.terms['memory_buffers'][r]
            kept_shard = (elem * params / l.data if cand.zero == 2 and cand.microbatches > 1
                          and buffers.gradients_a else 0.0)   # the accumulated fp32 shard
            memory[r] -= 3 * elem * params / l.data + kept_shard
            details.append(off)
        detail = max(details, key=lambda o: o.host_params)
    extra = max(offload_time(cluster, o) for o in details)
    terms = dict(est.terms, offload=extra, host_bytes=[o.host_bytes for o in details],
                 offload_detail=detail)
    return replace(est, step_time=est.step_time + extra, memory=memory, terms=terms)


def variants(est, shape, cluster: ClusterProfile, elem: int = 4) -> Iterator:
    """Offloaded estimates of a device-placement estimate (ZeRO-3: ``cpu`` and ``static`` at
    :data:`STATIC_FRACTIONS` giving distinct chunk counts; ZeRO-1/2: ``offload_optimizer``);
    none for other stages. ``auto`` is left out (module doc)."""
    cand = est.candidate
    if cand.zero == 3:
        n = len(chunk_shards(shape, cand.layout.data,
                             cand.layout.tensor if cand.layout.mode else 1))
        seen = {0, n}
        yield apply(replace(est, candidate=replace(cand, placement='cpu')), shape, cluster, elem)
        for f in STATIC_FRACTIONS:
            if static_kept(n, f) not in seen:
                seen.add(static_kept(n, f))
                yield apply(replace(est, candidate=replace(cand, placement='static',
                                                           device_fraction=f)),
                            shape, cluster, elem)
    elif cand.zero in (1, 2):
        yield apply(replace(est, candidate=replace(cand, offload_optimizer=True)), shape,
                    cluster, elem)
