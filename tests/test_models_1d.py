"""GPT, BERT and ViT under 1D tensor parallelism equal the serial model (tp = 2, 4, 8)."""
import pytest
import torch

from colossal_lite.testing import assert_traces_match, run_distributed, training_trace

from tests.model_cases import make_case, serial_state


def _trace(name, state, **overrides):
    build, inputs, labels, build_loss = make_case(name, **overrides)
    model = build()
    model.load_state_dict(state)
    return training_trace(model, inputs, labels, build_loss())


def _serial_trace(name, **overrides):
    return _trace(name, serial_state(name, **overrides), **overrides)


def _parallel_traces(rank, names, states, overrides):
    return {name: _trace(name, states[name], **overrides) for name in names}


@pytest.mark.parametrize('tp', [2, 4])
def test_gpt_bert_vit_under_1d_equal_serial(tp):
    names = ('gpt', 'bert', 'vit')
    states = {name: serial_state(name) for name in names}
    expected = {name: _serial_trace(name) for name in names}
    config = dict(parallel=dict(tensor=dict(size=tp, mode='1d')))
    results = run_distributed(_parallel_traces, tp, config, names, states, {}, timeout=600)
    for rank, traces in enumerate(results):
        for name in names:
            assert_traces_match(traces[name], expected[name])


def test_gpt_under_1d_tp8_equals_serial():
    overrides = dict(heads=8)
    states = {'gpt': serial_state('gpt', **overrides)}
    expected = _serial_trace('gpt', **overrides)
    config = dict(parallel=dict(tensor=dict(size=8, mode='1d')))
    results = run_distributed(_parallel_traces, 8, config, ('gpt',), states, overrides, timeout=600)
    for traces in results:
        assert_traces_match(traces['gpt'], expected)


def _init_only(rank):
    from tests.model_cases import make_case as mk
    build, *_ = mk('gpt')
    torch.manual_seed(0)
    return build().state_dict()


def test_parallel_init_draws_the_serial_weights():
    """Built under tp=2 with the serial seed, the full state dict equals the serial model's."""
    expected = serial_state('gpt')
    config = dict(parallel=dict(tensor=dict(size=2, mode='1d')))
    for state in run_distributed(_init_only, 2, config, timeout=300):
        assert state.keys() == expected.keys()
        for key in expected:
            assert torch.equal(state[key], expected[key]), key
