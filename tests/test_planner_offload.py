"""The planner's host-offload model (``auto/offload.py``) against real runs, and the search.

Real runs (forked gloo ranks, the tiny GPT of tests/test_planner_memory.py, AdamW through
``initialize``): for chunk ZeRO with placements 'device', 'cpu' and 'static' (half the
chunks), with fixed and searched chunk sizes and 1 or 2 micro-batches, the predicted chunk
layout equals the runtime's chunks, and the predicted device model data (the ledger's peak
over steady steps, its resident bytes), host bytes and bytes moved host->device and
device->host per step EQUAL the manager's ``DeviceLedger``. For ZeRO-2 with
``offload_optimizer`` the predicted host bytes equal the fp32 slices, their gradients and
Adam moments, and the moved bytes equal what passes the runtime's two transfer points
(``FlatBucket.add_grad``: reduce-scattered shards to the host master; ``FlatBucket.gather``:
updated slices back to the model's device).

On the hand-written 'nvlink8' profile: under a budget no device placement fits, the plan is
an offloaded one that fits, its config loads and names the placement; under 80 GiB the
device placement wins; offloading predicts more step time and less memory than the device
placement of the same layout, by exactly the offload terms.
"""
import pytest
import torch

import model_zoo  # noqa: F401  (registers gpt/bert/vit)
from colossal_lite.auto import load_profile, offload
from colossal_lite.auto.cost import Candidate, evaluate
from colossal_lite.auto.model_spec import model_shape
from colossal_lite.config import ParallelLayout

OPTS = dict(vocab_size=256, max_positions=16, hidden=32, layers=2, heads=4, dropout=0.0)
BATCH = 8
CHUNK = 8192                      # elements per chunk where the size is fixed: 6 chunks
TIMEOUT = 300
# (zero section without 'stage', micro-batches)
ZERO3_CASES = [(dict(placement='device', chunk_size_mb=CHUNK * 4 / 2 ** 20), 1),
               (dict(placement='cpu', chunk_size_mb=CHUNK * 4 / 2 ** 20), 2),
               (dict(placement='static', device_fraction=0.5, chunk_size_mb=CHUNK * 4 / 2 ** 20),
                1),
               (dict(placement='cpu'), 1)]


def _shape():
    return model_shape('gpt', None, seq=16, **OPTS)


def _engine(zero, micro):
    import colossal_lite as clt
    from colossal_lite.models import get_model
    entry = get_model('gpt')
    torch.manual_seed(0)
    model = entry.builder(**OPTS)
    engine, *_ = clt.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                entry.loss(), config=dict(zero=zero, num_microbatches=micro))
    return engine


def _batch():
    from colossal_lite.context import ParallelMode, global_context as gpc
    ids = torch.randint(0, 256, (BATCH // gpc.get_world_size(ParallelMode.DATA), 16),
                        generator=torch.Generator().manual_seed(0))
    return ids, ids


def _zero3_worker(rank, cases):
    """Per case: the chunks' shard elements, the ledger's peak over steps 3-4 (after the
    warm-up step and the re-pack), its bytes moved in step 4, and its resident bytes."""
    from colossal_lite.testing import engine_step
    out = []
    for zero, micro in cases:
        engine = _engine(dict(stage=3, **zero), micro)
        manager = engine.optimizer.manager
        for _ in range(2):
            engine_step(engine, _batch())
        ledger = manager.ledger
        ledger.peak = ledger.used
        engine_step(engine, _batch())
        h2d, d2h = ledger.moved_h2d, ledger.moved_d2h
        engine_step(engine, _batch())
        out.append(dict(shards=[c.shard_numel for c in manager.chunks], peak=ledger.peak,
                        used=ledger.used, h2d=ledger.moved_h2d - h2d,
                        d2h=ledger.moved_d2h - d2h,
                        host=16 * sum(c.shard_numel for c in manager.chunks
                                      if not manager.policy.on_device(c))))
    return out


@pytest.mark.parametrize('world', [2, 4])
def test_chunk_placements_ledger_equals_prediction(world):
    from colossal_lite.testing import run_distributed
    shape = _shape()
    per_rank = run_distributed(_zero3_worker, world, {}, ZERO3_CASES, timeout=TIMEOUT)
    for (zero, micro), *outs in zip(ZERO3_CASES, *per_rank):
        if 'chunk_size_mb' in zero:
            shards = offload.pack_shards(offload.model_numels(shape), CHUNK, world)
        else:
            shards = offload.chunk_shards(shape, world)
        pred = offload.zero3_offload(shards, world, zero['placement'], micro,
                                     zero.get('device_fraction', 1.0), tied=True)
        assert pred.moved_h2d > 0 or zero['placement'] == 'device'
        for o in outs:
            assert o['shards'] == list(shards), (zero, o)
            assert o['peak'] == pred.peak, (zero, o, pred)
            assert o['used'] == pred.resident, (zero, o, pred)
            assert (o['h2d'], o['d2h']) == (pred.moved_h2d, pred.moved_d2h), (zero, o, pred)
            assert o['host'] == pred.host_bytes, (zero, o, pred)


def _zero2_worker(rank, micro):
    """ZeRO-2 with offload_optimizer: bytes through ``add_grad`` (device->host) and
    ``gather`` (host->device) in the second step, and the host states after it."""
    from colossal_lite.testing import engine_step
    from colossal_lite.zero.buckets import FlatBucket
    moved = {'d2h': 0, 'h2d': 0}
    add_grad, gather = FlatBucket.add_grad, FlatBucket.gather

    def counting_add(self, shard):
        moved['d2h'] += shard.numel() * shard.element_size()
        return add_grad(self, shard)

    def counting_gather(self, shard, async_op=False):
        moved['h2d'] += shard.numel() * shard.element_size()
        return gather(self, shard, async_op)
    engine = _engine(dict(stage=2, offload_optimizer=True), micro)
    zopt = engine.optimizer
    engine_step(engine, _batch())
    FlatBucket.add_grad, FlatBucket.gather = counting_add, counting_gather
    try:
        engine_step(engine, _batch())
    finally:
        FlatBucket.add_grad, FlatBucket.gather = add_grad, gather
    host = 0
    for b in zopt.buckets:
        assert b.master.device.type == 'cpu'
        state = zopt.state[b.master]
        tensors = [b.master, b.master.grad, state['exp_avg'], state['exp_avg_sq']]
        host += sum(t.numel() * t.element_size() for t in tensors)
    return dict(moved, host=host, shards=[b.shard_numel for b in zopt.buckets])


def test_zero2_offload_optimizer_moves_what_the_model_predicts():
    from colossal_lite.auto.memory import ZERO_BUCKET_BYTES
    from colossal_lite.testing import run_distributed
    shape = _shape()
    micro = 2
    shards = offload.bucket_shards(offload.model_numels(shape), 2, ZERO_BUCKET_BYTES)
    pred = offload.low_level_offload(shards, 2, micro)
    for o in run_distributed(_zero2_worker, 2, {}, micro, timeout=TIMEOUT):
        assert o['shards'] == list(shards), o
        assert o['host'] == pred.host_bytes, (o, pred)
        assert (o['h2d'], o['d2h']) == (pred.moved_h2d, pred.moved_d2h), (o, pred)
    assert pred.moved_d2h == micro * pred.moved_h2d   # ZeRO-2 reduces every micro-step


# ------------------------------------------------------------------------------ the search
GPT2 = dict(model='gpt2-small', devices=2, batch=8, seq=128)   # states dominate memory


def _zero3(cand_kw):
    return Candidate(ParallelLayout(1, 1, None, 1, 2), 1, zero=3, checkpoint=True, **cand_kw)


def test_offloading_is_slower_and_smaller_by_its_terms():
    """Same layout: 'cpu' and 'static' cost exactly ``offload_time`` more than 'device' and
    hold exactly the ledger difference less; ZeRO-2 offload likewise."""
    shape = model_shape('gpt', 'gpt2-small')
    prof = load_profile('nvlink8')
    dev = evaluate(shape, prof, _zero3({}), 8)
    chunks = offload.chunk_shards(shape, 2)
    base = offload.zero3_offload(chunks, 2, 'device', 1, tied=True)
    times = []
    for kw in (dict(placement='static', device_fraction=0.5), dict(placement='cpu')):
        est = evaluate(shape, prof, _zero3(kw), 8)
        off = offload.zero3_offload(chunks, 2, kw['placement'], 1,
                                    kw.get('device_fraction', 1.0), tied=True)
        assert est.step_time == pytest.approx(dev.step_time + offload.offload_time(prof, off))
        assert est.step_time > dev.step_time
        assert est.peak_memory == pytest.approx(dev.peak_memory - base.peak + off.peak)
        assert est.peak_memory < dev.peak_memory - 2 ** 30 * 0.4   # ~16 * 62M / 2 B less
        assert est.terms['host_bytes'] == [off.host_bytes] and off.host_bytes > 0
        times.append(est.step_time)
    assert times[0] < times[1]
    z2 = Candidate(ParallelLayout(1, 1, None, 1, 2), 2, zero=2)
    d2 = evaluate(shape, prof, z2, 8)
    o2 = evaluate(shape, prof, Candidate(z2.layout, 2, zero=2, offload_optimizer=True), 8)
    params = d2.terms['params'][0]
    assert o2.step_time > d2.step_time
    assert o2.peak_memory == pytest.approx(d2.peak_memory - 16 * params / 2)
    assert 'offload optimizer' in o2.candidate.describe()
    assert _zero3({}).describe() == 'D=2 P=1 t=1(none) M=1 zero=3 ckpt'


def test_plan_offloads_only_when_nothing_else_fits():
    from colossal_lite.auto import plan
    from colossal_lite.auto.search import search
    from colossal_lite.config import load_config
    shape = model_shape('gpt', 'gpt2-small', 128)
    prof = load_profile('nvlink8').with_devices(2)
    everything = search(shape, prof, 2, 8, memory_bytes=float('inf'))
    assert not any(offload.is_offloaded(e.candidate) for e in everything.feasible)
    smallest = min(e.peak_memory for e in everything.feasible)
    budget_gb = 0.97 * smallest / 2 ** 30
    small = plan(memory_gb=budget_gb, cluster='nvlink8', **GPT2)
    cand = small.estimate.candidate
    assert offload.is_offloaded(cand), cand.describe()
    assert small.memory_per_device <= budget_gb * 2 ** 30
    settings = load_config(small.config).settings
    zero = small.config['zero']
    if cand.zero == 3:
        assert zero['placement'] == cand.placement != 'device'
        assert settings.zero.placement == cand.placement
    else:
        assert zero['offload_optimizer'] is True and settings.zero.offload_optimizer
    assert 'only an offloaded plan fits' in small.report()
    large = plan(memory_gb=80, cluster='nvlink8', **GPT2)
    assert not offload.is_offloaded(large.estimate.candidate)
    assert 'placement' not in large.config.get('zero', {}) or \
        large.config['zero']['placement'] == 'device'
    assert 'offload_optimizer' not in large.config.get('zero', {})


def test_one_device_offloads_a_model_whose_states_exceed_it():
    """Colossal-AI trains a GPT-2 larger than one GPU on that GPU by keeping its states on
    the host: gpt2-xl (1.56 B parameters, 16 B each = 23 GiB of weights, gradients and Adam
    moments) on one 16 GiB device. Every device placement needs more than 16 GiB; the plan
    offloads, fits, and names its placement; without ZeRO stages at one replica (the search
    before ``offload_only_stages``) there is no plan."""
    from colossal_lite.auto import plan
    from colossal_lite.auto.search import search
    shape = model_shape('gpt', 'gpt2-xl', 1024)
    prof = load_profile('nvlink8').with_devices(1, 16 * 2 ** 30)
    result = search(shape, prof, 1, 8)
    assert result.feasible and all(offload.is_offloaded(e.candidate) for e in result.feasible)
    device = [e for e in result.infeasible if not offload.is_offloaded(e.candidate)]
    assert device and min(e.peak_memory for e in device) > 16 * 2 ** 30
    assert offload.offload_only_stages(ParallelLayout(1, 1, None, 1, 1)) == (1, 2, 3)
    assert offload.offload_only_stages(ParallelLayout(1, 1, None, 1, 2)) == ()
    p = plan('gpt2-xl', devices=1, memory_gb=16, batch=8, seq=1024, cluster='nvlink8')
    cand = p.estimate.candidate
    assert offload.is_offloaded(cand) and cand.layout.data == 1
    assert p.memory_per_device <= 16 * 2 ** 30 < 16 * sum(offload.model_numels(shape))
    assert max(p.estimate.terms['host_bytes']) > 16 * 2 ** 30
    assert 'only an offloaded plan fits' in p.report()


def _losses_worker(rank, zero, micro, steps):
    from colossal_lite.testing import engine_step
    engine = _engine(zero, micro)
    return [float(engine_step(engine, _batch())['loss']) for _ in range(steps)]


def test_one_device_offloaded_plan_trains_like_no_zero():
    """A plan for the tiny GPT on one device under a budget below every device placement:
    its zero section (offloaded) trains 3 steps with the losses of the same model without
    ZeRO."""
    from colossal_lite.auto import plan
    from colossal_lite.auto.search import search
    from colossal_lite.testing import run_distributed
    shape = _shape()
    prof = load_profile('nvlink8').with_devices(1)
    everything = search(shape, prof, 1, BATCH, memory_bytes=float('inf'))
    smallest = min(e.peak_memory for e in everything.feasible
                   if not offload.is_offloaded(e.candidate))
    p = plan('gpt:tiny', devices=1, memory_gb=0.99 * smallest / 2 ** 30, batch=BATCH, seq=16,
             cluster='nvlink8', **OPTS)
    assert offload.is_offloaded(p.estimate.candidate), p.estimate.candidate.describe()
    micro = p.config['num_microbatches']
    (got,) = run_distributed(_losses_worker, 1, {}, p.config['zero'], micro, 3, timeout=TIMEOUT)
    (ref,) = run_distributed(_losses_worker, 1, {}, None, micro, 3, timeout=TIMEOUT)
    assert got == pytest.approx(ref, rel=1e-5, abs=1e-6)
