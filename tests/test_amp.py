"""Mixed precision: the dynamic loss scaler's rule, naive fp16 (fp32 masters, a step with
inf on one tensor-parallel rank skipped on every rank without touching any weight or
optimizer state), torch autocast (bf16 on CPU) and the apex error."""
from __future__ import annotations

import pytest
import torch

import colossal_lite as clt
from colossal_lite.amp import DynamicGradScaler, NaiveAmp, apex_amp
from colossal_lite.tensor import gather_full
from colossal_lite.testing import (make_optimizer, max_rel_diff, replica_batch, replica_mean,
                                   run_distributed)
from tests.model_cases import build, criterion, global_batch, reference_trace, serial_state


def test_dynamic_scaler_growth_backoff_hysteresis():
    s = DynamicGradScaler(initial_scale=64, growth_factor=2, backoff_factor=0.25,
                          growth_interval=3, hysteresis=2, min_scale=2, max_scale=256)
    s.update(True)
    assert s.scale == 64                    # first overflow absorbed by hysteresis
    s.update(True)
    assert s.scale == 16                    # second one backs off
    for _ in range(2):
        s.update(False)
    assert s.scale == 16 and s.growth_tracker == 2
    s.update(False)
    assert s.scale == 32 and s.growth_tracker == 0 and s.hysteresis_tracker == 2
    for _ in range(4):
        s.update(True)                      # hysteresis 2 then clamped at min_scale
    assert s.scale == 2
    for _ in range(12):
        s.update(False)
    assert s.scale == 32
    s.load_state_dict({'scale': 250.0, 'growth_tracker': 2, 'hysteresis_tracker': 1})
    s.update(False)
    assert s.scale == 256                   # clamped at max_scale
    with pytest.raises(clt.ConfigError, match='min_scale'):
        DynamicGradScaler(initial_scale=1, min_scale=2)


FP16 = dict(mode='naive', dtype='float16', initial_scale=2 ** 8, hysteresis=1, growth_interval=2)
POISONED = 'blocks.0.mlp.fc1.weight'        # column-split: each rank holds half of it


def _snapshot(amp: NaiveAmp, model):
    masters = [m.detach().clone() for _, m in amp.pairs]
    weights = [p.detach().clone() for p in model.parameters()]
    return masters, weights


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def _naive_worker(rank, state, ref, batch):
    model = build('gpt')
    model.load_state_dict(state)
    engine, *_ = clt.initialize(model, make_optimizer(model.parameters()), criterion('gpt'))
    amp, out = engine.amp, {}
    batch = replica_batch(batch)
    out['dtype'] = str(next(engine.model.parameters()).dtype)
    # step 1: clean; unscaled fp32 master gradients ~ serial fp32 gradients
    engine.zero_grad()
    _, _, loss = engine.execute_schedule(batch)
    engine.step()
    loss = replica_mean(loss)
    out['loss'] = abs(loss.item() - ref[0]['loss'].item()) / ref[0]['loss'].item()
    named = dict(engine.model.named_parameters())
    masters = {id(p): m for p, m in amp.pairs}
    ref_grads = ref.named(0, 'grad')
    out['grads'] = max(max_rel_diff(gather_full(masters[id(p)].grad, p), ref_grads[n])
                       / max(ref_grads[n].abs().max().item(), 1e-3)
                       for n, p in named.items())
    out['scales'] = [engine.loss_scale]
    # step 2: inf in rank 1's shard only (its replica partner sees it through the data-parallel
    # all-reduce, the other tensor-parallel pair only through the global flag) -> skipped everywhere
    poison = named[POISONED].register_hook(
        lambda g: g.index_fill(1, torch.tensor([0]), float('inf')) if rank == 1 else g)
    engine.zero_grad()
    before = _snapshot(amp, engine.model)
    engine.execute_schedule(batch)
    poison.remove()
    state_before = {k: v.clone() for k, v in engine.optimizer.state[amp.pairs[0][1]].items()}
    engine.step()
    after = _snapshot(amp, engine.model)
    state_after = engine.optimizer.state[amp.pairs[0][1]]
    out['skipped'] = engine.overflow
    out['untouched'] = _same(before[0], after[0]) and _same(before[1], after[1]) and all(
        torch.equal(state_before[k], state_after[k]) for k in state_before)
    out['scales'].append(engine.loss_scale)
    # steps 3, 4: clean again; the scale grows after growth_interval clean steps
    for _ in range(2):
        engine.zero_grad()
        engine.execute_schedule(batch)
        engine.step()
        out['scales'].append(engine.loss_scale)
    out['moved'] = not _same(before[0], _snapshot(amp, engine.model)[0])
    out['weights_follow_masters'] = all(torch.equal(p.detach(), m.detach().half())
                                        for p, m in amp.pairs)
    return out


def test_naive_fp16_skips_overflow_on_every_rank():
    """dp=2 x tp=2: half-precision gradients are all-reduced in buckets, then unscaled."""
    batch, state = global_batch('gpt', batch=4), serial_state('gpt')
    ref = reference_trace('gpt', state, batch, steps=1)
    config = dict(parallel=dict(tensor=dict(size=2, mode='1d')), fp16=FP16)
    for rank, r in enumerate(run_distributed(_naive_worker, 4, config, state, ref, batch,
                                             timeout=300)):
        assert r['dtype'] == 'torch.float16', r
        assert r['loss'] < 1e-2 and r['grads'] < 2e-2, (rank, r)
        assert r['skipped'] and r['untouched'], (rank, r)
        assert r['scales'] == [256.0, 128.0, 128.0, 256.0], (rank, r)
        assert r['moved'] and r['weights_follow_masters'], (rank, r)


def test_torch_autocast_bf16_on_cpu():
    batch, state = global_batch('vit', batch=4), serial_state('vit')
    ref = reference_trace('vit', state, batch, steps=1)[0]
    model = build('vit')
    model.load_state_dict(state)
    engine, *_ = clt.initialize(model, make_optimizer(model.parameters()), criterion('vit'),
                                config=dict(fp16=dict(mode='torch')))
    dtypes = []
    engine.model.blocks["0"].mlp.fc1.register_forward_hook(lambda m, i, o: dtypes.append(o.dtype))
    engine.zero_grad()
    _, _, loss = engine.execute_schedule(batch)
    assert engine.step()
    assert dtypes == [torch.bfloat16]
    assert abs(loss.item() - ref['loss'].item()) / ref['loss'].item() < 2e-2
    assert all(p.dtype == torch.float32 for p in engine.model.parameters())
    assert max_rel_diff(engine.model.state_dict()['head.weight'], ref['param:head.weight']) < 1e-2


def test_apex_mode_needs_apex(monkeypatch):
    monkeypatch.setattr(apex_amp, 'apex_amp_module', lambda: None)
    model = build('gpt')
    with pytest.raises(clt.ConfigError, match='apex'):
        clt.initialize(model, make_optimizer(model.parameters()),
                       config=dict(fp16=dict(mode='apex')))


def _torch_scaler_worker(rank, state, batch):
    from colossal_lite.amp import TorchAmp
    from colossal_lite.engine import Engine
    model = build('gpt')
    model.load_state_dict(state)
    opt = make_optimizer(model.parameters())
    amp = TorchAmp(model, opt, use_scaler=True, scaler_kwargs=dict(init_scale=2.0 ** 8))
    engine = Engine(model, opt, criterion('gpt'), amp=amp)
    named = dict(model.named_parameters())
    poison = named[POISONED].register_hook(
        lambda g: g.index_fill(1, torch.tensor([0]), float('inf')) if rank == 1 else g)
    before = [p.detach().clone() for p in model.parameters()]
    engine.zero_grad()
    engine.execute_schedule(batch)
    poison.remove()
    engine.step()
    skipped = engine.overflow and _same(before, [p.detach() for p in model.parameters()])
    scales = [engine.loss_scale]
    engine.zero_grad()
    engine.execute_schedule(batch)
    engine.step()
    moved = not engine.overflow and not _same(before, [p.detach() for p in model.parameters()])
    return skipped, moved, scales + [engine.loss_scale]


def test_torch_grad_scaler_skips_overflow_on_every_rank():
    """The GradScaler path (fp16 on CUDA; forced here on CPU): one rank's inf skips all ranks."""
    batch = global_batch('gpt', batch=4)
    config = dict(parallel=dict(tensor=dict(size=2, mode='1d')))
    for rank, (skipped, moved, scales) in enumerate(
            run_distributed(_torch_scaler_worker, 2, config, serial_state('gpt'), batch,
                            timeout=300)):
        assert skipped and moved, (rank, skipped, moved)
        assert scales == [128.0, 128.0], (rank, scales)


_NEAR_LIMIT = dict(fp16=dict(mode='naive', initial_scale=40000.0))


def _near_fp16_limit_step(rank=None):
    """A scaled fp16 gradient of 40000 per replica: fits in fp16, but a sum over two
    replicas before averaging (80000) would not."""
    import colossal_lite as clt
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    kwargs = {} if rank is not None else dict(config=_NEAR_LIMIT)
    engine, *_ = clt.initialize(model, optimizer, lambda out: out.float().mean(), **kwargs)
    x = replica_batch(torch.ones(4, 1))              # serial: the whole batch
    engine.zero_grad()
    engine.execute_schedule((x, None))
    engine.step()
    return engine.overflow, engine.model.weight.float().item()


def test_data_parallel_fp16_gradients_are_averaged_before_they_are_summed():
    expected = _near_fp16_limit_step()
    assert expected[0] is False
    for result in run_distributed(_near_fp16_limit_step, 2, _NEAR_LIMIT, timeout=300):
        assert result == expected
