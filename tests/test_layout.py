"""The rank layout is a pure function of (rank, sizes): checked here without processes."""
import itertools

import pytest

from colossal_lite.config import parse_parallel
from colossal_lite.context import ParallelMode as PM
from colossal_lite.context.layout import build_groups, coordinates

LAYOUTS = [
    (1, dict()),
    (8, dict()),
    (8, dict(pipeline=2)),
    (8, dict(pipeline=2, tensor=dict(size=2, mode='1d'))),
    (12, dict(pipeline=3, tensor=dict(size=2, mode='sequence'))),
    (16, dict(pipeline=2, tensor=dict(size=4, mode='sequence'))),
    (8, dict(tensor=dict(size=4, mode='2d'))),
    (18, dict(pipeline=2, tensor=dict(size=9, mode='2d'))),
    (16, dict(tensor=dict(size=8, mode='2.5d', depth=2))),
    (8, dict(tensor=dict(size=4, mode='2.5d', depth=1))),
    (16, dict(pipeline=2, tensor=dict(size=8, mode='3d'))),
    (27, dict(tensor=dict(size=27, mode='3d'))),
]


def _layout(world, parallel):
    return parse_parallel(parallel).with_world_size(world)


@pytest.mark.parametrize('world, parallel', LAYOUTS)
def test_every_rank_in_exactly_one_group_per_mode(world, parallel):
    for mode, groups in build_groups(_layout(world, parallel)).items():
        members = sorted(r for g in groups for r in g)
        assert members == list(range(world)), mode
        if mode is not PM.EMBEDDING:  # first+last stage together, middle stages alone
            assert len({len(g) for g in groups}) == 1, mode


@pytest.mark.parametrize('world, parallel', LAYOUTS)
def test_group_sizes(world, parallel):
    layout = _layout(world, parallel)
    groups = build_groups(layout)
    q, d = layout.tensor_grid, layout.depth
    sequence = layout.mode in ('sequence', 'ulysses')   # EXPERT_DATA = SEQUENCE_DP at E = 1
    expected = {PM.GLOBAL: world, PM.DATA: layout.data, PM.PIPELINE: layout.pipeline,
                PM.TENSOR: layout.tensor, PM.EXPERT: 1,
                PM.EXPERT_DATA: layout.data * (layout.tensor if sequence else 1)}
    expected.update({
        '1d': {PM.PARALLEL_1D: layout.tensor},
        'sequence': {PM.SEQUENCE: layout.tensor, PM.SEQUENCE_DP: layout.tensor * layout.data},
        '2d': {PM.PARALLEL_2D_ROW: q, PM.PARALLEL_2D_COL: q},
        '2.5d': {PM.PARALLEL_2P5D_ROW: q, PM.PARALLEL_2P5D_COL: q, PM.PARALLEL_2P5D_DEP: d,
                 PM.PARALLEL_2P5D_XZ: q * d},
        '3d': {PM.PARALLEL_3D_INPUT: q, PM.PARALLEL_3D_WEIGHT: q, PM.PARALLEL_3D_OUTPUT: q,
               PM.PARALLEL_3D_INPUT_X_WEIGHT: q * q, PM.PARALLEL_3D_OUTPUT_X_WEIGHT: q * q},
    }.get(layout.mode, {}))
    assert set(groups) == set(expected) | {PM.EMBEDDING}
    for mode, size in expected.items():
        assert all(len(g) == size for g in groups[mode]), mode
    for g in groups[PM.PIPELINE]:  # first and last stage together, middle stages alone
        assert tuple(sorted({g[0], g[-1]})) in groups[PM.EMBEDDING]
        assert all((r,) in groups[PM.EMBEDDING] for r in g[1:-1])


def _group_of(groups, rank):
    return next(g for g in groups if rank in g)


@pytest.mark.parametrize('world, parallel', LAYOUTS)
def test_axes_are_orthogonal_and_cover_the_world(world, parallel):
    """DATA, PIPELINE and TENSOR groups meet in exactly one rank, and their product is the world."""
    groups = build_groups(_layout(world, parallel))
    for a, b in itertools.combinations((PM.DATA, PM.PIPELINE, PM.TENSOR), 2):
        for ga in groups[a]:
            for gb in groups[b]:
                assert len(set(ga) & set(gb)) <= 1
    for rank in range(world):
        reach = {(p, d, t) for p in _group_of(groups[PM.PIPELINE], rank)
                 for d in _group_of(groups[PM.DATA], p) for t in _group_of(groups[PM.TENSOR], d)}
        assert {t for _, _, t in reach} == set(range(world))


@pytest.mark.parametrize('pipeline, data, seq', [(1, 1, 4), (2, 3, 2), (3, 2, 2), (2, 2, 4)])
def test_sequence_dp_is_data_times_sequence_within_a_stage(pipeline, data, seq):
    world = pipeline * data * seq
    layout = _layout(world, dict(pipeline=pipeline, tensor=dict(size=seq, mode='sequence')))
    groups = build_groups(layout)
    for rank in range(world):
        sdp = set(_group_of(groups[PM.SEQUENCE_DP], rank))
        union = {s for d in _group_of(groups[PM.DATA], rank)
                 for s in _group_of(groups[PM.SEQUENCE], d)}
        assert sdp == union
        stage = coordinates(layout, rank)['pipe']
        assert all(coordinates(layout, r)['pipe'] == stage for r in sdp)


def test_tensor_is_innermost_and_pipeline_outermost():
    layout = _layout(16, dict(pipeline=2, tensor=dict(size=4, mode='1d')))
    groups = build_groups(layout)
    assert groups[PM.TENSOR][0] == (0, 1, 2, 3)
    assert groups[PM.DATA][0] == (0, 4)
    assert groups[PM.PIPELINE][0] == (0, 8)


def test_2d_rows_and_columns():
    groups = build_groups(_layout(4, dict(tensor=dict(size=4, mode='2d'))))
    assert groups[PM.PARALLEL_2D_ROW] == [(0, 1), (2, 3)]
    assert groups[PM.PARALLEL_2D_COL] == [(0, 2), (1, 3)]


def test_2p5d_depth_and_xz():
    groups = build_groups(_layout(8, dict(tensor=dict(size=8, mode='2.5d', depth=2))))
    assert groups[PM.PARALLEL_2P5D_DEP] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert groups[PM.PARALLEL_2P5D_XZ] == [(0, 1, 4, 5), (2, 3, 6, 7)]


def test_3d_axes():
    layout = _layout(8, dict(tensor=dict(size=8, mode='3d')))
    groups = build_groups(layout)
    assert groups[PM.PARALLEL_3D_INPUT][0] == (0, 1)
    assert groups[PM.PARALLEL_3D_WEIGHT][0] == (0, 2)
    assert groups[PM.PARALLEL_3D_OUTPUT][0] == (0, 4)
    assert groups[PM.PARALLEL_3D_INPUT_X_WEIGHT][0] == (0, 1, 2, 3)
    assert groups[PM.PARALLEL_3D_OUTPUT_X_WEIGHT][0] == (0, 2, 4, 6)
    assert coordinates(layout, 6) == dict(pipe=0, data=0, output=1, weight=1, input=0)
