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

from ..config import ParallelLayout
from .parallel_mode import ParallelMode

Groups = List[Tuple[int, ...]]


def _tensor_axes(layout: ParallelLayout) -> List[Tuple[str, int]]:
    q = layout.tensor_grid
    if layout.mode == '2d':
        return [('row', q), ('col', q)]
    if layout.mode == '2.5d':
        return [('dep', layout.depth), ('row', q), ('col', q)]
    if layout.mode == '3d':
        return [('output', q), ('weight', q), ('input', q)]
    return [('t', layout.tensor)]


def axes_of(layout: ParallelLayout) -> List[Tuple[str, int]]:
    """The named axes of the rank grid, outermost first."""
    if layout.data is None:
        raise ValueError('the layout needs the data-parallel degree; call with_world_size first')
    return [('pipe', layout.pipeline), ('data', layout.data)] + _tensor_axes(layout)


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


_TENSOR_AXIS_NAMES = {None: ('t',), '1d': ('t',), 'sequence': ('t',),
                      '2d': ('row', 'col'), '2.5d': ('dep', 'row', 'col'),
                      '3d': ('output', 'weight', 'input')}

# the sub-groups of the tensor axis each mode needs, by the axes that vary within them
_MODE_GROUPS = {
    '1d': {ParallelMode.PARALLEL_1D: ('t',)},
    'sequence': {ParallelMode.SEQUENCE: ('t',), ParallelMode.SEQUENCE_DP: ('data', 't')},
    '2d': {ParallelMode.PARALLEL_2D_ROW: ('col',), ParallelMode.PARALLEL_2D_COL: ('row',)},
    '2.5d': {ParallelMode.PARALLEL_2P5D_ROW: ('col',), ParallelMode.PARALLEL_2P5D_COL: ('row',),
             ParallelMode.PARALLEL_2P5D_DEP: ('dep',), ParallelMode.PARALLEL_2P5D_XZ: ('col', 'dep')},
    '3d': {ParallelMode.PARALLEL_3D_INPUT: ('input',), ParallelMode.PARALLEL_3D_WEIGHT: ('weight',),
           ParallelMode.PARALLEL_3D_OUTPUT: ('output',),
           ParallelMode.PARALLEL_3D_INPUT_X_WEIGHT: ('input', 'weight'),
           ParallelMode.PARALLEL_3D_OUTPUT_X_WEIGHT: ('output', 'weight')},
}


def build_groups(layout: ParallelLayout) -> Dict[ParallelMode, Groups]:
    """All groups of every mode the layout uses, as lists of global-rank tuples."""
    axes = axes_of(layout)
    tensor_names = _TENSOR_AXIS_NAMES[layout.mode]
    result = {
        ParallelMode.GLOBAL: groups_varying(axes, [name for name, _ in axes]),
        ParallelMode.PIPELINE: groups_varying(axes, ('pipe',)),
        ParallelMode.DATA: groups_varying(axes, ('data',)),
        ParallelMode.TENSOR: groups_varying(axes, tensor_names),
    }
    for mode, varying in _MODE_GROUPS.get(layout.mode, {}).items():
        result[mode] = groups_varying(axes, varying)
    return result


def coordinates(layout: ParallelLayout, rank: int) -> Dict[str, int]:
    """The rank's coordinate on every named axis."""
    axes = axes_of(layout)
    coords = {}
    for name, size in reversed(axes):
        coords[name] = rank % size
        rank //= size
    return coords
