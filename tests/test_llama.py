"""Llama (tiny: hidden 64, 4 heads, 2 kv heads, SwiGLU 128, RoPE) equals the serial model in
every layout, through initialize -> execute_schedule -> step.

The serial reference is the same engine on one rank. Compared at each of 3 AdamW steps:
the replica-averaged loss, every gathered gradient (after clipping) and the weights.
Layouts: 1D t=2 (kv heads split) and t=4 (kv heads replicated per group of 2 ranks), 2D,
2.5D (d=2), 3D, pp=2 x 1D, zero-bubble pp=2, ZeRO-3 x 1D, 1D with Megatron sequence
parallelism (t=2, t=4, under pp=2 with 1F1B and zero bubble, with data 2, ZeRO-2 and ZeRO-3),
the zigzag ring (P=4), Ulysses (U=4, kv heads
repeated), ring x Ulysses (R=2 x U=2), and checkpoints written under 1D that load
under 2D and 3D. Also: the rotary tables, Llama-3 frequency scaling and
grouped-query attention against their closed forms, and the kv-head errors.
"""
from __future__ import annotations

import math

import pytest
import torch

import colossal_lite as clt
import colossal_lite.nn as col_nn
from colossal_lite import checkpoint
from colossal_lite.checkpoint import state as S
from colossal_lite.nn.rotary import apply_rotary, rope_frequencies, rotary_tables
from colossal_lite.testing import (assert_matches_serial, engine_step, make_optimizer,
                                   replica_batch, run_distributed, training_trace)
from model_zoo import Llama

from tests.model_cases import make_case

CLIP = 1.0
TP = lambda t: dict(tensor=dict(size=t, mode='1d'))  # noqa: E731
SP = lambda t: dict(tensor=dict(size=t, mode='1d', sequence_parallel=True))  # noqa: E731


def _case():
    return make_case('llama', batch=8, seq=16)


def _trace(rank, model_kw=None, steps=3):
    """An engine's trace on the tiny Llama (serial seed 0) from the serial initial weights."""
    case = _case()
    torch.manual_seed(0)
    model = case.build(**(model_kw or {}))
    engine, *_ = clt.initialize(model, make_optimizer(model.parameters()), case.criterion())
    return training_trace(engine, case.batch, steps=steps, step_fn=_step)


def _step(engine, batch):
    """One engine step; under chunk ZeRO the gradients come from the chunk shards."""
    out = engine_step(engine, batch)
    if hasattr(engine.optimizer, 'full_gradients'):
        out['grads'] = engine.optimizer.full_gradients()
    return out


def _config(parallel=None, **extra):
    return dict(parallel=parallel or {}, clip_grad_norm=CLIP, **extra)


@pytest.fixture(scope='module')
def serial():
    return {kw: run_distributed(_trace, 1, _config(), dict(kw))[0]
            for kw in ((), (('layers', 4),))}


LAYOUTS = {  # id: (world, config, model options)
    'tp2-kv-split': (2, _config(TP(2)), ()),
    'tp4-kv-replicated': (4, _config(TP(4)), ()),
    '2d': (4, _config(dict(tensor=dict(size=4, mode='2d'))), ()),
    '2.5d': (8, _config(dict(tensor=dict(size=8, mode='2.5d', depth=2))), ()),
    '3d': (8, _config(dict(tensor=dict(size=8, mode='3d'))), ()),
    'pp2xtp2': (4, _config(dict(pipeline=2, **TP(2)), num_microbatches=2), (('layers', 4),)),
    'zero-bubble': (2, _config(dict(pipeline=dict(size=2, schedule='zero_bubble')),
                               num_microbatches=4), (('layers', 4),)),
    'zero3xtp2': (4, _config(TP(2), zero=dict(stage=3)), ()),
    'tp2-sequence-parallel': (2, _config(dict(tensor=dict(size=2, mode='1d',
                                                          sequence_parallel=True))), ()),
    'tp4-sequence-parallel': (4, _config(dict(tensor=dict(size=4, mode='1d',
                                                          sequence_parallel=True))), ()),
    'pp2xtp2-sequence-parallel': (4, _config(dict(pipeline=2, tensor=dict(
        size=2, mode='1d', sequence_parallel=True)), num_microbatches=2), (('layers', 4),)),
    # the norms' gradients: bucketed at the end of backward without a reducer's hooks,
    # summed at once under the overlapping data-parallel reducer and ZeRO's hooks
    'data2xtp2-sequence-parallel': (4, _config(SP(2)), ()),
    'zero2xtp2-sequence-parallel': (4, _config(SP(2), zero=dict(stage=2)), ()),
    'zero3xtp2-sequence-parallel': (4, _config(SP(2), zero=dict(stage=3)), ()),
    # zero bubble's weight passes run after each micro-batch's input backward
    'zero-bubble-xtp2-sequence-parallel': (4, _config(dict(
        pipeline=dict(size=2, schedule='zero_bubble'), **SP(2)), num_microbatches=4),
        (('layers', 4),)),
    'ring4-zigzag': (4, _config(dict(tensor=dict(size=4, mode='sequence'))), ()),
    'ulysses4-kv-repeated': (4, _config(dict(tensor=dict(size=4, mode='ulysses'))), ()),
    'ring2xulysses2': (4, _config(dict(tensor=dict(size=4, mode='ulysses', ring=2))), ()),
}


@pytest.mark.parametrize('layout', list(LAYOUTS))
def test_llama_equals_serial(serial, layout):
    world, config, model_kw = LAYOUTS[layout]
    traces = run_distributed(_trace, world, config, dict(model_kw), timeout=600)
    assert_matches_serial(traces, serial[model_kw])


def _replicated_kv(rank):
    """Rank r of 1D t=4 reads kv head r // 2; every rank holds the full k/v weights."""
    model = Llama.from_preset('tiny')
    attn = model.blocks['0'].attn
    return attn.k_proj.kv_head, tuple(attn.k_proj.weight.shape), tuple(attn.q_proj.weight.shape)


def test_kv_heads_fewer_than_ranks_are_replicated_per_group():
    results = run_distributed(_replicated_kv, 4, dict(parallel=TP(4)))
    assert [r[0] for r in results] == [0, 0, 1, 1]
    assert all(r[1] == (32, 64) and r[2] == (16, 64) for r in results)


def _save(rank, path):
    case = _case()
    torch.manual_seed(0)
    model = case.build()
    engine, *_ = clt.initialize(model, make_optimizer(model.parameters()), case.criterion())
    batch = replica_batch(case.batch)
    for _ in range(2):
        engine_step(engine, batch)
    checkpoint.save(path, engine)
    return {k: v.detach().clone() for k, v in S.tensor_state(engine).items()}


def _load(rank, path):
    case = _case()
    torch.manual_seed(1)  # other initial weights: the checkpoint must replace them all
    model = case.build()
    engine, *_ = clt.initialize(model, make_optimizer(model.parameters()), case.criterion())
    checkpoint.load(path, engine)
    return {k: v.detach().clone() for k, v in S.tensor_state(engine).items()}


def _merged(states):
    out = {}
    for state in states:
        for key, value in state.items():
            assert key not in out or torch.equal(out[key], value), key
            out[key] = value
    return out


@pytest.mark.parametrize('src,src_world,dst,dst_world', [
    (TP(4), 4, dict(tensor=dict(size=4, mode='2d')), 4),   # kv replicated -> 2D
    (TP(2), 2, dict(tensor=dict(size=8, mode='3d')), 8),   # kv split -> 3D
    (dict(tensor=dict(size=4, mode='ulysses', ring=2)), 4, TP(4), 4),   # replicated -> 1D
], ids=['tp4-to-2d', 'tp2-to-3d', 'ring2xulysses2-to-tp4'])
def test_checkpoint_reshards_between_layouts(tmp_path, src, src_world, dst, dst_world):
    path = str(tmp_path / 'ckpt')
    saved = _merged(run_distributed(_save, src_world, dict(parallel=src), path))
    loaded = _merged(run_distributed(_load, dst_world, dict(parallel=dst), path))
    assert set(saved) == set(loaded) and any(k.endswith('exp_avg_sq') for k in saved)
    for key, value in saved.items():
        assert torch.equal(loaded[key].to(value.dtype), value), key


def test_rotary_tables_match_the_closed_form():
    d, theta = 8, 10000.0
    freqs = rope_frequencies(d, theta)
    assert torch.allclose(freqs, torch.tensor([theta ** (-2 * i / d) for i in range(d // 2)]))
    positions = torch.arange(5)
    cos, sin = rotary_tables(positions, freqs)
    x = torch.randn(2, 5, 2 * d)
    out = apply_rotary(x, cos, sin, d).view(2, 5, 2, d)
    pairs = x.view(2, 5, 2, d)
    for m in range(5):
        for i in range(d // 2):  # each pair (i, i + d/2) rotated by m * f_i
            a = m * freqs[i].item()
            x1, x2 = pairs[:, m, :, i], pairs[:, m, :, i + d // 2]
            assert torch.allclose(out[:, m, :, i], x1 * math.cos(a) - x2 * math.sin(a), atol=1e-6)
            assert torch.allclose(out[:, m, :, i + d // 2], x2 * math.cos(a) + x1 * math.sin(a),
                                  atol=1e-6)


def test_llama3_scaling_keeps_high_and_divides_low_frequencies():
    scaling = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_positions=8192)
    base, scaled = rope_frequencies(128, 500000.0), rope_frequencies(128, 500000.0, scaling)
    wavelength = 2 * math.pi / base
    high, low = wavelength < 8192 / 4, wavelength > 8192 / 1
    assert high.any() and low.any() and (~high & ~low).any()
    assert torch.equal(scaled[high], base[high])
    assert torch.allclose(scaled[low], base[low] / 8)
    middle = ~high & ~low
    assert ((scaled[middle] < base[middle]) & (scaled[middle] > base[middle] / 8)).all()
    with pytest.raises(ValueError, match="missing \\['original_max_positions'\\]"):
        rope_frequencies(128, 500000.0, dict(factor=8.0, low_freq_factor=1.0,
                                             high_freq_factor=4.0))


def test_grouped_query_attention_reads_kv_head_i_over_group():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 6, 4 * 8), torch.randn(2, 6, 2 * 8), torch.randn(2, 6, 2 * 8)
    out = col_nn.AttentionCore(8, causal=True)(q, k, v)
    heads = []
    for i in range(4):
        qi, ki, vi = (t.view(2, 6, -1, 8)[:, :, h] for t, h in ((q, i), (k, i // 2), (v, i // 2)))
        scores = (qi @ ki.transpose(1, 2)) / math.sqrt(8)
        scores = scores.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float('-inf'))
        heads.append(scores.softmax(-1) @ vi)
    assert torch.allclose(out, torch.stack(heads, 2).reshape(2, 6, 32), atol=1e-6)


def test_kv_heads_must_divide_the_heads():
    with pytest.raises(ValueError, match='heads 4 must be divisible by kv_heads 3'):
        Llama.from_preset('tiny', kv_heads=3)


def _kv_error(rank):
    try:
        Llama.from_preset('tiny', heads=8, kv_heads=4)
    except ValueError as err:
        return str(err)
    return None


def test_2d_needs_kv_heads_divisible_by_q():
    """2D splits the kv heads with the query heads (it does not replicate them)."""
    message = run_distributed(_kv_error, 4, dict(parallel=dict(tensor=dict(size=4, mode='2d'))))
    assert message[0] is None  # 4 kv heads over q = 2: fine
    results = run_distributed(_kv_error_one, 4, dict(parallel=dict(tensor=dict(size=4, mode='2d'))))
    assert all('kv_heads 1 must be divisible by 2' in r for r in results)


def _kv_error_one(rank):
    try:
        Llama.from_preset('tiny', kv_heads=1)
    except ValueError as err:
        return str(err)
    return ''
