"""Graph-level auto-parallelism (``auto.graph.parallelize``) on real architectures, 4 ranks
(mesh data=2 x tensor=2) and, for GPT-2 and Llama, 8 ranks (2 x 2 x 2), against the serial
model in the test process.

Architectures (tests/auto_graph_models.py: tiny random-init ``transformers`` configs, every
dropout 0): GPT-2, BERT (masked LM), ViT (image classification), Llama (GQA), Mistral,
Qwen2, OPT, GPT-NeoX, Phi, T5 (encoder-decoder with labels), a small CNN and a module of
odd ops (cumsum, sort, ``torch.cdist`` -- no sharding rule -- and ``torch.special.erfcx``).
GPT-2 also runs with untied embeddings (``gpt2_untied``); the tied ones (GPT-2, BERT's MLM
decoder, OPT, T5's shared embedding) keep one DTensor under every alias.

Per architecture, one ``run_distributed`` call checks

1. two random valid plans (``space.random_choice``, seeds 0 and 1: placements no cost model
   would pick): the loss and every parameter's gradient equal the serial ones, and
2. the ``fast`` solved plan under a memory budget of half the unconstrained (replicated)
   plan's predicted peak, which forces parameter sharding: at least one parameter is
   sharded, and the losses and the parameters after 3 AdamW steps (lr 1e-2, eps 1e-3 -- a
   large eps, so a gradient off by a constant factor moves the weights visibly) equal 3
   serial steps.

Tolerance: ``max_rel_diff`` (max |a - e| / max(1, max |e|)) <= 1e-5.
"""
from __future__ import annotations

import random
import warnings

import pytest
import torch
from torch.distributed.tensor import DTensor

from colossal_lite.testing import run_distributed
from colossal_lite.testing.compare import assert_close_dict, max_rel_diff

from tests.auto_graph_models import CASES

AXES = {'data': 2, 'tensor': 2}
AXES8 = {'data': 2, 'tensor': 2, 'tensor2': 2}
SEEDS = (0, 1)
STEPS = 3
TOL = 1e-5
BUDGET_FRACTION = 0.5

ARCHS = ['gpt2', 'gpt2_untied', 'llama', 'bert', 'vit', 'mistral', 'qwen2', 'opt', 'gpt_neox',
         'phi', 't5', 'cnn', 'odd_ops']
# architectures with a diagnosed failure in auto/graph: {name: reason}
KNOWN_FAILURES = {}
# run only with `-m slow` (the README's suite keeps one case per model family: GPT-2, Llama,
# BERT, ViT, T5, the CNN and the odd ops); run them before calling an auto/graph change done
SLOW = {'gpt2_untied', 'mistral', 'qwen2', 'opt', 'gpt_neox', 'phi'}


def _optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-3)


def _grads(named):
    """Full gradients by name; a parameter the loss does not reach has a zero gradient."""
    out = {}
    for name, p in named:
        g = p.grad
        if g is None:
            g = torch.zeros(p.shape, dtype=p.dtype)
        elif hasattr(g, 'full_tensor'):
            g = g.full_tensor()
        out[name] = g.detach().clone()
    return out


def _serial(name):
    """(loss, gradients) of the first step, losses and parameters after STEPS AdamW steps."""
    case = CASES[name]
    model, inputs = case.build(), case.inputs()
    opt = _optimizer(model.parameters())
    losses, grads = [], None
    for _ in range(STEPS):
        loss = case.loss_fn(model(*inputs), *inputs)
        loss.backward()
        losses.append(loss.detach())
        if grads is None:
            grads = _grads(model.named_parameters())
        opt.step()
        opt.zero_grad()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses, grads, params


def _budget_gb(name, axes=AXES, fraction=BUDGET_FRACTION):
    """``fraction`` (default half) of the unconstrained plan's predicted per-rank peak, in
    GiB (searched here, once)."""
    from colossal_lite.auto.cluster import load_profile
    from colossal_lite.auto.graph.api import _least_memory_choice, search
    from colossal_lite.auto.graph.cost import GraphCost
    from colossal_lite.auto.graph.space import Space
    from colossal_lite.auto.graph.trace import capture
    case = CASES[name]
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        space = Space(capture(case.build(), case.inputs(), case.loss_fn), tuple(axes.values()))
    free = search(space, load_profile(None), None, 'fast', axes)
    # never on the edge of the least-memory plan's peak, where any change to the cost or
    # memory model would make the budget unmeetable (NoPlanFits is tested on its own)
    cost = GraphCost(space, load_profile(None))
    floor = cost.peak_memory(_least_memory_choice(cost.problem()))['peak']
    return max(fraction * free.predicted['memory_bytes'], 1.15 * floor) / 2 ** 30


def _rank(rank, name, seeds, memory_gb, steps, axes=AXES):
    """Random plans (first-step loss and gradients) and the budgeted solved plan (STEPS
    AdamW steps): what every rank sees, full tensors."""
    warnings.simplefilter('ignore')
    from colossal_lite.auto.graph.api import parallelize, plan_from_choice
    from colossal_lite.auto.graph.space import Space, random_choice
    from colossal_lite.auto.graph.trace import capture
    case = CASES[name]
    inputs = case.inputs()
    space = Space(capture(case.build(), inputs, case.loss_fn), tuple(axes.values()))
    random_runs = {}
    for seed in seeds:
        choice = random_choice(space, random.Random(seed))
        plan = plan_from_choice(space, choice, dict(axes), 'random', 0.0, {})
        model, _ = parallelize(case.build(), inputs, loss_fn=case.loss_fn, plan=plan)
        loss = model(*inputs)
        loss.backward()
        random_runs[seed] = dict(loss=loss.detach(),
                                 grads=_grads(model.module.named_parameters()),
                                 params=plan.params)
    model, plan = parallelize(case.build(), inputs, loss_fn=case.loss_fn, mesh=dict(axes),
                              level='fast', memory_gb=memory_gb)
    opt = _optimizer(model.parameters())
    losses = []
    for _ in range(steps):
        loss = model(*inputs)
        loss.backward()
        losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
    named = list(model.module.named_parameters())
    params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
              for n, p in named}
    return dict(random=random_runs, losses=losses, params=params, plan_params=plan.params,
                unruled=list(space.unruled),
                plain=[n for n, p in named if not isinstance(p, DTensor)])


def _sharded(plan_params):
    return sorted(fqn for fqn, placements in plan_params.items()
                  if any(p.startswith('S') for p in placements))


def _check(name, results, serial):
    losses, grads, params = serial
    for rank, res in enumerate(results):
        if name == 'odd_ops':
            assert res['unruled'], 'odd_ops should hold an op no sharding rule covers ' \
                                   '(torch.cdist); pick another if one was added'
        assert not res['plain'], f'{name} rank {rank}: parameters left plain tensors, not ' \
                                 f'DTensors, by parallelize: {res["plain"]}'
        for seed, run in res['random'].items():
            where = f'{name} rank {rank} random plan seed {seed}'
            diff = max_rel_diff(run['loss'], losses[0])
            assert diff <= TOL, f'{where}: loss {run["loss"].item()} vs serial ' \
                                f'{losses[0].item()} (rel diff {diff:.3g})'
            assert_close_dict(run['grads'], grads, TOL, f'{where}: gradient')
        where = f'{name} rank {rank} fast plan under the memory budget'
        assert _sharded(res['plan_params']), f'{where}: no parameter is sharded: ' \
                                             f'{res["plan_params"]}'
        for step, (got, want) in enumerate(zip(res['losses'], losses)):
            diff = max_rel_diff(got, want)
            assert diff <= TOL, f'{where}: step {step} loss {got.item()} vs serial ' \
                                f'{want.item()} (rel diff {diff:.3g})'
        assert_close_dict(res['params'], params, TOL, f'{where}: after {STEPS} steps, parameter')


def _case_param(name):
    if name in SLOW:
        return pytest.param(name, marks=pytest.mark.slow)
    if name in KNOWN_FAILURES:
        return pytest.param(name, marks=pytest.mark.xfail(
            strict=True, raises=AssertionError, reason=KNOWN_FAILURES[name]))
    return name


@pytest.mark.timeout(600)
@pytest.mark.parametrize('name', [_case_param(n) for n in ARCHS])
def test_parallel_equals_serial(name):
    serial = _serial(name)
    memory_gb = _budget_gb(name)
    results = run_distributed(_rank, 4, None, name, SEEDS, memory_gb, STEPS, timeout=540)
    _check(name, results, serial)


@pytest.mark.timeout(900)
@pytest.mark.parametrize('name', ['gpt2', pytest.param('llama', marks=pytest.mark.slow)])
def test_eight_ranks_on_a_2x2x2_mesh_equal_serial(name):
    serial = _serial(name)
    memory_gb = _budget_gb(name, AXES8)
    results = run_distributed(_rank, 8, None, name, SEEDS[:1], memory_gb, STEPS, AXES8,
                              timeout=840)
    _check(name, results, serial)
