"""initialize() + Engine equal the serial model under dp=2, dp=2 x tp=2 (1D) and dp=4.

For GPT, BERT and ViT (tiny presets): the replica-averaged loss, every gathered
gradient (after clipping), the clipping norm and the weights after 3 AdamW steps
match a plain serial loop on the whole batch. Also: gradient accumulation of N
equals one batch N times larger with no data-parallel traffic before the last
micro-step and overlapped bucket all-reduces in it; unsupported config raises;
a rank that raises ends the job promptly.
"""
from __future__ import annotations

import time

import pytest
import torch

import colossal_lite as clt
from colossal_lite.communication import collective as C
from colossal_lite.communication import comm_profile
from colossal_lite.context import ParallelMode, global_context as gpc
from colossal_lite.testing import ChildFailed, full_gradients, max_rel_diff, run_distributed
from tests._engine_cases import (FAMILIES, build, criterion, global_batch, make_optimizer,
                                 replica_batch, serial_reference)

CLIP = 1.0
TIMEOUT = 300


def _worst(actual: dict, expected: dict) -> float:
    assert set(actual) == set(expected), sorted(set(actual) ^ set(expected))
    return max(max_rel_diff(actual[k], expected[k]) for k in expected)


def _train_family(family, ref, batch):
    model = build(family)
    model.load_state_dict(ref['init'])
    opt = make_optimizer(model.parameters())
    engine, *_ = clt.initialize(model, opt, criterion(family))
    local = replica_batch(batch)
    for step in range(3):
        engine.zero_grad()
        _, _, loss = engine.execute_schedule(local)
        assert engine.step()
        if step == 0:
            first_loss = C.all_reduce(loss, ParallelMode.DATA) / gpc.get_world_size(ParallelMode.DATA)
            grads = full_gradients(engine.model)
            norm = engine.last_grad_norm
    params = engine.model.state_dict()
    return {'loss': abs(first_loss.item() - ref['loss']) / max(1.0, abs(ref['loss'])),
            'norm': abs(norm - ref['norm']) / max(1.0, ref['norm']),
            'grads': _worst(grads, ref['grads']),
            'params': _worst(params, ref['params'])}


def _layout_worker(rank, refs, batches, families=FAMILIES):
    return {family: _train_family(family, refs[family], batches[family]) for family in families}


@pytest.fixture(scope='module')
def references():
    batches = {f: global_batch(f) for f in FAMILIES}
    refs = {f: serial_reference(f, [batches[f]], steps=3, clip=CLIP) for f in FAMILIES}
    for f in FAMILIES:  # the clipping branch must be exercised
        assert refs[f]['norm'] > CLIP, (f, refs[f]['norm'])
    return refs, batches


@pytest.mark.parametrize('world,parallel,handler,families', [
    (2, dict(), dict(), FAMILIES),
    (4, dict(tensor=dict(size=2, mode='1d')), dict(), FAMILIES),
    (4, dict(), dict(bucket_mb=0.004), FAMILIES),           # many small overlapped buckets
    # gradients summed over SEQUENCE_DP (ViT tiny's 17 tokens do not split over 2)
    (4, dict(tensor=dict(size=2, mode='sequence')), dict(), ('gpt', 'bert')),
], ids=['dp2', 'dp2xtp2', 'dp4', 'dp2xseq2'])
def test_layout_equals_serial(references, world, parallel, handler, families):
    refs, batches = references
    config = dict(parallel=parallel, clip_grad_norm=CLIP, gradient_handler=handler)
    results = run_distributed(_layout_worker, world, config, refs, batches, families,
                              timeout=TIMEOUT)
    for rank, per_family in enumerate(results):
        for family, diffs in per_family.items():
            for what, diff in diffs.items():
                assert diff <= 1e-5, f'rank {rank} {family} {what} differs by {diff:.3g}'


ACCUM = 2


def _accumulation_worker(rank, ref, batch):
    model = build('gpt')
    model.load_state_dict(ref['init'])
    engine, *_ = clt.initialize(model, make_optimizer(model.parameters()),
                                criterion('gpt'))
    micro = torch.chunk(replica_batch(batch)[0], ACCUM, dim=0)
    calls, overlapped = [], 0
    for i, ids in enumerate(micro):
        engine.zero_grad()                       # clears only at the start of the cycle
        with comm_profile() as stats:
            _, _, loss = engine.execute_schedule((ids, ids))    # forward + backward
        calls.append(stats.calls(ParallelMode.DATA))
        with comm_profile() as stats:
            stepped = engine.step()
        assert stepped == (i == ACCUM - 1), (i, stepped)
        calls[-1] += stats.calls(ParallelMode.DATA)
        if i == ACCUM - 1:
            overlapped = calls[-1] - stats.calls(ParallelMode.DATA)
    grads = full_gradients(engine.model)
    return {'calls': calls, 'overlapped': overlapped,
            'buckets': len(engine.gradient_handler.buckets),
            'grads': _worst(grads, ref['grads']),
            'params': _worst(engine.model.state_dict(), ref['params'])}


def test_gradient_accumulation_equals_larger_batch():
    batch = global_batch('gpt', seed=3, batch=8)
    ref = serial_reference('gpt', [batch], steps=1)
    config = dict(parallel=dict(tensor=dict(size=2, mode='1d')), gradient_accumulation=ACCUM,
                  gradient_handler=dict(bucket_mb=0.004))
    results = run_distributed(_accumulation_worker, 4, config, ref, batch, timeout=TIMEOUT)
    for rank, r in enumerate(results):
        assert r['grads'] <= 1e-5 and r['params'] <= 1e-5, (rank, r)
        assert r['buckets'] > 1, r
        assert r['calls'][0] == 0, f'rank {rank} communicated before the last micro-step: {r}'
        assert r['calls'][1] == r['buckets'], r
        assert r['overlapped'] > 0, f'no bucket all-reduce started during backward: {r}'


def _unsupported_worker(rank):
    model = build('gpt')
    try:
        clt.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1))
    except NotImplementedError as err:
        return str(err)
    return None


def _raising_worker(rank):
    if rank == 1:
        raise ValueError('rank 1 fails on purpose')
    C.barrier()          # rank 0 would wait here forever
    return 'unreachable'


def test_unsupported_config_and_failing_rank():
    messages = run_distributed(_unsupported_worker, 2, dict(parallel=dict(pipeline=2)),
                               timeout=TIMEOUT)
    assert all(m and 'pipeline' in m for m in messages), messages
    model = build('gpt')
    with pytest.raises(NotImplementedError, match='ZeRO'):
        clt.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                       config=dict(zero=dict(stage=3)))
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
    ref = serial_reference('gpt', [batch], steps=2, clip=0.5)
    model = build('gpt')
    model.load_state_dict(ref['init'])
    engine, *_ = clt.initialize(model, make_optimizer(model.parameters()),
                                criterion('gpt'), config=dict(clip_grad_norm=0.5))
    ids = batch[0]
    engine.zero_grad()
    engine.execute_schedule({'input_ids': ids, 'labels': ids})
    engine.step()
    assert abs(engine.last_grad_norm - ref['norm']) <= 1e-5 * ref['norm']
    engine.zero_grad()
    engine.backward(engine.criterion(engine(ids), ids))
    engine.step()
    assert max_rel_diff(torch.cat([v.flatten() for v in engine.model.state_dict().values()]),
                        torch.cat([v.flatten() for v in ref['params'].values()])) <= 1e-5
    with pytest.raises(RuntimeError, match='without engine.backward'):
        engine.step()
    with pytest.raises(ValueError, match='batch'):
        engine.execute_schedule((ids, ids, ids))


def _norm_worker(rank):
    from colossal_lite.engine import clip_grad_norm, grad_norm
    from colossal_lite.tensor import ShardSpec, set_spec
    row, col = gpc.axis(ParallelMode.PARALLEL_2D_ROW), gpc.axis(ParallelMode.PARALLEL_2D_COL)
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(4, 6, generator=g), torch.randn(6, generator=g), torch.randn(3, generator=g)]
    specs = [ShardSpec.of((0, col), (1, row)), ShardSpec.of((0, row)), ShardSpec()]
    params = []
    for f, spec in zip(full, specs):
        p = set_spec(torch.nn.Parameter(spec.shard(torch.zeros_like(f))), spec)
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
