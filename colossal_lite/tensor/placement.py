"""Placement: how one tensor of the serial model lives on the ranks of a layout.

A :class:`Placement` is frozen, names parallel modes (never process-group handles)
and survives a JSON round trip, so it can be compared across layouts and written to
a checkpoint index:

* ``shape``: the full (serial) shape;
* ``cuts``: ``((dim, mode), ...)`` outermost first -- the full tensor is chunked
  along ``dim`` into ``size(mode)`` equal pieces and a rank keeps the piece of its
  local rank in ``mode``; the next cut cuts that piece again;
* ``replicated``: the modes whose ranks hold identical copies (DATA, and the tensor
  sub-groups the tensor is not cut over);
* ``grad_sum``: the modes over which the engine sums its gradient (DATA, or
  SEQUENCE_DP in sequence mode) -- sums a layer completes itself are not listed.

Every parameter built by a ``colossal_lite.nn`` layer carries one in its
``placement`` attribute, and so does every classifier output (logits cut along the
batch, the sequence or the classes); ``state_dict``, ``load_state_dict``,
``gather_logits`` and the losses read it. Cuts over one-rank groups are dropped,
so a serial tensor has no cuts. :meth:`Placement.dtensor_spec` gives the
``torch.distributed.tensor`` placements of the local shard over the layout's
``DeviceMesh`` (``layout_mesh``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from ..communication import collective as C
from ..communication import gather_from
from ..context import ParallelMode, ProcessGroupAxis, current_context
from ..context.layout import axes_of, mode_axes

Cut = Tuple[int, ParallelMode]
AxisOrMode = Union[ProcessGroupAxis, ParallelMode]
ATTR = 'placement'


def _axis(mode: ParallelMode) -> ProcessGroupAxis:
    return current_context().axis(mode)


@dataclass(frozen=True)
class Placement:
    shape: Tuple[int, ...]
    cuts: Tuple[Cut, ...] = ()
    replicated: Tuple[ParallelMode, ...] = ()
    grad_sum: Tuple[ParallelMode, ...] = ()

    # ------------------------------------------------------------ building
    @staticmethod
    def of(shape: Sequence[int], *cuts: Tuple[int, AxisOrMode],
           replicated: Sequence[ParallelMode] = (),
           grad_sum: Sequence[ParallelMode] = ()) -> 'Placement':
        """``Placement.of(shape, (0, col_axis), (1, row_axis))``; cuts over one-rank groups
        are dropped; negative dims are counted from the end of ``shape``."""
        shape = tuple(int(s) for s in shape)
        kept = []
        for dim, axis in cuts:
            ax = axis if isinstance(axis, ProcessGroupAxis) else _axis(axis)
            if ax.size > 1:
                kept.append((dim % len(shape), ax.mode))
        placement = Placement(shape, tuple(kept), tuple(replicated), tuple(grad_sum))
        placement.local_shape()  # divisibility, with a message naming the numbers
        return placement

    @property
    def is_replicated(self) -> bool:
        """No cut: every rank holds the whole tensor."""
        return not self.cuts

    def cut_modes(self, dim: int) -> Tuple[ParallelMode, ...]:
        dim %= len(self.shape)
        return tuple(mode for d, mode in self.cuts if d == dim)

    def with_shape(self, shape: Sequence[int]) -> 'Placement':
        return Placement(tuple(shape), self.cuts, self.replicated, self.grad_sum)

    # ------------------------------------------------------------ local shards
    def local_shape(self) -> Tuple[int, ...]:
        shape = list(self.shape)
        for dim, mode in self.cuts:
            parts = _axis(mode).size
            if shape[dim] % parts:
                raise ValueError(f'dimension {dim} of size {shape[dim]} (full shape '
                                 f'{self.shape}) must be divisible by the {mode.name} group '
                                 f'size {parts}')
            shape[dim] //= parts
        return tuple(shape)

    def shard(self, full: torch.Tensor, dims: Optional[int] = None) -> torch.Tensor:
        """This rank's piece of ``full`` (no communication). ``dims``: apply only the cuts
        on the first ``dims`` dimensions (e.g. labels of ``[b, s, C]`` logits)."""
        out = full
        for dim, mode in self.cuts:
            if dims is not None and dim >= dims:
                continue
            ax = _axis(mode)
            if out.shape[dim] % ax.size:
                raise ValueError(f'dimension {dim} of size {out.shape[dim]} must be divisible '
                                 f'by the {mode.name} group size {ax.size}')
            out = out.chunk(ax.size, dim=dim)[ax.rank]
        return out.contiguous()

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """The full tensor on every rank from the local pieces (one all_gather per cut,
        innermost first; not differentiable)."""
        out = local.detach().contiguous()
        for dim, mode in reversed(self.cuts):
            out = C.all_gather(out, mode, dim=dim)
        return out

    def gather_differentiable(self, local: torch.Tensor) -> torch.Tensor:
        """As :meth:`gather`, differentiable: backward keeps this rank's piece of the
        gradient (right when what follows is computed alike on every rank)."""
        out = local
        for dim, mode in reversed(self.cuts):
            out = gather_from(out, mode, dim)
        return out

    # ------------------------------------------------------------ serialization
    def to_dict(self) -> dict:
        return {'shape': list(self.shape), 'cuts': [[d, m.value] for d, m in self.cuts],
                'replicated': [m.value for m in self.replicated],
                'grad_sum': [m.value for m in self.grad_sum]}

    @staticmethod
    def from_dict(data: dict) -> 'Placement':
        return Placement(tuple(data['shape']),
                         tuple((int(d), ParallelMode(m)) for d, m in data['cuts']),
                         tuple(ParallelMode(m) for m in data.get('replicated', ())),
                         tuple(ParallelMode(m) for m in data.get('grad_sum', ())))

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @staticmethod
    def from_json(text: str) -> 'Placement':
        return Placement.from_dict(json.loads(text))

    # ------------------------------------------------------------ DTensor
    def dtensor_spec(self, mesh_dims: Sequence[str],
                     mode_axes: Dict[ParallelMode, Tuple[str, ...]]) -> List[object]:
        """``torch.distributed.tensor`` placements, one per mesh dim in ``mesh_dims``:
        ``Shard(dim)`` on each grid axis a cut varies, ``Replicate()`` elsewhere. Cuts of one
        tensor dim must follow the mesh order (outer cut on the outer mesh dim)."""
        from torch.distributed.tensor import Replicate, Shard
        spec: List[object] = [Replicate() for _ in mesh_dims]
        last_index: Dict[int, int] = {}
        for dim, mode in self.cuts:
            for name in mode_axes[mode]:
                if name not in mesh_dims:
                    raise ValueError(f'{mode.name} varies grid axis {name!r}, which is not in '
                                     f'the mesh {list(mesh_dims)}')
                index = list(mesh_dims).index(name)
                if index <= last_index.get(dim, -1):
                    raise NotImplementedError(
                        f'dimension {dim} is cut in an order that is not the mesh order '
                        f'({self.cuts}); DTensor would need a strided shard')
                last_index[dim] = index
                spec[index] = Shard(dim)
        return spec


# ---------------------------------------------------------------------------- tagging
def set_placement(tensor: torch.Tensor, placement: Placement) -> torch.Tensor:
    setattr(tensor, ATTR, placement)
    return tensor


def placement_of(tensor: torch.Tensor) -> Optional[Placement]:
    """The tensor's placement, or None when it has none (an untagged activation)."""
    return getattr(tensor, ATTR, None)


def param_placement(param: torch.Tensor) -> Placement:
    """A parameter's placement; a plain torch parameter is whole on every rank."""
    placement = placement_of(param)
    return placement if placement is not None else Placement(tuple(param.shape))


def tag(tensor: torch.Tensor, *cuts: Tuple[int, AxisOrMode]) -> torch.Tensor:
    """Tag an activation (e.g. logits) with the cuts that made it from the full tensor."""
    full = list(tensor.shape)
    for dim, axis in cuts:
        ax = axis if isinstance(axis, ProcessGroupAxis) else _axis(axis)
        full[dim % tensor.dim()] *= ax.size
    return set_placement(tensor, Placement.of(full, *cuts))


# ---------------------------------------------------------------------------- DeviceMesh
def layout_mesh(layout, device_type: Optional[str] = None):
    """A ``DeviceMesh`` with one named dim per grid axis of the launched ``layout``
    (``pipe, data, <tensor sub-axes>``); collective the first time (every rank calls it),
    then kept by the context until ``destroy()``, so repeated calls create no new groups."""
    from torch.distributed.device_mesh import init_device_mesh
    ctx = current_context()
    device_type = device_type or ctx.device.type
    key = (layout, device_type)
    if key not in ctx.meshes:
        axes = axes_of(layout)
        ctx.meshes[key] = init_device_mesh(device_type, tuple(size for _, size in axes),
                                           mesh_dim_names=tuple(name for name, _ in axes))
    return ctx.meshes[key]


def to_dtensor(local: torch.Tensor, placement: Placement, mesh, layout):
    """``DTensor`` of a stage-local shard over the non-pipeline dims of ``mesh``."""
    from torch.distributed.tensor import DTensor
    names = tuple(n for n in mesh.mesh_dim_names if n != 'pipe')
    meshes = current_context().meshes       # slicing a mesh takes ms: once per mesh
    sub = meshes.get(('non-pipe', id(mesh)))
    if sub is None:
        sub = meshes[('non-pipe', id(mesh))] = mesh[names]
    spec = placement.dtensor_spec(names, mode_axes(layout))
    return DTensor.from_local(local, sub, spec, run_check=False,
                              shape=torch.Size(placement.shape),
                              stride=torch.empty(placement.shape, device='meta').stride())
