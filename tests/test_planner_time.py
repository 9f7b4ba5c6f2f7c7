"""The cost model's time terms for a measured, oversubscribed machine (docs/planner.md):

* ``profile.refit_family_blocks`` refits a family entry measured before ``per_replica`` (each
  rank ran ``data`` replicas' samples) against the samples it ran: it recovers the known
  seconds per FLOP of synthetic timings; a ``per_replica`` entry is left as it is;
* oversubscription (``ranks / cores`` > 1): a pipeline's bubble is filled by the ranks that
  compute while others wait, so 1F1B takes ``max(M * slowest stage, (M + P - 1) * slowest
  stage / (ranks / cores))``; without cores in the profile the plain ``(M + P - 1)`` form;
* a family's ``rest`` (embedding, head, loss beyond FLOPs) adds to every micro-batch;
* a tensor family's seconds per FLOP are at least the serial block's divided by t;
* a block takes the profile's timing of the nearest timed width (``profile.family_entry``);
* ZeRO-3: the chunk count equals the runtime's search on real GPT/BERT/ViT builds; each chunk
  adds one all_gather latency per forward and backward and one reduce_scatter per micro-step;
* between the timed batches a block costs the measured points (not the fitted line), its
  forward the timed forward's share (what a checkpointed block recomputes);
* each synchronizing point on the critical path (the gradient sync, ZeRO-1/2's weight
  all_gather, each pipeline boundary crossed forward and backward, one more per later
  micro-batch) adds the profile's measured ``sync_skew_s``;
* a data-group gradient sync the profile timed inside a step (``step_sync``: right after a
  real backward) costs that α-β and no skew point; other group sizes keep the collective's
  α-β plus the skew.
"""
import pytest

from colossal_lite.auto import ClusterProfile
from colossal_lite.auto.cost import Candidate, evaluate, oversubscription, zero3_chunks
from colossal_lite.auto.model_spec import ModelShape, model_shape
from colossal_lite.auto.profile import FAMILY_MODEL, refit_family_blocks
from colossal_lite.config import ParallelLayout

SHAPE = model_shape('gpt', None, seq=64, vocab_size=256, max_positions=64, hidden=128,
                    layers=4, heads=4, dropout=0.0)


def _profile(family, **compute):
    return ClusterProfile('t', 4, 4, 1e9, 1e10,
                          collectives={'all_reduce': {'4': {'intra': [1e-3, 1e-9]}},
                                       'p2p': {'2': {'intra': [1e-4, 1e-9]}}},
                          compute=dict(family_blocks=family, **compute))


def _entry(overhead, per_flop, rest=0.0):
    return dict(overhead=overhead, seconds_per_flop=per_flop, rest=rest, per_replica=True,
                batches=[2, 4, 8], block_s=[0.0, 0.0, 0.0])


def test_refit_family_blocks_counts_the_samples_each_rank_ran():
    shape = ModelShape('gpt', None, tuple(sorted(dict(FAMILY_MODEL, layers=1).items())), 64)
    per_flop, overhead, batches = 4e-11, 2e-3, [2, 4, 8]
    # old measurement: 'none' with data 4 ran 4 b samples per rank; 1D 4 (data 1) ran b
    old = {'none': {'1': dict(batches=batches, overhead=0.0, seconds_per_flop=1.0, rest=0.0,
                              block_s=[overhead + per_flop * 3 * shape.block_flops(4 * b * 64)
                                       for b in batches])},
           '1d': {'4': dict(batches=batches, overhead=0.0, seconds_per_flop=1.0, rest=0.0,
                            block_s=[overhead + per_flop * 3 * shape.block_flops(b * 64)
                                     for b in batches])},
           'sequence': {'2': _entry(5e-3, 7e-12)}}
    new = refit_family_blocks(old, world=4)
    for mode, t in (('none', '1'), ('1d', '4')):
        assert new[mode][t]['seconds_per_flop'] == pytest.approx(per_flop, rel=1e-6)
        assert new[mode][t]['overhead'] == pytest.approx(overhead, rel=1e-4)
        assert new[mode][t]['per_replica']
    assert new['none']['1']['batches'] == [8, 16, 32]
    assert new['sequence']['2'] == old['sequence']['2']
    assert old['none']['1']['seconds_per_flop'] == 1.0  # the input is not changed


def test_oversubscribed_pipeline_bubble_is_filled_by_the_waiting_ranks_cores():
    family = {'none': {'1': _entry(1e-3, 4e-11)}}
    layout = ParallelLayout(2, 1, None, 1, 2)
    cand = Candidate(layout, 4, '1f1b')
    plain = evaluate(SHAPE, _profile(family), cand, 16)
    assert oversubscription(_profile(family)) == 1.0
    slow = max(plain.stage_time)
    assert plain.terms['pipeline'] == pytest.approx((4 + 2 - 1) * slow)
    shared = evaluate(SHAPE, _profile(family, ranks=4, cores=2), cand, 16)
    assert oversubscription(_profile(family, ranks=4, cores=2)) == 2.0
    assert shared.stage_time == plain.stage_time
    assert shared.terms['pipeline'] == pytest.approx(max(4 * slow, 5 * slow / 2))
    assert shared.terms['pipeline'] == pytest.approx(4 * slow)
    # one micro-batch on 8 ranks: the path (2 stages at 1/4 of the time) is under the work
    one = evaluate(SHAPE, _profile(family, ranks=8, cores=2), Candidate(layout, 1), 16)
    assert one.terms['pipeline'] == pytest.approx(max(one.stage_time))
    # no pipeline: unchanged by oversubscription
    data = Candidate(ParallelLayout(1, 1, None, 1, 4), 1)
    assert (evaluate(SHAPE, _profile(family, ranks=4, cores=2), data, 16).step_time
            == pytest.approx(evaluate(SHAPE, _profile(family), data, 16).step_time))


def test_family_rest_adds_to_every_micro_batch():
    rest = 0.02
    cand = Candidate(ParallelLayout(1, 1, None, 1, 4), 3)
    without = evaluate(SHAPE, _profile({'none': {'1': _entry(1e-3, 4e-11)}}), cand, 24)
    with_rest = evaluate(SHAPE, _profile({'none': {'1': _entry(1e-3, 4e-11, rest)}}), cand, 24)
    assert with_rest.terms['pipeline'] - without.terms['pipeline'] == pytest.approx(3 * rest)
    # a pipeline: half on the first rank, half on the last
    pp = Candidate(ParallelLayout(2, 1, None, 1, 2), 2)
    a = evaluate(SHAPE, _profile({'none': {'1': _entry(1e-3, 4e-11)}}), pp, 8)
    b = evaluate(SHAPE, _profile({'none': {'1': _entry(1e-3, 4e-11, rest)}}), pp, 8)
    assert [y - x for x, y in zip(a.stage_time, b.stage_time)] == pytest.approx(
        [rest / 2, rest / 2])


def test_tensor_family_flop_rate_is_at_most_the_serial_rate_times_t():
    serial, overhead = 4e-11, 5e-3
    layout = ParallelLayout(1, 4, '1d', 1, 1)
    cand = Candidate(layout, 1)
    fitted_flat = {'none': {'1': _entry(0.0, serial)}, '1d': {'4': _entry(overhead, 1e-15)}}
    est = evaluate(SHAPE, _profile(fitted_flat), cand, 16)
    flops = SHAPE.block_flops(16 * 64)
    assert est.terms['block_compute'] == pytest.approx(overhead + serial / 4 * 3 * flops)
    # a fitted rate slower than the bound is kept
    slower = {'none': {'1': _entry(0.0, serial)}, '1d': {'4': _entry(overhead, serial)}}
    est = evaluate(SHAPE, _profile(slower), cand, 16)
    assert est.terms['block_compute'] == pytest.approx(overhead + serial * 3 * flops)


@pytest.mark.parametrize('kind,opts', [
    ('gpt', dict(hidden=128, layers=4, heads=4)),
    ('bert', dict(hidden=128, layers=4, heads=4, nsp=False)),
    ('vit', dict(img_size=32, patch_size=4, in_chans=3, num_classes=10, hidden=128, layers=4,
                 heads=4))])
def test_zero3_chunks_equal_the_runtime_search_and_cost_a_latency_each(kind, opts):
    import model_zoo  # noqa: F401  (registers gpt/bert/vit)
    from colossal_lite.models import get_model
    from colossal_lite.zero.chunk.search import search_chunk_size
    text = dict(vocab_size=256, max_positions=64) if kind != 'vit' else {}
    shape = model_shape(kind, None, seq=64 if kind != 'vit' else None, **text, **opts)
    model = get_model(kind).builder(dropout=0.0, **text, **opts)
    real = search_chunk_size([p.numel() for p in model.parameters()], dp_sizes=(4,)).chunks
    assert zero3_chunks(shape, 4) == real
    prof = _profile({}, ranks=4, cores=2)
    prof.collectives.update({'all_gather': {'4': {'intra': [2e-3, 1e-9]}},
                             'reduce_scatter': {'4': {'intra': [3e-3, 1e-9]}}})
    est = evaluate(shape, prof, Candidate(ParallelLayout(1, 1, None, 1, 4), 2, zero=3), 16)
    n = est.terms['params'][0] * 4
    # per micro-step: 2 all_gathers and 1 reduce_scatter per chunk
    expect = 2 * (2 * (real * 2e-3 + 1e-9 * n) + real * 3e-3 + 1e-9 * n)
    assert est.terms['gradient_sync'] == pytest.approx(expect)


def test_a_block_takes_the_timing_of_the_nearest_timed_width():
    """``profile.measure_families`` times blocks at several widths (``by_hidden``); the cost
    model reads the one nearest the model's hidden size on a log scale."""
    from colossal_lite.auto.profile import family_entry
    narrow, wide = _entry(1e-3, 9e-11, rest=0.01), _entry(4e-3, 3e-11, rest=0.03)
    family = {'none': {'1': dict(wide, by_hidden={'64': narrow, '128': wide})}}
    compute = dict(family_blocks=family)
    assert family_entry(compute, None, 1, 64) is narrow
    assert family_entry(compute, None, 1, 90) is narrow      # log(90/64) < log(128/90)
    assert family_entry(compute, None, 1, 91) is wide
    assert family_entry(compute, None, 1, 768) is wide
    assert family_entry(compute, '1d', 2, 64) is None
    assert family_entry({'family_blocks': {'none': {'1': wide}}}, None, 1, 64) is wide
    cand = Candidate(ParallelLayout(1, 1, None, 1, 4), 1)
    small = model_shape('gpt', None, seq=64, vocab_size=256, max_positions=64, hidden=64,
                        layers=2, heads=4, dropout=0.0)
    for shape, entry in ((small, narrow), (SHAPE, wide)):
        est = evaluate(shape, _profile(family), cand, 16)
        flops = shape.block_flops(4 * 64)
        assert est.terms['block_compute'] == pytest.approx(
            entry['overhead'] + entry['seconds_per_flop'] * 3 * flops)
        # the rest: half to the first part, half to the last, per micro-batch
        only_blocks = evaluate(shape, _profile({'none': {'1': dict(entry, rest=0.0)}}), cand, 16)
        assert (est.terms['pipeline'] - only_blocks.terms['pipeline'] == pytest.approx(
            entry['rest']))


def test_ulysses_takes_its_timed_block_and_the_hybrid_the_one_of_its_t():
    """Profiles since stop 35 time Ulysses 2 and 4 (``profile.FAMILY_LAYOUTS``): a Ulysses
    block then costs the timed entry, collectives included (no α-β term on top), and a ring ×
    Ulysses layout on t ranks the Ulysses entry of the same t; without an entry, the analytic
    FLOPs + all_to_all path (what set 1 of the held-out sweep found 1.3 - 1.9x too fast)."""
    from colossal_lite.auto.profile import FAMILY_LAYOUTS
    assert ('ulysses', 2) in FAMILY_LAYOUTS and ('ulysses', 4) in FAMILY_LAYOUTS
    entry = _entry(5e-3, 7e-11)
    timed = _profile({'ulysses': {'4': entry}})
    flops = 3 * SHAPE.block_flops(4 * 64)
    for ring in (1, 2):
        cand = Candidate(ParallelLayout(1, 4, 'ulysses', 1, 1, ring=ring), 1)
        est = evaluate(SHAPE, timed, cand, 4)
        assert est.terms['block_compute'] == pytest.approx(
            entry['overhead'] + entry['seconds_per_flop'] * flops)
        untimed = evaluate(SHAPE, _profile({}), cand, 4)
        assert untimed.terms['block_compute'] != pytest.approx(est.terms['block_compute'])


def test_adam_step_costs_per_element_and_per_tensor_stepped():
    """``cost.optimizer_time``: without ZeRO every local parameter tensor is one iteration of
    torch's per-tensor AdamW loop; ZeRO-1/2 step one flat slice per bucket, ZeRO-3 one per
    chunk; the elements are the rank's (ZeRO: its 1/D)."""
    import model_zoo  # noqa: F401  (registers gpt)
    from colossal_lite.models import get_model
    per_tensor, per_param = 2e-5, 3e-9
    prof = _profile({'none': {'1': _entry(1e-3, 4e-11)}}, adam_s_per_tensor=per_tensor,
                    adam_s_per_param=per_param)
    prof.collectives.update({'all_gather': {'4': {'intra': [1e-4, 1e-9]}},
                             'reduce_scatter': {'4': {'intra': [1e-4, 1e-9]}}})
    model = get_model('gpt').builder(vocab_size=256, max_positions=64, hidden=128, layers=4,
                                     heads=4, dropout=0.0)
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    data = ParallelLayout(1, 1, None, 1, 4)
    for zero, tensors, elems in ((0, len(params), numel), (2, 1, numel / 4),
                                 (3, zero3_chunks(SHAPE, 4), numel / 4)):
        est = evaluate(SHAPE, prof, Candidate(data, 1, zero=zero), 16)
        assert est.terms['optimizer'] == pytest.approx(per_tensor * tensors + per_param * elems)
    # a pipeline: the busier rank (the first holds the embeddings, the last shares them)
    pp = evaluate(SHAPE, prof, Candidate(ParallelLayout(2, 1, None, 1, 2), 2), 16)
    assert pp.terms['optimizer'] < evaluate(SHAPE, prof, Candidate(data, 1), 16).terms['optimizer']


def test_the_last_gradient_bucket_is_never_hidden_behind_the_backward():
    """``cost.exposed_sync``: one bucket (a model under 25 MiB of gradients) starts after the
    whole backward, fully exposed; with k buckets the first k - 1 overlap it."""
    from colossal_lite.auto.cost import OVERLAP_SLOWDOWN, exposed_sync
    mib = 2 ** 20
    assert exposed_sync(0.010, 0.050, 4 * mib) == pytest.approx(0.010)
    # 4 buckets, backward longer than the early three: only the last and the slowdown
    assert exposed_sync(0.040, 0.050, 100 * mib) == pytest.approx(
        0.010 + (OVERLAP_SLOWDOWN - 1) * 0.030)
    # backward shorter than the early buckets: their remainder is exposed too
    assert exposed_sync(0.040, 0.020, 100 * mib) == pytest.approx(
        0.010 + 0.010 + (OVERLAP_SLOWDOWN - 1) * 0.020)
    # in a step: a small data-parallel model pays its whole sync after the backward
    prof = _profile({'none': {'1': _entry(1e-3, 4e-11)}})
    est = evaluate(SHAPE, prof, Candidate(ParallelLayout(1, 1, None, 1, 4), 1), 16)
    assert est.terms['gradient_sync'] > 0
    assert est.terms['exposed_sync'] == pytest.approx(est.terms['gradient_sync'])


def test_zero3_prefetched_gathers_hide_behind_the_previous_chunks_compute():
    """``cost.zero3_exposed``: per pass the first chunk's all_gather waits whole; each later
    one overlaps the compute of the chunk before it (slowed 1.3x while it does); with no
    compute to hide behind every gather is exposed, as ``gradient_sync`` counts them."""
    from colossal_lite.auto.cost import OVERLAP_SLOWDOWN, zero3_exposed
    prof = _profile({}, ranks=4, cores=2)
    prof.collectives.update({'all_gather': {'4': {'intra': [2e-3, 1e-9]}},
                             'reduce_scatter': {'4': {'intra': [3e-3, 1e-9]}}})
    layout = ParallelLayout(1, 1, None, 1, 4)
    nbytes, chunks, m = 8e6, 5, 2
    g, r = 2e-3 + 1e-9 * nbytes / chunks, 3e-3 + 1e-9 * nbytes / chunks
    scatter = m * chunks * r
    assert zero3_exposed(prof, layout, m, nbytes, chunks, 0.0, 0.0) == pytest.approx(
        scatter + 2 * m * chunks * g)
    # compute per chunk longer than a gather: only the slowdown of the overlapped ones
    slow = 1.0
    assert zero3_exposed(prof, layout, m, nbytes, chunks, slow, slow) == pytest.approx(
        scatter + 2 * m * (g + (chunks - 1) * (OVERLAP_SLOWDOWN - 1) * g))
    # in a step: gradient_sync keeps the whole traffic, the step pays the exposed part
    est = evaluate(SHAPE, prof, Candidate(layout, 1, zero=3), 16)
    assert est.terms['exposed_sync'] < est.terms['gradient_sync']


def test_timed_points_that_fall_with_more_samples_are_pooled():
    """A block timed faster at 4 samples than at 2 (1D 2 at h = 128 in a real profile:
    10.9, 7.6, 20.1, 46.5 ms at 2, 4, 8, 16) is noise: the two points are pooled to their
    mean, so 2 micro-batches of 4 never cost less than one of 8 by the dip alone."""
    from colossal_lite.auto.profile import (family_block_seconds, family_rest_seconds,
                                            nondecreasing)
    assert nondecreasing([10.9, 7.6, 20.1, 46.5]) == pytest.approx([9.25, 9.25, 20.1, 46.5])
    assert nondecreasing([3, 2, 1, 5]) == pytest.approx([2, 2, 2, 5])
    assert nondecreasing([1, 2, 2, 3]) == [1, 2, 2, 3]
    entry = dict(_entry(5e-3, 1e-11), flops=[1e9, 2e9, 4e9, 8e9],
                 block_s=[0.0109, 0.0076, 0.0201, 0.0465],
                 one_s=[0.0158, 0.0220, 0.0359, 0.0604], tokens=[128, 256, 512, 1024])
    assert family_block_seconds(entry, 2e9) == pytest.approx(0.00925)
    assert family_block_seconds(entry, 1e9) == pytest.approx(0.00925)
    assert 2 * family_block_seconds(entry, 2e9) <= family_block_seconds(entry, 4e9)
    assert family_rest_seconds(entry, 256) == pytest.approx(0.0220 - 0.00925)


def test_a_block_between_timed_batches_takes_the_measured_points():
    """``profile.family_block_seconds``: between the timed batches the measured points
    (piecewise linear in FLOPs), beyond them the fitted seconds per FLOP; ``rest`` from the
    1-block times at the micro-batch's tokens; an entry without the points: the fit."""
    from colossal_lite.auto.profile import family_block_seconds, family_rest_seconds
    entry = dict(_entry(5e-3, 1e-11), flops=[1e9, 2e9, 4e9], block_s=[0.010, 0.030, 0.034],
                 one_s=[0.015, 0.036, 0.044], tokens=[128, 256, 512])
    assert family_block_seconds(entry, 2e9) == pytest.approx(0.030)
    assert family_block_seconds(entry, 1.5e9) == pytest.approx(0.020)   # not the line
    assert family_block_seconds(entry, 3e9) == pytest.approx(0.032)
    assert family_block_seconds(entry, 6e9) == pytest.approx(0.034 + 2e9 * 1e-11)
    assert family_block_seconds(entry, 6e9, 3e-11) == pytest.approx(0.034 + 2e9 * 3e-11)
    assert family_block_seconds(entry, 0.5e9) == pytest.approx(0.010 - 0.5e9 * 1e-11)
    assert family_rest_seconds(entry, 192) == pytest.approx((0.005 + 0.006) / 2)
    assert family_rest_seconds(entry, 64) == pytest.approx(0.005)       # held at the ends
    assert family_rest_seconds(entry, 1024) == pytest.approx(0.010)
    old = _entry(5e-3, 1e-11, rest=0.007)
    assert family_block_seconds(old, 2e9) == pytest.approx(5e-3 + 2e9 * 1e-11)
    assert family_rest_seconds(old, 512) == 0.007
    # the cost model uses them: a 2-block model at a timed batch costs its measured points
    small = model_shape('gpt', None, seq=64, vocab_size=256, max_positions=64, hidden=128,
                        layers=2, heads=4, dropout=0.0)
    from colossal_lite.auto.profile import _family_shape
    flops = [3 * _family_shape(128).block_flops(b * 64) for b in (2, 4, 8)]
    timed = dict(entry, flops=flops)
    est = evaluate(small, _profile({'none': {'1': timed}}),
                   Candidate(ParallelLayout(1, 1, None, 1, 1), 1), 4)
    head = 3 * small.head_flops(4) / 1e10    # the head's FLOPs at the profile's rate
    assert est.terms['pipeline'] == pytest.approx(2 * 0.030 + 0.006 + head, rel=1e-6)
    # a checkpointed block recomputes its forward: the timed forward's share of the block
    # (1D: half of the collectives are in the forward), 1/3 where the profile has none
    from colossal_lite.auto.profile import family_forward_share
    assert family_forward_share(timed, flops[1]) == pytest.approx(1 / 3)
    halves = dict(timed, forward_s=[0.005, 0.015, 0.017])
    assert family_forward_share(halves, flops[1]) == pytest.approx(0.5)
    assert family_forward_share(dict(timed, forward_s=[0.009, 0.001, 0.02]), flops[0]) == 0.6
    ckpt = Candidate(ParallelLayout(1, 1, None, 1, 1), 1, checkpoint=True)
    for e, share in ((timed, 1 / 3), (halves, 0.5)):
        plain = evaluate(small, _profile({'none': {'1': e}}),
                         Candidate(ParallelLayout(1, 1, None, 1, 1), 1), 4)
        again = evaluate(small, _profile({'none': {'1': e}}), ckpt, 4)
        assert again.terms['pipeline'] - plain.terms['pipeline'] == \
            pytest.approx(2 * 0.030 * share, rel=1e-6)


def test_sync_skew_counts_each_synchronizing_point_on_the_critical_path():
    """``cost.sync_skew_time``: the profile's ``sync_skew_s`` once for the gradient sync of a
    data group (DP; sequence: the D*t group), twice for ZeRO-1/2 (the reduce-scatter and
    the weight all_gather after the step), twice per pipeline boundary plus once per
    micro-batch after the first, never for ZeRO-3 (priced per chunk) or a profile without
    it; ``profile.sync_skew`` measures it as (last end - slowest compute) - the bare
    collective."""
    from colossal_lite.auto.cost import sync_skew_time
    from colossal_lite.auto.profile import sync_skew
    prof = _profile({}, sync_skew_s=0.003)
    cases = [((1, 1, None, 1, 4), 0, 1, 1, 1), ((1, 1, None, 1, 4), 2, 1, 1, 2),
             ((1, 1, None, 1, 4), 1, 1, 4, 2), ((1, 1, None, 1, 4), 3, 1, 1, 0),
             ((2, 1, None, 1, 2), 0, 2, 1, 3), ((2, 1, None, 1, 2), 1, 2, 1, 4),
             ((2, 1, None, 1, 2), 0, 2, 4, 6), ((2, 1, None, 1, 1), 0, 2, 1, 2),
             ((2, 1, None, 1, 1), 0, 4, 1, 6), ((2, 1, None, 1, 1), 0, 4, 8, 13),
             ((1, 4, '1d', 1, 1), 0, 1, 1, 0), ((1, 2, 'sequence', 1, 1), 0, 1, 1, 1)]
    for layout, zero, stages, m, points in cases:
        assert sync_skew_time(prof, ParallelLayout(*layout), zero, stages, m) == \
            pytest.approx(0.003 * points), (layout, zero, stages, m)
    assert sync_skew_time(_profile({}), ParallelLayout(1, 1, None, 1, 4), 0, 1) == 0.0
    for m, points in ((1, 3), (2, 4)):   # a data group of 2 and one boundary
        cand = Candidate(ParallelLayout(2, 1, None, 1, 2), m)
        est = evaluate(SHAPE, prof, cand, 16)
        bare = evaluate(SHAPE, _profile({}), cand, 16)
        assert est.step_time - bare.step_time == pytest.approx(points * 0.003)
    ranks = [dict(bare=[0.001, 0.002, 0.001], compute=[0.010, 0.011, 0.012],
                  total=[0.016, 0.017, 0.016]),
             dict(bare=[0.002, 0.001, 0.001], compute=[0.012, 0.010, 0.009],
                  total=[0.015, 0.018, 0.016])]
    # per repeat: last end - slowest compute = 4, 6, 4 ms; the bare medians' 2, 2, 1 ms
    assert sync_skew(ranks) == pytest.approx(0.004 - 0.002)


def test_a_profile_of_several_rounds_takes_each_entrys_median():
    """``profile.median_tree``: three rounds' profiles combine entry by entry (α and β of a
    collective, each timed point of a block, the skew) into their medians, counts stay
    integers, and the combined profile costs a layout as the median round does; rounds of a
    different shape, or no round, are refused with the lengths / value."""
    from colossal_lite.auto.profile import measure, median_tree

    def one(alpha, beta, points, skew):
        entry = dict(_entry(0.0, 1e-12), batches=[2, 4, 8], block_s=points,
                     flops=[1e8, 2e8, 4e8], tokens=[128, 256, 512], one_s=points)
        p = _profile({'none': {'1': entry}}, sync_skew_s=skew, ranks=4, cores=2)
        p.collectives['all_reduce']['4']['intra'] = [alpha, beta]
        return p.to_json()

    rounds = [one(3e-3, 2e-9, [0.010, 0.030, 0.050], 4e-3),
              one(1e-3, 1e-9, [0.020, 0.025, 0.070], 1e-3),
              one(2e-3, 4e-9, [0.015, 0.040, 0.060], 2e-3)]
    combined = ClusterProfile.from_json(median_tree(rounds))
    assert combined.collectives['all_reduce']['4']['intra'] == [2e-3, 2e-9]
    entry = combined.compute['family_blocks']['none']['1']
    assert entry['block_s'] == [0.015, 0.030, 0.060]
    assert combined.compute['sync_skew_s'] == 2e-3
    assert combined.devices == 4 and isinstance(combined.devices, int)
    assert combined.compute['ranks'] == 4 and combined.compute['cores'] == 2
    # equal to a profile written with the medians by hand
    middle = ClusterProfile.from_json(one(2e-3, 2e-9, [0.015, 0.030, 0.060], 2e-3))
    cand = Candidate(ParallelLayout(1, 1, None, 1, 4), 1, '1f1b', 1, 'uniform', 0, False)
    assert (evaluate(SHAPE, combined, cand, 16).step_time
            == pytest.approx(evaluate(SHAPE, middle, cand, 16).step_time, rel=1e-12))
    short = one(1e-3, 1e-9, [0.01, 0.02, 0.03], 1e-3)
    short['compute']['family_blocks']['none']['1']['block_s'] = [0.01, 0.02]
    with pytest.raises(ValueError, match=r'lengths \[3, 2\]'):
        median_tree([rounds[0], short])
    with pytest.raises(ValueError, match='rounds=0'):
        measure(rounds=0)
    # profiles measured at different times: the median over every round of all of them
    from colossal_lite.auto.profile import combine
    earlier = dict(median_tree(rounds[:2]), compute=dict(median_tree(rounds[:2])['compute'],
                                                         rounds=rounds[:2]))
    later = one(5e-3, 3e-9, [0.030, 0.050, 0.080], 5e-3)
    both = combine([{'profile': earlier}, later])
    assert both.collectives['all_reduce']['4']['intra'] == [3e-3, 2e-9]
    assert both.compute['family_blocks']['none']['1']['block_s'] == [0.020, 0.030, 0.070]
    assert len(both.compute['rounds']) == 3


def test_profile_cli_combines_stored_profiles(tmp_path, capsys):
    """``python -m colossal_lite.auto.profile out.json --combine A.json B.json C.json``
    measures nothing and writes the median over every round of the stored profiles (a
    results file holding one under 'profile' is read too)."""
    import json
    from colossal_lite.auto.profile import main
    paths = []
    for i, alpha in enumerate((1e-3, 7e-3, 2e-3)):
        p = _profile({}, sync_skew_s=alpha)
        p.collectives['all_reduce']['4']['intra'] = [alpha, 1e-9]
        path = tmp_path / f'p{i}.json'
        path.write_text(json.dumps({'profile': p.to_json()} if i else p.to_json()))
        paths.append(str(path))
    out = tmp_path / 'combined.json'
    assert main([str(out), '--combine', *paths]) == 0
    combined = ClusterProfile.from_json(json.loads(out.read_text()))
    assert combined.collectives['all_reduce']['4']['intra'] == [2e-3, 1e-9]
    assert combined.compute['sync_skew_s'] == 2e-3
    assert len(combined.compute['rounds']) == 3
    assert 'wrote' in capsys.readouterr().out


def test_gradient_sync_takes_the_in_step_alpha_beta_where_the_profile_timed_it():
    """``cost.data_sync_time``: DP's all_reduce and ZeRO-1/2's reduce_scatter + all_gather
    over a data group of 4 at the profile's ``step_sync`` α-β (timed after a backward,
    the wait for the slowest rank included), with no skew point for them; a data group
    of 2 the profile did not time keeps the isolated α-β and its skew point."""
    from colossal_lite import formulas
    skew = 0.003
    step_sync = {'all_reduce': {'4': [5e-3, 2e-9]}, 'reduce_scatter': {'4': [4e-3, 3e-9]},
                 'all_gather': {'4': [2e-3, 1e-9]}}
    timed = _profile({}, sync_skew_s=skew, step_sync=step_sync)
    alone = _profile({}, sync_skew_s=skew)
    for p in (timed, alone):
        p.collectives.update({'reduce_scatter': {'4': {'intra': [1e-3, 1e-9]}},
                              'all_gather': {'4': {'intra': [1e-3, 1e-9]}},
                              'all_reduce': {'2': {'intra': [5e-4, 1e-9]},
                                             '4': {'intra': [1e-3, 1e-9]}}})
    dp = Candidate(ParallelLayout(1, 1, None, 1, 4), 1)
    est, bare = evaluate(SHAPE, timed, dp, 16), evaluate(SHAPE, alone, dp, 16)
    n = formulas.gradient_sync_bytes(0, int(est.terms['params'][0]), 1, 4)
    assert est.terms['gradient_sync'] == pytest.approx(5e-3 + 2e-9 * n)
    assert bare.terms['gradient_sync'] == pytest.approx(1e-3 + 1e-9 * n)
    assert est.terms['sync_skew'] == 0.0 and bare.terms['sync_skew'] == pytest.approx(skew)
    for zero in (1, 2):
        z = evaluate(SHAPE, timed, Candidate(ParallelLayout(1, 1, None, 1, 4), 1, zero=zero),
                     16)
        one = z.terms['params'][0] * 4
        assert z.terms['gradient_sync'] == pytest.approx(4e-3 + 3e-9 * one + 2e-3 + 1e-9 * one)
        assert z.terms['sync_skew'] == 0.0
    # a data group of 2 (pipeline 2): not timed in a step -> isolated α-β, skew point kept
    pp = Candidate(ParallelLayout(2, 1, None, 1, 2), 1)
    est, bare = evaluate(SHAPE, timed, pp, 16), evaluate(SHAPE, alone, pp, 16)
    assert est.terms['gradient_sync'] == bare.terms['gradient_sync']
    assert est.terms['sync_skew'] == bare.terms['sync_skew'] == pytest.approx(3 * skew)


def test_step_sync_points_time_the_sync_from_the_last_ranks_backward_end():
    """``profile.step_sync_points``: per timed (width, blocks, batch) the gradient bytes and
    the median over repeats of (last rank's sync end - last rank's backward end)."""
    from colossal_lite.auto.profile import step_sync_points
    ranks = [{'elems:64,2': 1000, 'sync:all_reduce:64,2,4': [[0.010, 0.020], [0.011, 0.019],
                                                              [0.012, 0.030]]},
             {'elems:64,2': 1000, 'sync:all_reduce:64,2,4': [[0.014, 0.021], [0.010, 0.020],
                                                              [0.009, 0.029]]}]
    # per repeat: 21 - 14 = 7, 20 - 11 = 9, 30 - 12 = 18 ms -> median 9 ms
    assert step_sync_points(ranks) == {'all_reduce': [[4000, pytest.approx(0.009)]]}


def test_combining_rounds_keeps_an_entry_older_rounds_lack():
    """``profile.median_tree`` over rounds measured before an entry existed: the entry is
    the median over the rounds that have it (older rounds add nothing to it)."""
    from colossal_lite.auto.profile import median_tree
    old = _profile({}, sync_skew_s=1e-3).to_json()
    new = [_profile({}, sync_skew_s=s, step_sync={'all_reduce': {'4': [a, 1e-9]}}).to_json()
           for s, a in ((3e-3, 4e-3), (5e-3, 6e-3))]
    combined = ClusterProfile.from_json(median_tree([old] + new))
    assert combined.compute['sync_skew_s'] == pytest.approx(3e-3)
    assert combined.compute['step_sync']['all_reduce']['4'] == [pytest.approx(5e-3), 1e-9]
