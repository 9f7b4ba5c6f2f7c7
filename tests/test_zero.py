"""Low-level ZeRO (stages 1 and 2) equals the serial model.

The serial reference is a plain torch loop (AdamW, optional torch clip_grad_norm_) on the
whole batch in the parent process. Ranks train a tiny GPT through ``initialize`` with
``zero=dict(stage=1|2, ...)`` on their data-parallel slice of the batch, under dp=2,
dp=4 and dp=2 x tp=2 (1D), and return the worst relative differences, which the tests
assert: parameters after 5 steps, the full optimizer state (exp_avg, exp_avg_sq and step
by serial name), one more step after loading the serial optimizer state (full form) or the
rank's own (sharded form), the per-rank
optimizer-state and gradient bytes (1/D of the unsharded ones, from the tensors) and the
collective bytes. Mixed precision (torch autocast, naive fp16) matches plain data
parallelism in the same precision; an inf in one rank's gradient skips the step on every
rank and backs the scale off. Every bad ``zero`` value is a ConfigError naming key and value.
"""
from __future__ import annotations

import copy

import pytest
import torch

import colossal_lite as clt
from colossal_lite.communication import comm_profile
from colossal_lite.config import ConfigError
from colossal_lite.context import ParallelMode, global_context as gpc
from colossal_lite.testing import max_rel_diff, run_distributed
from colossal_lite.zero import ZeroSettings, parse_zero
from model_zoo import GPT, GPTLMLoss

STEPS = 5
LR, EPS, WD = 1e-3, 1e-6, 0.01
CLIP = 0.05          # small enough that every step clips (the serial norms are ~0.5-2)
BUCKET_MB = 0.01     # ~2.6k fp32 elements: several buckets, parameters split across ranks
TIMEOUT = 300
TP2 = dict(tensor=dict(size=2, mode='1d'))


def build():
    return GPT.from_preset('tiny', layers=1, hidden=32, heads=4, max_positions=16, dropout=0.0)


def optimizer(params):
    return torch.optim.AdamW(params, lr=LR, eps=EPS, weight_decay=WD)


def global_batch(seed: int = 0, batch: int = 8, seq: int = 8):
    ids = torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(seed))
    return ids, ids


def replica(batch):
    parts, index = gpc.get_world_size(ParallelMode.DATA), gpc.get_local_rank(ParallelMode.DATA)
    return tuple(t.chunk(parts)[index] for t in batch)


def serial_reference(batch, clip: float = 0.0, steps: int = STEPS + 1) -> dict:
    """Initial weights; weights and AdamW state (by name) after STEPS steps; weights after
    one more step."""
    torch.manual_seed(1)
    model = build()
    out = {'init': {k: v.clone() for k, v in model.state_dict().items()}}
    opt = optimizer(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    for step in range(steps):
        opt.zero_grad()
        GPTLMLoss()(model(batch[0]), batch[1]).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        if step == STEPS - 1:
            out['params'] = {k: v.clone() for k, v in model.state_dict().items()}
            sd = opt.state_dict()
            out['opt_state'] = {names[i]: {k: v.clone() for k, v in s.items()}
                                for i, s in sd['state'].items()}
    out['params_next'] = {k: v.clone() for k, v in model.state_dict().items()}
    return out


def _worst_params(actual: dict, expected: dict) -> float:
    assert set(actual) == set(expected), sorted(set(actual) ^ set(expected))
    return max(max_rel_diff(actual[k], expected[k]) for k in expected)


def _worst_state(actual: dict, expected: dict) -> float:
    """Worst difference of exp_avg / exp_avg_sq relative to that moment's largest value over
    the model (a moment is ~0 for gradients that are 0 up to rounding, e.g. key biases)."""
    assert set(actual) == set(expected), sorted(set(actual) ^ set(expected))
    worst = 0.0
    for slot in ('exp_avg', 'exp_avg_sq'):
        scale = max(s[slot].abs().max().item() for s in expected.values())
        for name, slots in expected.items():
            assert set(actual[name]) == set(slots), (name, set(actual[name]), set(slots))
            assert float(actual[name]['step']) == float(slots['step']), name
            worst = max(worst, (actual[name][slot] - slots[slot]).abs().max().item() / scale)
    return worst


def _engine(init, zero: dict, layout: dict, **config):
    torch.manual_seed(1)
    model = build()
    model.load_state_dict(init)
    engine, *_ = clt.initialize(model, optimizer(model.parameters()), GPTLMLoss(),
                                config=dict(parallel=layout, zero=zero, **config))
    return engine


def _train(engine, batch, steps: int = STEPS):
    local = replica(batch)
    for _ in range(steps):
        engine.zero_grad()
        engine.execute_schedule(local)
        assert engine.step()


def _memory(engine, unsharded_numel: int) -> dict:
    """Optimizer-state and gradient bytes read from the tensors, against the unsharded ones."""
    zero = engine.optimizer
    d = zero.buckets[0].axis.size
    moments = sum(t.numel() * t.element_size() for s in zero.state.values()
                  for t in s.values() if t.dim() > 0)
    masters = sum(b.master.numel() * b.master.element_size() for b in zero.buckets)
    padding = sum(b.padded_numel - b.numel for b in zero.buckets)
    where = 'cpu' if zero.offload else gpc.device.type
    return {'moments_times_d': moments * d, 'moments_unsharded': 8 * (unsharded_numel + padding),
            'masters_times_d': masters * d, 'masters_unsharded': 4 * (unsharded_numel + padding),
            'placed': all(b.master.device.type == where for b in zero.buckets)
            and all(t.device.type == where for s in zero.state.values() for t in s.values()
                    if t.dim() > 0)}


def _case_worker(rank, layout, cases, refs, batch):
    results = []
    for zero, extra, ref_key in cases:
        ref = refs[ref_key]
        engine = _engine(ref['init'], zero, layout, **extra)
        local_numel = sum(p.numel() for b in engine.optimizer.buckets for p in b.params)
        _train(engine, batch)
        out = {'params': _worst_params(engine.model.state_dict(), ref['params']),
               'state': _worst_state(engine.optimizer.state_dict()['state'], ref['opt_state']),
               **_memory(engine, local_numel)}
        # a fresh engine loaded with the serial weights and the serial AdamW state (by name)
        # takes the serial model's 6th step
        fresh = _engine(ref['init'], zero, layout, **extra)
        fresh.model.load_state_dict(ref['params'])
        full = engine.optimizer.state_dict()
        full['state'] = ref['opt_state']
        fresh.optimizer.load_state_dict(full)
        _train(fresh, batch, steps=1)
        out['resumed'] = _worst_params(fresh.model.state_dict(), ref['params_next'])
        # the sharded (per-rank) form resumes the same way
        sharded = copy.deepcopy(engine.optimizer.sharded_state_dict())
        again = _engine(ref['init'], zero, layout, **extra)
        again.model.load_state_dict(engine.model.state_dict())
        again.optimizer.load_state_dict(sharded)
        _train(again, batch, steps=1)
        out['resumed_sharded'] = _worst_params(again.model.state_dict(), ref['params_next'])
        results.append(out)
    return results


CASES = [(dict(stage=s, bucket_mb=BUCKET_MB, offload_optimizer=o), {}, 'plain')
         for s in (1, 2) for o in (False, True)]
CASES += [(dict(stage=s, bucket_mb=BUCKET_MB, offload_optimizer=s == 2), dict(clip_grad_norm=CLIP),
           'clip') for s in (1, 2)]
CASES += [(dict(stage=2, bucket_mb=BUCKET_MB, overlap=False), {}, 'plain')]
CASES += [(dict(stage=s, bucket_mb=BUCKET_MB), dict(num_microbatches=2), 'plain') for s in (1, 2)]


@pytest.fixture(scope='module')
def refs():
    batch = global_batch()
    return batch, {'plain': serial_reference(batch), 'clip': serial_reference(batch, clip=CLIP)}


@pytest.mark.parametrize('world,layout', [(2, {}), (4, {}), (4, TP2)],
                         ids=['dp2', 'dp4', 'dp2xtp2'])
def test_zero_stages_equal_serial_adamw(refs, world, layout):
    """ZeRO-1/2, with and without CPU offload, clipping, no overlap, 2 micro-batches:
    parameters after 5 steps and the full optimizer state equal serial AdamW's; the
    state loaded back takes the serial 6th step; states are 1/D per rank."""
    batch, references = refs
    for rank, results in enumerate(run_distributed(_case_worker, world, dict(parallel=layout),
                                                   layout, CASES, references, batch,
                                                   timeout=TIMEOUT)):
        for (zero, extra, _), out in zip(CASES, results):
            what = (rank, zero, extra)
            assert out['params'] <= 1e-5, (what, out)
            assert out['state'] <= 1e-4, (what, out)
            assert out['resumed'] <= 1e-5 and out['resumed_sharded'] <= 1e-5, (what, out)
            assert out['moments_times_d'] == out['moments_unsharded'], (what, out)
            assert out['masters_times_d'] == out['masters_unsharded'], (what, out)
            assert out['placed'], what


# ------------------------------------------------------------------ gradients and collectives
def _grad_bytes_worker(rank, refs, batch):
    out = {}
    for stage in (1, 2):
        engine = _engine(refs['plain']['init'], dict(stage=stage, bucket_mb=BUCKET_MB), {},
                         num_microbatches=2)
        zero = engine.optimizer
        local = replica(batch)
        half = tuple(t.chunk(2)[0] for t in local)
        engine.zero_grad()
        with comm_profile() as first:
            engine.backward(GPTLMLoss()(engine(half[0]), half[1]))
        model_grads = sum(p.grad.numel() for p in engine.model.parameters() if p.grad is not None)
        with comm_profile() as rest:
            engine.backward(GPTLMLoss()(engine(local[0].chunk(2)[1]), local[1].chunk(2)[1]))
            engine.step()
        padded = sum(b.padded_numel for b in zero.buckets)
        out[stage] = {
            'model_grads_after_first': model_grads,
            'numel': sum(b.numel for b in zero.buckets),
            'first_rs_bytes': first.bytes(ParallelMode.DATA, 'reduce_scatter'),
            'rest_rs_bytes': rest.bytes(ParallelMode.DATA, 'reduce_scatter'),
            'ag_bytes': rest.bytes(ParallelMode.DATA, 'all_gather'),
            'padded_bytes': 4 * padded,
            'shard_grad_bytes': sum(b.master.grad.numel() * 4 for b in zero.buckets),
            'model_grads_after_step': sum(p.grad is not None for p in engine.model.parameters()),
        }
    return out


def test_stage2_shards_gradients_and_counts_collectives(refs):
    """Stage 2 reduce-scatters every micro-step (no full gradient survives a micro-step);
    stage 1 accumulates full gradients locally and reduce-scatters once. Per step each
    bucket costs one reduce_scatter and one all_gather of its padded fp32 flat size."""
    batch, references = refs
    for out in run_distributed(_grad_bytes_worker, 2, None, references, batch, timeout=TIMEOUT):
        s1, s2 = out[1], out[2]
        assert s1['model_grads_after_first'] == s1['numel'] and s1['first_rs_bytes'] == 0
        assert s2['model_grads_after_first'] == 0
        assert s2['first_rs_bytes'] == s2['padded_bytes']
        for s in (s1, s2):
            assert s['rest_rs_bytes'] == s['padded_bytes'] == s['ag_bytes'], s
            assert s['shard_grad_bytes'] * 2 == s['padded_bytes'], s
            assert s['model_grads_after_step'] == 0, s


# ------------------------------------------------------------------ mixed precision
def _amp_worker(rank, init, batch, fp16):
    out = {}
    for zero in (None, dict(stage=1, bucket_mb=BUCKET_MB), dict(stage=2, bucket_mb=BUCKET_MB)):
        engine = _engine(init, zero, {}, fp16=fp16)
        _train(engine, batch)
        out[zero['stage'] if zero else 0] = {k: v.float() for k, v in
                                             engine.model.state_dict().items()}
    return out


@pytest.mark.parametrize('fp16', [dict(mode='torch'), dict(mode='naive')], ids=['torch', 'naive'])
def test_mixed_precision_matches_plain_data_parallel(refs, fp16):
    """Same precision, same per-rank arithmetic: ZeRO-1/2 end where plain data parallelism
    ends (torch autocast: bf16 on CPU; naive: fp16 model, fp32 masters)."""
    batch, references = refs
    for out in run_distributed(_amp_worker, 2, None, references['plain']['init'], batch, fp16,
                               timeout=TIMEOUT):
        moved = _worst_params(out[0], references['plain']['init'])
        assert moved > 1e-3  # the steps changed the weights visibly in this precision
        for stage in (1, 2):
            assert _worst_params(out[stage], out[0]) <= 1e-4, (stage, fp16)


POISONED = 'blocks.0.mlp.fc1.weight'


def _overflow_worker(rank, init, batch, how):
    from colossal_lite.amp import TorchAmp
    from colossal_lite.engine import Engine
    from colossal_lite.config.sections import AmpSettings, parse_amp
    from colossal_lite.zero.low_level import build_low_level_zero
    torch.manual_seed(1)
    model = build()
    model.load_state_dict(init)
    settings = parse_zero(dict(stage=2, bucket_mb=BUCKET_MB))
    if how == 'torch':  # the GradScaler path (fp16 on CUDA), forced on CPU
        amp, handler = build_low_level_zero(settings, AmpSettings(), model,
                                            optimizer(model.parameters()))
        amp = TorchAmp(model, amp.optimizer, use_scaler=True,
                       scaler_kwargs=dict(init_scale=2.0 ** 8))
    else:
        amp, handler = build_low_level_zero(
            settings, parse_amp(dict(mode='naive', initial_scale=2.0 ** 8, hysteresis=1)), model,
            optimizer(model.parameters()))
    engine = Engine(model, amp.optimizer, GPTLMLoss(), gradient_handler=handler, amp=amp)
    poison = dict(model.named_parameters())[POISONED].register_hook(
        lambda g: g.index_fill(1, torch.tensor([0]), float('inf')) if rank == 1 else g)
    local = replica(batch)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    masters = [b.master.detach().clone() for b in amp.optimizer.buckets]
    engine.zero_grad()
    engine.execute_schedule(local)
    poison.remove()
    engine.step()
    after = model.state_dict()
    skipped = (engine.overflow and all(torch.equal(before[k], after[k]) for k in before)
               and all(torch.equal(m, b.master) for m, b in zip(masters, amp.optimizer.buckets))
               and not amp.optimizer.state)
    scales = [engine.loss_scale]
    engine.zero_grad()
    engine.execute_schedule(local)
    engine.step()
    moved = not engine.overflow and not torch.equal(before[POISONED], model.state_dict()[POISONED])
    return skipped, moved, scales + [engine.loss_scale]


@pytest.mark.parametrize('how', ['torch', 'naive'])
def test_overflow_on_one_rank_skips_the_step_everywhere(refs, how):
    batch, references = refs
    for rank, (skipped, moved, scales) in enumerate(run_distributed(
            _overflow_worker, 2, None, references['plain']['init'], batch, how,
            timeout=TIMEOUT)):
        assert skipped and moved, (rank, skipped, moved)
        assert scales == [128.0, 128.0], (rank, scales)


# ------------------------------------------------------------------ config
BAD = [  # (section, substrings the message must hold: the key and the value)
    (dict(), ["'zero' needs 'zero.stage'"]),
    (dict(stage=0), ["'zero.stage' must be one of [1, 2, 3], got 0"]),
    (dict(stage='2'), ["'zero.stage'", "got '2'"]),
    (dict(stage=True), ["'zero.stage'", 'got True']),
    (dict(stage=2, bucket_mb=0), ["'zero.bucket_mb' must be a positive finite number, got 0"]),
    (dict(stage=2, bucket_mb=float('inf')), ["'zero.bucket_mb'", 'got inf']),
    (dict(stage=1, overlap='yes'), ["'zero.overlap' must be True or False, got 'yes'"]),
    (dict(stage=2, offload_optimizer=1), ["'zero.offload_optimizer'", 'got 1']),
    (dict(stage=2, placement='cpu'), ["'zero.placement' = 'cpu' applies only to stage 3"]),
    (dict(stage=1, chunk_size_mb=32), ["'zero.chunk_size_mb' = 32 applies only to stage 3"]),
    (dict(stage=3, bucket_mb=4), ["'zero.bucket_mb' = 4 applies only to stages 1 and 2"]),
    (dict(stage=3, placement='gpu'), ["'zero.placement' must be one of", "got 'gpu'"]),
    (dict(stage=3, device_memory_limit=-1), ["'zero.device_memory_limit'", 'got -1']),
    (dict(stage=3, chunk_size_mb='big'), ["'zero.chunk_size_mb'", "got 'big'"]),
    (dict(stage=3, placement='auto', device_fraction=0.5),
     ["'zero.device_fraction' = 0.5 applies only to placement 'static'"]),
    (dict(stage=3, placement='static', device_fraction=1.5),
     ["'zero.device_fraction' must be in (0, 1], got 1.5"]),
    (dict(stage=3, placement='cpu', device_margin_ratio=1.5),
     ["'zero.device_margin_ratio' must be in [0, 1], got 1.5"]),
    (dict(stage=3, device_margin_ratio=0.5),
     ["'zero.device_margin_ratio' = 0.5 moves CPU master shards", "placement 'device'"]),
    (dict(stage=1, device_margin_ratio=0.5), ["applies only to stage 3"]),
    (dict(stage=3, keep_gathered=-1), ["'zero.keep_gathered' must be an integer >= 0, got -1"]),
    (dict(stage=3, keep_gathered=1.5), ["'zero.keep_gathered' must be an integer >= 0, got 1.5"]),
    (dict(stage=2, keep_gathered=1), ["applies only to stage 3"]),
    (dict(stage=3, prefetch=True), ["'zero.prefetch' must be an integer >= 0, got True"]),
    (dict(stage=2, bucket=4), ["unknown config key 'zero.bucket'; did you mean 'bucket_mb'"]),
    ([('stage', 2)], ["'zero' must be a dict", "[('stage', 2)]"]),
]


@pytest.mark.parametrize('section,parts', BAD)
def test_bad_zero_values_are_config_errors(section, parts):
    with pytest.raises(ConfigError) as err:
        parse_zero(section)
    assert all(part in str(err.value) for part in parts), (str(err.value), parts)


def test_zero_settings_and_unsupported_combinations():
    assert parse_zero(None) is None
    assert parse_zero(dict(stage=2)) == ZeroSettings(stage=2)
    assert parse_zero(dict(stage=1, bucket_mb=0.5, overlap=False, offload_optimizer=True)) == \
        ZeroSettings(stage=1, bucket_mb=0.5, overlap=False, offload_optimizer=True)
    assert parse_zero(dict(stage=3, placement='static', device_fraction=0.25,
                           device_memory_limit=2 ** 30)).device_fraction == 0.25
    model = build()
    with pytest.raises(NotImplementedError, match="ZeRO stage 3 with pipeline .*'zero_bubble'"):
        clt.initialize(model, optimizer(model.parameters()),
                       config=dict(zero=dict(stage=3), num_microbatches=2,
                                   parallel=dict(pipeline=dict(size=2, schedule='zero_bubble'))))
    with pytest.raises(NotImplementedError, match="'apex' is not supported with ZeRO"):
        clt.initialize(model, optimizer(model.parameters()),
                       config=dict(zero=dict(stage=2), fp16=dict(mode='apex')))
    with pytest.raises(ConfigError, match="'zero.bucket_mb'"):
        clt.initialize(model, optimizer(model.parameters()),
                       config=dict(zero=dict(stage=2, bucket_mb=-1)))
    with pytest.raises(TypeError, match='ZeRO stage 1 cannot shard the optimizer '
                                        'torch.optim.lbfgs.LBFGS: it is not elementwise'):
        clt.initialize(model, torch.optim.LBFGS(model.parameters()),
                       config=dict(zero=dict(stage=1)))


# ------------------------------------------------------------------ pipeline
PIPELINE = dict(pipeline=2)
PP_CASES = [(s, clip) for s in (1, 2) for clip in (0.0, CLIP)]


def build_two_layers():
    return GPT.from_preset('tiny', layers=2, hidden=32, heads=4, max_positions=16, dropout=0.0)


def _pipeline_reference(batch, clip: float) -> tuple:
    torch.manual_seed(1)
    model = build_two_layers()
    init = {k: v.clone() for k, v in model.state_dict().items()}
    opt = optimizer(model.parameters())
    for _ in range(STEPS):
        opt.zero_grad()
        GPTLMLoss()(model(batch[0]), batch[1]).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return init, {k: v.clone() for k, v in model.state_dict().items()}


def _pipeline_worker(rank, refs, batch):
    out = []
    for stage, clip in PP_CASES:
        init, final = refs[clip]
        torch.manual_seed(1)
        model = build_two_layers()  # this rank's stage; its state_dict has its own serial keys
        model.load_state_dict(init, strict=False)
        config = dict(parallel=PIPELINE, num_microbatches=4,
                      zero=dict(stage=stage, bucket_mb=BUCKET_MB))
        if clip:
            config['clip_grad_norm'] = clip
        engine, *_ = clt.initialize(model, optimizer(model.parameters()), GPTLMLoss(),
                                    config=config)
        _train(engine, batch)
        params = engine.model.state_dict()
        out.append(max(max_rel_diff(v, final[k]) for k, v in params.items()))
    return out


def test_zero_with_pipeline_equals_serial():
    """dp=2 x pipeline=2 (4 micro-batches), ZeRO-1/2 with and without clipping: the weights
    of each stage after 5 steps equal the serial model's, the embedding weight tied across
    the first and the last stage included (its gradient slice is summed over EMBEDDING)."""
    batch = global_batch()
    refs = {clip: _pipeline_reference(batch, clip) for clip in (0.0, CLIP)}
    for rank, diffs in enumerate(run_distributed(
            _pipeline_worker, 4, dict(parallel=PIPELINE, num_microbatches=4), refs, batch,
            timeout=TIMEOUT)):
        for case, diff in zip(PP_CASES, diffs):
            assert diff <= 1e-5, (rank, case, diff)


# ------------------------------------------------------------------ HybridAdam
def _hybrid_adam_worker(rank, ref, batch):
    from colossal_lite.nn.optimizer import HybridAdam
    torch.manual_seed(1)
    model = build()
    model.load_state_dict(ref['init'])
    opt = HybridAdam(model.parameters(), lr=LR, eps=EPS, weight_decay=WD)
    engine, *_ = clt.initialize(model, opt, GPTLMLoss(), config=dict(
        zero=dict(stage=2, bucket_mb=BUCKET_MB, offload_optimizer=True)))
    _train(engine, batch)
    return (_worst_params(engine.model.state_dict(), ref['params']),
            _worst_state(engine.optimizer.state_dict()['state'], ref['opt_state']))


def test_offloaded_slices_step_through_hybrid_adam(refs):
    """ZeRO-2 with offload_optimizer and HybridAdam (CPU slices through the C++ kernel, or its
    torch fallback) ends where serial torch AdamW ends."""
    from colossal_lite.nn.optimizer import load_extension
    load_extension()  # build (or load) once in the parent, before the ranks fork
    batch, references = refs
    for params, state in run_distributed(_hybrid_adam_worker, 2, None, references['plain'],
                                         batch, timeout=TIMEOUT):
        assert params <= 1e-5 and state <= 1e-4, (params, state)
