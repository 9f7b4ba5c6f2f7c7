"""Graph plans cut into pipeline stages (``auto/graph/pipeline.py``) and run by the pipeline
runtime: loss, parameters after 3 AdamW steps equal the serial model's (full batch of 4, two
micro-batches of 2).

* GPT-2 (tied embedding: held by the first and the last stage, its gradient summed over
  PIPELINE) and Llama (GQA) on 8 ranks: pipeline 2 x mesh data 2 x tensor 2, 1F1B, the fast
  plan under half the unconstrained plan's memory (parameters sharded), and a random plan
  (placements no cost model picks: the values crossing a cut are sharded, strided, or
  replicated; a Partial one is never cut through);
* GPT-2 on 4 ranks (pipeline 2 x tensor 2) under zero bubble and under interleaved 1F1B
  with 2 chunks (4 stages), clipping the gradient norm at 0.5 (the tied embedding, held by
  both pipeline ranks, counted once);
* memory: every rank's measured peak under the unpipelined plan's prediction;
* a checkpoint saved by the pipelined plan resumes under a plan without stages;
* the cut itself, without processes: valid cut points, free ops recomputed in every stage
  that reads them, node names kept, the bad inputs.
"""
from __future__ import annotations

import random
import warnings

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from colossal_lite.testing import run_distributed
from colossal_lite.testing.compare import assert_close_dict, max_rel_diff

from tests.auto_graph_models import CASES
from tests.test_auto_graph_models import STEPS, TOL, _budget_gb, _optimizer, _serial

MICROBATCHES = 2


# of the full batch's unconstrained peak: a 1F1B stage plan searched on one micro-batch
# (half the rows) needs about half of it with tensor = 2; 0.5 sat on that edge
STAGE_BUDGET = 0.6


def _micro(inputs):
    return tuple(t[: t.shape[0] // MICROBATCHES] for t in inputs)


def _random_plan(case, mesh, stages, seed):
    """A random valid plan of ``case`` on ``mesh`` with its pipeline cut."""
    from colossal_lite.auto.cluster import load_profile
    from colossal_lite.auto.graph.api import plan_from_choice
    from colossal_lite.auto.graph.cost import GraphCost
    from colossal_lite.auto.graph.pipeline import plan_cut
    from colossal_lite.auto.graph.space import Space, random_choice
    from colossal_lite.auto.graph.trace import capture
    space = Space(capture(case.build(), _micro(case.inputs()), case.loss_fn),
                  tuple(mesh.values()))
    choice = random_choice(space, random.Random(seed))
    plan = plan_from_choice(space, choice, dict(mesh), 'random', 0.0, {})
    plan.pipeline = plan_cut(space, GraphCost(space, load_profile(None)), choice, stages)
    return plan


def _train(rank, name, mesh, memory_gb, seed, stages):
    """STEPS engine steps of the pipelined plan: losses, full parameters, the plan's cut."""
    warnings.simplefilter('ignore')
    import colossal_lite
    from colossal_lite.auto import parallelize
    case = CASES[name]
    inputs = case.inputs()
    plan = None if seed is None else _random_plan(case, mesh, stages, seed)
    model, plan = parallelize(case.build(), _micro(inputs), loss_fn=case.loss_fn, mesh=mesh,
                              memory_gb=memory_gb, plan=plan)
    engine, *_ = colossal_lite.initialize(model, _optimizer(model.parameters()))
    losses = []
    for _ in range(STEPS):
        engine.zero_grad()
        _, _, loss = engine.execute_schedule((inputs, None))
        engine.step()
        losses.append(loss.detach())
    params = {n: p.full_tensor().detach() for n, p in model.named_parameters()}
    return dict(losses=losses, params=params, pipeline=plan.pipeline, plan_params=plan.params,
                stages=[s.index for s in model.stages])


def _check(name, results, serial, stages):
    losses, _, params = serial
    held = {}
    for rank, res in enumerate(results):
        where = f'{name} rank {rank} (stages {res["stages"]})'
        assert res['pipeline']['stages'] == stages
        for step, (got, want) in enumerate(zip(res['losses'], losses)):
            diff = max_rel_diff(got, want)
            assert diff <= TOL, f'{where}: step {step} loss {got.item()} vs serial ' \
                                f'{want.item()} (rel diff {diff:.3g})'
        assert_close_dict(res['params'], {n: params[n] for n in res['params']}, TOL,
                          f'{where}: after {STEPS} steps, parameter')
        for fqn in res['params']:
            held.setdefault(fqn, set()).update(res['stages'])
    # every parameter is held by some stage, and no rank holds every parameter
    assert set(held) == set(params), sorted(set(params) - set(held))
    assert all(len(r['params']) < len(params) for r in results)


def _config(schedule='1f1b', chunks=1, clip=None):
    config = dict(parallel=dict(pipeline=dict(size=2, schedule=schedule, chunks=chunks)),
                  num_microbatches=MICROBATCHES)
    if clip is not None:
        config['clip_grad_norm'] = clip
    return config


CLIP = 0.5


def _serial_clipped(name, clip):
    """(losses, None, parameters) of STEPS serial AdamW steps with torch's norm clipping."""
    case = CASES[name]
    model, inputs = case.build(), case.inputs()
    opt = _optimizer(model.parameters())
    losses, norms = [], []
    for _ in range(STEPS):
        loss = case.loss_fn(model(*inputs), *inputs)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
    assert min(norms) > clip, f'clipping at {clip} never acts: norms {norms}'
    return losses, None, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.timeout(900)
@pytest.mark.parametrize('name', ['gpt2', pytest.param('llama', marks=pytest.mark.slow)])
def test_eight_ranks_pipeline_2_of_2x2_meshes_equal_serial(name):
    mesh = dict(data=2, tensor=2)
    serial = _serial(name)
    memory_gb = _budget_gb(name, mesh)
    results = run_distributed(_train, 8, _config(), name, mesh, memory_gb, None, 2, timeout=840)
    _check(name, results, serial, 2)
    assert any(p.startswith('S') for r in results for v in r['plan_params'].values()
               for p in v), 'the budgeted plan shards no parameter'
    results = run_distributed(_train, 8, _config(), name, mesh, None, 0, 2, timeout=840)
    _check(name, results, serial, 2)


@pytest.mark.timeout(600)
@pytest.mark.parametrize('schedule,chunks', [('zero_bubble', 1), ('interleaved', 2)])
def test_gpt2_pipeline_schedules_equal_serial_with_clipping(schedule, chunks):
    """Also clipping at 0.5: the norm counts the tied embedding (held by two pipeline
    ranks) once."""
    serial = _serial_clipped('gpt2', CLIP)
    results = run_distributed(_train, 4, _config(schedule, chunks, CLIP), 'gpt2',
                              dict(tensor=2), None, 1, 2 * chunks, timeout=540)
    _check('gpt2', results, serial, 2 * chunks)


# ------------------------------------------------------------------ the cut, in one process
def _space(name):
    from colossal_lite.auto.graph.space import Space
    from colossal_lite.auto.graph.trace import capture
    case = CASES[name]
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        return Space(capture(case.build(), _micro(case.inputs()), case.loss_fn), (2,))


def _replicated(space):
    return [next(k for k, st in enumerate(d.strategies)
                 if all(p is None or all(isinstance(x, Replicate) for x in p)
                        for p in st.inputs + st.outputs))
            for d in space.decisions]


class _Reshaping(torch.fx.Interpreter):
    """Runs a graph on plain tensors, its views as reshapes (an exported graph's view may
    meet a real tensor with other strides; the executor does the same, execute._local_view)."""

    def call_function(self, target, args, kwargs):
        if target in (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default):
            return args[0].reshape(args[1])
        return super().call_function(target, args, kwargs)


@pytest.mark.parametrize('name,stages', [('gpt2', 3), ('t5', 3), ('llama', 2)])
def test_stages_run_in_turn_give_the_serial_loss_and_gradients(name, stages):
    """Each stage's graph, fed the previous stage's sent values, computes the serial loss
    and gradients: the cut loses and duplicates nothing (free ops are recomputed)."""
    from colossal_lite.auto.cluster import load_profile
    from colossal_lite.auto.graph.cost import GraphCost
    from colossal_lite.auto.graph.model import input_values
    from colossal_lite.auto.graph.pipeline import chain, plan_cut, split
    case = CASES[name]
    model, inputs = case.build(), _micro(case.inputs())
    want = case.loss_fn(model(*inputs), *inputs)
    want.backward()
    serial_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    space = _space(name)
    cut = plan_cut(space, GraphCost(space, load_profile(None)), _replicated(space), stages)
    graphs = split(space.captured, cut['starts'])
    assert [g.index for g in graphs] == list(range(stages))
    sent = ()
    for graph in graphs:
        values = input_values(graph.captured, model, inputs, sent)
        sent = _Reshaping(graph.captured.graph_module).run(*values)
        names = {n.name for n in graph.captured.graph.nodes}
        assert set(graph.receives) <= names and set(graph.sends) <= names
    loss = sent[0]
    assert max_rel_diff(loss, want) <= TOL
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert_close_dict(grads, serial_grads, TOL, f'{name} stage-by-stage gradient')
    # every op of the chain runs in exactly one stage
    ops = {n.name for n in chain(space.captured)}
    owned = [n.name for g in graphs for n in g.captured.graph.nodes
             if n.name in ops and n.op == 'call_function']
    assert sorted(owned) == sorted(ops)
    # the free ops (no parameter read) are recomputed by every stage that reads them
    free = [n.name for n in graphs[-1].captured.graph.nodes
            if n.op == 'call_function' and n.name not in ops]
    assert free, f'{name}: the last stage recomputes no free op (the loss reads the labels)'


def test_a_cut_never_passes_a_partial_sum():
    from colossal_lite.auto.graph.pipeline import _crossing_spans, chain, valid_cuts
    from colossal_lite.auto.graph.strategies import Strategy
    space = _space('gpt2')
    order = chain(space.captured)
    replicated = {d.name: d.strategies[k] for d, k in zip(space.decisions, _replicated(space))}
    ok = valid_cuts(order, replicated, 1)
    spans = _crossing_spans(order)
    # a value read one op later only, after which the chain may be cut when it is replicated
    pos, node = next((i, n) for i, n in enumerate(order)
                     if ok[i] and spans.get(n, (0, 0))[1] > i)
    partial = dict(replicated, **{node.name: Strategy((), ((Partial(),),))})
    assert not valid_cuts(order, partial, 1)[pos]
    sharded = dict(replicated, **{node.name: Strategy((), ((Shard(0),),))})
    assert valid_cuts(order, sharded, 1)[pos]


def test_more_stages_than_places_to_cut_is_an_error():
    from colossal_lite.auto.graph.pipeline import chain, cut_chain
    order = chain(_space('gpt2').captured)
    ok = [False] * (len(order) - 1)
    ok[len(order) // 2] = True
    with pytest.raises(ValueError, match=r'1 places where it can be cut.*3 stages'):
        cut_chain(order, [1.0] * len(order), ok, 3)


def test_pipeline_needs_a_pipelined_launch_and_a_plan_with_its_stages():
    from colossal_lite.auto import parallelize
    from colossal_lite.auto.cluster import load_profile
    from colossal_lite.auto.graph.api import search
    from colossal_lite.config.checks import ConfigError
    case = CASES['gpt2']
    inputs = _micro(case.inputs())
    with pytest.raises(ConfigError, match=r'parallelize\(pipeline=2\) needs a launch with '
                                          r'parallel=dict\(pipeline=2'):
        parallelize(case.build(), inputs, loss_fn=case.loss_fn, mesh=dict(tensor=1), pipeline=2)
    space = _space('gpt2')
    plan = search(space, load_profile(None), None, 'fast', dict(tensor=2), stages=2)
    plan.mesh = dict(tensor=1)
    with pytest.raises(ValueError, match=r'cuts the graph into 2 pipeline stage\(s\) but the '
                                         r'launch runs 1'):
        parallelize(case.build(), inputs, loss_fn=case.loss_fn, plan=plan)


def _pipelined_peaks(rank, name, memory_gb):
    """(predicted peak of the unpipelined plan, this rank's measured peak live bytes over
    STEPS engine steps of the pipelined plan, parameters, buffers and inputs included)."""
    warnings.simplefilter('ignore')
    import colossal_lite
    from colossal_lite.auto import parallelize
    from colossal_lite.testing.memory import peak_live_bytes
    case = CASES[name]
    inputs = case.inputs()
    model, plan = parallelize(case.build(), _micro(inputs), loss_fn=case.loss_fn,
                              mesh=dict(tensor=2), memory_gb=memory_gb)
    engine, *_ = colossal_lite.initialize(model, _optimizer(model.parameters()))

    def step():
        engine.zero_grad()
        engine.execute_schedule((inputs, None))
        engine.step()
    held = list(model.parameters()) + list(model.buffers()) + list(inputs)
    return plan.predicted['memory_bytes'], max(peak_live_bytes([step] * STEPS, held))


@pytest.mark.timeout(400)
def test_the_unpipelined_prediction_bounds_every_stage_peak():
    """The budget bounds the whole graph's plan on the stage mesh (parallelize's doc): every
    rank of the 1F1B pipeline (2 stages, 2 micro-batches) measures at most that peak."""
    name = 'gpt2'
    budget = _budget_gb(name, dict(tensor=2), STAGE_BUDGET)
    results = run_distributed(_pipelined_peaks, 4, _config(), name, budget, timeout=360)
    for rank, (predicted, measured) in enumerate(results):
        assert predicted <= budget * 2 ** 30
        assert measured <= predicted, f'rank {rank}: measured {measured} > predicted {predicted}'


def _pipelined_save(rank, name, path):
    """Two engine steps of the pipelined, budgeted (sharded) plan, then a checkpoint."""
    warnings.simplefilter('ignore')
    import colossal_lite
    from colossal_lite import checkpoint
    from colossal_lite.auto import parallelize
    case = CASES[name]
    inputs = case.inputs()
    model, plan = parallelize(case.build(), _micro(inputs), loss_fn=case.loss_fn,
                              mesh=dict(tensor=2), memory_gb=_budget_gb(name, dict(tensor=2), STAGE_BUDGET))
    engine, *_ = colossal_lite.initialize(model, _optimizer(model.parameters()))
    losses = []
    for _ in range(2):
        engine.zero_grad()
        losses.append(engine.execute_schedule((inputs, None))[2].detach())
        engine.step()
    checkpoint.save(path, engine)
    return losses, plan.params


def _resume_unpipelined(rank, name, path):
    """A fresh model planned on a 2 x 2 mesh without stages loads it and takes step 3."""
    warnings.simplefilter('ignore')
    import colossal_lite
    from colossal_lite import checkpoint
    from colossal_lite.auto import parallelize
    case = CASES[name]
    inputs = case.inputs()
    model, _ = parallelize(case.build(), inputs, loss_fn=case.loss_fn,
                           mesh=dict(data=2, tensor=2))
    engine = colossal_lite.initialize(model, _optimizer(model.parameters()))[0]
    checkpoint.load(path, engine)
    loss = engine(*inputs)
    engine.backward(loss)
    engine.step()
    return loss.detach(), {n: p.full_tensor().detach() for n, p in model.named_parameters()}


@pytest.mark.timeout(600)
def test_a_pipelined_plan_checkpoint_resumes_without_stages(tmp_path):
    """Saved by 2 stages of a sharded plan (each rank holding its stages' parameters and
    AdamW states), loaded by a 2 x 2 plan with no stages: the third step equals serial."""
    name, path = 'gpt2', str(tmp_path / 'ckpt')
    losses, _, params = _serial(name)
    saved = run_distributed(_pipelined_save, 4, _config(), name, path, timeout=540)
    assert any('S' in ''.join(p) for p in saved[0][1].values())
    for got, want in zip(saved[0][0], losses):
        assert max_rel_diff(got, want) <= TOL
    for loss, got in run_distributed(_resume_unpipelined, 4, None, name, path, timeout=540):
        assert max_rel_diff(loss, losses[2]) <= TOL
        assert_close_dict(got, params, TOL, 'after resuming, parameter')
