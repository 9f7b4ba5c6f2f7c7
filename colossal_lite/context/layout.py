"""The rank layout: a pure function from the parallel degrees to every process group.

A global rank is a point on a grid of named axes, outermost first::

    pipe, data, <tensor sub-axes>

with the tensor axis unfolded per mode (innermost varies fastest):

    1d / sequence : t
    2d            : row, col                 t = row*q + col
    2.5d          : dep, row, col            t = dep*q*q + row*q + col
    3d            : output, weight, input    t = l*q*q + j*q + i

A group is the set of ranks that share every coordinate except the varying
ones; its members are listed in increasing global rank, so a rank's position
in the list is its local rank in that group. Nothing here touches
``torch.distributed``: tests check the layout without processes.
"""
from __future__ import annotations

import itertools
from typing import Dict, List, Sequence, Tuple

from ..config.families import family
from ..config.layout import ParallelLayout
from ..config.modes import ParallelMode

Groups = List[Tuple[int, ...]]


def _family(layout: ParallelLayout):
    return family(layout.mode)


def axes_of(layout: ParallelLayout) -> List[Tuple[str, int]]:
    """The named axes of the rank grid, outermost first."""
    if layout.data is None:
        raise ValueError('the layout needs the data-parallel degree; call with_world_size first')
    return [('pipe', layout.pipeline), ('data', layout.data)] + list(_family(layout).axes(layout))


def groups_varying(axes: Sequence[Tuple[str, int]], varying: Sequence[str]) -> Groups:
    """Every group of ranks that differ only along ``varying`` axes (members ascending)."""
    names = [name for name, _ in axes]
    unknown = set(varying) - set(names)
    if unknown:
        raise ValueError(f'unknown axes {sorted(unknown)}; the grid has {names}')
    sizes = [size for _, size in axes]
    strides = [1] * len(sizes)
    for k in range(len(sizes) - 2, -1, -1):
        strides[k] = strides[k + 1] * sizes[k + 1]
    fixed = [k for k, name in enumerate(names) if name not in varying]
    moving = [k for k, name in enumerate(names) if name in varying]
    groups = []
    for fixed_coords in itertools.product(*(range(sizes[k]) for k in fixed)):
        base = sum(c * strides[k] for c, k in zip(fixed_coords, fixed))
        members = [base + sum(c * strides[k] for c, k in zip(coords, moving))
                   for coords in itertools.product(*(range(sizes[k]) for k in moving))]
        groups.append(tuple(sorted(members)))
    return groups


def mode_axes(layout: ParallelLayout) -> Dict[ParallelMode, Tuple[str, ...]]:
    """Every mode the layout builds, with the grid axes that vary inside its groups
    (in grid order, so a member's local rank is its flattened coordinate on them)."""
    names = [name for name, _ in axes_of(layout)]
    fam = _family(layout)
    varying = {ParallelMode.GLOBAL: tuple(names), ParallelMode.PIPELINE: ('pipe',),
               ParallelMode.DATA: ('data',), ParallelMode.TENSOR: fam.tensor_axis_names}
    varying.update(fam.groups)
    return {mode: tuple(n for n in names if n in axes) for mode, axes in varying.items()}


def build_groups(layout: ParallelLayout) -> Dict[ParallelMode, Groups]:
    """All groups of every mode the layout uses, as lists of global-rank tuples."""
    axes = axes_of(layout)
    groups = {mode: groups_varying(axes, varying) for mode, varying in mode_axes(layout).items()}
    groups[ParallelMode.EMBEDDING] = embedding_groups(groups[ParallelMode.PIPELINE])
    return groups


def embedding_groups(pipeline_groups: Groups) -> Groups:
    """The first and last rank of each pipeline group; every middle-stage rank alone (so each
    rank is in one EMBEDDING group, of size 1 where it holds no tied weight)."""
    out = []
    for g in pipeline_groups:
        out.append(tuple(sorted({g[0], g[-1]})))
        out.extend((r,) for r in g[1:-1])
    return out


def coordinates(layout: ParallelLayout, rank: int) -> Dict[str, int]:
    """The rank's coordinate on every named axis."""
    axes = axes_of(layout)
    coords = {}
    for name, size in reversed(axes):
        coords[name] = rank % size
        rank //= size
    return coords
