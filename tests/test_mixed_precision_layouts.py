"""Mixed precision in every tensor-parallel layout: bf16 autocast matches the serial autocast
run, naive fp16 takes its steps (no spurious overflow), fully padded samples stay finite."""
import pytest
import torch

import colossal_lite as clt
from colossal_lite.engine import allreduce_gradients
from colossal_lite.testing import full_gradients, max_rel_diff, run_distributed

from tests.model_cases import make_case, serial_state

LAYOUTS = {
    '1d': (2, dict(tensor=dict(size=2, mode='1d'))),
    '2d': (4, dict(tensor=dict(size=4, mode='2d'))),
    '3d': (8, dict(tensor=dict(size=8, mode='3d'))),
    'sequence': (2, dict(tensor=dict(size=2, mode='sequence'))),
}


def _autocast_grads(rank, state):
    build, inputs, labels, build_loss = make_case('gpt')
    model = build()
    model.load_state_dict(state)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        loss = build_loss()(model(*inputs), labels)
    loss.backward()
    allreduce_gradients(model.parameters())  # completes sequence-mode gradients
    return loss.detach().float(), full_gradients(model)


@pytest.mark.parametrize('mode', ['2d', '3d', 'sequence'])
def test_bf16_autocast_matches_serial_in_every_layout(mode):
    state = serial_state('gpt')
    expected_loss, expected = _autocast_grads(0, state)
    world, parallel = LAYOUTS[mode]
    loss, grads = run_distributed(_autocast_grads, world, dict(parallel=parallel), state,
                                  timeout=600)[0]
    assert abs(loss - expected_loss) < 1e-3
    for key in expected:  # bf16 sums in another order: a few bf16 ulps
        assert max_rel_diff(grads[key], expected[key]) < 1e-2, key


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


def _fully_padded_bert(rank, state):
    build, (ids, mask), (mlm, nsp), build_loss = make_case('bert')
    mask = mask.clone()
    mask[1] = 0                     # a sample with nothing to attend to
    mlm = mlm.clone()
    mlm[1] = -100
    model = build()
    model.load_state_dict(state)
    loss = build_loss()(model(ids, mask), (mlm, nsp))
    loss.backward()
    allreduce_gradients(model.parameters())
    return loss.detach(), full_gradients(model)


def test_sequence_mode_gives_zero_attention_to_fully_padded_samples():
    state = serial_state('bert')
    expected_loss, expected = _fully_padded_bert(0, state)
    assert torch.isfinite(expected_loss)
    world, parallel = LAYOUTS['sequence']
    loss, grads = run_distributed(_fully_padded_bert, world, dict(parallel=parallel), state,
                                  timeout=600)[0]
    assert max_rel_diff(loss, expected_loss) < 1e-5
    for key in expected:
        assert max_rel_diff(grads[key], expected[key]) < 1e-5, key
