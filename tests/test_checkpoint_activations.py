"""Activation checkpointing: checkpointed and plain blocks give equal losses and gradients,
with dropout > 0, serially and under dp=2 x tp=2 (where attention dropout draws from the
TENSOR stream of seed_manager)."""
from __future__ import annotations

import torch

from colossal_lite.engine.checkpoint import capture_rng_state, checkpoint, restore_rng_state
from colossal_lite.testing import (max_rel_diff, plain_step, run_distributed, trace_diffs,
                                   training_trace)
from tests.model_cases import FAMILIES, build, criterion, global_batch

DROPOUT = 0.2


def _backward_trace(model, family, batch):
    """Loss and every full gradient of one backward (no update) as a one-step trace."""
    return training_trace(model, batch, steps=1, step_fn=plain_step(criterion(family)))


def _worst(actual, expected, kind):
    return max(d for (_, key), (d, _) in trace_diffs(actual, expected).items()
               if key.startswith(kind))


def _compare_family(family, init, batch):
    """Worst differences plain vs checkpointed (same RNG start), and plain vs plain with
    another RNG start (must differ: proves dropout is active)."""
    plain, ckpt = build(family, dropout=DROPOUT), build(family, dropout=DROPOUT, checkpoint=True)
    plain.load_state_dict(init)
    ckpt.load_state_dict(init)
    start = capture_rng_state()
    trace_p = _backward_trace(plain, family, batch)
    restore_rng_state(start)
    trace_c = _backward_trace(ckpt, family, batch)
    after_ckpt = torch.rand(4)             # the stream continues as after a plain run
    restore_rng_state(start)
    _backward_trace(plain, family, batch)
    after_plain = torch.rand(4)
    trace_other = _backward_trace(plain, family, batch)   # different dropout masks
    return {'loss': _worst(trace_c, trace_p, 'loss'),
            'grads': _worst(trace_c, trace_p, 'grad:'),
            'outputs': _worst(trace_c, trace_p, 'output'),
            'rng_after': max_rel_diff(after_ckpt, after_plain),
            'other_masks': _worst(trace_other, trace_p, 'grad:')}


def _check(results):
    for family, r in results.items():
        assert r['loss'] <= 1e-6 and r['grads'] <= 1e-6 and r['outputs'] <= 1e-6, (family, r)
        assert r['rng_after'] == 0.0, (family, r)
        assert r['other_masks'] > 1e-4, f'{family}: dropout had no effect: {r}'


def _init(family):
    torch.manual_seed(11)
    return build(family, dropout=DROPOUT).state_dict()


def test_checkpoint_equals_plain_serial():
    _check({f: _compare_family(f, _init(f), global_batch(f, batch=4)) for f in FAMILIES})


def _tp_worker(rank, inits, batches):
    return {f: _compare_family(f, inits[f], batches[f]) for f in FAMILIES}


def test_checkpoint_equals_plain_dp2_tp2():
    """Every rank passes the global batch; the harness gives each replica its rows."""
    inits = {f: _init(f) for f in FAMILIES}
    batches = {f: global_batch(f) for f in FAMILIES}
    config = dict(parallel=dict(tensor=dict(size=2, mode='1d')))
    for results in run_distributed(_tp_worker, 4, config, inits, batches, timeout=300):
        _check(results)


def test_checkpoint_function_without_grad_inputs_and_in_eval():
    """Parameters get gradients even when no input requires grad; no_grad runs plainly."""
    lin = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)
    checkpoint(lambda t, none: lin(t).relu(), x, None).sum().backward()
    expected_w = lin.weight.grad.clone()
    lin.weight.grad = None
    lin(x).relu().sum().backward()
    assert max_rel_diff(expected_w, lin.weight.grad) <= 1e-7
    with torch.no_grad():
        assert checkpoint(lin, x).grad_fn is None
