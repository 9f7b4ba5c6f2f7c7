"""The fused q/k/v weight as a view: ``tensor.adjacent.join_rows`` (and the 1D column
matmul) join rows that lie back to back and fill one storage without a copy, model_zoo's
attention lays its q/k/v weights and biases so (``col_nn.place_qkv_adjacent``), and every
layout computes what the serial model computes through ``torch.cat`` (the fallback, taken
whenever the rows are not adjacent): loss, outputs, every gradient and the parameters
after 3 AdamW steps.
"""
import pytest
import torch
from torch import nn

import colossal_lite.nn as col_nn
from colossal_lite.tensor.adjacent import join_rows, place_adjacent, rows_adjacent
from colossal_lite.testing import assert_matches_serial, run_distributed, training_trace
from model_zoo.blocks import SelfAttention

from tests.model_cases import make_case, serial_state

TOL = 1e-5
CASE = dict(batch=4, seq=8)


def _attentions(model):
    return [m for m in model.modules() if isinstance(m, SelfAttention)]


def _groups(attn):
    layers = (attn.query, attn.key, attn.value)
    return [layer.weight for layer in layers], [layer.bias for layer in layers]


def _separate(model):
    """Give every q/k/v weight and bias a storage of its own (the fused join falls back)."""
    for attn in _attentions(model):
        for group in _groups(attn):
            for p in group:
                p.data = p.data.clone()


def _storage_report(model):
    """Per attention layer: weights adjacent, biases adjacent, the join a view of query's."""
    report = []
    for attn in _attentions(model):
        weights, biases = _groups(attn)
        joined, _ = join_rows(weights, biases)
        report.append((rows_adjacent(weights), rows_adjacent(biases),
                       joined.data_ptr() == weights[0].data_ptr()))
    return report


# ------------------------------------------------------------------------- join_rows
def _rows(n=3, rows=2, cols=5, seed=0):
    return list(torch.randn(n * rows, cols, generator=torch.Generator().manual_seed(seed))
                .split(rows))


def test_join_of_adjacent_rows_is_a_view_whose_backward_gives_each_its_block():
    buffer = torch.randn(6, 5, generator=torch.Generator().manual_seed(0))
    params = [nn.Parameter(block) for block in buffer.split(2)]
    assert rows_adjacent(params)
    (joined,) = join_rows(params)
    assert joined.data_ptr() == params[0].data_ptr() and torch.equal(joined, buffer)
    grad = torch.randn(6, 5, generator=torch.Generator().manual_seed(1))
    joined.backward(grad)
    for p, expected in zip(params, grad.split(2)):
        assert torch.equal(p.grad, expected)


@pytest.mark.parametrize('case', ['separate', 'gap', 'inside_larger_storage', 'order',
                                  'strided', 'dtype'])
def test_join_of_rows_not_adjacent_is_a_copy_with_cat_numbers(case):
    buffer = torch.randn(8, 5, generator=torch.Generator().manual_seed(0))
    columns = buffer.t().contiguous().t()          # same values, column-major
    tensors = {
        'separate': lambda: [t.clone() for t in buffer[:6].split(2)],
        'gap': lambda: [buffer[0:2], buffer[2:4], buffer[5:7]],
        'inside_larger_storage': lambda: list(buffer[:6].split(2)),   # e.g. a ZeRO chunk
        'order': lambda: [buffer[2:4], buffer[0:2], buffer[4:6]],
        'strided': lambda: list(columns[:6].split(2)),
        'dtype': lambda: [buffer[0:2], buffer[2:4], buffer[4:6].double()],
    }[case]()
    assert not rows_adjacent(tensors)
    leaves = [t.detach().requires_grad_() for t in tensors]
    (joined,) = join_rows(leaves)
    assert joined.data_ptr() != leaves[0].data_ptr()
    assert torch.equal(joined, torch.cat(tensors))
    grad = torch.randn(joined.shape, dtype=joined.dtype, generator=torch.Generator().manual_seed(1))
    joined.backward(grad)
    for leaf, expected in zip(leaves, grad.split([t.shape[0] for t in tensors])):
        assert torch.equal(leaf.grad, expected.to(leaf.dtype))


def test_join_follows_a_parameter_given_new_storage():
    """The kept view is dropped once a tensor's data pointer changes (``p.data = ...``)."""
    params = [nn.Parameter(block) for block in torch.randn(6, 5).split(2)]
    assert join_rows(params)[0].data_ptr() == params[0].data_ptr()
    params[1].data = torch.randn(2, 5)
    (joined,) = join_rows(params)
    assert joined.data_ptr() != params[0].data_ptr()
    assert torch.equal(joined, torch.cat([p.detach() for p in params]))


def test_rows_of_different_widths_are_not_adjacent():
    buffer = torch.randn(6, 5)
    assert not rows_adjacent([buffer[0:2], buffer[2:4], buffer[4:6, :4]])
    assert not rows_adjacent([buffer[0:2], buffer[2:4].flatten()[:10].view(5, 2)])


def test_place_adjacent_keeps_values_objects_and_raises_on_mismatch():
    params = [nn.Parameter(t.clone()) for t in _rows()]
    values, ids = [p.detach().clone() for p in params], [id(p) for p in params]
    place_adjacent(params)
    assert rows_adjacent(params) and [id(p) for p in params] == ids
    assert all(torch.equal(p, v) for p, v in zip(params, values))
    with pytest.raises(ValueError, match='one dtype, device and trailing shape'):
        place_adjacent([nn.Parameter(torch.zeros(2, 5)), nn.Parameter(torch.zeros(2, 4))])


def test_attention_built_outside_meta_and_by_name_is_adjacent():
    """The benchmark's path (layers drawn at once) and model_zoo's (meta, then drawn by
    name in ``materialize``) both lay q/k/v back to back; load_state_dict and AdamW steps
    (in-place writes) keep it; a dtype cast gives own storages and the join falls back."""
    torch.manual_seed(0)
    attn = SelfAttention(16, 4, 0.0, True, 0.02)
    assert _storage_report(attn) == [(True, True, True)]
    model = make_case('gpt', **CASE).build()
    assert _storage_report(model) == [(True, True, True)] * 2
    model.load_state_dict(serial_state('gpt', **CASE))
    trace_case(model, steps=1)
    assert _storage_report(model) == [(True, True, True)] * 2
    model.double()
    assert _storage_report(model) == [(False, False, False)] * 2


def trace_case(model, steps=3):
    case = make_case('gpt', **CASE)
    return training_trace(model, case.batch, case.criterion(), steps=steps)


def test_serial_view_and_cat_paths_are_bitwise_equal():
    state = serial_state('gpt', **CASE)
    traces = []
    for separate in (False, True):
        model = make_case('gpt', **CASE).build()
        model.load_state_dict(state)
        if separate:
            _separate(model)
        assert _storage_report(model) == [(not separate,) * 3] * 2
        traces.append(trace_case(model))
    assert_matches_serial([traces[0]], traces[1], 0.0)


# ------------------------------------------------------------------- every layout
def _rank_trace(rank, state, separate):
    model = make_case('gpt', **CASE).build()
    model.load_state_dict(state)
    if separate:
        _separate(model)
    before = _storage_report(model)
    trace = trace_case(model)
    return trace, before, _storage_report(model)


@pytest.fixture(scope='module')
def serial_cat():
    """The serial reference through the torch.cat path (own storages)."""
    state = serial_state('gpt', **CASE)
    model = make_case('gpt', **CASE).build()
    model.load_state_dict(state)
    _separate(model)
    return state, trace_case(model)


LAYOUTS = {
    '1d': (2, dict(size=2, mode='1d')),
    '2d': (4, dict(size=4, mode='2d')),
    '2.5d': (8, dict(size=8, mode='2.5d', depth=2)),
    '3d': (8, dict(size=8, mode='3d')),
    'sequence': (2, dict(size=2, mode='sequence')),
}


@pytest.mark.parametrize('mode', list(LAYOUTS))
def test_view_path_equals_serial_in_every_layout(serial_cat, mode):
    """Each rank's q/k/v shards are adjacent and joined as a view of the query's storage
    (before and after 3 AdamW steps), and the run equals the serial cat-path run."""
    state, expected = serial_cat
    world, tensor = LAYOUTS[mode]
    results = run_distributed(_rank_trace, world, dict(parallel=dict(tensor=tensor)),
                              state, False, timeout=300)
    for _, before, after in results:
        assert before == after == [(True, True, True)] * 2
    assert_matches_serial([r[0] for r in results], expected, TOL)


def test_cat_fallback_equals_serial_in_1d(serial_cat):
    """tp=2 with q/k/v in storages of their own: the join copies, the numbers agree."""
    state, expected = serial_cat
    results = run_distributed(_rank_trace, 2, dict(parallel=dict(tensor=LAYOUTS['1d'][1])),
                              state, True, timeout=300)
    for _, before, after in results:
        assert before == after == [(False, False, False)] * 2
    assert_matches_serial([r[0] for r in results], expected, TOL)
