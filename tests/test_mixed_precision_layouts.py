"""Mixed precision in every tensor-parallel layout: bf16 autocast matches the serial autocast
run, naive fp16 takes its steps (no spurious overflow), fully padded samples stay finite."""
import pytest
import torch

import colossal_lite as clt
from colossal_lite.testing import (assert_matches_serial, plain_step, run_distributed,
                                   training_trace)

from tests.model_cases import make_case, serial_state

LAYOUTS = {
    '1d': (2, dict(tensor=dict(size=2, mode='1d'))),
    '2d': (4, dict(tensor=dict(size=4, mode='2d'))),
    '3d': (8, dict(tensor=dict(size=8, mode='3d'))),
    'sequence': (2, dict(tensor=dict(size=2, mode='sequence'))),
}


def _backward_trace(name, state, batch, **step_kw):
    """Loss and every full gradient of one backward (no update) of a case's model."""
    case = make_case(name)
    model = case.build()
    model.load_state_dict(state)
    step = plain_step(case.criterion(), outputs=False, **step_kw)
    return training_trace(model, batch, steps=1, step_fn=step)


def _autocast_trace(rank, state):
    return _backward_trace('gpt', state, make_case('gpt').batch, autocast=torch.bfloat16)


@pytest.mark.parametrize('mode', ['2d', '3d', 'sequence'])
def test_bf16_autocast_matches_serial_in_every_layout(mode):
    """bf16 sums in another order: a few bf16 ulps on gradients, loss within 1e-3."""
    state = serial_state('gpt')
    expected = _autocast_trace(None, state)
    world, parallel = LAYOUTS[mode]
    traces = run_distributed(_autocast_trace, world, dict(parallel=parallel), state, timeout=600)
    loss_tol = 1e-3 / max(1.0, abs(expected[0]['loss'].item()))   # |diff| < 1e-3
    assert_matches_serial(traces, expected, dict(loss=loss_tol, grad=1e-2, param=0.0))


def _naive_fp16_steps(rank, state):
    build, inputs, labels, build_loss = make_case('gpt')
    model = build()
    model.load_state_dict(state)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, *_ = clt.initialize(model, optimizer, build_loss())
    skipped = []
    for _ in range(3):
        engine.zero_grad()
        engine.execute_schedule((inputs[0], labels))
        engine.step()
        skipped.append(engine.overflow)
    return skipped


@pytest.mark.parametrize('mode', ['2d', '3d'])
def test_naive_fp16_takes_every_step(mode):
    """LayerNorm statistics in fp32: their rsqrt' no longer overflows fp16 at init scale."""
    world, parallel = LAYOUTS[mode]
    config = dict(parallel=parallel, fp16=dict(mode='naive', initial_scale=256))
    for skipped in run_distributed(_naive_fp16_steps, world, config, serial_state('gpt'),
                                   timeout=600):
        assert skipped == [False, False, False]


def _fully_padded_batch():
    (ids, mask), (mlm, nsp) = make_case('bert').batch
    mask, mlm = mask.clone(), mlm.clone()
    mask[1] = 0                     # a sample with nothing to attend to
    mlm[1] = -100
    return (ids, mask), (mlm, nsp)


def _fully_padded_trace(rank, state):
    return _backward_trace('bert', state, _fully_padded_batch())


def test_sequence_mode_gives_zero_attention_to_fully_padded_samples():
    state = serial_state('bert')
    expected = _fully_padded_trace(None, state)
    assert torch.isfinite(expected[0]['loss'])
    world, parallel = LAYOUTS['sequence']
    traces = run_distributed(_fully_padded_trace, world, dict(parallel=parallel), state,
                             timeout=600)
    assert_matches_serial(traces, expected, 1e-5)
