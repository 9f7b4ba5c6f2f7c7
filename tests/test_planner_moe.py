"""The layer-level planner knows mixture-of-experts models (``PlannerShape.moe``) and searches
the expert-parallel degree E (``parallel.expert``) beside its other dimensions:

* parameters per rank (experts / E, / t under expert tensor parallelism) equal a real build's;
* the all_to_all bytes of a real step (Llama-MoE, E = 2, with and without 1D t = 2) equal
  ``ModelShape.moe_all_to_all_bytes`` of the step's measured routing, and the planner's
  uniform prediction is that formula at ``N k (E-1)/E`` rows each way; the uneven
  all_to_all's wire bytes equal its recorded bytes (``CommStats``);
* ranking: many large experts that do not fit with E = 1 -> E > 1 first; two small experts
  on PCIe -> E = 1 first;
* a plan with E > 1 passes ``cli.check_job`` and trains two steps on 4 processes with the
  serial job's losses.
"""
from __future__ import annotations

from fractions import Fraction

import pytest
import torch

import model_zoo  # noqa: F401  (registers llama)
from colossal_lite.auto import load_profile, plan
from colossal_lite.auto.cost import Candidate, evaluate
from colossal_lite.auto.model_spec import model_shape
from colossal_lite.auto.search import layouts
from colossal_lite.communication import CommStats
from colossal_lite.config import ParallelLayout
from colossal_lite.context import ParallelMode
from colossal_lite.testing import run_distributed
from tests.planned_runs import assert_planned_config_trains_like_serial

MOE = dict(experts=4, top_k=2, ffn_hidden=32)
OPTS = dict(vocab_size=256, max_positions=16, hidden=32, layers=3, heads=4, kv_heads=2,
            intermediate=48, dropout=0.0, moe=dict(MOE, first_dense=1))


# ---------------------------------------------------------------------------- the uneven counter
def test_uneven_all_to_all_wire_bytes_equal_recorded_bytes():
    stats = CommStats()
    stats.record(ParallelMode.EXPERT, 'all_to_all', 1000, 4, exact_wire=True)  # uneven
    stats.record(ParallelMode.EXPERT, 'all_to_all', 64, 4)                     # even
    assert stats.bytes(ParallelMode.EXPERT) == 1064
    assert stats.wire_bytes(ParallelMode.EXPERT) == 1000 + 64 * 3 / 4
    assert stats.calls(ParallelMode.EXPERT, 'all_to_all') == 2


# ---------------------------------------------------------------------------- the search
def test_search_offers_every_expert_degree_and_no_hidden_splitting_mode():
    shape = model_shape('llama', None, seq=16, **OPTS)
    assert shape.moe.experts == 4 and shape.moe_layers == 2
    seen = {(l.data, l.expert) for l in layouts(shape, 8, 8) if l.pipeline == l.tensor == 1}
    assert seen == {(8, 1), (8, 2), (8, 4)}   # E | gcd(data, experts)
    assert not any(l.mode in ('2d', '2.5d', '3d') for l in layouts(shape, 8, 8))
    dense = model_shape('llama', None, seq=16, **dict(OPTS, moe=None))
    assert {l.expert for l in layouts(dense, 8, 8)} == {1}


# ---------------------------------------------------------------------------- bytes per step
def _moe_step(rank, opts, batch):
    """One engine step after a warm-up on ``batch`` samples per data replica (other tokens
    on each replica, the same on tensor peers): EXPERT all_to_all bytes, wire bytes and
    calls, and the (S_off, R_off) rows of every exchange; the rank's parameter elements
    (all, and the experts')."""
    from colossal_lite.context import global_context as gpc
    import colossal_lite as clt
    from colossal_lite.communication import comm_profile
    from colossal_lite.models import get_model
    from colossal_lite.nn.moe import dispatch
    from colossal_lite.testing import engine_step
    torch.manual_seed(0)
    entry = get_model('llama')
    model = entry.builder(**opts)
    numel = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if '.experts.' in n)
    engine, *_ = clt.initialize(model, torch.optim.SGD(model.parameters(), lr=1e-3),
                                entry.loss())
    replica = gpc.get_local_rank(ParallelMode.DATA)
    ids = torch.randint(0, 256, (batch, 16),
                        generator=torch.Generator().manual_seed(replica))
    engine_step(engine, (ids, ids))
    rows, init = [], dispatch.ExpertExchange.__init__

    def spy(self, counts, axis):
        init(self, counts, axis)
        if axis.size > 1:
            me = axis.rank
            rows.append((sum(self.send) - self.send[me], sum(self.recv) - self.recv[me]))
    dispatch.ExpertExchange.__init__ = spy
    try:
        with comm_profile() as stats:
            engine_step(engine, (ids, ids))
    finally:
        dispatch.ExpertExchange.__init__ = init
    mode = ParallelMode.EXPERT
    return dict(bytes=stats.bytes(mode, 'all_to_all'), wire=stats.wire_bytes(mode, 'all_to_all'),
                calls=stats.calls(mode, 'all_to_all'), rows=rows, numel=numel, experts=experts)


@pytest.mark.parametrize('world,tensor,micro', [(2, 1, 2), (4, 2, 1)])
def test_all_to_all_bytes_equal_the_counter(world, tensor, micro):
    """EXPERT all_to_all per step = the sum over the step's MoE forwards (L_moe M of them) of
    ``8 X + 2 h elem (S_off + R_off)`` in 5 calls each, with the exchanges' measured rows;
    wire bytes: the counts' ``(E-1)/E`` and the rows whole. The planner's per-layer bytes
    are the same formula at uniform routing, ``S_off = R_off = N k (E-1)/E`` (N the tokens
    of a replica micro-batch). Parameters per
    rank equal the build's (experts / E, / t under expert tensor parallelism)."""
    from colossal_lite.auto.planner import plan_config
    shape = model_shape('llama', None, seq=16, **OPTS)
    batch, e = 4, 2
    mode = '1d' if tensor > 1 else None
    layout = ParallelLayout(1, tensor, mode, 1, world // tensor, expert=e)
    cand = Candidate(layout, micro)
    config = {k: v for k, v in plan_config(shape, cand, batch).items()
              if k in ('parallel', 'num_microbatches')}
    assert config['parallel']['expert'] == e
    measured = run_distributed(_moe_step, world, config, OPTS, batch, timeout=300)
    est = evaluate(shape, load_profile('nvlink8'), cand, batch * layout.data)  # global batch
    x, h = MOE['experts'], 32
    tokens = batch / micro * 16
    off = tokens * MOE['top_k'] * (e - 1) / e
    assert est.terms['moe']['all_to_all_bytes_per_layer'] == 8 * x + 2 * h * 4 * 2 * off
    assert est.terms['expert_params'] == [2 * 3 * x * h * 32 // (e * tensor)]
    for got in measured:
        assert len(got['rows']) == shape.moe_layers * micro
        assert got['bytes'] == sum(shape.moe_all_to_all_bytes(s, r) for s, r in got['rows'])
        assert got['calls'] == 5 * len(got['rows'])
        assert Fraction(got['wire']) == sum(Fraction(8 * x * (e - 1), e) + 2 * h * 4 * (s + r)
                                            for s, r in got['rows'])
        assert got['numel'] == est.terms['params'][0]
        assert got['experts'] == est.terms['expert_params'][0]


# ---------------------------------------------------------------------------- ranking
BIG = dict(hidden=1024, layers=4, heads=16, kv_heads=8, intermediate=2816, vocab_size=32000,
           max_positions=1024, moe=dict(experts=64, top_k=2, ffn_hidden=1408))
SMALL = dict(hidden=256, layers=4, heads=8, kv_heads=4, intermediate=512, vocab_size=8000,
             max_positions=512, moe=dict(experts=2, top_k=1, ffn_hidden=256))


def test_many_large_experts_choose_expert_parallelism():
    """64 experts of 1408 x 1024 in 4 layers (1.1 G expert parameters, 17 GiB of fp32
    AdamW states): plain data parallelism does not fit 16 GiB; nvlink8's 8 devices as
    D = 8 with E = 8 (8 experts per rank, tokens by all_to_all) beat every E = 1 layout
    that fits (pipeline, 1D, ZeRO)."""
    p = plan('llama:tiny', devices=8, memory_gb=16, batch=16, seq=1024, **BIG)
    chosen = p.estimate.candidate.layout
    assert chosen.expert > 1, p.report()
    plain = Candidate(ParallelLayout(1, 1, None, 1, 8), 1)
    shape = model_shape('llama', 'tiny', seq=1024, **BIG)
    assert evaluate(shape, p.cluster, plain, 16).peak_memory > p.search.budget
    dense_best = next(e for e in p.search.feasible if e.candidate.layout.expert == 1)
    assert dense_best.step_time > p.step_time
    assert p.estimate.terms['moe']['all_to_all_bytes_per_layer'] > 0
    assert p.config['parallel']['expert'] == chosen.expert


def test_few_small_experts_keep_expert_parallelism_off():
    """Two experts of 256 x 256, top-1, on 4 PCIe devices: every E = 2 layout pays the
    all_to_all's latencies and bytes per layer and saves little memory: E = 1 first, and
    the best E = 2 plan is slower mostly by the expert all_to_all."""
    p = plan('llama:tiny', devices=4, memory_gb=80, batch=16, seq=512, cluster='pcie8',
             **SMALL)
    assert p.estimate.candidate.layout.expert == 1, p.report()
    assert 'expert' not in p.config['parallel']
    moe_best = next(e for e in p.search.feasible if e.candidate.layout.expert > 1)
    assert moe_best.step_time > p.step_time
    # E = 1 keeps only the statistics all_reduce of [experts] int64 over DATA
    assert moe_best.terms['expert_comm'] > 5 * p.estimate.terms['expert_comm'] > 0


# ---------------------------------------------------------------------------- the plan runs
TINY = dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab_size=256,
            max_positions=32, moe=dict(experts=16, top_k=2, ffn_hidden=256))


def test_the_planned_expert_parallel_config_trains_like_serial(tmp_path):
    """16 experts of 256 x 64 in 2 layers on 4 devices with 12 MB each: E = 1 layouts do not
    fit or are slower; the plan (D = 2 x E = 2 x pipeline 2) written by ``to_py`` passes
    ``cli.check_job`` and trains two steps on 4 processes with the serial job's losses."""
    planned = plan('llama:tiny', devices=4, memory_gb=0.012, batch=4, seq=32, **TINY)
    cand = planned.estimate.candidate
    assert cand.layout.expert > 1, planned.report()
    assert planned.config['parallel']['expert'] == cand.layout.expert
    assert_planned_config_trains_like_serial(planned, tmp_path)
