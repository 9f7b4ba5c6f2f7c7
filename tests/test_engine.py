"""initialize() + Engine equal the serial model under dp=2, dp=2 x tp=2 (1D) and dp=4.

For GPT, BERT and ViT (tiny presets): the replica-averaged loss, every gathered
gradient (after clipping), the clipping norm and the weights after 3 AdamW steps
match a plain serial loop on the whole batch. Also: a schedule of M micro-batches
equals one batch M times larger with no data-parallel traffic before the last
micro-step and overlapped bucket all-reduces in it; unsupported config raises;
a rank that raises ends the job promptly. Serially: ``execute_schedule`` over M
micro-batches (split batch or iterator) equals M manual micro-steps and one
full-batch step; errors come before any forward; ``backward_by_grad`` on a model
cut in two equals one whole-model backward (also with M = 2 and a loss scale).
"""
from __future__ import annotations

import time

import pytest
import torch

import colossal_lite as clt
from colossal_lite.communication import collective as C
from colossal_lite.communication import comm_profile
from colossal_lite.context import ParallelMode, global_context as gpc
from colossal_lite.testing import (ChildFailed, assert_close_dict, assert_matches_serial,
                                   max_rel_diff, run_distributed, training_trace)
from colossal_lite.amp import DynamicGradScaler, NaiveAmp
from colossal_lite.engine import Engine
from tests.model_cases import (FAMILIES, build, criterion, global_batch, make_optimizer,
                               reference_trace, serial_state)

CLIP = 1.0
TIMEOUT = 300


def _engine_trace(family, state, batch, steps=3):
    """``steps`` engine steps (execute_schedule + step) from ``state`` on every rank."""
    model = build(family)
    model.load_state_dict(state)
    engine, *_ = clt.initialize(model, make_optimizer(model.parameters()), criterion(family))
    return training_trace(engine, batch, steps=steps)


def _layout_worker(rank, states, batches, families=FAMILIES):
    return {family: _engine_trace(family, states[family], batches[family])
            for family in families}


@pytest.fixture(scope='module')
def references():
    batches = {f: global_batch(f) for f in FAMILIES}
    states = {f: serial_state(f) for f in FAMILIES}
    refs = {f: reference_trace(f, states[f], batches[f], steps=3, clip=CLIP) for f in FAMILIES}
    for f in FAMILIES:  # the clipping branch must be exercised
        assert refs[f][0]['grad_norm'] > CLIP, (f, refs[f][0]['grad_norm'])
    return states, batches, refs


@pytest.mark.parametrize('world,parallel,handler,families', [
    (2, dict(), dict(), FAMILIES),
    (4, dict(tensor=dict(size=2, mode='1d')), dict(), FAMILIES),
    (4, dict(), dict(bucket_mb=0.004), FAMILIES),           # many small overlapped buckets
    # gradients summed over SEQUENCE_DP (ViT tiny's 17 tokens do not split over 2)
    (4, dict(tensor=dict(size=2, mode='sequence')), dict(), ('gpt', 'bert')),
], ids=['dp2', 'dp2xtp2', 'dp4', 'dp2xseq2'])
def test_layout_equals_serial(references, world, parallel, handler, families):
    """Replica-averaged loss, clipping norm, every (clipped) gradient and the weights at
    each of 3 engine steps equal a plain serial loop on the whole batch."""
    states, batches, refs = references
    config = dict(parallel=parallel, clip_grad_norm=CLIP, gradient_handler=handler)
    results = run_distributed(_layout_worker, world, config, states, batches, families,
                              timeout=TIMEOUT)
    for family in families:
        assert_matches_serial([r[family] for r in results], refs[family])


ACCUM = 2


def _accumulation_worker(rank, state, batch):
    model = build('gpt')
    model.load_state_dict(state)
    engine, *_ = clt.initialize(model, make_optimizer(model.parameters()),
                                criterion('gpt'))
    assert engine.num_microbatches == ACCUM
    calls, backward, counts = [], engine.backward, {}

    def counted_backward(loss):                  # DATA collectives issued inside each backward
        with comm_profile() as stats:
            backward(loss)
        calls.append(stats.calls(ParallelMode.DATA))

    def counted_step(engine, batch):
        engine.zero_grad()
        with comm_profile() as schedule_stats:
            _, _, loss = engine.execute_schedule(batch)   # ACCUM micro-batches
        with comm_profile() as step_stats:
            counts['stepped'] = engine.step()
        counts['total'] = (schedule_stats.calls(ParallelMode.DATA)
                           + step_stats.calls(ParallelMode.DATA))
        return {'loss': loss}

    engine.backward = counted_backward
    trace = training_trace(engine, batch, steps=1, step_fn=counted_step)
    return dict(counts, trace=trace, calls=calls, overlapped=calls[-1],
                buckets=len(engine.gradient_handler.buckets))


def test_gradient_accumulation_equals_larger_batch():
    batch = global_batch('gpt', seed=3, batch=8)
    state = serial_state('gpt')
    ref = reference_trace('gpt', state, batch, steps=1)
    config = dict(parallel=dict(tensor=dict(size=2, mode='1d')), gradient_accumulation=ACCUM,
                  gradient_handler=dict(bucket_mb=0.004))
    results = run_distributed(_accumulation_worker, 4, config, state, batch, timeout=TIMEOUT)
    assert_matches_serial([r['trace'] for r in results], ref)
    for rank, r in enumerate(results):
        assert r['stepped'] and len(r['calls']) == ACCUM, r
        assert r['buckets'] > 1, r
        assert r['calls'][0] == 0, f'rank {rank} communicated before the last micro-step: {r}'
        assert r['total'] == r['buckets'], r
        assert r['overlapped'] > 0, f'no bucket all-reduce started during backward: {r}'


def _unsupported_worker(rank):
    model = torch.nn.Linear(4, 4)  # not cut into pipeline stages
    try:
        clt.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1))
    except ValueError as err:
        return str(err)
    return None


def _raising_worker(rank):
    if rank == 1:
        raise ValueError('rank 1 fails on purpose')
    C.barrier()          # rank 0 would wait here forever
    return 'unreachable'


def test_unsupported_config_and_failing_rank():
    with pytest.raises(ChildFailed, match='needs num_microbatches >= pipeline size 2'):
        run_distributed(_unsupported_worker, 2, dict(parallel=dict(pipeline=2)), timeout=TIMEOUT)
    messages = run_distributed(_unsupported_worker, 2, dict(parallel=dict(pipeline=2),
                                                            num_microbatches=2), timeout=TIMEOUT)
    assert all(m and 'cut into 2 stages' in m for m in messages), messages
    model = build('gpt')
    with pytest.raises(NotImplementedError, match='ZeRO'):
        clt.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                       config=dict(zero=dict(stage=3), num_microbatches=2,
                                   parallel=dict(pipeline=dict(size=2, schedule='zero_bubble'))))
    with pytest.raises(clt.ConfigError, match='bucket_mb'):
        clt.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                       config=dict(gradient_handler=dict(bucket_mb=-1)))
    start = time.monotonic()
    with pytest.raises(ChildFailed, match='fails on purpose'):
        run_distributed(_raising_worker, 2, None, timeout=TIMEOUT)
    assert time.monotonic() - start < 60


def test_engine_serial_matches_plain_loop_and_batch_forms():
    """No launch: the engine is a plain loop; dict batches and direct calls work."""
    batch = global_batch('gpt', seed=4, batch=4)
    state = serial_state('gpt')
    ref = reference_trace('gpt', state, batch, steps=2, clip=0.5)
    model = build('gpt')
    model.load_state_dict(state)
    engine, *_ = clt.initialize(model, make_optimizer(model.parameters()),
                                criterion('gpt'), config=dict(clip_grad_norm=0.5))
    ids = batch[0]
    engine.zero_grad()
    engine.execute_schedule({'input_ids': ids, 'labels': ids})
    engine.step()
    norm = ref[0]['grad_norm'].item()
    assert abs(engine.last_grad_norm - norm) <= 1e-5 * norm
    engine.zero_grad()
    engine.backward(engine.criterion(engine(ids), ids))
    engine.step()
    assert_close_dict(engine.model.state_dict(), ref.named(1, 'param'), 1e-5, 'parameter')
    with pytest.raises(RuntimeError, match='without engine.backward'):
        engine.step()
    with pytest.raises(ValueError, match='batch'):
        engine.execute_schedule((ids, ids, ids))


def _norm_worker(rank):
    from colossal_lite.engine import clip_grad_norm, grad_norm
    from colossal_lite.tensor import Placement, set_placement
    row, col = gpc.axis(ParallelMode.PARALLEL_2D_ROW), gpc.axis(ParallelMode.PARALLEL_2D_COL)
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(4, 6, generator=g), torch.randn(6, generator=g), torch.randn(3, generator=g)]
    specs = [Placement.of((4, 6), (0, col), (1, row)), Placement.of((6,), (0, row)),
             Placement.of((3,))]
    params = []
    for f, spec in zip(full, specs):
        p = set_placement(torch.nn.Parameter(spec.shard(torch.zeros_like(f))), spec)
        p.grad = spec.shard(f).clone()
        params.append(p)
    params.append(params[0])                       # a tied weight is counted once
    norm = grad_norm(params)
    clip_grad_norm(params, 1.0)
    expected = torch.sqrt(sum(f.pow(2).sum() for f in full)).item()
    clipped = max(max_rel_diff(s.shard(f * (1.0 / (expected + 1e-6))), p.grad)
                  for f, s, p in zip(full, specs, params))
    return abs(norm - expected) / expected, clipped


def test_clip_norm_sums_each_shard_group_once_2d():
    """Parameters split over two groups, one group, or replicated (2D layout, 4 ranks)."""
    results = run_distributed(_norm_worker, 4, dict(parallel=dict(tensor=dict(size=4, mode='2d'))),
                              timeout=TIMEOUT)
    for rank, (norm_diff, clip_diff) in enumerate(results):
        assert norm_diff <= 1e-6 and clip_diff <= 1e-6, (rank, norm_diff, clip_diff)


# ------------------------------------------------------------------ serial schedule (no launch)
M = 4


def mlp(seed: int = 0) -> torch.nn.Sequential:
    """A small two-half MLP: ``[0]`` = Linear + Tanh (first half), ``[1]`` = Linear (second)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh()),
                               torch.nn.Linear(16, 5))


def mlp_batch(batch: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 6, generator=g), torch.randint(0, 5, (batch,), generator=g)


def full_batch_grads(model: torch.nn.Module, batch) -> tuple:
    """(loss, {name: grad}) of one plain backward of the mean cross entropy on ``batch``."""
    model.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(model(batch[0]), batch[1])
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _engine(model, m=M, **kwargs):
    return Engine(model, torch.optim.SGD(model.parameters(), lr=0.1),
                  torch.nn.CrossEntropyLoss(), num_microbatches=m, **kwargs)


def _grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _forward_counter(model) -> list:
    calls = []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    return calls


def _reference(batch, seed=0):
    """Full-batch loss and gradients, and the weights after one SGD step (lr 0.1)."""
    model = mlp(seed)
    loss, grads = full_batch_grads(model, batch)
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
    return loss, grads, model.state_dict()


@pytest.mark.parametrize('form', ['tuple', 'dict', 'iterator'])
def test_schedule_equals_manual_microsteps_and_full_batch(form):
    x, y = batch = mlp_batch(8)
    ref_loss, ref_grads, ref_params = _reference(batch)
    data = {'tuple': (x, y), 'dict': {'input': x, 'labels': y},
            'iterator': iter(list(zip(x.chunk(M), y.chunk(M))))}[form]
    engine = _engine(mlp())
    engine.zero_grad()
    _, _, loss = engine.execute_schedule(data)
    grads = _grads(engine.model)
    assert engine.at_boundary and engine.step() and engine.global_step == 1
    manual, losses, stepped = _engine(mlp()), [], []
    for xi, yi in zip(x.chunk(M), y.chunk(M)):
        manual.zero_grad()                         # clears only at the start of the cycle
        losses.append(manual.criterion(manual(xi), yi))
        manual.backward(losses[-1])
        stepped.append(manual.step())
    assert stepped == [False] * (M - 1) + [True]
    assert abs(loss.item() - ref_loss.item()) <= 1e-6
    assert abs(torch.stack(losses).mean().item() - ref_loss.item()) <= 1e-6
    for name, expected in ref_grads.items():
        assert max_rel_diff(grads[name], expected) <= 1e-6, name
        assert max_rel_diff(manual.model.get_parameter(name).grad, expected) <= 1e-6, name
    for e in (engine, manual):
        assert_close_dict(e.model.state_dict(), ref_params, 1e-6, 'parameter')


def test_schedule_outputs_forward_only_and_test_batches():
    x, y = batch = mlp_batch(8, seed=1)
    model = mlp()
    with torch.no_grad():
        full_out = model(x)
    ref_loss, _, _ = _reference(batch)
    engine = _engine(model)
    counter = _forward_counter(model)
    out, labels, loss = engine.execute_schedule(batch, forward_only=True, return_output=True)
    assert len(counter) == M and all(p.grad is None for p in model.parameters())
    assert max_rel_diff(out, full_out) <= 1e-6 and torch.equal(labels, y)
    assert abs(loss.item() - ref_loss.item()) <= 1e-6
    with pytest.raises(RuntimeError, match='without engine.backward'):
        engine.step()                              # forward_only counted no micro-step
    out, labels, _ = engine.execute_schedule(batch, return_output=True)
    assert max_rel_diff(out, full_out) <= 1e-6 and torch.equal(labels, y) and engine.step()
    odd = (x[:6], y[:6])                           # one test batch as one micro-batch
    _, _, loss = engine.execute_schedule(odd, forward_only=True, num_microbatches=1)
    assert abs(loss.item() - torch.nn.functional.cross_entropy(model(odd[0]), odd[1]).item()) \
        <= 1e-6
    with pytest.raises(ValueError, match='forward_only'):
        engine.execute_schedule(batch, num_microbatches=1)


def test_schedule_checks_come_before_any_forward():
    x, y = mlp_batch(6)
    engine = _engine(mlp())
    counter = _forward_counter(engine.model)
    with pytest.raises(ValueError, match=r'num_microbatches = 4 does not divide the batch size 6'):
        engine.execute_schedule((x, y))
    batches = iter([(x[:2], y[:2])] * (M - 1))
    with pytest.raises(StopIteration, match=f'after 3 of num_microbatches = {M}'):
        engine.execute_schedule(batches)
    assert counter == [] and all(p.grad is None for p in engine.model.parameters())
    with pytest.raises(RuntimeError, match='without engine.backward'):
        engine.step()
    engine.backward(engine.criterion(engine(x[:2]), y[:2]))      # a manual micro-step ...
    with pytest.raises(RuntimeError, match='already'):           # ... then a whole schedule
        engine.execute_schedule((x[:4], y[:4]))
    assert len(counter) == 1


def test_gradient_accumulation_is_an_alias_of_num_microbatches():
    x, y = mlp_batch(8, seed=2)
    engines = [_engine(mlp(), m=None, gradient_accumulation=M), _engine(mlp())]
    stepped = [[], []]
    for e, record in zip(engines, stepped):
        assert e.num_microbatches == e.gradient_accumulation == M
        for xi, yi in zip(x.chunk(M), y.chunk(M)):
            e.zero_grad()
            e.backward(e.criterion(e(xi), yi))
            record.append(e.step())
    assert stepped[0] == stepped[1] == [False] * (M - 1) + [True]
    assert_close_dict(engines[0].model.state_dict(), engines[1].model.state_dict(), 0.0,
                      'parameter')
    with pytest.raises(AttributeError):
        engines[0].gradient_accumulation = 2
    with pytest.raises(ValueError, match='differ'):
        _engine(mlp(), m=2, gradient_accumulation=M)
    with pytest.raises(ValueError, match='positive integer'):
        _engine(mlp(), m=0)
    assert _engine(mlp(), m=None).num_microbatches == 1


def _stage_engine(stage, m, scale, criterion=None):
    opt = torch.optim.SGD(stage.parameters(), lr=0.1)
    amp = None if scale is None else NaiveAmp(stage, opt, dtype=torch.float32,
                                              scaler=DynamicGradScaler(initial_scale=scale))
    return Engine(stage, opt, criterion, amp=amp, num_microbatches=m)


@pytest.mark.parametrize('m,scale', [(1, None), (2, None), (2, 256.0)])
def test_backward_by_grad_on_a_split_model_equals_whole_model(m, scale):
    """Two 'stages': the second's loss backward gives d(loss)/d(hidden) (already / M and
    x S), which backward_by_grad takes as is on the first."""
    x, y = batch = mlp_batch(8, seed=3)
    _, ref_grads = full_batch_grads(mlp(), batch)
    whole = mlp()
    first = _stage_engine(whole[0], m, scale)
    second = _stage_engine(whole[1], m, scale, torch.nn.CrossEntropyLoss())
    for i, (xi, yi) in enumerate(zip(x.chunk(m), y.chunk(m))):
        hidden = first(xi)
        received = hidden.detach().requires_grad_()
        second.backward(second.criterion(second(received), yi))
        if i % 2:                                  # tuple form; None entries are skipped
            first.backward_by_grad((hidden, yi), (received.grad, None))
        else:
            first.backward_by_grad(hidden, received.grad)
    with pytest.raises(RuntimeError, match='without step'):
        first.backward_by_grad(hidden, received.grad)
    assert first.step() and second.step() and not first.overflow
    for prefix, e in (('0.', first), ('1.', second)):
        names = [prefix + n for n, _ in e.model.named_parameters()]
        for name, p in zip(names, e.amp.grad_parameters()):    # unscaled (fp32 master) grads
            assert max_rel_diff(p.grad, ref_grads[name]) <= 1e-6, (name, m, scale)
