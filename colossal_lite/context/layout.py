"""The rank layout: a pure function from the parallel degrees to every process group.

A global rank is a point on a grid of named axes, outermost first::

    pipe, data, <tensor sub-axes>

with the tensor axis unfolded per mode (innermost varies fastest):

    1d / sequence : t
    2d            : row, col                 t = row*q + col
    2.5d          : dep, row, col            t = dep*q*q + row*q + col
    3d            : output, weight, input    t = l*q*q + j*q + i

and, with expert parallelism (``parallel.expert`` = E > 1), the data axis unfolded into
``expert_data, expert`` (data = expert_data * E + expert): DATA varies both (its groups
and local ranks are those of the folded axis), EXPERT varies ``expert`` (E consecutive
data coordinates: the ranks whose experts differ, all_to_all of tokens), EXPERT_DATA
varies ``expert_data`` (the replicas of one expert shard: its gradient sum, its ZeRO
shards). In the sequence modes ('sequence', 'ulysses') every rank of the tensor axis holds
other tokens of the same samples, so EXPERT_DATA also varies the tensor sub-axes, as
SEQUENCE_DP does. With E = 1 the grid keeps ``data`` whole: EXPERT groups are single ranks
and EXPERT_DATA equals DATA (SEQUENCE_DP in the sequence modes), so both modes exist in
every layout.

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


DATA_SUBAXES = ('expert_data', 'expert')


def _expert(layout: ParallelLayout) -> int:
    return getattr(layout, 'expert', 1)


def axes_of(layout: ParallelLayout) -> List[Tuple[str, int]]:
    """The named axes of the rank grid, outermost first."""
    if layout.data is None:
        raise ValueError('the layout needs the data-parallel degree; call with_world_size first')
    expert = _expert(layout)
    if expert > 1:
        if layout.data % expert:
            raise ValueError(f'the expert-parallel size {expert} must divide the data size '
                             f'{layout.data}')
        data = [('expert_data', layout.data // expert), ('expert', expert)]
    else:
        data = [('data', layout.data)]
    return [('pipe', layout.pipeline)] + data + list(_family(layout).axes(layout))


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
    unfolded = _expert(layout) > 1
    sequence = fam.tensor_axis_names if fam.splits_sequence else ()
    varying = {ParallelMode.GLOBAL: tuple(names), ParallelMode.PIPELINE: ('pipe',),
               ParallelMode.DATA: ('data',), ParallelMode.TENSOR: fam.tensor_axis_names,
               ParallelMode.EXPERT: ('expert',) if unfolded else (),
               ParallelMode.EXPERT_DATA: ('expert_data' if unfolded else 'data',) + sequence}
    varying.update(fam.groups)
    out = {}
    for mode, axes in varying.items():
        if unfolded and 'data' in axes:   # the folded axis: both of its sub-axes
            axes = tuple(axes) + DATA_SUBAXES
        out[mode] = tuple(n for n in names if n in axes)
    return out


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
    """The rank's coordinate on every named axis (and ``data`` = expert_data * E + expert
    when the data axis is unfolded)."""
    axes = axes_of(layout)
    coords = {}
    for name, size in reversed(axes):
        coords[name] = rank % size
        rank //= size
    if 'expert' in coords:
        coords['data'] = coords['expert_data'] * _expert(layout) + coords['expert']
    return coords
