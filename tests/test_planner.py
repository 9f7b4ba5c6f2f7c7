"""The planner (colossal_lite.auto): profile fitting, cost model, search, plan output.

* α-β fitting recovers known latency and inverse bandwidth from synthetic timings;
* the cost model's parameter counts equal a meta build of gpt2-small, bert-base and
  vit-base in every tensor family and under pipelining; its tensor-parallel bytes equal
  ``formulas.block_bytes``, which equals the byte counter on a real block (1D, 2D);
* memory: the activations a block saves (``block_values_per_token``) equal what autograd
  saves on real blocks (serial GPT/BERT, 1D, 2D, sequence); the model data after a step
  equals the live tensor bytes of real runs (data, ZeRO-1/2/3, sequence, pipeline, 1D,
  2D); the peak's buffers: tests/test_planner_memory.py;
* the per-layer DP equals exhaustive search on every small random case;
* ``plan()`` returns a config that ``load_config`` and ``check_layout`` accept, and
  ``colossal-lite plan --write`` a file ``colossal-lite train`` loads;
* the papers' qualitative results on the shipped profiles.
"""
import math
import random
import time

import pytest
import torch

import model_zoo  # noqa: F401  (registers gpt/bert/vit)
from colossal_lite import formulas
from colossal_lite.auto import ClusterProfile, load_profile, plan
from colossal_lite.auto.cluster import ring_alpha_beta
from colossal_lite.auto.cost import Candidate, evaluate, model_state_bytes, part_params
from colossal_lite.auto.galvatron import strategies
from colossal_lite.auto.model_spec import model_shape
from colossal_lite.auto.profile import fit_alpha_beta
from colossal_lite.auto.search import (bmw_partition, divisors, dp_layers, exhaustive_layers,
                                       job_spec, layouts, search, tensor_options)
from colossal_lite.config import ParallelLayout, PipelineSettings, load_config, parse_parallel
from colossal_lite.context import ParallelContext, use_context
from colossal_lite.pipeline.partition import uniform_cut
from colossal_lite.testing.memory import live_tensor_bytes
from model_zoo import BERT, GPT, ViT



# ---------------------------------------------------------------------------- profile
def test_fit_recovers_known_alpha_beta():
    rng = random.Random(0)
    alpha, beta = 25e-6, 1 / 12e9
    sizes = [2 ** k for k in range(10, 24, 2)]
    times = [(alpha + beta * n) * (1 + rng.uniform(-1e-3, 1e-3)) for n in sizes]
    a, b = fit_alpha_beta(sizes, times)
    assert abs(a - alpha) / alpha < 0.05 and abs(b - beta) / beta < 1e-3
    with pytest.raises(ValueError, match='>= 2'):
        fit_alpha_beta([1], [1.0])


def test_profile_json_round_trip_and_lookup(tmp_path):
    for name in ('nvlink8', 'nodes4x8', 'pcie8'):
        prof = load_profile(name)
        path = tmp_path / f'{name}.json'
        prof.save(str(path))
        assert load_profile(str(path)) == prof
    prof = load_profile('nodes4x8')
    link = prof.links['inter']
    assert prof.alpha_beta('all_gather', 4, 'inter') == ring_alpha_beta(
        'all_gather', 4, link['latency_s'], link['bandwidth_Bps'], link['launch_s'])
    # a measured table entry wins; another size scales it by the ring factors
    table = ClusterProfile('t', 4, 4, 1e9, 1e9,
                           collectives={'all_reduce': {'2': {'intra': [1e-3, 1e-9]}}})
    assert table.alpha_beta('all_reduce', 2, 'intra') == (1e-3, 1e-9)
    a4, b4 = table.alpha_beta('all_reduce', 4, 'intra')
    assert math.isclose(a4, 3e-3) and math.isclose(b4, 1.5e-9)
    assert prof.placement(1, 8) == 'intra' and prof.placement(8, 2) == 'inter'
    with pytest.raises(ValueError, match='unknown cluster profile keys'):
        ClusterProfile.from_json(dict(prof.to_json(), bogus=1))
    with pytest.raises(ValueError, match='neither a file nor one of the shipped'):
        load_profile('no-such-profile')


# ---------------------------------------------------------------------------- cost model
_LAYOUTS = [({}, 1), (dict(tensor=dict(size=4, mode='1d')), 4),
            (dict(tensor=dict(size=4, mode='2d')), 4),
            (dict(tensor=dict(size=8, mode='2.5d', depth=2)), 8),
            (dict(tensor=dict(size=8, mode='3d')), 8),
            (dict(tensor=dict(size=2, mode='sequence')), 2),
            (dict(pipeline=2, tensor=dict(size=2, mode='1d')), 4), (dict(pipeline=3), 6)]
_MODELS = [('gpt', 'gpt2-small', GPT), ('bert', 'bert-base', BERT), ('vit', 'vit-base', ViT)]


def check_rank_params(shape, layout, build):
    """For the first and last rank of ``layout``: ``build()`` on meta under that rank's
    described context holds the planner's parameter count (first / blocks / last part of
    its pipeline stage); yields each count."""
    p, world = layout.pipeline, layout.world_size
    block, first, last = part_params(shape, layout, p > 1)
    ranges = uniform_cut(shape.layers, p)
    for rank in sorted({0, world - 1}):
        stage = rank // (world // p)
        want = len(ranges[stage]) * block + (first if stage == 0 else 0) \
            + (last if stage == p - 1 else 0)
        with use_context(ParallelContext.describe(layout, rank)), torch.device('meta'):
            model = build()
        got = sum(t.numel() for t in {id(t): t for t in model.parameters()}.values())
        assert got == want, (layout, rank)
        yield got


@pytest.mark.parametrize('kind,preset,cls', _MODELS)
def test_parameter_counts_equal_meta_build(kind, preset, cls):
    shape = model_shape(kind, preset)
    for parallel, world in _LAYOUTS:
        layout = parse_parallel(parallel).with_world_size(world)
        if kind == 'vit' and layout.mode == 'sequence':
            continue  # 197 tokens do not split in 2 (check_layout rejects it)
        for got in check_rank_params(shape, layout, lambda: cls.from_preset(preset)):
            # model states by ZeRO stage (docs/zero.md, fp32 Adam): 16 bytes per element
            assert model_state_bytes(got, 0, 4) == 16 * got
            assert model_state_bytes(got, 3, 4) == 4 * got


def test_block_bytes_compose_the_layer_formulas():
    b, s, h = 4, 32, 64
    # MLP ratio 1: six Linear(h, h) plus two LayerNorms
    for q, d in ((2, 1), (2, 2), (4, 1)):
        mode = '2d' if d == 1 else '2.5d'
        ln = 2 * 4 * (4 * b * s / (d * q) + 2 * h / q * (1 + (d > 1)))
        assert formulas.block_bytes(mode, d * q * q, b, s, h, 1, d) == pytest.approx(
            6 * formulas.linear_2p5d_bytes(b, s, h, q, d) + ln)
    assert formulas.block_bytes('1d', 4, b, s, h) == 2 * formulas.mlp_1d_bytes(4, b, s, h)
    assert formulas.block_bytes('sequence', 4, b, s, h) == formulas.ring_attention_bytes(4, b, s, h)
    assert formulas.block_bytes(None, 1, b, s, h) == 0


def _measure_block(rank, mode):
    from colossal_lite.communication import comm_profile
    from model_zoo.blocks import TransformerLayer
    torch.set_num_threads(1)
    torch.manual_seed(0)
    block = TransformerLayer(16, 4, 4, dropout=0.0, pre_ln=True)
    x = torch.randn(4, 8, 16)
    if mode == '2d':
        from colossal_lite.nn.parallel_2p5d import Grid2p5D
        x = Grid2p5D.current().split_activation(x)
    x.requires_grad_(True)
    block(x).sum().backward()  # warm-up
    with comm_profile() as stats:
        block(x).sum().backward()
    return stats.bytes()


@pytest.mark.parametrize('mode,world', [('1d', 2), ('2d', 4)])
def test_cost_model_tensor_bytes_equal_byte_counter(mode, world):
    from colossal_lite.testing import run_distributed
    measured = run_distributed(_measure_block, world,
                               dict(parallel=dict(tensor=dict(size=world, mode=mode))), mode)
    expected = formulas.block_bytes(mode, world, 4, 8, 16)
    assert measured == [expected] * world
    # the cost model charges exactly these bytes per block and micro-batch
    shape = model_shape('gpt', 'tiny', seq=8, hidden=16, heads=4)
    layout = ParallelLayout(1, world, mode, 1, 1)
    est = evaluate(shape, load_profile('nvlink8'), Candidate(layout, 1), batch=4)
    assert est.terms['tensor_bytes_per_block'] == expected


# ---------------------------------------------------------------------------- memory
ACT_OPTS = dict(vocab_size=256, max_positions=16, hidden=32, layers=2, heads=4, dropout=0.0)


def _saved_bytes(model, block, run):
    """Bytes of the distinct non-parameter storages ``block`` saves for backward in ``run``."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() and st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t
    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    pre = block.register_forward_pre_hook(lambda m, a: hooks.__enter__())
    post = block.register_forward_hook(lambda m, a, o: hooks.__exit__(None, None, None))
    run()
    pre.remove()
    post.remove()
    return sum(seen.values())


def _saved_per_token(rank, kind):
    """Saved values per token of one block of ``kind`` (the difference of batch 2 and 4, so
    the batch-independent part drops out), on this rank."""
    from colossal_lite.models import get_model
    opts = dict(ACT_OPTS, nsp=False) if kind == 'bert' else ACT_OPTS
    torch.manual_seed(0)
    model = get_model(kind).builder(**opts)
    block = [m for m in model.modules() if type(m).__name__ == 'TransformerLayer'][0]
    saved = []
    for b in (2, 4):
        ids = torch.randint(0, 256, (b, 16))
        saved.append(_saved_bytes(model, block, lambda: model(ids).float().sum().backward()))
    return (saved[1] - saved[0]) / (2 * 16 * 4)


@pytest.mark.parametrize('kind,mode,size,world', [
    ('gpt', None, 1, 1), ('bert', None, 1, 1), ('gpt', '1d', 2, 2), ('gpt', '2d', 4, 4),
    ('gpt', 'sequence', 2, 2), ('bert', 'sequence', 2, 2)])
def test_block_activations_equal_saved_tensors(kind, mode, size, world):
    """``block_values_per_token`` equals what autograd saves on a real block (per rank;
    the replica batch is the full batch: data size 1)."""
    from colossal_lite.testing import run_distributed
    parallel = dict(tensor=dict(size=size, mode=mode)) if mode else dict()
    measured = run_distributed(_saved_per_token, world, dict(parallel=parallel), kind)
    opts = dict(ACT_OPTS, nsp=False) if kind == 'bert' else ACT_OPTS
    shape = model_shape(kind, None, seq=16, **opts)
    grid = 2 if mode == '2d' else 1
    assert measured == [shape.block_values_per_token(mode, size, grid)] * world


def _model_data(rank, config_zero):
    """Live tensor bytes after two engine steps minus those before the build (each storage
    once): weights, gradients and optimizer states."""
    import colossal_lite as clt
    from colossal_lite.models import get_model
    from colossal_lite.testing import engine_step

    def live():   # 0-dim tensors (AdamW's per-parameter step counters) not counted
        return live_tensor_bytes(scalars=False)
    ids = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(0))
    before = live()
    entry = get_model('gpt')
    model = entry.builder(**ACT_OPTS)
    engine, *_ = clt.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                entry.loss())
    from colossal_lite.context import ParallelMode, global_context as gpc
    batch = ids[: 8 // gpc.get_world_size(ParallelMode.DATA)]
    for _ in range(2):
        engine_step(engine, (batch, batch))
    del batch
    # an overlapped collective's buffers are released by gloo's thread, at times after the
    # step returns: the lowest of a few reads (late buffers only add bytes)
    after = []
    for _ in range(4):
        after.append(live())
        time.sleep(0.05)
    return min(after) - before


@pytest.mark.parametrize('cand', [
    Candidate(ParallelLayout(1, 1, None, 1, 4), 1),
    Candidate(ParallelLayout(1, 1, None, 1, 4), 2, zero=1),
    Candidate(ParallelLayout(1, 1, None, 1, 4), 2, zero=2),
    Candidate(ParallelLayout(1, 1, None, 1, 4), 1, zero=3),
    Candidate(ParallelLayout(1, 2, 'sequence', 1, 2), 1),
    Candidate(ParallelLayout(2, 1, None, 1, 2), 2, '1f1b'),
    Candidate(ParallelLayout(1, 4, '1d', 1, 1), 1),
    Candidate(ParallelLayout(1, 2, '1d', 1, 2), 1),
    Candidate(ParallelLayout(1, 4, '2d', 1, 1), 1)],
    ids=lambda c: c.describe().replace(' ', '_'))
def test_model_data_equals_real_builds(cand):
    """The cost model's ``model_data`` (weights, gradients -- ZeRO: their shard -- and AdamW
    moments live after a step) equals the live tensor bytes of a real run, on every rank
    (1D and 2D too: a drawn shard owns its memory, q/k/v share one storage)."""
    from colossal_lite.auto.planner import plan_config
    from colossal_lite.testing import run_distributed
    shape = model_shape('gpt', None, seq=16, **ACT_OPTS)
    config = {k: v for k, v in plan_config(shape, cand, 8).items()
              if k in ('parallel', 'num_microbatches', 'zero')}
    measured = run_distributed(_model_data, 4, config, cand.zero)
    est = evaluate(shape, load_profile('nvlink8'), cand, 8)
    l = cand.layout
    # rank r sits on pipeline stage r // (D t) (ranks are data-fastest, then tensor)
    want = [est.terms['model_data'][r // (l.data * l.tensor)] for r in range(4)]
    assert measured == want


def test_gradient_sync_and_pipeline_terms():
    shape = model_shape('gpt', 'gpt2-small', seq=256)
    prof = load_profile('nvlink8')
    plain = evaluate(shape, prof, Candidate(ParallelLayout(1, 1, None, 1, 8), 1), 32)
    n = plain.terms['params'][0]
    assert formulas.gradient_sync_bytes(0, n) == 4 * n
    assert formulas.gradient_sync_bytes(2, n, microbatches=3) == 16 * n
    ar = prof.group_time('all_reduce', 4 * n, 1, 8)
    assert plain.terms['gradient_sync'] == pytest.approx(ar)
    # 1F1B holds P - r micro-batches, GPipe M: GPipe needs more memory on stage 0
    pp = ParallelLayout(4, 1, None, 1, 2)
    one = evaluate(shape, prof, Candidate(pp, 8, '1f1b'), 32)
    gpipe = evaluate(shape, prof, Candidate(pp, 8, 'gpipe'), 32)
    assert gpipe.memory[0] > one.memory[0]
    assert one.terms['bubble'] == pytest.approx(3 * max(one.stage_time))
    zb = evaluate(shape, prof, Candidate(pp, 8, 'zero_bubble'), 32)
    assert zb.step_time < one.step_time
    ckpt = evaluate(shape, prof, Candidate(pp, 8, '1f1b', checkpoint=True), 32)
    assert ckpt.peak_memory < one.peak_memory and ckpt.step_time > one.step_time


# ---------------------------------------------------------------------------- search
def test_dp_equals_exhaustive_on_small_cases():
    rng = random.Random(1)
    for _ in range(300):
        layers = rng.randint(1, 5)
        opts = [[(rng.uniform(0, 10), rng.uniform(0, 5)) for _ in range(rng.randint(1, 3))]
                for _ in range(layers)]
        budget = rng.uniform(0, 5 * layers)
        quantum = rng.choice([0.05, 0.25, 1.0])
        t_dp, pick_dp = dp_layers(opts, budget, quantum)
        t_ex, pick_ex = exhaustive_layers(opts, budget, quantum)
        if math.isinf(t_ex):
            assert math.isinf(t_dp) and pick_dp == []
            continue
        assert t_dp == pytest.approx(t_ex, abs=1e-9)
        assert sum(opts[i][k][0] for i, k in enumerate(pick_dp)) == pytest.approx(t_dp)
        units = sum(math.ceil(opts[i][k][1] / quantum - 1e-9) for i, k in enumerate(pick_dp))
        assert units <= math.floor(budget / quantum + 1e-9)


def test_bmw_partition_moves_toward_time_balance_within_memory():
    weights = [1.0] * 12
    head = 5.0  # the first stage carries a heavy embedding in memory, none in time

    def times(ranges):
        return [sum(weights[i] for i in r) for r in ranges]

    def memory(ranges):
        return [sum(weights[i] for i in r) + (head if s == 0 else 0) for s, r in enumerate(ranges)]
    start = [1, 5, 6]  # memory-balanced: 6, 5, 6
    loose = bmw_partition(start, lambda r: max(memory(r)) <= 100, times)
    assert [len(r) for r in loose] == [4, 4, 4]       # time-balanced when memory allows
    tight = bmw_partition(start, lambda r: max(memory(r)) <= 8, times)
    assert max(memory(tight)) <= 8 and max(times(tight)) < 6
    assert [len(r) for r in tight] != [4, 4, 4]


def test_layouts_are_exactly_those_train_accepts():
    """The search's layouts of 8 ranks are exactly the ones ``check_layout`` (what
    ``colossal-lite train`` runs, meta build included) accepts."""
    from colossal_lite.config import ConfigError
    from colossal_lite.job import check_layout
    shape = model_shape('gpt', 'tiny', seq=16, layers=4)
    spec = job_spec(shape, 16)
    accepted = set()
    for p in divisors(8):
        for t in divisors(8 // p):
            for mode, depth in tensor_options(t):
                for ring in divisors(t) if mode == 'ulysses' else (1,):
                    layout = ParallelLayout(p, t, mode, depth, 8 // p // t, ring=ring)
                    try:
                        check_layout(spec, layout, PipelineSettings(size=p))
                    except ConfigError:
                        continue
                    if mode != 'ulysses' or ring < t:  # R = t: the ring alone ('sequence')
                        accepted.add(layout)
    seen = set(layouts(shape, 8, 16))
    assert seen == accepted
    assert {(l.mode, l.tensor) for l in seen} >= {(None, 1), ('1d', 4), ('2d', 4), ('3d', 8),
                                                   ('2.5d', 8), ('sequence', 8), ('ulysses', 8)}
    # 4 heads: Ulysses over U = 8 cannot split them; the hybrids R = 2 (U = 4), R = 4 (U = 2) can
    assert {l.ring for l in seen if l.mode == 'ulysses' and l.tensor == 8} == {2, 4}


# ---------------------------------------------------------------------------- output
def test_plan_config_loads_and_passes_check_layout():
    from colossal_lite.job import check_layout
    result = plan('gpt2-small', devices=8, memory_gb=4, batch=32, seq=512)
    cfg = load_config(result.config)
    s = cfg.settings
    layout = s.layout.with_world_size(8)
    check_layout(s.job, layout, s.pipeline)
    cand = result.estimate.candidate
    assert (layout.pipeline, layout.tensor, layout.mode, layout.data) == (
        cand.layout.pipeline, cand.layout.tensor, cand.layout.mode, cand.layout.data)
    assert result.memory_per_device <= 4 * 2 ** 30
    assert all(result.step_time <= est.step_time for est, _ in result.runners_up
               if est.peak_memory <= 4 * 2 ** 30)
    assert result.runners_up and all(why for _, why in result.runners_up)
    with pytest.raises(ValueError, match='no plan .* fits'):
        plan('gpt2-small', devices=2, memory_gb=0.01, batch=8, seq=256)


_CANDIDATES = [Candidate(ParallelLayout(1, 2, '1d', 1, 4), 2, zero=3, checkpoint=True),
               Candidate(ParallelLayout(2, 4, '2.5d', 1, 1), 4, 'interleaved', 2, 'parameters'),
               Candidate(ParallelLayout(2, 1, None, 1, 4), 4, 'zero_bubble', 1, 'parameters', 2),
               Candidate(ParallelLayout(1, 8, '2.5d', 2, 1), 1),
               Candidate(ParallelLayout(4, 2, 'sequence', 1, 1), 8, 'gpipe'),
               Candidate(ParallelLayout(1, 8, '3d', 1, 1), 2, zero=0, checkpoint=True),
               Candidate(ParallelLayout(2, 2, '1d', 1, 2), 4, '1f1b', zero=1)]


@pytest.mark.parametrize('cand', _CANDIDATES, ids=lambda c: c.describe())
def test_every_kind_of_plan_config_passes_the_train_checks(cand):
    """plan_config of every kind of candidate (ZeRO stages, schedules, partitions, tensor
    modes, checkpointing) gives the layout, pipeline and ZeRO settings it describes."""
    from colossal_lite.auto.planner import check_plan, plan_config
    shape = model_shape('gpt', 'gpt2-small', seq=256)
    check_plan(shape, cand, 32)
    s = load_config(plan_config(shape, cand, 32)).settings
    assert s.layout.with_world_size(cand.layout.world_size) == cand.layout
    assert (s.pipeline.schedule if cand.layout.pipeline > 1 else '1f1b') == cand.schedule
    assert (s.pipeline.chunks, s.pipeline.num_microbatches) == (cand.chunks, cand.microbatches)
    assert (s.zero.stage if s.zero else 0) == cand.zero
    assert s.job.options.get('checkpoint', False) == cand.checkpoint


@pytest.mark.parametrize('model,seq', [('bert-base', 512), ('vit-base', None)])
def test_plans_for_bert_and_vit(model, seq):
    from colossal_lite.auto.planner import check_plan
    result = plan(model, devices=8, memory_gb=2, batch=64, seq=seq)
    check_plan(model_shape(model.split('-')[0], model, seq=seq), result.estimate.candidate, 64)
    assert result.memory_per_device <= 2 * 2 ** 30
    layout = load_config(result.config).settings.layout.with_world_size(8)
    assert layout == result.estimate.candidate.layout


def test_cli_plan_writes_a_train_config(tmp_path, capsys):
    from colossal_lite.cli import main
    path = tmp_path / 'planned.py'
    assert main(['plan', '--model', 'gpt:tiny', '--devices', '4', '--memory-gb', '1',
                 '--batch', '16', '--seq', '32', '--write', str(path)]) == 0
    out = capsys.readouterr().out
    assert 'chosen:' in out and 'runners-up:' in out
    cfg = load_config(str(path))
    assert cfg.settings.job.kind == 'gpt' and cfg.settings.job.train.global_batch_size == 16
    assert main(['plan', '--model', 'nonexistent', '--devices', '4']) == 2
    assert main(['plan', '--model', 'tiny', '--devices', '4']) == 2   # gpt, bert and vit have it
    assert "write 'kind:preset'" in capsys.readouterr().err


# ---------------------------------------------------------------------------- the papers
def test_galvatron_strategy_counts():
    assert len(strategies(8)) == 44                      # with CKPT, after Takeaway #3
    assert len(strategies(8, takeaway3=False)) == 68
    assert len(strategies(8, checkpoint=False)) == 22    # Galvatron without CKPT


def test_vit_1d_wins_on_nvlink_2d_on_pcie():
    """Colossal-AI's ViT finding on 8 GPUs as 2 data x 4 tensor ranks (ViT-base, batch 128):
    1D fastest on the fully NVLinked box, 2D when the interconnect is slow (PCIe)."""
    shape = model_shape('vit', 'vit-base')

    def times(name):
        return {mode: evaluate(shape, load_profile(name),
                               Candidate(ParallelLayout(1, 4, mode, 1, 2), 1), 128).step_time
                for mode in ('1d', '2d')}
    nvlink, pcie = times('nvlink8'), times('pcie8')
    assert nvlink['1d'] < nvlink['2d']
    assert pcie['2d'] < 0.95 * pcie['1d']


def test_pipeline_goes_across_the_slow_link():
    result = plan('gpt2-large', devices=32, memory_gb=16, batch=128, seq=1024, cluster='nodes4x8')
    l = result.estimate.candidate.layout
    assert l.pipeline > 1 and l.data * l.tensor <= 8  # data and tensor groups inside a node
    assert result.cluster.placement(l.data * l.tensor, l.pipeline) == 'inter'
    assert result.search.evaluated > 1000


def test_search_covers_48_layers_on_64_devices():
    shape = model_shape('gpt', 'gpt2-xl', seq=1024, heads=32)
    result = search(shape, load_profile('nodes4x8').with_devices(64), 64, 512, 40 * 2 ** 30)
    best = result.best
    assert best is not None and best.peak_memory <= 40 * 2 ** 30
    assert {e.candidate.layout.pipeline for e in result.feasible} >= {1, 2, 4, 8, 16}


# ---------------------------------------------------------------------------- AutoDDL-style SBP
def test_sbp_coordinate_descent_equals_exhaustive_on_small_meshes():
    from colossal_lite.auto import sbp
    rng = random.Random(3)
    for _ in range(6):
        tokens, hidden = 2 ** rng.randint(4, 12), 2 ** rng.randint(4, 10)
        split = rng.choice([1, 2, 4])
        for mesh in sbp.meshes(8, 2):
            cd, plan = sbp.coordinate_descent(mesh, tokens, hidden, split)
            ex, _ = sbp.exhaustive(mesh, tokens, hidden, split)
            assert cd == pytest.approx(ex), (mesh, tokens, hidden, split)
            assert sbp.attention_traffic(mesh, plan, tokens, hidden) == pytest.approx(cd)


def test_sbp_conversion_costs():
    from colossal_lite.auto import sbp
    # all_gather over 4: receive 3 quarters; reduce_scatter: 3/4 of the partial buffer
    assert sbp.convert(64, (4,), ('S0',), ('B',)) == 48
    assert sbp.convert(64, (4,), ('P',), ('S1',)) == 48
    assert sbp.convert(64, (4,), ('P',), ('B',)) == 96
    assert sbp.convert(64, (4,), ('S0',), ('S1',)) == 12
    assert sbp.convert(64, (4, 2), ('B', 'B'), ('S0', 'S1')) == 0
    # cheapest order: reduce_scatter over 2 first (64 -> 32 local), then gather over 4
    assert sbp.convert(64, (4, 2), ('S0', 'P'), ('B', 'S1')) == pytest.approx(
        0.5 * 16 + 3 * 8)


def test_autoddl_attention_example():
    """AutoDDL's 64-device attention layer (h = 8192, batch 1024 x sequence 1024): Megatron's
    4 data x 16 model moves 3.75 * 2^30 activation elements per device forward; per-matmul
    layouts with every weight still split 16 ways move 2 * 2^30 on a 2x2x4x4 mesh."""
    from colossal_lite.auto import sbp
    tokens, hidden = 2 ** 20, 2 ** 13
    megatron = {'qkv': ('M', 'N'), 'core': ('S0', 'S1'), 'out': ('M', 'K'),
                'layer': ('S0', 'S1')}
    assert sbp.attention_traffic((4, 16), megatron, tokens, hidden) == 3.75 * 2 ** 30
    found = {'qkv': ('N', 'K', 'M', 'N'), 'core': ('S1', 'S0', 'S0', 'S1'),
             'out': ('N', 'N', 'M', 'K'), 'layer': ('S1', 'S1', 'S0', 'S0')}
    mesh = (2, 2, 4, 4)
    assert min(sbp.weight_split(mesh, found['qkv']), sbp.weight_split(mesh, found['out'])) >= 16
    assert sbp.attention_traffic(mesh, found, tokens, hidden) == 2 * 2 ** 30
    cost, mesh3, _ = sbp.search(64, tokens, hidden, min_split=16, axes=3)
    assert cost == 2.25 * 2 ** 30   # three mesh axes do not reach it


def test_a_profile_for_more_ranks_measures_their_groups_and_shares_the_cores(tmp_path):
    """``python -m colossal_lite.auto.profile OUT --ranks 8 --base BASE``: the collectives are
    timed again on 8 local ranks (groups of 2, 4 and 8, each fitted), the base's compute
    kept, its FLOP rate scaled by its ranks / 8 where 8 ranks share fewer cores."""
    import os
    from colossal_lite.auto.profile import main
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        'benchmarks', 'results', 'profiles', 'stops20_21.json')
    base = load_profile(path)
    out = tmp_path / 'eight.json'
    assert main([str(out), '--ranks', '8', '--base', path]) == 0
    eight = load_profile(str(out))
    assert (eight.devices, eight.devices_per_node) == (8, 8)
    for op in ('all_reduce', 'all_gather', 'reduce_scatter', 'all_to_all'):
        assert sorted(eight.collectives[op], key=int) == ['2', '4', '8'], op
        for size in ('2', '4', '8'):
            alpha, beta = eight.collectives[op][size]['intra']
            assert alpha >= 0 and alpha + beta * 2 ** 22 > 1e-6, (op, size)   # 4 MiB > 1 us
    share = base.compute['ranks'] / 8 if base.compute['cores'] < 8 else 1.0
    assert eight.flops == pytest.approx(base.flops * share, rel=1e-12)
    assert eight.compute['adam_s_per_param'] == base.compute['adam_s_per_param']
    with pytest.raises(SystemExit):
        main([str(out), '--ranks', '8'])                 # --base missing
