"""GPT, BERT and ViT under 1D tensor parallelism equal the serial model (tp = 2, 4, 8)."""
import pytest
import torch

from colossal_lite.testing import assert_matches_serial, run_distributed

from tests.model_cases import FAMILIES, rank_traces, serial_state, serial_traces


@pytest.mark.parametrize('tp', [2, 4])
def test_gpt_bert_vit_under_1d_equal_serial(tp):
    states, expected = serial_traces(FAMILIES)
    config = dict(parallel=dict(tensor=dict(size=tp, mode='1d')))
    results = run_distributed(rank_traces, tp, config, states, timeout=600)
    for name in FAMILIES:
        assert_matches_serial([r[name] for r in results], expected[name])


def test_gpt_under_1d_tp8_equals_serial():
    case_kw = dict(heads=8)
    states, expected = serial_traces(('gpt',), case_kw)
    config = dict(parallel=dict(tensor=dict(size=8, mode='1d')))
    results = run_distributed(rank_traces, 8, config, states, case_kw, timeout=600)
    assert_matches_serial([r['gpt'] for r in results], expected['gpt'])


def _init_only(rank):
    from model_zoo import GPT
    torch.manual_seed(0)
    return GPT.from_preset('tiny').state_dict()


def test_parallel_init_draws_the_serial_weights():
    """Built under tp=2 with the serial seed, the full state dict equals the serial model's."""
    expected = serial_state('gpt')
    config = dict(parallel=dict(tensor=dict(size=2, mode='1d')))
    for state in run_distributed(_init_only, 2, config, timeout=300):
        assert state.keys() == expected.keys()
        for key in expected:
            assert torch.equal(state[key], expected[key]), key


@pytest.mark.parametrize('tp', [2, 4])
def test_gpt_bert_under_1d_sequence_parallel_equal_serial(tp):
    """Megatron's sequence parallelism inside 1D: norms, dropout and residuals on sequence
    blocks, all_gather / reduce_scatter at the regions (ViT's 17 tokens do not split)."""
    names = ('gpt', 'bert')
    states, expected = serial_traces(names)
    config = dict(parallel=dict(tensor=dict(size=tp, mode='1d', sequence_parallel=True)))
    results = run_distributed(rank_traces, tp, config, states, timeout=600)
    for name in names:
        assert_matches_serial([r[name] for r in results], expected[name])
