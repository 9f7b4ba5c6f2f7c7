"""The layer-level plan scored beside the graph-level plan (colossal_lite/auto/compare.py):
GPT tiny shapes on 4 devices, the layer layout pinned on the graph and priced by GraphCost,
the winner, a layout the graph cannot express, and the CLI's lines."""
import dataclasses
import math

import pytest

from colossal_lite.auto import plan
from colossal_lite.auto.compare import compare_plans, ms, unexpressible
from colossal_lite.auto.cost import Candidate
from colossal_lite.auto.graph.cost import GraphCost
from colossal_lite.auto.model_spec import model_shape
from colossal_lite.config import ParallelLayout

DEVICES, BATCH, SEQ = 4, 8, 32
SHAPE = model_shape('gpt', 'tiny', SEQ)


@pytest.fixture(scope='module')
def layer_plan():
    return plan('gpt:tiny', devices=DEVICES, batch=BATCH, seq=SEQ)


def _as_winner(layer_plan, mode, tensor):
    """The layer plan with its fastest (mode, tensor) candidate without pipeline, ZeRO,
    checkpointing or accumulation made the chosen one."""
    est = next(e for e in layer_plan.search.feasible
               if (e.candidate.layout.mode, e.candidate.layout.tensor) == (mode, tensor)
               and e.candidate.layout.pipeline == 1 and not e.candidate.zero
               and not e.candidate.checkpoint and e.candidate.microbatches == 1)
    return dataclasses.replace(layer_plan, estimate=est)


@pytest.fixture(scope='module')
def megatron(layer_plan):
    """D=2 x 1D t=2 as the layer planner's choice."""
    return compare_plans(_as_winner(layer_plan, '1d', 2), SHAPE, BATCH)


def _objective(space, graph_plan, cluster):
    """GraphCost's price of the plan's choice, recomputed from the space: the strategy index
    of every decision, then node costs + edge costs less the shared gradient all_reduces the
    choice never runs, and the predicted peak memory."""
    choice = [d.strategies.index(graph_plan.strategy(d.name)) for d in space.decisions]
    cost = GraphCost(space, cluster)
    problem = cost.problem()
    time = sum(float(c[k]) for c, k in zip(problem.node_costs, choice))
    time += sum(float(e.cost[choice[e.src], choice[e.dst]]) for e in problem.edges)
    return time - cost.shared_overcharge(choice), cost.peak_memory(choice)['peak']


def test_megatron_layout_is_priced_on_the_graph_by_graph_cost(megatron):
    r = megatron
    assert r.unexpressible is None and r.compared is r.layer
    assert r.mesh == {'data': 2, 'tensor': 2}
    for side in (r.graph, r.pinned):
        assert side is not None and math.isfinite(side.predicted['step_s'])
        assert side.predicted['step_s'] > 0
    assert math.isfinite(r.layer.step_time)
    # Megatron's placements: column-split q/k/v and fc1, row-split dense and fc2, the
    # vocabulary-split embedding (tied head), replicated on the data axis; inputs data-split
    block = 'model.blocks.0.'
    for name in ('attn.query.weight', 'attn.key.weight', 'attn.value.weight', 'mlp.fc1.weight',
                 'attn.query.bias', 'mlp.fc1.bias'):
        assert r.pins[block + name] == ['R', 'S0'], name
    for name in ('attn.dense.weight', 'mlp.fc2.weight'):
        assert r.pins[block + name] == ['R', 'S1'], name
    for name in ('attn.dense.bias', 'mlp.fc2.bias', 'ln1.weight'):
        assert r.pins[block + name] == ['R', 'R'], name
    assert r.pins['model.lm_head.weight'] == ['R', 'S0']
    inputs = [d.name for d in r.space.decisions if d.kind == 'input']
    assert len(inputs) == 2 and all(r.pins[n] == ['S0', 'R'] for n in inputs)
    for fqn, placements in r.pins.items():
        if fqn in r.pinned.params:
            assert r.pinned.params[fqn] == placements, fqn
    # the pinned plan's price is GraphCost's objective of its choice, recomputed here
    time, memory = _objective(r.pinned_space, r.pinned, r.cluster)
    assert time == pytest.approx(r.pinned.predicted['step_s'], rel=1e-9)
    assert memory == pytest.approx(r.pinned.predicted['memory_bytes'], rel=1e-9)


def test_the_winner_is_the_cheaper_plan_under_graph_cost(megatron, layer_plan):
    natural = compare_plans(layer_plan, SHAPE, BATCH)   # the planner's own choice (DP, M=2)
    for r in (megatron, natural):
        graph, _ = _objective(r.space, r.graph, r.cluster)
        pinned, _ = _objective(r.pinned_space, r.pinned, r.cluster)
        assert graph == pytest.approx(r.graph.predicted['step_s'], rel=1e-9)
        assert r.winner == ('graph' if graph < pinned else 'layer')
        text = r.report()
        name = 'the graph plan' if r.winner == 'graph' else 'the layer'
        assert f'under GraphCost {name}' in text
        assert f'{ms(graph)}' in text and f'{ms(pinned)}' in text
    # the free search can only match or beat its own pinned subset at the optimum
    best = compare_plans(_as_winner(layer_plan, '1d', 2), SHAPE, BATCH, level='optimal')
    assert best.graph_step <= best.pinned_step * (1 + 1e-9)
    assert best.winner in ('graph', 'tie')


def test_a_layout_the_graph_cannot_express_is_not_compared(layer_plan):
    r = compare_plans(_as_winner(layer_plan, '2d', 4), SHAPE, BATCH)
    assert r.layer.candidate.layout.mode == '2d'
    assert '2D tensor parallelism' in r.unexpressible
    text = r.report()
    assert "the layer planner's layout cannot be expressed on the graph (2D tensor " in text
    assert 'they come from different cost models' in text
    assert f'{ms(r.layer.step_time)} (layer cost model) is not compared' in text
    # the fastest feasible candidate the graph expresses is compared instead, labelled so
    expressible = [e for e in layer_plan.search.feasible if unexpressible(e.candidate) is None]
    assert r.compared is expressible[0]
    assert 'compared instead: the fastest layer candidate the graph expresses, ' \
           + r.compared.candidate.describe() in text
    assert r.winner is not None


@pytest.mark.parametrize('cand, words', [
    (Candidate(ParallelLayout(1, 2, '1d', 1, 2), 1), None),
    (Candidate(ParallelLayout(1, 1, None, 1, 4), 1), None),
    (Candidate(ParallelLayout(2, 1, None, 1, 2), 2), 'pipeline of 2 stages'),
    (Candidate(ParallelLayout(1, 2, 'sequence', 1, 2), 1), 'ring attention'),
    (Candidate(ParallelLayout(1, 8, '3d', 1, 1), 1), '3D tensor parallelism'),
    (Candidate(ParallelLayout(1, 1, None, 1, 4), 1, zero=2), 'ZeRO-2'),
    (Candidate(ParallelLayout(1, 1, None, 1, 4), 1, checkpoint=True), 'checkpointing'),
    (Candidate(ParallelLayout(1, 1, None, 1, 4), 2), 'gradient accumulation over M=2'),
])
def test_what_the_graph_cannot_express_is_named(cand, words):
    why = unexpressible(cand)
    assert why is None if words is None else words in why


def test_cli_prints_the_comparison(capsys):
    from colossal_lite.cli import main
    args = ['plan', '--model', 'gpt:tiny', '--devices', str(DEVICES), '--batch', str(BATCH),
            '--seq', str(SEQ)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert 'chosen:' in out
    lines = out[out.index('graph-level comparison (level fast'):].splitlines()
    assert lines[1].startswith('  layer planner:  D=4 P=1 t=1(none)')
    assert '(layer cost model, auto/cost.py)' in lines[1]
    assert lines[2].startswith('  graph plan:     mesh data=4: ')
    assert '(GraphCost, auto/graph/cost.py)' in lines[2]
    assert any('on the graph (data parallel, parameters pinned)' in line for line in lines)
    assert lines[-1].startswith('  under GraphCost ')
    assert main(args + ['--no-graph']) == 0
    assert 'graph-level comparison' not in capsys.readouterr().out
