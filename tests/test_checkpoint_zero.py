"""Checkpoints of chunk ZeRO (stage 3) and of ZeRO with naive fp16: the weights saved are
the ZeRO fp32 masters, gathered to full tensors under the serial names.

The tiny GPT of ``tests/model_cases.py`` (4 layers, no dropout) trains a few steps in one
layout, is saved with ``colossal_lite.checkpoint.save`` and loaded with ``load`` into a
fresh engine of another layout; the full state (``'model.<key>'`` and
``'optim.<name>.<slot>'`` tensors, merged over the ranks) must be bit-equal. Resuming chunk
ZeRO (4 steps, save, load, 4 steps) must give the losses and the state of 8 straight steps
bit for bit.
"""
import pytest
import torch

import colossal_lite as clt
from colossal_lite import checkpoint
from colossal_lite.testing import engine_step, make_optimizer, replica_batch, run_distributed
from tests.model_cases import make_case
from tests.test_checkpoint import _full, _merge

TIMEOUT = 300
CHUNK_MB = 8192 * 4 / 2 ** 20        # 8192 fp32 elements: several chunks for the tiny GPT
CHUNK_CPU = dict(zero=dict(stage=3, placement='cpu', chunk_size_mb=CHUNK_MB))
TP2 = dict(parallel=dict(tensor=dict(size=2, mode='1d')))          # x dp=2 on 4 ranks
CHUNK_PP2 = dict(CHUNK_CPU, parallel=dict(pipeline=2), num_microbatches=2)   # x dp=2 on 4
NAIVE = dict(fp16=dict(mode='naive', initial_scale=2 ** 8))
ZERO1_NAIVE = dict(zero=dict(stage=1), **NAIVE)
ZERO2_NAIVE = dict(zero=dict(stage=2), **NAIVE)
CHUNK_NAIVE = dict(zero=dict(stage=3, placement='device', chunk_size_mb=CHUNK_MB), **NAIVE)


def _case():
    return make_case('gpt', batch=8, seq=16)


def _engine():
    case = _case()
    model = case.build(layers=4, dropout=0.0)
    engine, *_ = clt.initialize(model, make_optimizer(model.parameters()), case.criterion())
    return engine


def _steps(engine, n):
    batch = replica_batch(_case().batch)
    return [float(engine_step(engine, batch)['loss']) for _ in range(n)]




def _assert_equal_states(expected, actual):
    assert set(actual) == set(expected), sorted(set(actual) ^ set(expected))
    assert any(k.endswith('.exp_avg_sq') for k in expected)
    for key, value in expected.items():
        assert actual[key].dtype == value.dtype or key.endswith('.step'), key
        assert torch.equal(actual[key].to(value.dtype), value), key


def _train_and_save(rank, path, steps):
    engine = _engine()
    _steps(engine, steps)
    checkpoint.save(path, engine)
    return _full(engine)


def _load_fresh(rank, path):
    engine = _engine()
    checkpoint.load(path, engine)
    return engine.global_step, _full(engine)


@pytest.mark.parametrize('src, src_world, dst, dst_world', [
    (CHUNK_CPU, 4, TP2, 4),            # chunk ZeRO dp=4 (cpu) -> 1D tp=2 x dp=2
    (TP2, 4, CHUNK_CPU, 4),            # and back
    (ZERO2_NAIVE, 2, ZERO2_NAIVE, 2),  # ZeRO-2 + naive fp16: fp32 masters, scaler
    (ZERO2_NAIVE, 2, CHUNK_NAIVE, 4),  # ZeRO-2 dp=2 -> chunk ZeRO dp=4, both naive fp16
    (ZERO1_NAIVE, 2, TP2, 2),          # ZeRO-1 + naive fp16 dp=2 -> 1D tp=2, fp32
    (CHUNK_PP2, 4, CHUNK_CPU, 4),      # chunk ZeRO pp=2 x dp=2 -> chunk ZeRO dp=4
], ids=['chunk-to-tp2dp2', 'tp2dp2-to-chunk', 'zero2-naive', 'zero2-naive-to-chunk-naive',
        'zero1-naive-to-tp2', 'chunk-pp2dp2-to-chunk-dp4'])
def test_zero_round_trip_is_bit_exact(tmp_path, src, src_world, dst, dst_world):
    """Parameters (fp32 masters where the source keeps them) and Adam's exp_avg,
    exp_avg_sq and step are bit-equal after resharding into the other layout."""
    path = str(tmp_path / 'ckpt')
    saved = _merge(run_distributed(_train_and_save, src_world, src, path, 2, timeout=TIMEOUT))
    assert all(v.dtype == torch.float32 for k, v in saved.items() if k.startswith('model.'))
    results = run_distributed(_load_fresh, dst_world, dst, path, timeout=TIMEOUT)
    assert all(step == 2 for step, _ in results)
    _assert_equal_states(saved, _merge(r[1] for r in results))


def _straight(rank, steps):
    engine = _engine()
    return _steps(engine, steps), _full(engine)


def _resumed(rank, path, steps):
    first = _engine()
    losses = _steps(first, steps)
    checkpoint.save(path, first)
    del first
    second = _engine()
    checkpoint.load(path, second)
    return losses + _steps(second, steps), _full(second)


@pytest.mark.parametrize('cfg', [CHUNK_CPU, CHUNK_NAIVE], ids=['chunk-cpu', 'chunk-naive-fp16'])
def test_chunk_zero_resume_equals_uninterrupted(tmp_path, cfg):
    """4 steps + save + load + 4 steps == 8 straight steps, bit for bit (losses, weights,
    optimizer state; naive fp16: also the loss scale's effect on every step)."""
    straight = run_distributed(_straight, 2, cfg, 8, timeout=TIMEOUT)
    resumed = run_distributed(_resumed, 2, cfg, str(tmp_path / 'ckpt'), 4, timeout=TIMEOUT)
    for (loss_a, state_a), (loss_b, state_b) in zip(straight, resumed):
        assert loss_a == loss_b, (loss_a, loss_b)
        _assert_equal_states(state_a, state_b)
