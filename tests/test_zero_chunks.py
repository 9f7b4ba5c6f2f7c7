"""Chunk ZeRO (stage 3) equals the serial model.

A tiny 2-layer GPT (LM head tied to the token embedding) trains AdamW steps in the parent
(the serial trace: loss, every gradient, every parameter) and through ``initialize`` with
``zero=dict(stage=3, placement=...)`` on each data-parallel replica's rows; the traces
(loss, gradients gathered from the chunk shards, ``model.state_dict()``) must match to 1e-5
at dp=2, dp=4 and dp=2 x tp=2, also with 2 micro-batches and clipping, and engines resumed
from the full or sharded state dicts take the serial next step. Chunks of 8192 elements cut
the model into 6 chunks. The device accounting is read from the manager's ledger: 'auto'
under a budget below the model data trains to the serial parameters, its accounted peak
never passes the budget, and it moves fewer bytes than 'cpu'. Mixed precision matches plain
data parallelism in the same precision and an overflow skips the step everywhere. A tiny
ViT (its patch embedding uses the parameters of ``proj``, a module without a forward) and a
model whose gradient arrives while its chunk is released also train to serial. Also: the
tensor-state table, the named budget error, the chunk-size search, and the stage-3
combinations that are not built.
"""
from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
import types
from contextlib import nullcontext

import pytest
import torch

import colossal_lite as clt
import colossal_lite.nn as col_nn
from colossal_lite.config import ConfigError, load_config, parse_zero
from colossal_lite.nn.optimizer import HybridAdam
from colossal_lite.tensor import param_placement
from colossal_lite.testing import (Trace, assert_close_dict, assert_matches_serial, engine_step,
                                   make_optimizer, max_rel_diff, plain_step, replica_batch, run_distributed,
                                   training_trace)
from colossal_lite.zero.chunk import (DeviceBudgetExceeded, IllegalTransition, TensorState,
                                      building_into_chunks, packed_waste, search_chunk_size)
from colossal_lite.zero.chunk.chunk import Chunk
from model_zoo import GPT, GPTLMLoss
from tests.model_cases import make_case

STEPS = 5
CHUNK_MB = 8192 * 4 / 2 ** 20       # 8192 fp32 elements per chunk
CLIP = 0.05                         # small enough that every step clips
TIMEOUT = 240
TP2 = dict(tensor=dict(size=2, mode='1d'))


def build(checkpoint: bool = False):
    return GPT.from_preset('tiny', layers=2, hidden=32, heads=4, max_positions=16, dropout=0.0,
                           checkpoint=checkpoint)


def global_batch():
    ids = torch.randint(0, 256, (8, 8), generator=torch.Generator().manual_seed(0))
    return ids, ids


@pytest.fixture(scope='module')
def serial():
    """Initial weights, parameter count, and serial traces: 'plain' (6 steps: the 6th is the
    reference for resumed engines) and 'clip' (every step clipped to CLIP)."""
    torch.manual_seed(1)
    model = build()
    init = {k: v.clone() for k, v in model.state_dict().items()}
    numel = sum(p.numel() for p in model.parameters())
    traces = {}
    for key, clip, steps in (('plain', 0.0, STEPS + 1), ('clip', CLIP, STEPS)):
        model.load_state_dict(init)
        traces[key] = training_trace(model, global_batch(), steps=steps, step_fn=plain_step(
            GPTLMLoss(), make_optimizer(model.parameters()), clip=clip, outputs=False))
    return init, traces, numel


def _first(trace: Trace, steps: int = STEPS) -> Trace:
    return Trace(trace.steps[:steps])


def _step(engine, batch):
    """One engine step; the gradients come from the chunk shards (full, by serial name)."""
    out = engine_step(engine, batch)
    out['grads'] = engine.optimizer.full_gradients()
    return out


def _engine(init, zero, extra=None, optimizer=make_optimizer):
    """An engine over the serial initial weights; ``extra``: config keys, and 'checkpoint'
    (activation checkpointing in every block)."""
    extra = dict(extra or {})
    torch.manual_seed(1)
    model = build(checkpoint=extra.pop('checkpoint', False))
    model.load_state_dict(init)
    engine, *_ = clt.initialize(model, optimizer(model.parameters()), GPTLMLoss(),
                                config=dict(zero=zero, **extra))
    return engine


def hybrid_adam(params):
    """make_optimizer's AdamW through the C++ kernel (as chunk ZeRO steps CPU shards)."""
    return HybridAdam(params, lr=1e-3, eps=1e-6, weight_decay=0.01)


def _worker(rank, init, cases, resume=False):
    results = []
    for zero, extra in cases:
        engine = _engine(init, zero, extra)
        manager = engine.optimizer.manager
        wte, head = engine.model.wte.weight, engine.model.lm_head.weight
        tied = wte is head and sum(p is wte for c in manager.chunks for p in c.params) == 1
        trace = training_trace(engine, global_batch(), steps=STEPS, step_fn=_step)
        policy = manager.policy
        out = {'trace': trace, 'ledger': manager.ledger.stats(), 'tied': tied,
               'chunks': len(manager.chunks), 'dp': manager.chunks[0].axis.size,
               'shard_elems': sum(c.shard_numel for c in manager.chunks),
               'shards': [c.shard_numel for c in manager.chunks],
               'capacity_elems': sum(c.padded_numel for c in manager.chunks),
               'hits': getattr(policy, 'hits', None),
               'evictions': getattr(policy, 'evictions', None),
               'non_model': getattr(policy, 'non_model_bytes', None)}
        if resume:
            out.update(_resumed(engine, init, zero))
        results.append(out)
    return results


def _resumed(engine, init, zero) -> dict:
    """Fresh engines loaded with the trained weights (full state_dict) and the optimizer's
    full or sharded state take one more step: their weights (for the serial 6th step)."""
    weights = engine.model.state_dict()
    states = {'full': engine.optimizer.state_dict(),
              'sharded': copy.deepcopy(engine.optimizer.sharded_state_dict())}
    out = {}
    for form, state in states.items():
        fresh = _engine(init, zero)
        fresh.model.load_state_dict(weights)
        fresh.optimizer.load_state_dict(state)
        engine_step(fresh, replica_batch(global_batch()))
        out[f'resumed_{form}'] = fresh.model.state_dict()
    return out


def _run(world, init, cases, config=None, resume=False):
    return run_distributed(_worker, world, config or {}, init, cases, resume, timeout=TIMEOUT)


PLACEMENTS = [dict(placement='device'), dict(placement='cpu'),
              dict(placement='static', device_fraction=0.5), dict(placement='auto')]


def _check_layout(per_rank, cases, traces, dp):
    for index, (zero, extra) in enumerate(cases):
        outs = [r[index] for r in per_rank]
        ref = traces['clip' if extra and 'clip_grad_norm' in extra else 'plain']
        assert_matches_serial([o['trace'] for o in outs], _first(ref))
        for o in outs:
            assert o['tied'] and o['dp'] == dp, (zero, o)
            assert o['shard_elems'] * dp == o['capacity_elems'], (zero, o)
        yield zero, outs


@pytest.mark.parametrize('world', [2, 4])
def test_chunk_zero_each_placement_equals_serial_adamw(serial, world):
    """Loss, every gradient (tied wte/lm_head included) and the parameters after each of 5
    AdamW steps equal serial, for every placement, for 2 micro-batches with clipping
    (the serial norm, recorded), and with activation checkpointing (blocks recomputed in
    backward re-gather their chunks; 'auto' traces that order); each rank holds 1/D of every chunk; the tied weight sits
    once in one chunk; 'device' keeps 16 bytes per shard element on the device and moves
    nothing, 'cpu' keeps nothing resident, 'static' half of the chunks."""
    init, traces, numel = serial
    cases = [(dict(stage=3, chunk_size_mb=CHUNK_MB, **p), None) for p in PLACEMENTS]
    cases += [(dict(stage=3, chunk_size_mb=CHUNK_MB, placement='cpu'),
               dict(num_microbatches=2, clip_grad_norm=CLIP))]
    cases += [(dict(stage=3, chunk_size_mb=CHUNK_MB, placement='auto'), dict(checkpoint=True))]
    per_rank = _run(world, init, cases)
    for zero, outs in _check_layout(per_rank, cases, traces, world):
        o = outs[0]
        assert o['chunks'] == 6 and o['capacity_elems'] >= numel, o
        ledger, resident = o['ledger'], 16 * o['shard_elems']
        if zero['placement'] == 'device':
            assert ledger['used'] == resident and ledger['moved_h2d'] == 0, ledger
        if zero['placement'] == 'cpu':
            assert ledger['used'] == 0 and ledger['moved_h2d'] > 0, ledger
        if zero['placement'] == 'static':
            assert ledger['used'] == 16 * sum(o['shards'][:3]), ledger   # 3 of 6 chunks


def test_chunk_zero_with_1d_tensor_parallel_inside(serial):
    """dp=2 x tp=2 (1D): chunks hold the local tensor-parallel shards, grouped by their
    cuts; the trace (full gradients and state_dict gathered over both) equals serial."""
    init, traces, numel = serial
    cases = [(dict(stage=3, chunk_size_mb=CHUNK_MB, placement=p), None)
             for p in ('device', 'auto')]
    per_rank = _run(4, init, cases, config=dict(parallel=TP2))
    for _ in _check_layout(per_rank, cases, traces, 2):
        pass


class UsedInReverse(torch.nn.Module):
    """Modules declared in the reverse of the order forward uses them."""

    def __init__(self):
        super().__init__()
        self.out = col_nn.Linear(16, 8)    # used last
        self.mid = col_nn.Linear(16, 16)
        self.inp = col_nn.Linear(8, 16)    # used first

    def forward(self, x):
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))))


REVERSE_CHUNK_MB = 420 * 4 / 2 ** 20      # 420 fp32 elements: out+mid | inp, then inp+mid | out
USE_ORDER = [['inp.weight', 'inp.bias', 'mid.weight', 'mid.bias'], ['out.weight', 'out.bias']]


def _reverse_batch():
    g = torch.Generator().manual_seed(3)
    return torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)


def _mse(out, target):
    return torch.nn.functional.mse_loss(out, target)


def _serial_mse_run(model_cls):
    """A ``model_cls()`` (seed 1): its initial weights and its serial trace of STEPS AdamW
    steps on the MSE batch."""
    torch.manual_seed(1)
    model = model_cls()
    init = {k: v.clone() for k, v in model.state_dict().items()}
    return init, training_trace(model, _reverse_batch(), steps=STEPS, step_fn=plain_step(
        _mse, make_optimizer(model.parameters()), outputs=False))


def _reverse_worker(rank, init, placement):
    torch.manual_seed(1)
    model = UsedInReverse()
    model.load_state_dict(init)
    zero = dict(stage=3, chunk_size_mb=REVERSE_CHUNK_MB, **placement)
    engine, *_ = clt.initialize(model, make_optimizer(model.parameters()), _mse,
                                config=dict(zero=zero))
    names = {id(p): n for n, p in model.named_parameters()}
    manager = engine.optimizer.manager

    def packing():
        return [[names[id(p)] for p in c.params] for c in manager.chunks]

    before = packing()
    trace = training_trace(engine, _reverse_batch(), steps=STEPS, step_fn=_step)
    policy = manager.policy
    resident = sum(16 * c.shard_numel for c in manager.chunks if policy.on_device(c))
    return before, packing(), trace, manager.ledger.stats(), resident


@pytest.mark.parametrize('placement', [dict(placement='static', device_fraction=0.5),
                                       dict(placement='auto')], ids=['static', 'auto'])
def test_chunks_are_repacked_in_traced_first_use_order(placement):
    """A model whose modules are declared in the reverse of their use: chunks start in
    module order, the warm-up step traces first use, and the next zero_grad re-packs
    (different grouping: the masters and Adam's moments move across chunk boundaries);
    the loss, every gradient and the parameters after each of 5 AdamW steps still equal
    the serial run, and the device ledger holds exactly the new resident shards."""
    init, ref = _serial_mse_run(UsedInReverse)
    per_rank = run_distributed(_reverse_worker, 2, {}, init, placement, timeout=TIMEOUT)
    assert_matches_serial([r[2] for r in per_rank], ref)
    for before, after, _, ledger, resident in per_rank:
        assert before == [['out.weight', 'out.bias', 'mid.weight', 'mid.bias'],
                          ['inp.weight', 'inp.bias']], before
        assert after == USE_ORDER, after
        assert ledger['used'] == resident, (ledger, resident)


VIT_CHUNK_MB = 600 * 4 / 2 ** 20    # 600 fp32 elements: cls_token + pos_embed | proj | ...
PATCH_PARAMS = ('patch_embed.cls_token', 'patch_embed.pos_embed', 'patch_embed.proj.weight',
                'patch_embed.proj.bias')


def _vit_worker(rank, init, placement):
    """The tiny ViT (patch embedding: ``proj`` is a parameter container without a forward,
    used by ``PatchEmbedding.forward``) under chunk ZeRO, searched and 600-element chunks."""
    case = make_case('vit', batch=8)
    out = []
    for chunk_mb in (None, VIT_CHUNK_MB):
        torch.manual_seed(1)
        model = case.build()
        model.load_state_dict(init)
        zero = dict(stage=3, placement=placement)
        if chunk_mb is not None:
            zero['chunk_size_mb'] = chunk_mb
        engine, *_ = clt.initialize(model, make_optimizer(model.parameters()),
                                    case.criterion(), config=dict(zero=zero))
        names = {id(p): n for n, p in model.named_parameters()}
        trace = training_trace(engine, case.batch, steps=STEPS, step_fn=_step)
        packing = [[names[id(p)] for p in c.params] for c in engine.optimizer.manager.chunks]
        out.append((trace, packing, engine.model.state_dict()))
    return out


@pytest.mark.parametrize('placement', ['device', 'cpu'])
def test_vit_with_chunk_zero_equals_serial_adamw(placement):
    """ViT at dp=2: the patch embedding's conv weight and bias live in ``proj``, a module
    without a forward that ``PatchEmbedding.forward`` uses; they are gathered and traced
    with the patch embedding's hooks, so with the searched chunk size and with 600-element
    chunks (``proj`` in a chunk of its own) the loss, every gradient and the parameters
    after each of 5 AdamW steps equal serial, and the first-use re-packing puts the four
    patch-embedding tensors in chunks before the final norm's (first used, not unused)."""
    case = make_case('vit', batch=8)
    torch.manual_seed(0)
    model = case.build()
    init = {k: v.clone() for k, v in model.state_dict().items()}
    ref = training_trace(model, case.batch, steps=STEPS, step_fn=plain_step(
        case.criterion(), make_optimizer(model.parameters()), outputs=False))
    per_rank = run_distributed(_vit_worker, 2, {}, init, placement, timeout=TIMEOUT)
    for index in range(2):
        assert_matches_serial([r[index][0] for r in per_rank], ref)
        for r in per_rank:
            trace, packing, state = r[index]
            where = {n: k for k, ps in enumerate(packing) for n in ps}
            assert max(where[n] for n in PATCH_PARAMS) < where['norm.weight'], packing
            assert_close_dict(state, model.state_dict())
    assert len(per_rank[0][1][1]) > 2, per_rank[0][1][1]   # small chunks: several of them


class _Boxed:
    """A module output the chunk hooks cannot see (no tensor hook is put on it)."""

    def __init__(self, value):
        self.value = value


class _BoxedLinear(torch.nn.Module):
    def __init__(self, fan_in: int, fan_out: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(fan_out, fan_in) / fan_in ** 0.5)

    def forward(self, x):
        return _Boxed(x @ self.weight.t())


class HiddenOutput(torch.nn.Module):
    """The first layer returns its output boxed: backward never reaches its module hook, so
    its weight's gradient (which needs the input, not the weight) arrives while its chunk
    is released."""

    def __init__(self):
        super().__init__()
        self.inp = _BoxedLinear(8, 16)      # 128 elements: a chunk of its own
        self.out = col_nn.Linear(16, 8)

    def forward(self, x):
        return self.out(torch.tanh(self.inp(x).value))


HIDDEN_CHUNK_MB = 160 * 4 / 2 ** 20     # 160 fp32 elements: inp | out


def _hidden_worker(rank, init, placement):
    torch.manual_seed(1)
    model = HiddenOutput()
    model.load_state_dict(init)
    # released at once after forward (no idle keep, no prefetch): the gradient finds it so
    zero = dict(stage=3, chunk_size_mb=HIDDEN_CHUNK_MB, placement=placement, keep_gathered=0,
                prefetch=0)
    engine, *_ = clt.initialize(model, make_optimizer(model.parameters()), _mse,
                                config=dict(zero=zero))
    chunks = [[p is model.inp.weight for p in c.params] for c in engine.optimizer.manager.chunks]
    return chunks, training_trace(engine, _reverse_batch(), steps=STEPS, step_fn=_step)


@pytest.mark.parametrize('placement', ['device', 'cpu'])
def test_gradient_arriving_while_its_chunk_is_released(placement):
    """A parameter whose gradient arrives without its module's backward hook (its chunk
    released after forward) re-gathers the chunk for its gradient: the trace equals serial."""
    init, ref = _serial_mse_run(HiddenOutput)
    per_rank = run_distributed(_hidden_worker, 2, {}, init, placement, timeout=TIMEOUT)
    assert_matches_serial([r[1] for r in per_rank], ref)
    for chunks, _ in per_rank:
        assert [True] in chunks, chunks     # the boxed weight alone in its chunk


def _cpu_peak_bytes(fn):
    """``(peak, result)``: the peak of CPU bytes allocated while ``fn`` runs, from the
    profiler's memory events (each op's own allocations at its start, frees as they come)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = sorted((e.time_range.start, e.self_cpu_memory_usage)
                    for e in prof.profiler.function_events if e.self_cpu_memory_usage)
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak, result


def _built_into_chunks_worker(rank):
    """The same GPT built whole and built on meta into its chunks (seed 1 both times)."""
    zero = dict(stage=3, chunk_size_mb=CHUNK_MB, placement='cpu')
    out = {}
    for how in ('whole', 'meta'):
        torch.manual_seed(1)

        def build_and_shard():
            with building_into_chunks(parse_zero(zero)) if how == 'meta' else nullcontext():
                model = build()
            engine, *_ = clt.initialize(model, make_optimizer(model.parameters()), GPTLMLoss(),
                                        config=dict(zero=zero))
            return engine
        peak, engine = _cpu_peak_bytes(build_and_shard)
        chunks = engine.optimizer.manager.chunks
        out[how] = {'peak': peak, 'shards': [c.master.detach().clone() for c in chunks],
                    'packing': [[tuple(s) for s in c.shapes] for c in chunks],
                    'shard_bytes': sum(4 * c.shard_numel for c in chunks),
                    'largest': max(4 * math.prod(param_placement(p).shape)
                                   for c in chunks for p in c.params),
                    'state': engine.model.state_dict(),
                    'trace': training_trace(engine, global_batch(), steps=2, step_fn=_step)}
    return out


@pytest.mark.parametrize('config, world', [({}, 4), (dict(parallel=TP2), 4)],
                         ids=['dp4', 'dp2-tp2'])
def test_model_built_straight_into_chunks(serial, config, world):
    """Built under ``building_into_chunks`` (the meta device), the model is materialized
    by ``initialize`` into this rank's chunk shards, drawn by name: the shards equal those
    of the model built whole bit for bit, ``state_dict()`` is the serial initial weights,
    two AdamW steps equal serial, and the peak of CPU bytes allocated by the build and
    ``initialize`` stays within the rank's fp32 shards plus the largest single parameter
    drawn in full (+10%) -- far below the whole model, which the whole build allocates."""
    init, traces, numel = serial
    per_rank = run_distributed(_built_into_chunks_worker, world, config, timeout=TIMEOUT)
    assert_matches_serial([r['meta']['trace'] for r in per_rank], _first(traces['plain'], 2))
    for r in per_rank:
        whole, meta = r['whole'], r['meta']
        assert meta['packing'] == whole['packing']
        assert all(torch.equal(a, b) for a, b in zip(meta['shards'], whole['shards']))
        assert set(meta['state']) == set(init)
        assert all(torch.equal(meta['state'][k], init[k]) for k in init)
        bound = 1.1 * (meta['shard_bytes'] + meta['largest'])
        assert meta['peak'] <= bound < 4 * numel <= whole['peak'], (meta, whole['peak'])


def test_state_dicts_resume_the_serial_run(serial):
    """After 5 steps, engines rebuilt from ``model.state_dict()`` plus the optimizer's full
    (serial names) or sharded state take the serial 6th step."""
    init, traces, numel = serial
    cases = [(dict(stage=3, chunk_size_mb=CHUNK_MB, placement=p), None)
             for p in ('device', 'auto')]
    per_rank = _run(2, init, cases, resume=True)
    expected = traces['plain'][STEPS].items()
    expected = {k[len('param:'):]: v for k, v in expected if k.startswith('param:')}
    for results in per_rank:
        for out in results:
            assert_close_dict(out['resumed_full'], expected, what='full state resumed')
            assert_close_dict(out['resumed_sharded'], expected, what='sharded state resumed')


@pytest.mark.parametrize('share', [0.75, 0.5])
def test_auto_under_a_budget_below_the_model_data(serial, share):
    """'auto' with device_memory_limit at 3/4 and 1/2 of the unsharded model data (fp32
    weights, gradients, Adam moments: 16 bytes per parameter) trains to the serial
    parameters, its accounted device peak (checked at every allocation) stays under the
    limit, and it moves fewer bytes between CPU and device than 'cpu' under the same limit.
    At 1/2 the cached shards do not all fit: Belady evicts."""
    init, traces, numel = serial
    limit = int(share * 16 * numel)
    zeros = [dict(stage=3, chunk_size_mb=CHUNK_MB, placement=p, device_memory_limit=limit)
             for p in ('auto', 'cpu')]
    per_rank = _run(2, init, [(z, None) for z in zeros])
    for index in range(2):
        assert_matches_serial([r[index]['trace'] for r in per_rank], _first(traces['plain']))
    auto, cpu = per_rank[0][0], per_rank[0][1]
    for o in (auto, cpu):
        assert o['ledger']['limit'] == limit and 0 < o['ledger']['peak'] <= limit, o['ledger']
        assert o['ledger']['checks'] > 50, o['ledger']
    moved = {k: o['ledger']['moved_h2d'] + o['ledger']['moved_d2h']
             for k, o in (('auto', auto), ('cpu', cpu))}
    assert moved['auto'] < moved['cpu'], moved
    assert auto['hits'] > 0 and auto['non_model'] > 0, auto
    assert (auto['evictions'] > 0) == (share == 0.5), auto


def _gathers_worker(rank, init, keep, prefetch=1):
    """The chunk gathers of the last of 5 steps (after the warm-up trace and re-packing):
    in order of use, and as launched (index, started ahead of use)."""
    engine = _engine(init, dict(stage=3, chunk_size_mb=CHUNK_MB, keep_gathered=keep,
                                prefetch=prefetch))
    manager = engine.optimizer.manager
    gathered, launched, peaks = [], [], []
    access, launch = manager.access, manager._launch

    def logged_access(chunk):
        if chunk.full is None:
            gathered.append(chunk.index)
        access(chunk)

    def logged_launch(chunk, async_op):
        launched.append((chunk.index, async_op))
        return launch(chunk, async_op)
    manager.access, manager._launch = logged_access, logged_launch

    def step(engine, batch):
        gathered.clear()
        launched.clear()
        out = _step(engine, batch)
        peaks.append(manager.ledger.peak)
        return out
    trace = training_trace(engine, global_batch(), steps=STEPS, step_fn=step)
    wte = engine.model.wte.weight
    return {'trace': trace, 'gathered': list(gathered), 'launched': list(launched),
            'chunks': len(manager.chunks), 'tied_chunk': manager.chunk_of[id(wte)].index,
            'peak': peaks[-1], 'full_bytes': max(c.full_bytes for c in manager.chunks)}


def test_keep_gathered_spares_the_re_gathers_of_chunks_used_again_soon(serial):
    """Chunks re-packed in first-use order: chunk 0 holds the token embedding tied to the LM
    head (used first and last in forward, first and last in backward), chunk n-1 the last
    block. keep_gathered=0 releases a chunk as soon as its tensors hold: a step gathers
    chunk 0 three times (embedding, LM head, its backward) and chunk n-1 twice. With the
    default keep_gathered=1 (Belady over the previous step's chunk uses) chunk 0 and chunk
    n-1 stay gathered into backward: 3 gathers fewer, the accounted peak no higher. Both
    equal the serial run."""
    init, traces, _ = serial
    runs = {keep: run_distributed(_gathers_worker, 2, {}, init, keep, 0, timeout=TIMEOUT)
            for keep in (0, 1)}
    for keep, per_rank in runs.items():
        assert_matches_serial([r['trace'] for r in per_rank], _first(traces['plain']))
    eager, kept = runs[0][0], runs[1][0]
    n = kept['chunks']
    assert n == 6 and kept['tied_chunk'] == 0, kept
    forward = list(range(n))
    assert eager['gathered'] == forward + [0, 0] + list(range(n - 1, 0, -1)), eager
    assert kept['gathered'] == forward + list(range(n - 2, 0, -1)), kept
    assert kept['peak'] <= eager['peak'], (eager, kept)


def test_prefetch_starts_the_next_gathers_ahead_without_extra_ones(serial):
    """zero.prefetch=1 (the default) starts the all_gather of the next chunk the previous
    step used while the current one computes: every forward gather after the first is
    launched ahead; a step gathers exactly the chunks it gathers without prefetching (none
    wasted, each landed before use), equals the serial run, and its accounted peak grows by
    at most the one chunk in flight."""
    init, traces, _ = serial
    runs = {pf: run_distributed(_gathers_worker, 2, {}, init, 1, pf, timeout=TIMEOUT)
            for pf in (0, 1)}
    for per_rank in runs.values():
        assert_matches_serial([r['trace'] for r in per_rank], _first(traces['plain']))
    plain, ahead = runs[0][0], runs[1][0]
    n = ahead['chunks']
    assert not any(a for _, a in plain['launched']), plain
    assert ahead['launched'][:n] == [(0, False)] + [(i, True) for i in range(1, n)], ahead
    assert sorted(i for i, _ in ahead['launched']) == sorted(plain['gathered']), (plain, ahead)
    assert sorted(ahead['gathered']) == sorted(plain['gathered']), (plain, ahead)
    assert sum(a for _, a in ahead['launched']) >= len(ahead['launched']) - 2, ahead
    assert ahead['peak'] <= plain['peak'] + ahead['full_bytes'], (plain, ahead)


ADAPTIVE_LIMIT = 580_000   # leaves ~150 kB of margin after the warm-up: 3 of 6 chunks move


def _adaptive_worker(rank, init, zero):
    engine = _engine(init, zero)
    manager = engine.optimizer.manager
    ledgers = []

    def step(engine, batch):
        out = _step(engine, batch)
        ledgers.append(dict(manager.ledger.stats()))
        return out
    trace = training_trace(engine, global_batch(), steps=STEPS, step_fn=step)
    return {'trace': trace, 'ledgers': ledgers, 'adaptive': engine.optimizer.adaptive,
            'shards': [c.shard_numel for c in manager.chunks],
            'non_model': engine.optimizer.hooks.trace.non_model_peak}


def test_adaptive_hybrid_adam_moves_masters_to_the_device_within_the_budget(serial):
    """zero.device_margin_ratio=1 with placement 'cpu' under a device budget: after the
    warm-up step the master shards (and moments) of the first chunks move to the device
    while 16 bytes per element fit in the margin (limit - accounted warm-up peak - traced
    non-model peak), greedily in chunk order. Exact accounting: the resident bytes equal
    16 x the promoted shard elements, every later step moves to the host exactly the
    gradient shards of the chunks left on the CPU (4 bytes per element), the peak stays
    under the limit, fewer bytes move than with plain 'cpu'; the run equals serial."""
    init, traces, numel = serial
    base = dict(stage=3, chunk_size_mb=CHUNK_MB, placement='cpu',
                device_memory_limit=ADAPTIVE_LIMIT)
    runs = {}
    for key, zero in (('cpu', base), ('adaptive', dict(base, device_margin_ratio=1.0))):
        per_rank = run_distributed(_adaptive_worker, 2, {}, init, zero, timeout=TIMEOUT)
        assert_matches_serial([r['trace'] for r in per_rank], _first(traces['plain']))
        runs[key] = per_rank[0]
    cpu, adaptive = runs['cpu'], runs['adaptive']
    assert cpu['adaptive'] is None and cpu['ledgers'][-1]['used'] == 0
    warm = adaptive['ledgers'][0]
    margin = ADAPTIVE_LIMIT - warm['peak'] - adaptive['non_model']
    promoted, room = [], margin
    for index, s in enumerate(adaptive['shards']):
        if 16 * s <= room:
            promoted.append(index)
            room -= 16 * s
    assert adaptive['adaptive'] == {'margin': margin, 'promoted': promoted}, adaptive
    assert 0 < len(promoted) < len(adaptive['shards']), promoted
    resident = sum(16 * adaptive['shards'][i] for i in promoted)
    on_cpu = sum(4 * s for i, s in enumerate(adaptive['shards']) if i not in promoted)
    ledgers = adaptive['ledgers']
    for before, after in zip(ledgers[1:], ledgers[2:]):
        assert after['used'] == resident, after
        assert after['moved_d2h'] - before['moved_d2h'] == on_cpu, (before, after)
    assert max(lg['peak'] for lg in ledgers) <= ADAPTIVE_LIMIT
    moved = {k: r['ledgers'][-1]['moved_h2d'] + r['ledgers'][-1]['moved_d2h']
             for k, r in runs.items()}
    assert moved['adaptive'] < moved['cpu'], moved


def _pipeline_worker(rank, init, zero, extra):
    """This rank's stage of the GPT (4 micro-batches), chunk ZeRO over the stage's DATA
    group; the trace's parameters are the stage's own keys."""
    torch.manual_seed(1)
    model = build()
    model.load_state_dict(init, strict=False)
    engine, *_ = clt.initialize(model, make_optimizer(model.parameters()), GPTLMLoss(),
                                config=dict(zero=zero, **extra))
    chunks = engine.optimizer.manager.chunks
    tied = [c for c in chunks if c.tied_across_stages]
    trace = training_trace(engine, global_batch(), steps=STEPS, step_fn=_step)
    return trace, len(tied), [len(c.params) for c in tied]


@pytest.mark.parametrize('schedule, placement, clip', [
    ('1f1b', 'device', 0.0), ('1f1b', 'cpu', CLIP), ('gpipe', 'auto', 0.0)],
    ids=['1f1b-device', '1f1b-cpu-clip', 'gpipe-auto'])
def test_chunk_zero_with_pipeline_equals_serial(serial, schedule, placement, clip):
    """dp=2 x pipeline=2, 4 micro-batches (several in flight on a stage): each stage's chunks
    over its DATA group; the loss, every gradient the stage holds (gathered from the chunk
    shards; the embedding tied across the first and last stage alone in its chunk, its
    gradient summed over EMBEDDING) and every parameter after each of 5 AdamW steps equal
    serial, with clipping too (the serial norm)."""
    init, traces, numel = serial
    zero = dict(stage=3, chunk_size_mb=CHUNK_MB, placement=placement)
    extra = dict(parallel=dict(pipeline=dict(size=2, schedule=schedule)), num_microbatches=4)
    if clip:
        extra['clip_grad_norm'] = clip
    per_rank = run_distributed(_pipeline_worker, 4, extra, init, zero, extra, timeout=TIMEOUT)
    assert_matches_serial([r[0] for r in per_rank], _first(traces['clip' if clip else 'plain']))
    for _, tied, sizes in per_rank:   # wte: on the first and the last stage
        assert tied == 1 and sizes == [1], (tied, sizes)


def _amp_worker(rank, init, fp16):
    out = {}
    for key, zero in (('dp', None), ('zero2', dict(stage=2)),
                      ('zero3', dict(stage=3, chunk_size_mb=CHUNK_MB, placement='cpu'))):
        engine = _engine(init, zero, dict(fp16=fp16), optimizer=hybrid_adam)
        for _ in range(STEPS):
            engine_step(engine, replica_batch(global_batch()))
        out[key] = {k: v.float() for k, v in engine.model.state_dict().items()}
    return out


@pytest.mark.parametrize('fp16', [dict(mode='torch'), dict(mode='naive'),
                                  dict(mode='naive', dtype='bfloat16')],
                         ids=['torch-autocast', 'naive-fp16', 'naive-bf16'])
def test_mixed_precision_matches_plain_data_parallel(serial, fp16):
    """Same precision (autocast: bf16 on CPU; naive: fp16/bf16 chunks, gradients written
    over the weights, fp32 master shards) and the same Adam arithmetic (HybridAdam's C++
    kernel, which chunk ZeRO uses for CPU shards): chunk ZeRO ends where plain data
    parallelism and ZeRO-2 end after 5 steps."""
    init, traces, numel = serial
    for out in run_distributed(_amp_worker, 2, {}, init, fp16, timeout=TIMEOUT):
        moved = max(max_rel_diff(out['dp'][k], init[k].float()) for k in init)
        assert moved > 1e-3  # the steps changed the weights visibly in this precision
        for key in ('zero2', 'zero3'):
            worst = max(max_rel_diff(out[key][k], out['dp'][k]) for k in init)
            assert worst <= 1e-4, (key, fp16, worst)


def _overflow_worker(rank, init):
    engine = _engine(init, dict(stage=3, chunk_size_mb=CHUNK_MB, placement='auto'),
                     dict(fp16=dict(mode='naive', initial_scale=2.0 ** 8, hysteresis=1)))
    poison = dict(engine.model.named_parameters())['blocks.0.mlp.fc1.weight'].register_hook(
        lambda g: g.index_fill(1, torch.tensor([0]), float('inf')) if rank == 1 else g)
    before = engine.model.state_dict()
    masters = [c.master.detach().clone() for c in engine.optimizer.buckets]
    engine_step(engine, replica_batch(global_batch()))
    poison.remove()
    after = engine.model.state_dict()
    skipped = (engine.overflow and all(torch.equal(before[k], after[k]) for k in before)
               and all(torch.equal(m, c.master) for m, c in zip(masters,
                                                                engine.optimizer.buckets))
               and not engine.optimizer.state)
    scale = engine.loss_scale
    engine_step(engine, replica_batch(global_batch()))
    return skipped, scale, engine.overflow, bool(engine.optimizer.state)


def test_overflow_on_one_rank_skips_the_step_everywhere(serial):
    """Naive fp16 chunks: an inf in rank 1's gradient skips the step on both ranks
    (weights, masters and optimizer state untouched), halves the scale, and the next step
    updates."""
    init, _, _ = serial
    for skipped, scale, overflow, stepped in run_distributed(_overflow_worker, 2, {}, init,
                                                             timeout=TIMEOUT):
        assert skipped and scale == 2.0 ** 7 and not overflow and stepped


def _budget_worker(rank, zero):
    torch.manual_seed(1)
    model = build()
    engine, *_ = clt.initialize(model, make_optimizer(model.parameters()), GPTLMLoss(),
                                config=dict(zero=zero))
    try:
        engine.execute_schedule(global_batch())
    except DeviceBudgetExceeded as err:
        return str(err)
    return None


def test_a_budget_that_cannot_hold_one_chunk_is_a_named_error():
    """8192-element chunks need 32768 bytes on the device to be gathered: a 20000-byte
    budget raises DeviceBudgetExceeded naming the limit and the chunk (at the first gather
    for 'cpu', at initialize for 'device', whose resident shards do not fit)."""
    zero = dict(stage=3, chunk_size_mb=CHUNK_MB, placement='cpu', device_memory_limit=20000)
    message = run_distributed(_budget_worker, 1, {}, zero, timeout=TIMEOUT)[0]
    assert message is not None and '20000' in message and 'chunk 0 (32768 bytes)' in message, message
    zero = dict(zero, placement='device')
    with pytest.raises(Exception, match='DeviceBudgetExceeded'):
        run_distributed(_budget_worker, 1, {}, zero, timeout=TIMEOUT)


def test_tensor_state_table():
    """Legal moves pass, every other move raises IllegalTransition."""
    S = TensorState
    legal = {(S.FREE, S.COMPUTE), (S.FREE, S.FREE), (S.FREE, S.HOLD), (S.COMPUTE, S.HOLD),
             (S.COMPUTE, S.HOLD_AFTER_BWD), (S.HOLD, S.COMPUTE), (S.HOLD, S.FREE),
             (S.HOLD_AFTER_BWD, S.READY_FOR_REDUCE), (S.HOLD_AFTER_BWD, S.FREE),
             (S.READY_FOR_REDUCE, S.FREE)}
    param = torch.zeros(3)
    for old in S:
        for new in S:
            chunk = types.SimpleNamespace(index=0, states={id(param): old})
            if (old, new) in legal:
                Chunk.move(chunk, [param], new)
                assert chunk.states[id(param)] is new
            else:
                with pytest.raises(IllegalTransition, match=f'{old.name} to {new.name}'):
                    Chunk.move(chunk, [param], new)


def test_chunk_size_search_picks_least_waste():
    """Sizes [6, 6, 6, 10, 4] packed in order: capacity 14 wastes 10 elements over 3
    chunks, the least among 10..16; with data-parallel sizes 2 and 4 only multiples of 4
    qualify, and 12 and 16 both waste 16: 16 wins with fewer chunks."""
    numels = [6, 6, 6, 10, 4]
    assert packed_waste(numels, 10) == (18, 5) and packed_waste(numels, 12) == (16, 4)
    best = search_chunk_size(numels, dp_sizes=(2,), max_elems=16)
    assert (best.capacity, best.waste, best.chunks) == (14, 10, 3)
    best = search_chunk_size(numels, dp_sizes=(2, 4), max_elems=16)
    assert (best.capacity, best.waste, best.chunks) == (16, 16, 3)
    best = search_chunk_size([5, 9, 20], dp_sizes=(8,))
    assert best.capacity % 8 == 0 and best.waste == packed_waste([5, 9, 20], best.capacity, 8)[0]


def test_stage3_combinations_not_built_are_named():
    with pytest.raises(NotImplementedError, match="'apex'"):
        load_config(dict(zero=dict(stage=3), fp16=dict(mode='apex')))
    with pytest.raises(NotImplementedError, match="'zero_bubble' with chunks = 1"):
        load_config(dict(zero=dict(stage=3), num_microbatches=2,
                         parallel=dict(pipeline=dict(size=2, schedule='zero_bubble'))))
    with pytest.raises(NotImplementedError, match="'interleaved' with chunks = 2"):
        load_config(dict(zero=dict(stage=3), num_microbatches=4,
                         parallel=dict(pipeline=dict(size=2, chunks=2))))
    with pytest.raises(ConfigError, match='placement'):
        load_config(dict(zero=dict(stage=3, placement='gpu')))


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLI_JOB = """_base_ = {base!r}
model = dict(type='gpt', preset='tiny', hidden=64, layers=2, heads=4, max_positions=32,
             dropout=0.0)
data = dict(type='shakespeare', seq_len=32, val_fraction=0.05)
train = dict(global_batch_size=8, steps=4, log_every=1, eval_batches=1, run_dir={run!r})
zero = {zero}
"""


def _cli_losses(tmp_path, name, zero):
    job = tmp_path / f'{name}.py'
    run = str(tmp_path / name)
    job.write_text(CLI_JOB.format(base=os.path.join(REPO, 'configs', '_gpt_shakespeare.py'),
                                  run=run, zero=zero))
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS='1')
    out = subprocess.run([sys.executable, '-m', 'colossal_lite.cli', 'train', str(job),
                          '--nproc', '2'], cwd=str(tmp_path), env=env, capture_output=True,
                         text=True, timeout=TIMEOUT)
    assert out.returncode == 0, out.stdout + out.stderr
    with open(os.path.join(run, 'metrics.jsonl')) as f:
        return [json.loads(line)['loss'] for line in f if '"loss"' in line]


def test_cli_train_with_chunk_zero_gives_the_data_parallel_losses(tmp_path):
    """``colossal-lite train`` (clipping, cosine LR schedule, 2 workers) with
    zero=dict(stage=3, placement='auto') under a device budget logs the losses of plain
    data parallelism."""
    plain = _cli_losses(tmp_path, 'plain', 'None')
    chunked = _cli_losses(tmp_path, 'chunked', "dict(stage=3, placement='auto', "
                                                "chunk_size_mb=0.05, device_memory_limit=4e6)")
    assert len(plain) == len(chunked) >= 4
    assert max(abs(a - b) / abs(b) for a, b in zip(chunked, plain)) <= 1e-5, (chunked, plain)
