"""Sharding specs: how a local tensor is cut out of the full (serial) tensor.

A :class:`ShardSpec` is an ordered tuple of :class:`DimShard` (dim, axis):
the full tensor is chunked along ``dim`` into ``axis.size`` pieces and this
rank keeps piece ``axis.rank``; the next entry cuts that piece again. No
entry means replicated. ``shard`` needs no communication; ``gather`` undoes
the cuts innermost-first with one all-gather per entry (over that entry's
group). A tensor replicated over other groups simply has no entry for them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple

import torch

from ..communication import collective as C
from ..context import ProcessGroupAxis

_SPEC_ATTR = 'shard_spec'


@dataclass(frozen=True)
class DimShard:
    dim: int
    axis: ProcessGroupAxis


@dataclass(frozen=True)
class ShardSpec:
    shards: Tuple[DimShard, ...] = ()

    @staticmethod
    def of(*pairs: Tuple[int, ProcessGroupAxis]) -> 'ShardSpec':
        """``ShardSpec.of((0, row_axis), (1, col_axis))``; size-1 axes are dropped."""
        return ShardSpec(tuple(DimShard(d, a) for d, a in pairs if a.size > 1))

    @property
    def is_replicated(self) -> bool:
        return not self.shards

    def local_shape(self, full_shape: Sequence[int]) -> Tuple[int, ...]:
        shape = list(full_shape)
        for s in self.shards:
            if shape[s.dim] % s.axis.size:
                raise ValueError(f'dimension {s.dim} of size {shape[s.dim]} must be divisible by '
                                 f'the {s.axis.mode.name} group size {s.axis.size}')
            shape[s.dim] //= s.axis.size
        return tuple(shape)

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        self.local_shape(full.shape)  # divisibility check with a clear message
        out = full
        for s in self.shards:
            out = out.chunk(s.axis.size, dim=s.dim)[s.axis.rank]
        return out.contiguous()

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        out = local.contiguous()
        for s in reversed(self.shards):
            out = C.all_gather(out, s.axis, dim=s.dim)
        return out


def set_spec(param: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    setattr(param, _SPEC_ATTR, spec)
    return param


def get_spec(param: torch.Tensor) -> ShardSpec:
    return getattr(param, _SPEC_ATTR, ShardSpec())


def sharded_parameter(full_shape: Sequence[int], spec: ShardSpec,
                      init: Callable[[torch.Tensor], object],
                      dtype: Optional[torch.dtype] = None,
                      device: Optional[torch.device] = None) -> torch.nn.Parameter:
    """Initialise the full tensor with ``init`` (default generator: the serial model's draws),
    keep this rank's shard, and tag the parameter with its spec."""
    full = torch.empty(tuple(full_shape), dtype=dtype or torch.get_default_dtype(), device=device)
    with torch.no_grad():
        init(full)
    return set_spec(torch.nn.Parameter(spec.shard(full)), spec)


def tied_or_new_parameter(weight: Optional[torch.nn.Parameter], full_shape: Sequence[int],
                          spec: ShardSpec, init: Callable[[torch.Tensor], object],
                          dtype: Optional[torch.dtype] = None) -> torch.nn.Parameter:
    """``weight`` itself when given (a tied weight, which must already be cut by ``spec``),
    else a new :func:`sharded_parameter`."""
    if weight is None:
        return sharded_parameter(full_shape, spec, init, dtype)
    if get_spec(weight) != spec or tuple(weight.shape) != spec.local_shape(full_shape):
        raise ValueError(f'a tied weight must be sharded as {spec} with local shape '
                         f'{spec.local_shape(full_shape)}, got {get_spec(weight)} and '
                         f'{tuple(weight.shape)}')
    return weight


def gather_full(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Gather ``tensor`` (a local shard, e.g. a gradient) with the spec of parameter ``like``."""
    return get_spec(like).gather(tensor)
