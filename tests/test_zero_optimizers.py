"""ZeRO 1, 2 and 3 run any elementwise torch optimizer, and leave a parameter whose gradient
is None exactly as the serial optimizer leaves it.

The model is a one-layer tiny BERT built with its NSP head but trained on the masked-LM
loss alone, so the pooler and the NSP head get no gradient (None) in every step while the
rest of their bucket or chunk does. The serial reference is a plain torch loop on the
whole batch; every ZeRO engine starts from the same weights, runs 3 steps on its
data-parallel slice, and must match it (``assert_matches_serial``: the loss, every
gradient -- the unused heads have none on either side -- and every parameter after each
step), keep the unused heads bit-identical to their initial values, and hold the serial
optimizer's state by name (no state for the unused heads, the same step counts and slots).

Optimizers: AdamW (large eps, so the update follows the gradient's scale), SGD with
Nesterov momentum, Adagrad and centered RMSprop with momentum, each with weight decay (the
update a parameter without a gradient must not get), and HybridAdam (the C++ kernel).
Layouts: dp=2 (every stage x optimizer) and dp=2 x 1D tp=2 (every stage, AdamW and SGD).
A non-elementwise optimizer is refused with an error naming it and the stage.
"""
from __future__ import annotations

import pytest
import torch

import colossal_lite as clt
from colossal_lite.nn.optimizer import HybridAdam
from colossal_lite.testing import (assert_matches_serial, engine_step, plain_step,
                                   run_distributed, training_trace)
from colossal_lite.zero.optimizer import check_optimizer
from model_zoo import BERT, BertPretrainingLoss
from tests.model_cases import make_case

STEPS = 3
TIMEOUT = 240
UNUSED = ('pooler.weight', 'pooler.bias', 'nsp_head.weight', 'nsp_head.bias')
CHUNK_MB = 4096 * 4 / 2 ** 20    # 4096 fp32 elements: several chunks, the heads among others
ZERO = {1: dict(stage=1), 2: dict(stage=2, bucket_mb=0.02),
        3: dict(stage=3, placement='cpu', chunk_size_mb=CHUNK_MB)}
TP2 = dict(tensor=dict(size=2, mode='1d'))


def make_optimizer(name: str, params):
    if name == 'adamw':
        return torch.optim.AdamW(params, lr=0.02, eps=1e-3, weight_decay=0.1)
    if name == 'hybrid_adam':
        return HybridAdam(params, lr=0.02, eps=1e-3, weight_decay=0.1)
    if name == 'sgd':
        return torch.optim.SGD(params, lr=0.5, momentum=0.9, nesterov=True, weight_decay=0.1)
    if name == 'adagrad':
        return torch.optim.Adagrad(params, lr=0.05, weight_decay=0.1,
                                   initial_accumulator_value=0.1)
    if name == 'rmsprop':
        return torch.optim.RMSprop(params, lr=0.005, momentum=0.5, centered=True,
                                   weight_decay=0.1, eps=1e-3)
    raise KeyError(name)


def build():
    return BERT.from_preset('tiny', layers=1, dropout=0.0)


def batch():
    """Inputs and the masked-LM labels only: the NSP logits feed no loss."""
    case = make_case('bert', batch=4, seq=16)
    inputs, (mlm, _) = case.batch
    return inputs, (mlm,)


def named_state(optimizer_state: dict, names) -> dict:
    """``{serial name: {slot: tensor}}`` from a torch state_dict's ``state`` by index."""
    return {names[i]: {k: torch.as_tensor(v).clone() for k, v in s.items()}
            for i, s in optimizer_state.items()}


def serial_reference(init: dict, name: str):
    model = build()
    model.load_state_dict(init)
    opt = make_optimizer(name, model.parameters())
    trace = training_trace(model, batch(), steps=STEPS, step_fn=plain_step(
        BertPretrainingLoss(), opt, outputs=False))
    names = [n for n, _ in model.named_parameters()]
    return trace, named_state(opt.state_dict()['state'], names)


def _step(engine, replica):
    out = engine_step(engine, replica)
    out['grads'] = engine.optimizer.full_gradients()
    return out


def _engine(init: dict, zero: dict, name: str):
    model = build()
    model.load_state_dict(init)
    engine, *_ = clt.initialize(model, make_optimizer(name, model.parameters()),
                                BertPretrainingLoss(), config=dict(zero=zero))
    return engine


def _worker(rank, init, cases, refused):
    out = {}
    for stage, name in cases:
        engine = _engine(init, ZERO[stage], name)
        trace = training_trace(engine, batch(), steps=STEPS, step_fn=_step)
        state = engine.optimizer.state_dict()['state']
        out[(stage, name)] = (trace, {n: {k: torch.as_tensor(v).clone() for k, v in s.items()}
                                      for n, s in state.items()})
    for stage in refused:
        model = build()
        try:
            clt.initialize(model, torch.optim.LBFGS(model.parameters()), BertPretrainingLoss(),
                           config=dict(zero=ZERO[stage]))
        except TypeError as err:
            out[('refused', stage)] = str(err)
    return out


def run(world, config, init, cases, refused):
    return run_distributed(_worker, world, config, init, cases, refused, timeout=TIMEOUT)


def _check_state(actual: dict, expected: dict, what):
    """ZeRO's full optimizer state equals the serial optimizer's by name: no state where the
    serial optimizer has none (Adagrad builds state for every parameter at construction:
    those never stepped count as none), the same slots and steps, and each slot within 1e-4
    of that slot's largest value over the model (a slot is ~0 where a gradient is 0 up to
    rounding, e.g. the attention key biases)."""
    expected = {n: s for n, s in expected.items()
                if 'step' not in s or float(s['step']) > 0}
    assert set(actual) == set(expected), (what, sorted(set(actual) ^ set(expected)))
    assert not set(actual) & set(UNUSED), what
    scales = {}
    for slots in expected.values():
        for key, value in slots.items():
            scales[key] = max(scales.get(key, 0.0), value.abs().max().item())
    for name, slots in expected.items():
        assert set(actual[name]) == set(slots), (what, name, set(actual[name]), set(slots))
        for key, value in slots.items():
            if value.dim() == 0:
                assert float(actual[name][key]) == float(value), (what, name, key)
                continue
            diff = (actual[name][key] - value).abs().max().item() / scales[key]
            assert diff <= 1e-4, (what, name, key, diff)


def _check(results, refs, init, cases):
    for stage, name in cases:
        trace, state = refs[name]
        per_rank = [r[(stage, name)] for r in results]
        assert_matches_serial([t for t, _ in per_rank], trace)
        for rank, (t, s) in enumerate(per_rank):
            what = (rank, stage, name)
            for key in UNUSED:           # left exactly as they were, as torch leaves them
                assert all(torch.equal(t[i][f'param:{key}'], init[key])
                           for i in range(STEPS)), (what, key)
                assert f'grad:{key}' not in t[STEPS - 1], (what, key)
            _check_state(s, state, what)


@pytest.fixture(scope='module')
def serial():
    torch.manual_seed(1)
    model = build()
    init = {k: v.clone() for k, v in model.state_dict().items()}
    names = ('adamw', 'hybrid_adam', 'sgd', 'adagrad', 'rmsprop')
    return init, {name: serial_reference(init, name) for name in names}


DP2_CASES = [(stage, name) for stage in (1, 2, 3)
             for name in ('adamw', 'sgd', 'adagrad', 'rmsprop')] + [(2, 'hybrid_adam'),
                                                                    (3, 'hybrid_adam')]


def test_optimizers_and_unused_heads_equal_serial_dp2(serial):
    """dp=2: ZeRO 1, 2, 3 with AdamW, SGD, Adagrad, RMSprop (and HybridAdam at 2 and 3) equal
    the serial loop, the unused heads never move; LBFGS is refused, named, at each stage."""
    init, refs = serial
    results = run(2, {}, init, DP2_CASES, (1, 2, 3))
    _check(results, refs, init, DP2_CASES)
    for r in results:
        for stage in (1, 2, 3):
            message = r[('refused', stage)]
            assert 'LBFGS' in message and f'stage {stage}' in message, message


TP_CASES = [(stage, name) for stage in (1, 2, 3) for name in ('adamw', 'sgd')]


def test_unused_heads_equal_serial_dp2_tp2(serial):
    """dp=2 x 1D tp=2: ZeRO 1, 2, 3 with AdamW and SGD equal the serial loop."""
    init, refs = serial
    results = run(4, dict(parallel=TP2), init, TP_CASES, ())
    _check(results, refs, init, TP_CASES)


class _Lion(torch.optim.Optimizer):
    """A sign-of-momentum update: elementwise, declared so."""
    elementwise = True

    def __init__(self, params, lr=1e-4):
        super().__init__(params, dict(lr=lr))


class _Lars(torch.optim.SGD):
    """A subclass of an accepted optimizer is not taken on trust (LARS scales per tensor)."""


def test_which_optimizers_zero_accepts():
    params = [torch.nn.Parameter(torch.zeros(4))]
    for opt in (torch.optim.SGD(params, lr=0.1), torch.optim.Adam(params),
                torch.optim.AdamW(params), torch.optim.Adagrad(params),
                torch.optim.RMSprop(params), torch.optim.Adamax(params),
                torch.optim.NAdam(params), torch.optim.RAdam(params),
                torch.optim.Adadelta(params), torch.optim.Rprop(params),
                torch.optim.ASGD(params), HybridAdam(params), _Lion(params)):
        check_optimizer(opt, stage=3)
    for opt, why in ((torch.optim.LBFGS(params), 'line search'),
                     (torch.optim.Adafactor(params), 'factor'),
                     (_Lars(params, lr=0.1), 'elementwise')):
        with pytest.raises(TypeError) as err:
            check_optimizer(opt, stage=2)
        message = str(err.value)
        assert type(opt).__name__ in message and 'stage 2' in message and why in message, message
    stepped = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    params[0].grad = torch.ones(4)
    stepped.step()
    with pytest.raises(ValueError, match='stepped'):
        check_optimizer(stepped, stage=1)
