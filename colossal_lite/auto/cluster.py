"""A cluster profile: what the planner knows about the machines, as JSON-ready data.

A :class:`ClusterProfile` holds

* ``devices`` (N), ``devices_per_node`` (G: ranks ``[k G, (k+1) G)`` share a node) and
  ``memory_bytes`` per device;
* ``flops``: the sustained compute rate of one device on transformer blocks (FLOP/s;
  measured: block FLOPs / measured block time), and optionally the raw ``compute``
  measurements it came from;
* ``collectives``: α-β pairs ``[alpha_s, beta_s_per_byte]`` keyed
  ``op -> str(group size) -> placement``, so a collective whose buffer (as
  ``comm_profile`` counts it) holds ``n`` bytes takes ``alpha + beta * n`` seconds;
  placement ``intra`` = every rank of the group in one node, ``inter`` = across nodes;
* ``links``: per placement a link's latency per ring step (s), bandwidth (bytes/s) and
  ``launch_s``, a fixed cost per call (kernel launch and synchronization), from which a
  missing table entry follows by the ring model (:func:`ring_alpha_beta`); ``links['host']``
  (optional): the host<->device link, ``latency_s`` per copy and ``bandwidth_Bps``, that
  offloaded ZeRO states cross (``offload.host_link``; default PCIe 4.0, 10 us and 25 GB/s);
* ``compute['cpu_adam_s_per_param']`` (optional): the host's Adam step per element of the
  offloaded states (default ``compute['adam_s_per_param']``).

Ops: ``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all``, ``broadcast``,
``reduce`` and ``p2p`` (one send between two ranks, group size 2).
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Dict, Optional, Tuple

OPS = ('all_reduce', 'all_gather', 'reduce_scatter', 'all_to_all', 'broadcast', 'reduce', 'p2p')
PLACEMENTS = ('intra', 'inter')
PROFILE_DIR = os.path.join(os.path.dirname(__file__), 'profiles')
SHIPPED = {'nvlink8': 'nvlink8.json', 'nodes4x8': 'nodes4x8.json', 'pcie8': 'pcie8.json'}


def ring_factors(op: str, p: int) -> Tuple[float, float]:
    """(latency steps, bandwidth share of the buffer) of a ring/chain collective over p ranks:
    all_reduce 2(p-1) steps moving 2(p-1)/p of the buffer, the others p-1 steps and (p-1)/p;
    p2p one step, the whole buffer."""
    if op == 'p2p':
        return 1.0, 1.0
    if p <= 1:
        return 0.0, 0.0
    if op == 'all_reduce':
        return 2.0 * (p - 1), 2.0 * (p - 1) / p
    return float(p - 1), (p - 1) / p


def ring_alpha_beta(op: str, p: int, latency: float, bandwidth: float, launch: float = 0.0
                    ) -> Tuple[float, float]:
    """The α-β pair of ``op`` over p ranks on links of ``latency`` s per ring step and
    ``bandwidth`` B/s, plus a fixed ``launch`` overhead per call."""
    steps, share = ring_factors(op, p)
    return launch + steps * latency, share / bandwidth


@dataclass
class ClusterProfile:
    """See the module doc. ``collectives[op][str(p)][placement] = [alpha, beta]``."""

    name: str
    devices: int
    devices_per_node: int
    memory_bytes: float
    flops: float
    links: Dict[str, Dict[str, float]] = field(default_factory=dict)
    collectives: Dict[str, Dict[str, Dict[str, list]]] = field(default_factory=dict)
    compute: Dict[str, object] = field(default_factory=dict)
    sources: Dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        for key in ('devices', 'devices_per_node'):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise ValueError(f'cluster profile {key!r} must be a positive integer, '
                                 f'got {getattr(self, key)!r}')
        for key in ('memory_bytes', 'flops'):
            if not getattr(self, key) > 0:
                raise ValueError(f'cluster profile {key!r} must be positive, '
                                 f'got {getattr(self, key)!r}')
        for op in self.collectives:
            if op not in OPS:
                raise ValueError(f'unknown collective {op!r} in cluster profile; ops: {OPS}')

    # ---------------------------------------------------------------- α-β lookup
    def alpha_beta(self, op: str, p: int, placement: str) -> Tuple[float, float]:
        """α, β of ``op`` over p ranks: the table entry, else scaled by the ring model from
        the table entry of the nearest size with this op and placement, else (a measured
        table without ``links``) from broadcast over 2 ranks for p2p and from all_reduce
        for other ops, else from ``links``."""
        cache = self.__dict__.setdefault('_cache', {})
        key = (op, p, placement)
        if key not in cache:
            cache[key] = self._alpha_beta(op, p, placement)
        return cache[key]

    def _alpha_beta(self, op: str, p: int, placement: str) -> Tuple[float, float]:
        if op not in OPS or placement not in PLACEMENTS:
            raise ValueError(f'unknown collective {op!r} or placement {placement!r}')
        if p <= 1 and op != 'p2p':
            return 0.0, 0.0
        table = self.collectives.get(op, {})
        entry = table.get(str(p), {}).get(placement)
        if entry is not None:
            return float(entry[0]), float(entry[1])
        sizes = [int(k) for k, v in table.items() if placement in v and int(k) > 1]
        if sizes:
            near = min(sizes, key=lambda k: (abs(k - p), -k))
            a, b = table[str(near)][placement]
            steps, share = ring_factors(op, p)
            steps0, share0 = ring_factors(op, near)
            return a * steps / steps0, b * share / share0
        stand_in = 'broadcast' if op == 'p2p' else 'all_reduce'  # measured tables lack some ops
        if op != stand_in and self.collectives.get(stand_in) and not self.links:
            a, b = self.alpha_beta(stand_in, 2 if op == 'p2p' else p, placement)
            if op == 'p2p':
                return a, b
            steps, share = ring_factors(op, p)
            steps0, share0 = ring_factors(stand_in, p)
            return a * steps / steps0, b * share / share0
        link = self.links.get(placement) or self.links.get('intra')
        if link is None:
            raise ValueError(f'cluster profile {self.name!r} has no {op} entry and no link '
                             f'parameters for placement {placement!r}')
        return ring_alpha_beta(op, p, link['latency_s'], link['bandwidth_Bps'],
                               link.get('launch_s', 0.0))

    def time(self, op: str, nbytes: float, p: int, placement: str) -> float:
        """Seconds of one ``op`` over p ranks moving a buffer of ``nbytes`` (0 for nothing)."""
        if nbytes <= 0 or (p <= 1 and op != 'p2p'):
            return 0.0
        alpha, beta = self.alpha_beta(op, p, placement)
        return alpha + beta * nbytes

    def placement(self, stride: int, size: int) -> str:
        """'intra' when a group of ``size`` ranks ``stride`` apart (aligned on a grid whose
        nodes hold ``devices_per_node`` consecutive ranks) stays inside one node."""
        return 'intra' if stride * size <= self.devices_per_node else 'inter'

    def group_time(self, op: str, nbytes: float, stride: int, size: int,
                   latency: bool = True) -> float:
        """:meth:`time` for a group of ``size`` ranks ``stride`` apart. A group crossing nodes
        shares each node's link with the ``min(stride, G)`` groups that cross beside it
        (one per rank offset inside the stride), so its bandwidth term is that many times
        longer. ``latency=False``: the bandwidth term alone (a message that rides in a
        bucket whose one latency is paid once)."""
        where = self.placement(stride, size)
        if nbytes <= 0 or (size <= 1 and op != 'p2p'):
            return 0.0
        alpha, beta = self.alpha_beta(op, size, where)
        share = min(stride, self.devices_per_node) if where == 'inter' else 1
        return (alpha if latency else 0.0) + beta * nbytes * share

    # ---------------------------------------------------------------- JSON
    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> 'ClusterProfile':
        return dataclass_from_json(cls, data, 'cluster profile')

    def save(self, path: str):
        with open(path, 'w') as f:
            json.dump(self.to_json(), f, indent=1)

    def with_devices(self, devices: int, memory_bytes: Optional[float] = None) -> 'ClusterProfile':
        """This profile for ``devices`` devices (and another memory per device)."""
        data = self.to_json()
        data['devices'] = devices
        if memory_bytes is not None:
            data['memory_bytes'] = memory_bytes
        return ClusterProfile.from_json(data)


def dataclass_from_json(cls, data: dict, what: str):
    """``cls(**data)`` for a dataclass, with a ValueError naming any unknown key."""
    known = set(cls.__dataclass_fields__)
    unknown = set(data) - known
    if unknown:
        raise ValueError(f'unknown {what} keys {sorted(unknown)}; keys: {sorted(known)}')
    return cls(**data)


def load_profile(source=None) -> ClusterProfile:
    """A profile from a :class:`ClusterProfile`, a shipped name (``'nvlink8'``,
    ``'nodes4x8'``), a JSON path or a dict; None gives ``'nvlink8'``."""
    if source is None:
        source = 'nvlink8'
    if isinstance(source, ClusterProfile):
        return source
    if isinstance(source, dict):
        return ClusterProfile.from_json(source)
    path = os.fspath(source)
    if path in SHIPPED:
        path = os.path.join(PROFILE_DIR, SHIPPED[path])
    if not os.path.isfile(path):
        raise ValueError(f'cluster profile {source!r} is neither a file nor one of the shipped '
                         f'profiles {sorted(SHIPPED)}')
    with open(path) as f:
        return ClusterProfile.from_json(json.load(f))
