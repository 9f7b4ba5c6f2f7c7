"""The layer-level planner searches DeepSpeed-Ulysses (mode 'ulysses') and the ring x Ulysses
hybrid (``parallel.tensor.ring`` = R):

* the search offers Ulysses at every R dividing t with U = t / R >= 2, exactly the layouts
  ``check_layout`` accepts, and records each layout the size rules refuse with the rule's
  message (heads, or kv heads neither divisible by U nor dividing it);
* the activations a Ulysses block saves (``block_values_per_token``) equal what autograd
  saves on real GPT and Llama blocks (U = 2, U = 4 with the kv heads repeated, R = 2 x U = 2);
* the all_to_all and ring bytes the cost model predicts for a step equal the byte counter
  on a real step of a planned config (L blocks x M micro-batches, per group), and its calls;
* ranking on the shipped ``nvlink8`` profile: long sequence, many heads, small hidden,
  batch 1 -> Ulysses first, above the ring and 1D; a short sequence -> not above them;
* the plan ``plan()`` emits for Ulysses passes ``colossal-lite train``'s checks and trains
  two steps with the serial job's losses;
* pure Ulysses (R = 1) runs plain causal attention by SDPA's ``is_causal`` (no ``s x s``
  mask), with outputs and gradients bitwise those of the explicit-mask path.
"""
from __future__ import annotations


import pytest
import torch

import model_zoo  # noqa: F401  (registers gpt / llama)
from colossal_lite.auto import plan
from colossal_lite.auto.cost import Candidate, evaluate
from colossal_lite.auto.model_spec import model_shape
from colossal_lite.auto.search import layouts, search, split_error, job_spec
from colossal_lite.auto import load_profile
from colossal_lite.config import ParallelLayout, load_config
from colossal_lite.testing import run_distributed
from tests.planned_runs import assert_planned_config_trains_like_serial

ACT_OPTS = dict(vocab_size=256, max_positions=16, hidden=32, layers=2, heads=4, dropout=0.0)
LLAMA_OPTS = dict(vocab_size=256, max_positions=16, hidden=32, layers=2, heads=4, kv_heads=2,
                  intermediate=48, dropout=0.0)


def _ulysses(size, ring=1):
    return dict(parallel=dict(tensor=dict(size=size, mode='ulysses', ring=ring)))


# ---------------------------------------------------------------------------- the search
def test_search_offers_pure_and_hybrid_ulysses_and_records_skipped_layouts():
    # GPT tiny, 4 heads on 8 ranks: U = 8 cannot split them; U = 4 (R = 2) and U = 2 (R = 4) can
    shape = model_shape('gpt', 'tiny', seq=64, heads=4, hidden=64)
    seen = {(l.tensor, l.ring) for l in layouts(shape, 8, 8) if l.mode == 'ulysses'}
    assert {(2, 1), (4, 1), (4, 2), (8, 2), (8, 4)} <= seen
    assert (8, 1) not in seen and all(r < t for t, r in seen)
    result = search(shape, load_profile('nvlink8').with_devices(8), 8, 8)
    skipped = {(l.mode, l.tensor, l.ring): why for l, why in result.skipped}
    why = skipped[('ulysses', 8, 1)]
    assert "splits the attention heads 8 ways" in why and "'model.heads'" in why, why
    assert not any(e.candidate.layout.mode == 'ulysses' and e.candidate.layout.tensor == 8
                   and e.candidate.layout.ring == 1 for e in result.feasible)
    # Llama, 6 heads and 3 kv heads: U = 2 cannot split the 3 kv heads (nor repeat them)
    llama = model_shape('llama', None, seq=48, **dict(LLAMA_OPTS, hidden=48, heads=6,
                                                       kv_heads=3, intermediate=96,
                                                       max_positions=48))
    spec = job_spec(llama, 6)
    why = split_error(spec, ParallelLayout(1, 2, 'ulysses', 1, 3))
    assert "'model.kv_heads'" in why and 'divisible by 2 or dividing 2' in why, why
    assert split_error(spec, ParallelLayout(1, 3, 'ulysses', 1, 2)) is None   # 3 | 3, 3 | 6
    # Llama tiny, 2 kv heads: U = 4 repeats them (2 | 4)
    tiny = model_shape('llama', None, seq=16, **LLAMA_OPTS)
    assert ParallelLayout(1, 4, 'ulysses', 1, 1) in set(layouts(tiny, 4, 4))


def test_plan_report_lists_skipped_layouts_and_the_hybrid_config():
    result = plan('gpt:tiny', devices=8, memory_gb=80, batch=1, seq=8192, hidden=256, heads=4,
                  layers=4, max_positions=8192)
    report = result.report()
    assert 'layouts the model\'s sizes refuse' in report
    assert 't=8(ulysses)' in report and 'splits the attention heads 8 ways' in report
    hybrid = [e for e in result.search.feasible if e.candidate.layout.mode == 'ulysses'
              and e.candidate.layout.ring > 1]
    assert hybrid
    from colossal_lite.auto.planner import check_plan, plan_config
    shape = model_shape('gpt', 'tiny', seq=8192, hidden=256, heads=4, layers=4,
                        max_positions=8192)
    cand = hybrid[0].candidate
    check_plan(shape, cand, 1)
    config = plan_config(shape, cand, 1)
    assert config['parallel']['tensor'] == dict(size=cand.layout.tensor, mode='ulysses',
                                                ring=cand.layout.ring)
    layout = load_config(config).settings.layout.with_world_size(8)
    assert layout == cand.layout and 'R=' in cand.describe()


# ---------------------------------------------------------------------------- activations
def _gpt_saved(rank):
    from tests.test_planner import _saved_per_token
    return _saved_per_token(rank, 'gpt')


def _llama_saved(rank):
    from tests.test_planner_llama import _llama_saved_per_token
    return _llama_saved_per_token(rank)


@pytest.mark.parametrize('kind,size,ring', [('gpt', 2, 1), ('llama', 2, 1), ('llama', 4, 1),
                                            ('llama', 4, 2)])
def test_block_activations_equal_saved_tensors(kind, size, ring):
    """Ulysses saves ``(3h + 2 n' d + a) / t`` in attention (module doc of ``model_spec``):
    GPT 276 values per token at t = 2 where the ring saves 260; Llama 259 (U = 2), 137.5
    (U = 4: 2 kv heads repeated to 4), 129.5 (R = 2 x U = 2)."""
    opts = ACT_OPTS if kind == 'gpt' else LLAMA_OPTS
    measured = run_distributed(_gpt_saved if kind == 'gpt' else _llama_saved, size,
                               _ulysses(size, ring), timeout=300)
    shape = model_shape(kind, None, seq=16, **opts)
    assert measured == [shape.block_values_per_token('ulysses', size, 1, ring)] * size


# ---------------------------------------------------------------------------- bytes per step
def _step_bytes(rank, kind, opts, batch):
    """The bytes and calls of one engine step per group, after a warm-up step."""
    import colossal_lite as clt
    from colossal_lite.communication import comm_profile
    from colossal_lite.context import ParallelMode
    from colossal_lite.models import get_model
    from colossal_lite.testing import engine_step
    torch.manual_seed(0)
    entry = get_model(kind)
    model = entry.builder(**opts)
    engine, *_ = clt.initialize(model, torch.optim.SGD(model.parameters(), lr=1e-3),
                                entry.loss())
    ids = torch.randint(0, 256, (batch, 16), generator=torch.Generator().manual_seed(0))
    engine_step(engine, (ids, ids))
    with comm_profile() as stats:
        engine_step(engine, (ids, ids))
    ring = ParallelMode.SEQUENCE_RING   # p2p: the bytes sent (the same are received)
    return dict(ULYSSES=(stats.bytes(ParallelMode.ULYSSES), stats.calls(ParallelMode.ULYSSES)),
                SEQUENCE_RING=(stats.bytes(ring, 'send'), stats.bytes(ring)))


@pytest.mark.parametrize('kind,size,ring,micro', [('gpt', 2, 1, 2), ('llama', 4, 1, 1),
                                                  ('llama', 4, 2, 2)])
def test_predicted_step_bytes_equal_the_byte_counter(kind, size, ring, micro):
    """Per step: ULYSSES all_to_all bytes = L M ``ulysses_attention_bytes`` (6 calls per block
    and micro-batch), SEQUENCE_RING bytes = L M ``ring_attention_bytes`` of the R ring
    ranks' ``s/R`` block and ``n'/U`` kv heads; their sum is the cost model's
    ``tensor_bytes_per_block`` x L x M (the ring's p2p counted as the bytes each rank sends,
    as for mode 'sequence'; the counter also counts as many received)."""
    from colossal_lite.auto.planner import plan_config
    opts = ACT_OPTS if kind == 'gpt' else LLAMA_OPTS
    shape = model_shape(kind, None, seq=16, **opts)
    batch = 4
    cand = Candidate(ParallelLayout(1, size, 'ulysses', 1, 1, ring=ring), micro)
    config = {k: v for k, v in plan_config(shape, cand, batch).items()
              if k in ('parallel', 'num_microbatches')}
    measured = run_distributed(_step_bytes, size, config, kind, opts, batch, timeout=300)
    est = evaluate(shape, load_profile('nvlink8'), cand, batch)
    blocks = shape.layers * micro
    a2a, ring_bytes = shape.ulysses_comm_bytes(size, ring, batch / micro)
    assert est.terms['tensor_bytes_per_block'] * blocks == (a2a + ring_bytes) * blocks
    for got in measured:
        assert got['ULYSSES'] == (a2a * blocks, 6 * blocks)
        assert got['SEQUENCE_RING'] == (ring_bytes * blocks, 2 * ring_bytes * blocks)
        assert (ring > 1) == (got['SEQUENCE_RING'][0] > 0)


# ---------------------------------------------------------------------------- ranking
LONG = dict(hidden=512, heads=32, layers=12, max_positions=32768)


def _best_per_mode(result):
    best = {}
    for est in result.search.feasible:   # sorted by step time: the first of each mode wins
        best.setdefault(est.candidate.layout.mode, est)
    return best


def test_ulysses_wins_a_long_sequence_and_not_a_short_one():
    """nvlink8, 8 devices, batch 1: at 16384 tokens (32 heads, h = 512) Ulysses' all_to_alls
    (``8 b s h / P`` bytes per block) beat the ring's ``6 (P-1) b s h / P`` and 1D's four
    all_reduces; at 256 tokens the all_to_all's latency (P - 1 steps) and the replicated
    weights' gradient all_reduce leave it behind the ring and 1D."""
    long = plan('gpt:gpt2-small', devices=8, memory_gb=80, batch=1, seq=16384, **LONG)
    best = _best_per_mode(long)
    assert long.estimate.candidate.layout.mode == 'ulysses'
    assert best['ulysses'].step_time < best['sequence'].step_time < best['1d'].step_time
    assert long.estimate.terms['tensor_comm'] < best['sequence'].terms['tensor_comm']
    short = plan('gpt:gpt2-small', devices=8, memory_gb=80, batch=1, seq=256, **LONG)
    best = _best_per_mode(short)
    assert short.estimate.candidate.layout.mode != 'ulysses'
    assert best['ulysses'].step_time > max(best['sequence'].step_time, best['1d'].step_time)


# ---------------------------------------------------------------------------- the plan runs
RUN_MODEL = dict(hidden=64, heads=8, layers=2, vocab_size=256, max_positions=512)


def test_the_planned_ulysses_config_trains_like_serial(tmp_path):
    """``plan()`` (what ``colossal-lite plan`` runs) picks Ulysses for a 512-token GPT (8
    heads, h = 64) at batch 1 on 4 devices of the ``pcie8`` profile (pipeline 2 x Ulysses 2:
    on PCIe the all_to_all's bytes beat the ring's, on NVLink the ring's fewer latencies
    win for so small a model); its ``to_py`` file passes ``cli.check_job`` and trains two
    steps on 4 processes with the serial job's losses."""
    planned = plan('gpt:tiny', devices=4, memory_gb=80, batch=1, seq=512, cluster='pcie8',
                   **RUN_MODEL)
    cand = planned.estimate.candidate
    assert cand.layout.mode == 'ulysses', planned.report()
    assert planned.config['parallel']['tensor']['mode'] == 'ulysses'
    assert_planned_config_trains_like_serial(planned, tmp_path)


# ---------------------------------------------------------------------------- is_causal
@pytest.mark.parametrize('heads,kv_heads,dropout', [(4, 4, 0.0), (4, 2, 0.0), (4, 1, 0.0),
                                                    (4, 2, 0.3)])
def test_causal_attention_equals_the_masked_path(heads, kv_heads, dropout):
    """``functional.attention(..., sdpa_causal=True)`` (SDPA ``is_causal``, as pure Ulysses
    runs it) gives bitwise the output and input
    gradients of ``functional.attention``'s explicit lower-triangular mask (MHA, GQA, MQA;
    with dropout from the same seed)."""
    from colossal_lite.nn.functional import attention
    d, b, s = 8, 2, 24
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, s, heads * d, generator=gen, requires_grad=True)
    k = torch.randn(b, s, kv_heads * d, generator=gen, requires_grad=True)
    v = torch.randn(b, s, kv_heads * d, generator=gen, requires_grad=True)
    grad = torch.randn(b, s, heads * d, generator=gen)
    outs = []
    for fn in (lambda: attention(q, k, v, d, causal=True, dropout_p=dropout),
               lambda: attention(q, k, v, d, causal=True, dropout_p=dropout, sdpa_causal=True)):
        torch.manual_seed(3)
        out = fn()
        outs.append((out,) + torch.autograd.grad(out, (q, k, v), grad))
    for x, y in zip(*outs):
        assert torch.equal(x, y)


def _ulysses_causal_run(rank):
    """Pure Ulysses' causal attention on 2 ranks: the SDPA calls' (is_causal, mask given)
    and out / dq / dk / dv, with no padding mask (the fast path) and with an all-ones one
    (the explicit-mask path)."""
    import torch.nn.functional as F
    from colossal_lite.context import ParallelMode
    from colossal_lite.nn.sequence import SequenceLayout, sequence_axis, ulysses_attention
    ulysses = sequence_axis(ParallelMode.ULYSSES)
    ring = SequenceLayout.of(sequence_axis(ParallelMode.SEQUENCE_RING))
    calls, real = [], F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append((kwargs.get('is_causal'), kwargs.get('attn_mask') is not None))
        return real(*args, **kwargs)
    F.scaled_dot_product_attention = spy
    try:
        gen = torch.Generator().manual_seed(rank)
        b, s_l, d = 2, 8, 8
        q = torch.randn(b, s_l, 4 * d, generator=gen, requires_grad=True)
        k = torch.randn(b, s_l, 2 * d, generator=gen, requires_grad=True)
        v = torch.randn(b, s_l, 2 * d, generator=gen, requires_grad=True)
        grad = torch.randn(b, s_l, 4 * d, generator=gen)
        results = []
        for mask in (None, torch.ones(b, 2 * s_l, dtype=torch.bool)):
            out = ulysses_attention(q, k, v, d, ulysses, ring, causal=True, key_padding_mask=mask)
            results.append([out.detach()] + list(torch.autograd.grad(out, (q, k, v), grad)))
    finally:
        F.scaled_dot_product_attention = real
    return calls, [torch.equal(x, y) for x, y in zip(*results)]


def test_pure_ulysses_runs_sdpa_is_causal_with_unchanged_outputs():
    for calls, same in run_distributed(_ulysses_causal_run, 2, _ulysses(2), timeout=120):
        assert calls[0] == (True, False)      # fast path: is_causal, no mask tensor
        assert calls[1] == (False, True)      # a padding mask: the explicit mask
        assert all(same), same
