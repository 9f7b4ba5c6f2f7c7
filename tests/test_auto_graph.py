"""Graph-level auto-parallelism (colossal_lite/auto/graph): capture, strategies, plans,
errors, and the Engine path equal to the serial model. The per-architecture matrix is in
tests/test_auto_graph_models.py."""
import json
import random
import warnings

import pytest
import torch

from colossal_lite.auto.cluster import load_profile
from colossal_lite.auto.graph import GraphBreakError, Plan, capture, resolve_mesh
from colossal_lite.auto.graph.api import NoPlanFits, search
from colossal_lite.auto.graph.space import Space
from colossal_lite.auto.graph.strategies import axis_strategies, placement_name
from colossal_lite.config.checks import ConfigError
from colossal_lite.testing import run_distributed
from colossal_lite.testing.compare import max_rel_diff

transformers = pytest.importorskip('transformers')

MESH = {'data': 2, 'tensor': 2}


def tiny_llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg)


def lm_loss(out, ids):
    return out.loss


class WithLabels(torch.nn.Module):
    """A causal LM called as ``model(ids)`` with the ids as labels."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids, labels=ids, use_cache=False)


def ids_batch():
    return torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))


def llama_space(mesh_shape=(2, 2)):
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        cap = capture(WithLabels(tiny_llama()), (ids_batch(),), lm_loss)
        return Space(cap, mesh_shape)


# ------------------------------------------------------------------ capture and errors
class DataDependent(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if y.sum() > 0:      # the graph break: Python control flow on a tensor value
            y = y * 2
        return y.sum()


def test_untraceable_model_names_the_graph_break_and_line():
    with pytest.raises(GraphBreakError) as err:
        capture(DataDependent(), (torch.randn(2, 4),))
    text = str(err.value)
    assert 'DataDependent' in text and 'data-dependent' in text
    assert 'test_auto_graph.py' in text and 'if y.sum() > 0' in text


def test_mesh_must_match_the_world():
    assert resolve_mesh({'data': 2, 'tensor': 4}, 8) == {'data': 2, 'tensor': 4}
    assert resolve_mesh((2, 2, 2), 8) == {'data': 2, 'tensor': 2, 'tensor2': 2}
    assert resolve_mesh((4,), 4) == {'tensor': 4}
    with pytest.raises(ConfigError, match=r'has 6 devices but the world has 4'):
        resolve_mesh({'data': 3, 'tensor': 2}, 4)
    with pytest.raises(ConfigError, match='1 to 3 axes'):
        resolve_mesh((1, 1, 2, 2), 4)


def test_mm_strategies_are_the_sbp_signatures():
    """On one axis DTensor's rules give a matmul exactly AutoDDL's signatures: data (S0 x B),
    column (B x S1), row (S1 x S0 -> P), partial passing through, and all-replicated."""
    space = llama_space()
    mm = next(d for d in space.decisions if str(d.node.target) == 'aten.mm.default')
    rules, ruled = axis_strategies(mm.node, 2)
    got = {(tuple(placement_name(p[0]) for p in r.inputs), placement_name(r.outputs[0][0]))
           for r in rules}
    assert ruled
    assert got == {(('R', 'R'), 'R'), (('S0', 'R'), 'S0'), (('R', 'S1'), 'S1'),
                   (('S1', 'S0'), 'P'), (('P', 'R'), 'P'), (('R', 'P'), 'P')}


def test_plan_is_json_and_explains_itself():
    space = llama_space()
    plan = search(space, load_profile('nvlink8'), 0.0004, 'fast', MESH)
    again = Plan.from_json(json.loads(json.dumps(plan.to_json())))
    assert again == plan
    text = plan.explain()
    assert 'aten.mm.default' in text and 'aten.scaled_dot_product_attention' in text
    assert 'no sharding rule (run replicated): aten.index.Tensor' in text
    assert 'collectives per step' in text
    assert any('S' in ''.join(p) for p in plan.params.values())   # the budget forced shards
    with pytest.raises(ValueError, match='unknown plan keys'):
        Plan.from_json(dict(plan.to_json(), extra=1))


def test_a_budget_no_plan_meets_names_the_smallest_peak():
    space = llama_space()
    with pytest.raises(NoPlanFits, match=r'memory_gb=1e-06 .* smallest predicted peak is'):
        search(space, load_profile('nvlink8'), 1e-6, 'fast', MESH)


# ------------------------------------------------------------------ 4 ranks: Engine path
def _serial_steps(ids, steps, clip):
    model = WithLabels(tiny_llama())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3)
    losses = []
    for _ in range(steps):
        loss = lm_loss(model(ids), ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _engine_run(engine, ids, steps=3):
    losses = []
    for _ in range(steps):
        loss = engine(ids)
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        losses.append(loss.item())
    return losses


def _engine_steps(rank, ids, steps, clip):
    warnings.simplefilter('ignore')
    import colossal_lite
    from colossal_lite.auto import parallelize
    from colossal_lite.communication.profile import comm_profile
    model = WithLabels(tiny_llama())
    pmodel, plan = parallelize(model, (ids,), loss_fn=lm_loss, mesh=MESH, memory_gb=0.0004)
    opt = torch.optim.AdamW(pmodel.parameters(), lr=1e-2, eps=1e-3)
    engine, *_ = colossal_lite.initialize(pmodel, opt, config=dict(clip_grad_norm=clip))
    assert opt.param_groups[0]['foreach'] is True     # batched over the DTensor parameters
    with comm_profile() as stats:
        losses = _engine_run(engine, ids, steps)
    params = {n: p.full_tensor().detach() for n, p in pmodel.named_parameters()}
    return losses, params, plan.params, stats.bytes(), pmodel.last_deviations


def _foreach_groups(rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor
    from colossal_lite.engine.foreach import prefer_foreach
    mesh = init_device_mesh('cpu', (1,))
    dt = [torch.nn.Parameter(distribute_tensor(torch.ones(2), mesh, [Replicate()]))
          for _ in range(4)]
    plain = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([{'params': dt[:1]}, {'params': dt[1:2], 'foreach': False},
                             {'params': [dt[2], plain]}, {'params': dt[3:]}])
    changed = prefer_foreach(opt)
    plain_opt = torch.optim.SGD([plain])
    return changed, [g['foreach'] for g in opt.param_groups], prefer_foreach(plain_opt), \
        plain_opt.param_groups[0]['foreach']


def test_the_optimizer_is_batched_only_over_all_dtensor_groups_left_unset():
    changed, flags, plain_changed, plain_flag = run_distributed(_foreach_groups, 1, None)[0]
    assert (changed, flags) == (2, [True, False, None, True])
    assert (plain_changed, plain_flag) == (0, None)


def test_engine_trains_an_auto_plan_equal_to_serial_with_clipping():
    ids, steps, clip = ids_batch(), 3, 0.5
    serial_losses, serial_params = _serial_steps(ids, steps, clip)
    results = run_distributed(_engine_steps, 4, None, ids, steps, clip, timeout=240)
    for losses, params, placements, comm_bytes, deviations in results:
        assert max(abs(a - b) for a, b in zip(losses, serial_losses)) < 1e-5
        for name, value in serial_params.items():
            assert max_rel_diff(params[name], value) < 1e-5, name
        assert any('S' in ''.join(p) for p in placements.values())
        assert comm_bytes > 0 and deviations == {}


# ------------------------------------------------------------------ checkpoints
def _train_and_save(rank, ids, path, plan_seed):
    """Two steps under a solved plan, save; then a fresh model under another (random) plan
    loads the checkpoint and takes the third step."""
    warnings.simplefilter('ignore')
    import colossal_lite
    from colossal_lite import checkpoint
    from colossal_lite.auto import parallelize
    from colossal_lite.auto.graph.api import plan_from_choice
    from colossal_lite.auto.graph.space import random_choice

    def engine_for(plan=None):
        model = WithLabels(tiny_llama())
        pmodel, plan = parallelize(model, (ids,), loss_fn=lm_loss, mesh=MESH,
                                   memory_gb=0.0004, plan=plan)
        opt = torch.optim.AdamW(pmodel.parameters(), lr=1e-2, eps=1e-3)
        return colossal_lite.initialize(pmodel, opt, config={})[0], pmodel, plan

    def step(engine):
        loss = engine(ids)
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        return loss.item()

    engine, _, first = engine_for()
    losses = [step(engine), step(engine)]
    checkpoint.save(path, engine)
    space = llama_space()
    other = plan_from_choice(space, random_choice(space, random.Random(plan_seed)), MESH,
                             'random', 0.0, {})
    assert other.params != first.params
    engine, pmodel, _ = engine_for(other)
    checkpoint.load(path, engine)
    losses.append(step(engine))
    params = {n: p.full_tensor().detach() for n, p in pmodel.named_parameters()}
    return losses, params


def test_auto_plan_checkpoint_resumes_under_another_plan_and_serially(tmp_path):
    import colossal_lite
    from colossal_lite import checkpoint
    ids = ids_batch()
    serial_losses, serial_params = _serial_steps(ids, 3, clip=1e9)
    path = str(tmp_path / 'ckpt')
    results = run_distributed(_train_and_save, 4, None, ids, path, 7, timeout=240)
    for losses, params in results:
        assert max(abs(a - b) for a, b in zip(losses, serial_losses)) < 1e-5
        for name, value in serial_params.items():
            assert max_rel_diff(params[name], value) < 1e-5, name
    # the same checkpoint (saved after 2 steps) loads into a plain serial engine
    model = WithLabels(tiny_llama())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3)
    engine = colossal_lite.initialize(model, opt, config={})[0]
    checkpoint.load(path, engine)
    loss = engine(ids)
    loss = lm_loss(loss, ids)
    engine.backward(loss)
    engine.step()
    assert abs(loss.item() - serial_losses[2]) < 1e-5
    for name, p in model.named_parameters():
        assert max_rel_diff(p.detach(), serial_params[name]) < 1e-5, name


# ------------------------------------------------------------------ predicted = measured bytes
class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = torch.nn.Linear(16, 32)
        self.fc2 = torch.nn.Linear(32, 16)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.fc2(torch.relu(self.fc1(x))), y)


MEGATRON_MLP = {'fc1.weight': ['S0'], 'fc1.bias': ['S0'], 'fc2.weight': ['S1']}


def _mlp_bytes(rank, inputs):
    warnings.simplefilter('ignore')
    from colossal_lite.auto import parallelize
    from colossal_lite.communication.profile import comm_profile
    pmodel, plan = parallelize(MLP(), inputs, mesh=(4,), pins=MEGATRON_MLP)
    with comm_profile() as stats:
        loss = pmodel(*inputs)
        with pmodel.backward_context():
            loss.backward()
    measured = {op: stats.bytes(op=op) for op in
                ('all_reduce', 'all_gather', 'reduce_scatter', 'all_to_all')}
    grads = {n: p.grad.full_tensor() for n, p in pmodel.named_parameters()}
    return plan.predicted['comm_bytes'], {k: v for k, v in measured.items() if v}, \
        loss.item(), grads


def test_predicted_bytes_equal_measured_for_a_megatron_mlp():
    gen = torch.Generator().manual_seed(0)
    inputs = (torch.randn(8, 16, generator=gen), torch.randn(8, 16, generator=gen))
    serial = MLP()
    loss = serial(*inputs)
    loss.backward()
    for predicted, measured, got, grads in run_distributed(_mlp_bytes, 4, None, inputs):
        assert predicted == measured and measured   # forward and backward, every op
        assert abs(got - loss.item()) < 1e-6
        for name, p in serial.named_parameters():
            assert max_rel_diff(grads[name], p.grad) < 1e-5, name


# ------------------------------------------------------------------ Megatron as a baseline
def test_plans_for_llama3_8b_shapes_are_at_least_as_good_as_megatron():
    """Llama-3-8B shapes (2 of its layers), a tensor-only mesh of 8 under nvlink8, a budget
    just above the Megatron plan's memory (no room to replicate the blocks): the optimal plan
    predicts no more than Megatron's pattern pinned (q/k/v, gate/up column-split, o/down
    row-split), and fast is within 1% of optimal."""
    cfg = transformers.LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                   num_hidden_layers=2, num_attention_heads=32,
                                   num_key_value_heads=8, max_position_embeddings=8192)
    with torch.device('meta'):
        model = WithLabels(transformers.LlamaForCausalLM(cfg))
        ids = torch.zeros(8, 2048, dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        captured = capture(model, (ids,), lm_loss)
    megatron = {}
    for layer in range(2):
        for name, p in [('self_attn.q_proj', 'S0'), ('self_attn.k_proj', 'S0'),
                        ('self_attn.v_proj', 'S0'), ('self_attn.o_proj', 'S1'),
                        ('mlp.gate_proj', 'S0'), ('mlp.up_proj', 'S0'), ('mlp.down_proj', 'S1')]:
            megatron[f'model.model.layers.{layer}.{name}.weight'] = [p]
    from colossal_lite.auto.graph.api import apply_pins
    mesh, cluster = {'tensor': 8}, load_profile('nvlink8')
    pinned = Space(captured, (8,))
    apply_pins(pinned, megatron)
    reference = search(pinned, cluster, None, 'optimal', mesh)
    budget = reference.predicted['memory_bytes'] * 1.02 / 2 ** 30
    best = search(Space(captured, (8,)), cluster, budget, 'optimal', mesh)
    fast = search(Space(captured, (8,)), cluster, budget, 'fast', mesh)
    assert best.predicted['step_s'] <= reference.predicted['step_s'] * (1 + 1e-9)
    assert fast.predicted['step_s'] <= best.predicted['step_s'] * 1.01
    for plan in (best, fast):
        assert plan.predicted['memory_bytes'] <= budget * 2 ** 30
        assert plan.params['model.model.layers.1.mlp.gate_proj.weight'] != ['R']


# ------------------------------------------------------------------ the lowered step
def _lowered_and_interpreted(rank, budget_gb):
    warnings.simplefilter('ignore')
    from colossal_lite.auto import parallelize
    from colossal_lite.communication.profile import comm_profile
    ids = ids_batch()
    model, plan = parallelize(WithLabels(tiny_llama()), (ids,), loss_fn=lm_loss, mesh=MESH,
                              memory_gb=budget_gb)
    runs = {}
    for name in ('lowered', 'interpreted'):
        if name == 'interpreted':
            model.lowered = None
        model.zero_grad()
        model(ids)                               # the lowered step traces on first use
        model.zero_grad()
        with comm_profile() as stats:
            loss = model(ids)
            with model.backward_context():
                (2 * loss).backward()            # the incoming scalar scales the gradients
        runs[name] = dict(loss=loss.item(), bytes=dict(stats._bytes), calls=dict(stats._calls),
                          grads={n: p.grad.full_tensor() for n, p in model.named_parameters()})
        if name == 'lowered':
            runs[name]['merged'] = [p.merged_all_reduces
                                    for p in model.lowered._programs.values()][0]
    return runs, plan.params


def test_lowered_step_equals_the_interpreter_and_issues_the_same_collectives():
    """A budgeted (sharded) plan: the lowered per-rank program gives the interpreter's loss
    and gradients (also under a scaled backward) and the same collectives, op by op, but for
    the parameters' gradient all_reduces, which it sends as one bucket per group: the same
    bytes in fewer calls."""
    runs, params = run_distributed(_lowered_and_interpreted, 4, None, 0.0004)[0]
    assert any(p != ['R', 'R'] for p in params.values())          # something is sharded
    lowered, interpreted = runs['lowered'], runs['interpreted']
    assert lowered['loss'] == pytest.approx(interpreted['loss'], rel=1e-6)
    assert lowered['bytes'] == interpreted['bytes'] and lowered['bytes']
    fewer = {key: interpreted['calls'][key] - n for key, n in lowered['calls'].items()}
    assert set(lowered['calls']) == set(interpreted['calls'])
    assert all(v == 0 for key, v in fewer.items() if 'all_reduce' not in str(key))
    assert sum(fewer.values()) == lowered['merged'] > 0
    for name, grad in interpreted['grads'].items():
        assert max_rel_diff(lowered['grads'][name], grad) < 1e-5, name


class _SharedGradient(torch.nn.Module):
    """``x @ (a + b)^T``: autograd hands ``a`` and ``b`` one gradient tensor."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Parameter(torch.randn(4, 8))
        self.b = torch.nn.Parameter(torch.randn(4, 8))

    def forward(self, x):
        return ((x @ (self.a + self.b).t()) ** 2).mean()


def _shared_gradient(rank, x):
    from colossal_lite.auto import parallelize
    model, _ = parallelize(_SharedGradient(), (x,), mesh=dict(data=2))
    for _ in range(2):                 # two scaled micro-steps accumulate
        (model(x) * 0.5).backward()
    assert model.lowered is not None and model.lowered._programs
    return {n: p.grad.full_tensor() for n, p in model.named_parameters()}


def test_lowered_gradients_shared_by_two_parameters_are_scaled_once():
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    serial = _SharedGradient()
    for _ in range(2):
        (serial(x) * 0.5).backward()
    for grads in run_distributed(_shared_gradient, 2, None, x):
        for name, p in serial.named_parameters():
            assert max_rel_diff(grads[name], p.grad) < 1e-6, name


def test_identity_views_are_dropped_from_a_lowered_program_and_others_kept():
    from torch.fx.experimental.proxy_tensor import make_fx
    from colossal_lite.auto.graph.simplify import drop_identity_views

    def f(x):
        y = x.view(4, 6).detach().view(4, 6)        # identities: dropped
        z = x.t().view(6, 4)                         # the transpose's own shape: dropped
        return y * 2, z.reshape(24).view(2, 12), x.view(6, 4)   # reshaping views: kept

    x = torch.randn(4, 6)
    gm = make_fx(f)(x)
    calls = [n.target for n in gm.graph.nodes if n.op == 'call_function']
    assert drop_identity_views(gm.graph) == 4
    gm.recompile()
    kept = [n.target for n in gm.graph.nodes if n.op == 'call_function']
    assert len(kept) == len(calls) - 4 and kept.count(torch.ops.aten.view.default) == 2 and torch.ops.aten.detach.default not in kept
    for got, want in zip(gm(x), f(x)):
        assert torch.equal(got, want)


def test_constant_chunks_are_allocated_at_their_own_shape_and_copies_dropped():
    from torch.fx.experimental.proxy_tensor import make_fx
    from colossal_lite.auto.graph.simplify import simplify

    aten = torch.ops.aten

    def f(x):
        rows = torch.zeros(8, 4).split(2)[1]          # contiguous chunk: allocated as [2, 4]
        cols = torch.full((2, 8), 3.0).split(4, 1)[0]  # strided chunk: kept
        y = (x + rows).clone()                         # a copy with its input's strides
        z = x.t().clone(memory_format=torch.contiguous_format)   # a layout change: kept
        return y * cols, z

    x = torch.randn(2, 4)
    gm = make_fx(f)(x)
    assert simplify(gm.graph) == {'constant_chunks': 1, 'identity_views': 1}
    gm.recompile()
    fulls = [n.args[0] for n in gm.graph.nodes if n.target in (aten.full.default,
                                                               aten.zeros.default)]
    assert sorted(map(list, fulls)) == [[2, 4], [2, 8]]
    assert sum(n.target is aten.clone.default for n in gm.graph.nodes) == 1
    for got, want in zip(gm(x), f(x)):
        assert torch.equal(got, want)

    def writes(x):                                     # in place: nothing may be dropped
        y = x.clone()
        y.add_(1)
        return torch.zeros(8, 4).split(2)[1] + y

    gm = make_fx(writes)(x)
    assert simplify(gm.graph) == {'constant_chunks': 0, 'identity_views': 0}


def test_copies_of_chunks_are_kept_where_the_backward_reads_them_or_the_program_returns_them():
    """A chunk's copy lets its larger source go: dropping it where the value waits for the
    backward (or outlives the program) would hold the whole source instead."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from colossal_lite.auto.graph.simplify import drop_identity_views, forward_end

    aten = torch.ops.aten

    def joint(x):
        saved = x.split(2)[1].clone()          # read after the loss: kept
        passing = x.split(2)[0].clone()        # read before it only: dropped
        whole = (x * 2).clone()                # not a chunk: dropped
        loss = (passing * saved).sum() + whole.sum()
        grad = saved.view(-1) * 3              # the "backward"
        return loss.detach(), [grad, x.split(2)[2].clone()]    # returned: kept

    def copies(gm):
        return sum(n.target is aten.clone.default for n in gm.graph.nodes)

    x = torch.randn(6, 3)
    gm = make_fx(joint)(x)
    boundary = forward_end(gm.graph)
    assert boundary is not None and boundary.target is aten.add.Tensor and copies(gm) == 4
    assert drop_identity_views(gm.graph, boundary) >= 2 and copies(gm) == 2
    gm.recompile()
    for got, want in zip(torch.utils._pytree.tree_leaves(gm(x)),
                         torch.utils._pytree.tree_leaves(joint(x))):
        assert torch.equal(got, want)
    kept = make_fx(joint)(x)                   # no boundary known: every chunk copy stays
    drop_identity_views(kept.graph)
    assert copies(kept) == 3


def test_forward_matmuls_run_on_onednn_within_the_modelled_scratch():
    """The lowered program's forward matmuls become oneDNN linears (the backward's stay on
    mm) with the same results to fp32 rounding, and each call's scratch, as torch's CPU
    allocator reports it, stays within ``onednn.scratch_bytes``, which the memory model adds."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from colossal_lite.auto.graph import onednn
    from colossal_lite.auto.graph.simplify import forward_end
    from colossal_lite.testing.memory import peak_allocated

    aten = torch.ops.aten

    def joint(x, w, b, v):
        h = torch.addmm(b, x, w)                 # forward, [in, out] weight: rewritten
        y = h.mm(v.t())                          # forward, [out, in] weight: rewritten
        loss = y.sum()
        return loss.detach(), [x.t().mm(y), y.mm(v)]    # the "backward": kept on mm

    args = (torch.randn(16, 32), torch.randn(32, 48), torch.randn(48), torch.randn(24, 48))
    gm = make_fx(joint)(*args)
    if onednn.ONEDNN_LINEAR is None:      # no oneDNN in this torch: every matmul stays on mm
        assert onednn.matmuls_on_onednn(gm.graph, forward_end(gm.graph)) == 0
        return
    assert onednn.matmuls_on_onednn(gm.graph, forward_end(gm.graph)) == 2
    gm.recompile()
    targets = [n.target for n in gm.graph.nodes]
    assert targets.count(onednn.ONEDNN_LINEAR) == 2 and targets.count(aten.mm.default) == 2
    for got, want in zip(torch.utils._pytree.tree_leaves(gm(*args)),
                         torch.utils._pytree.tree_leaves(joint(*args))):
        assert max_rel_diff(got, want) < 1e-5
    for m, k, n in ((256, 256, 1024), (256, 1024, 256), (16, 32, 96), (64, 128, 64)):
        x = torch.randn(m, k)
        for w in (torch.randn(k, n), torch.randn(n, k).t()):      # both weight layouts
            call = lambda: onednn.ONEDNN_LINEAR(x, w.t(), None, 'none', [], '')  # noqa: E731
            extra = max(peak_allocated([call] * 3)) - m * n * 4
            assert 0 <= extra <= onednn.scratch_bytes(k), (m, k, n, w.stride(), extra)


class SpelledGelu(torch.nn.Module):
    """An MLP whose activation is written out as arithmetic (GPT-2's ``gelu_new``), with the
    factors in the given order, or a cubic coefficient that is not GELU's."""

    def __init__(self, swap=False, cubic=0.044715):
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.out, self.swap, self.cubic = torch.nn.Linear(8, 16), \
            torch.nn.Linear(16, 1), swap, cubic

    def forward(self, x):
        h = self.fc(x)
        inner = 0.7978845608028654 * (h + self.cubic * torch.pow(h, 3.0))
        act = (1.0 + torch.tanh(inner)) * (h * 0.5) if self.swap else \
            0.5 * h * (1.0 + torch.tanh(inner))
        return self.out(act).square().mean()


@pytest.mark.parametrize('swap', [False, True])
def test_a_spelled_out_tanh_gelu_is_captured_as_the_kernel_with_the_same_gradients(swap):
    aten = torch.ops.aten
    model, x = SpelledGelu(swap), torch.randn(4, 8)
    graph = capture(model, (x,)).graph
    targets = [n.target for n in graph.nodes]
    assert targets.count(aten.gelu.default) == 1 and aten.tanh.default not in targets
    assert [n.kwargs for n in graph.nodes if n.target is aten.gelu.default] == \
        [{'approximate': 'tanh'}]
    near = capture(SpelledGelu(swap, cubic=0.045), (x,)).graph   # not GELU: left as written
    assert aten.gelu.default not in [n.target for n in near.nodes]

    captured = capture(model, (x,))                # the fused graph against the model
    params = dict(model.named_parameters())
    leaves = {k: p.detach().clone().requires_grad_() for k, p in params.items()}
    args = [leaves[name] if kind == 'param' else x for kind, name in captured.inputs]
    loss, = captured.graph_module(*args)
    loss.backward()
    ref = model(x)
    ref.backward()
    assert max_rel_diff(loss, ref) < 1e-6
    for name, p in params.items():
        assert max_rel_diff(leaves[name].grad, p.grad) < 1e-5, name


def test_random_ops_are_not_lowered_but_dropout_zero_is():
    from colossal_lite.auto.graph.lower import has_random_ops

    class Drop(torch.nn.Module):
        def __init__(self, p):
            super().__init__()
            self.lin, self.p = torch.nn.Linear(4, 4), p

        def forward(self, x):
            return torch.nn.functional.dropout(self.lin(x), self.p).sum()

    x = torch.randn(2, 4)
    assert has_random_ops(capture(Drop(0.5), (x,)).graph)
    assert not has_random_ops(capture(Drop(0.0), (x,)).graph)


# ------------------------------------------------------------------ head-aligned fused splits
FUSED_PINS = {f'model.transformer.h.{i}.attn.c_attn.{kind}': ['R', f'S{dim}:3']
              for i in range(2) for kind, dim in (('weight', 1), ('bias', 0))}


def test_fused_qkv_chains_get_head_aligned_strided_strategies():
    """GPT-2's c_attn (addmm -> view -> split into q, k, v) is marked in both layers, and
    only its chain is offered the strided placement."""
    from tests.auto_graph_models import CASES
    case = CASES['gpt2']
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        captured = capture(case.build(), case.inputs(), case.loss_fn)
    marked = {n.name: n.meta['fused'] for n in captured.graph.nodes if 'fused' in n.meta}
    splits = [n for n in captured.graph.nodes if 'fused_split' in n.meta]
    assert len(splits) == 2 and all(n.meta['fused_split'] == (2, 3) for n in splits)
    space = Space(captured, (2, 2))
    names = {d.source or d.name: {tuple(placement_name(p) for p in s.outputs[0])
                                  for s in d.strategies if s.outputs and s.outputs[0]}
             for d in space.decisions}
    assert ('R', 'S1:3') in names['model.transformer.h.0.attn.c_attn.weight']
    assert ('S1:3', 'S1:3') not in names['model.transformer.h.0.attn.c_attn.weight']  # 32/3/4
    assert not any(':' in ''.join(sum(map(list, v), [])) for k, v in names.items()
                   if 'c_attn' not in str(k) and k not in marked)


def _fused_steps(rank, path):
    warnings.simplefilter('ignore')
    import colossal_lite
    from colossal_lite import checkpoint
    from colossal_lite.auto import parallelize
    from colossal_lite.communication.profile import comm_profile
    from tests.auto_graph_models import CASES
    case = CASES['gpt2']
    inputs = case.inputs()
    model, plan = parallelize(case.build(), inputs, loss_fn=case.loss_fn, mesh=MESH,
                              pins=FUSED_PINS)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3)
    engine = colossal_lite.initialize(model, opt, config={})[0]
    losses = []
    for _ in range(2):
        with comm_profile() as stats:
            loss = engine(*inputs)
            engine.backward(loss)
        engine.step()
        engine.zero_grad()
        losses.append(loss.item())
    checkpoint.save(path, engine)
    split = next(n for n in model._captured.graph.nodes if 'fused_split' in n.meta)
    params = {n: p.full_tensor() for n, p in model.named_parameters()}
    # the checkpoint loads back into the strided placements
    again, _ = parallelize(case.build(), inputs, loss_fn=case.loss_fn, plan=plan)
    with torch.no_grad():
        for p in again.parameters():
            p.zero_()
    checkpoint.load(path, colossal_lite.initialize(
        again, torch.optim.AdamW(again.parameters(), lr=1e-2, eps=1e-3), config={})[0])
    reloaded = all(torch.equal(p.full_tensor(), params[n]) for n, p in again.named_parameters())
    return losses, params, plan.nodes[split.name], model.lowered.failure, reloaded


def test_head_aligned_split_of_gpt2_qkv_equals_serial_and_checkpoints(tmp_path):
    """c_attn held as [q_r | k_r | v_r] per tensor rank (``S1:3``): two AdamW steps equal the
    serial model, the split needs no collective, and the checkpoint (saved replicated on
    that axis) loads back into the strided placements and into a serial engine."""
    import colossal_lite
    from colossal_lite import checkpoint
    from tests.auto_graph_models import CASES
    case = CASES['gpt2']
    inputs = case.inputs()
    serial = case.build()
    opt = torch.optim.AdamW(serial.parameters(), lr=1e-2, eps=1e-3)
    serial_losses = []
    for _ in range(2):
        loss = case.loss_fn(serial(*inputs), *inputs)
        loss.backward()
        opt.step()
        opt.zero_grad()
        serial_losses.append(loss.item())
    path = str(tmp_path / 'ckpt')
    for losses, params, split, failure, reloaded in run_distributed(_fused_steps, 4, None,
                                                                     path, timeout=240):
        assert failure is None and reloaded     # ran as the lowered program; loads back
        assert split['in'][0] == ['R', 'S2:3'] and not split.get('moves')   # no collective
        assert max(abs(a - b) for a, b in zip(losses, serial_losses)) < 1e-5
        for name, p in serial.named_parameters():
            assert max_rel_diff(params[name], p.detach()) < 1e-5, name
    fresh = case.build()
    engine = colossal_lite.initialize(fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-2,
                                                               eps=1e-3), config={})[0]
    checkpoint.load(path, engine)
    for name, p in serial.named_parameters():
        assert max_rel_diff(dict(fresh.named_parameters())[name].detach(), p.detach()) < 1e-5


# ------------------------------------------------------------------ the hand layout on a graph
def _megatron_gpt2_bytes(rank):
    warnings.simplefilter('ignore')
    from colossal_lite.auto import parallelize
    from colossal_lite.communication.profile import comm_profile
    from tests.auto_graph_models import CASES, LAYERS, gpt2_megatron_pins
    case = CASES['gpt2']
    inputs = case.inputs()
    model, plan = parallelize(case.build(), inputs, loss_fn=case.loss_fn, mesh=(4,),
                              pins=gpt2_megatron_pins(LAYERS))
    model(*inputs)                    # the first step traces the lowered program
    measured = {}
    for mode in ('lowered', 'interpreted'):
        if mode == 'interpreted':
            model.lowered = None
        model.zero_grad()
        with comm_profile() as stats:
            loss = model(*inputs)
            with model.backward_context():
                loss.backward()
        measured[mode] = {op: stats.bytes(op=op) for op in
                          ('all_reduce', 'all_gather', 'reduce_scatter', 'all_to_all')
                          if stats.bytes(op=op)}
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    ops = {n.name: plan.nodes[n.name]['in'] for n in model._captured.graph.nodes
           if n.name in ('_log_softmax', 'gather', 'embedding')}
    return plan.predicted['comm_bytes'], measured, loss.item(), grads, ops


def test_gpt2_megatron_layout_on_the_graph_is_exact_and_bytes_are_predicted():
    """GPT-2 with the hand layout pinned on 4 tensor ranks (head-aligned fused q/k/v, the
    biased row-parallel projections, the vocab-parallel embedding and loss): loss and
    gradients equal serial, and the predicted bytes equal the measured ones, op by op, for
    the lowered program and for the interpreter."""
    from tests.auto_graph_models import CASES
    case = CASES['gpt2']
    serial = case.build()
    inputs = case.inputs()
    loss = case.loss_fn(serial(*inputs), *inputs)
    loss.backward()
    for predicted, measured, got, grads, ops in run_distributed(_megatron_gpt2_bytes, 4, None):
        assert measured['lowered'] == predicted == measured['interpreted'] and predicted
        assert ops['_log_softmax'][0] == ['S1'] and ops['gather'][0] == ['S1']  # vocab split
        assert ops['embedding'][0] == ['S0']
        assert abs(got - loss.item()) < 1e-5
        for name, p in serial.named_parameters():
            assert max_rel_diff(grads[name], p.grad) < 1e-5, name


# ------------------------------------------------------------------ autocast (torch AMP)
class LossOf(torch.nn.Module):
    """The serial engine's model: HF Llama returning its own loss."""

    def __init__(self):
        super().__init__()
        self.inner = WithLabels(tiny_llama())

    def forward(self, ids):
        return lm_loss(self.inner(ids), ids)


def _serial_amp(rank, ids):
    import colossal_lite
    model = LossOf()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3)
    engine = colossal_lite.initialize(model, opt, config=dict(fp16=dict(mode='torch')))[0]
    losses = _engine_run(engine, ids)
    return losses, {n[len('inner.'):]: p.detach().clone() for n, p in model.named_parameters()}


def _planned_amp(rank, ids):
    warnings.simplefilter('ignore')
    import colossal_lite
    from colossal_lite.auto import parallelize
    out = {}
    for autocast in (torch.bfloat16, None):
        pmodel, _ = parallelize(WithLabels(tiny_llama()), (ids,), loss_fn=lm_loss, mesh=MESH,
                                memory_gb=0.0004, autocast=autocast)
        opt = torch.optim.AdamW(pmodel.parameters(), lr=1e-2, eps=1e-3)
        engine = colossal_lite.initialize(pmodel, opt, config=dict(fp16=dict(mode='torch')))[0]
        try:
            losses = _engine_run(engine, ids)
        except RuntimeError as err:
            out[autocast] = str(err)
            continue
        out[autocast] = (losses, {n: p.full_tensor().detach() for n, p in
                                  pmodel.named_parameters()}, pmodel.lowered.failure)
    return out


def test_a_plan_captured_under_autocast_trains_as_the_serial_model_under_torch_amp():
    """fp16=dict(mode='torch') (bf16 autocast on CPU): a model planned with
    ``autocast=torch.bfloat16`` holds autocast's casts and HF's own fp32 loss upcast (a
    no-op in an fp32 capture, whose replay under autocast summed the token losses in bf16:
    first loss 4.1667 against 4.1700). Its 3 lowered steps match the serial engine under the
    same autocast (losses 2e-4, weights 3e-3: bf16 rounding of sharded matmuls), and a model
    planned without autocast refuses to run under it, on every rank, naming both."""
    ids = ids_batch()
    serial_losses, serial_params = run_distributed(_serial_amp, 1, None, ids)[0]
    for out in run_distributed(_planned_amp, 4, None, ids, timeout=300):
        losses, params, lowering_failure = out[torch.bfloat16]
        assert lowering_failure is None
        assert abs(losses[0] - serial_losses[0]) <= 2e-5 * serial_losses[0]
        assert max(abs(a - b) for a, b in zip(losses, serial_losses)) <= 2e-4 * serial_losses[0]
        assert max(max_rel_diff(params[k], v) for k, v in serial_params.items()) <= 3e-3
        assert out[None].startswith('this model was planned under no autocast and now runs '
                                    'under autocast torch.bfloat16')


# ------------------------------------------------------------------ tied weights, loss wait
class _TiedLM(torch.nn.Module):
    """An embedding whose table is also the output projection (GPT-2's tied wte)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(64, 16)
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, ids):
        h = torch.tanh(self.proj(self.emb(ids)))
        logits = h @ self.emb.weight.t()
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())


TIED_IDS = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(2))
TIED_PINS = {'addmm': ['S0']}          # the projection splits the batch


def _tied_lm(rank, ids):
    warnings.simplefilter('ignore')
    from colossal_lite.auto import parallelize
    from colossal_lite.communication.profile import comm_profile
    model, plan = parallelize(_TiedLM(), (ids,), mesh=dict(data=4), pins=TIED_PINS)
    model(ids).backward()                      # the lowered program is traced here
    for p in model.parameters():
        p.grad = None
    with comm_profile() as stats:
        loss = model(ids)
        loss.backward()
    measured = {op: stats.bytes(op=op) for op in ('all_reduce', 'all_gather', 'reduce_scatter')}
    nodes = list(next(iter(model.lowered._programs.values())).graph.graph.nodes)
    kinds = [str(n.target) for n in nodes if '_c10d_functional' in str(n.target)]
    return (plan.nodes['embedding']['out'], plan.predicted['comm_bytes'],
            {k: v for k, v in measured.items() if v}, kinds, loss.item(),
            {n: p.grad.full_tensor() for n, p in model.named_parameters()})


def test_a_tied_weight_is_reduced_once_and_the_loss_is_waited_for_at_the_end():
    """The tied table's two uses (lookup and projection) each leave a Partial gradient when
    they split the batch; the program sums them and all_reduces once, as the cost model now
    prices it, so the plan splits the lookup too instead of gathering the hidden gradient.
    The loss's collective is waited for after the backward: every wait follows the last
    collective issued (one synchronisation a step)."""
    serial = _TiedLM()
    loss = serial(TIED_IDS)
    loss.backward()
    params = sum(p.numel() * 4 for p in serial.parameters())
    for placed, predicted, measured, kinds, got, grads in run_distributed(_tied_lm, 4, None,
                                                                          TIED_IDS):
        assert placed == [['S0']]                          # the lookup splits the batch
        assert predicted == measured
        assert measured['all_reduce'] == params            # each parameter reduced once
        issues = [i for i, k in enumerate(kinds) if 'wait' not in k]
        waits = [i for i, k in enumerate(kinds) if 'wait' in k]
        assert len(issues) >= 2 and min(waits) > max(issues), kinds
        assert abs(got - loss.item()) < 1e-6
        for name, p in serial.named_parameters():
            assert max_rel_diff(grads[name], p.grad) < 1e-5, name
