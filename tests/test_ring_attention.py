"""Ring attention (online softmax, zigzag chunks) equals serial attention; memory linear in s/P.

docs/sequence_parallel.md states the formulas asserted here: the ring's bytes, what it saves
for backward, and the chunk pairs each rank computes under a causal mask.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from colossal_lite.communication import collective as C
from colossal_lite.communication import comm_profile
from colossal_lite.context import ParallelMode, ProcessGroupAxis, global_context as gpc
from colossal_lite.nn.functional import attention
from colossal_lite.nn.sequence import (SequenceLayout, chunk_pairs, record_blocks, ring_attention,
                                       sequence_layout)
from colossal_lite.testing import assert_matches_serial, max_rel_diff, run_distributed
from model_zoo import GPT

from tests.model_cases import rank_traces, serial_traces

B, S, HEADS, D = 2, 24, 4, 8          # no saved tensor may have a dimension of size S
TOL = 1e-5
KV_HEADS = (4, 2, 1)                  # multi-head, grouped-query (2 groups), multi-query


def seq_config(p, zigzag=True):
    return dict(parallel=dict(tensor=dict(mode='sequence', size=p, zigzag=zigzag)))


def _padding():
    pad = torch.ones(B, S)
    pad[0, 0] = 0      # causal: query 0 of sample 0 has no key at all -> zeros, as SDPA
    pad[0, 7] = 0
    pad[1, -5:] = 0
    return pad


def _inputs(kv_heads, dtype=torch.float32):
    g = torch.Generator().manual_seed(kv_heads)   # the same full tensors on every rank
    return [torch.randn(B, S, width, generator=g, dtype=dtype)
            for width in (HEADS * D, kv_heads * D, kv_heads * D, HEADS * D)]


def _record_saved():
    """A saved_tensors_hooks context and the list of (shape, bytes) it records."""
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.numel() * t.element_size()))
        return t
    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), saved


# ----------------------------------------------------------------- ring vs serial SDPA
def attention_cases(layout, run):
    """For MHA, GQA and MQA, causal or not, padded or not: ``run(local q, k, v, causal,
    mask, layout.local(g))`` (it runs the local attention and its backward and returns the
    output and a dict of what it recorded) against serial SDPA on the full tensors; per
    case that dict plus ``diffs``: the max relative differences of out, dq, dk, dv."""
    out = {}
    for kv_heads in KV_HEADS:
        q, k, v, g = _inputs(kv_heads)
        for causal in (False, True):
            for padded in (False, True):
                mask = _padding() if padded else None
                full = [t.clone().requires_grad_() for t in (q, k, v)]
                ref = attention(*full, D, causal=causal, key_padding_mask=mask)
                ref.backward(g)
                local = [layout.local(t).detach().clone().requires_grad_() for t in (q, k, v)]
                res, record = run(local, causal, mask, layout.local(g))
                record['diffs'] = ([max_rel_diff(res.detach(), layout.local(ref.detach()))]
                                   + [max_rel_diff(lt.grad, layout.local(ft.grad))
                                      for lt, ft in zip(local, full)])
                out[kv_heads, causal, padded] = record
    return out


def _ring_worker(rank):
    layout = sequence_layout()

    def run(local, causal, mask, grad):
        hooks, saved = _record_saved()
        with comm_profile() as stats, record_blocks() as blocks:
            with hooks:
                res = ring_attention(*local, D, layout, causal=causal, key_padding_mask=mask)
            res.backward(grad)
        return res, dict(
            sent=stats.bytes(ParallelMode.SEQUENCE, 'send'),
            received=stats.bytes(ParallelMode.SEQUENCE, 'recv'),
            other=stats.bytes() - stats.bytes(ParallelMode.SEQUENCE),
            saved=saved,
            forward=[(a, b) for phase, a, b in blocks if phase == 'forward'],
            backward=[(a, b) for phase, a, b in blocks if phase == 'backward'],
            planned=chunk_pairs(layout, causal))
    return attention_cases(layout, run)


LAYOUTS = [(2, True), (4, True), (2, False), (4, False)]


@pytest.fixture(scope='module', params=LAYOUTS, ids=[f'P{p}-{"zigzag" if z else "contiguous"}'
                                                    for p, z in LAYOUTS])
def ring(request):
    p, zigzag = request.param
    return p, zigzag, run_distributed(_ring_worker, p, seq_config(p, zigzag), timeout=300)


def test_ring_matches_serial_sdpa_out_dq_dk_dv(ring):
    """Every case (MHA, GQA 4:2, MQA 4:1; causal or not; with or without a key padding mask
    that leaves a causal query with no key): out, dq, dk, dv equal serial SDPA."""
    _, _, results = ring
    for rank, res in enumerate(results):
        for case, r in res.items():
            assert max(r['diffs']) <= TOL, (rank, case, 'out, dq, dk, dv', r['diffs'])


def test_ring_bytes_are_kv_heads_only(ring):
    """(P-1) exchanges of [k; v] forward, (P-1) of [k; v] and (P-1) of the fp32 [dk; dv]
    backward: 6 (P-1) b (s/P) n_kv d * 4 bytes, only the n_kv heads travel."""
    p, _, results = ring
    for res in results:
        for (kv_heads, _, _), r in res.items():
            expected = 6 * (p - 1) * B * (S // p) * kv_heads * D * 4
            assert r['sent'] == r['received'] == expected
            assert r['other'] == 0


def test_ring_saves_no_full_sequence_tensor(ring):
    """Structural memory: every tensor saved for backward is O(s/P) -- q, k, v, out
    ``[b, s/P, .]``, the log-sum-exp ``[b, n, s/P]`` fp32 and the key padding mask as
    ``[b, C, s/C]`` booleans; none has a dimension of size s (no ``[s/P, s]`` scores)."""
    p, zigzag, results = ring
    chunks = 2 * p if zigzag else p
    for res in results:
        for (kv_heads, _, padded), r in res.items():
            shapes = [shape for shape, _ in r['saved']]
            assert all(S not in shape for shape in shapes), shapes
            s_l = S // p
            expected = 4 * (2 * B * s_l * HEADS * D + 2 * B * s_l * kv_heads * D
                            + B * HEADS * s_l) + (B * S if padded else 0)
            assert sum(nbytes for _, nbytes in r['saved']) == expected, r['saved']
            if padded:
                assert (B, chunks, S // chunks) in shapes


def test_causal_work_is_balanced_under_zigzag(ring):
    """Chunk pairs computed per rank (recorded while running) under a causal mask: zigzag
    gives every rank 2P+1 pairs of (s/2P)^2 (max/mean = 1); contiguous blocks give rank r
    r+1 blocks of (s/P)^2, max/mean = P / ((P+1)/2)."""
    p, zigzag, results = ring
    work = []
    for rank, res in enumerate(results):
        r = res[2, True, False]
        assert sorted(r['forward']) == sorted(r['backward']) == sorted(r['planned'])
        pairs = len(r['forward'])
        assert pairs == (2 * p + 1 if zigzag else rank + 1)
        work.append(pairs * (1 if zigzag else 4))             # in units of (s/2P)^2
        assert len(res[2, False, False]['forward']) == (4 * p if zigzag else p)
    ratio = max(work) / (sum(work) / len(work))
    assert ratio == (1.0 if zigzag else p / ((p + 1) / 2))


# ----------------------------------------------------------------- the layout alone
def _axis(p, rank):
    return ProcessGroupAxis(ParallelMode.SEQUENCE, None, tuple(range(p)), rank, p)


@pytest.mark.parametrize('p', [2, 4, 8])
def test_zigzag_chunks_positions_and_orders(p):
    s = 4 * p
    layouts = [SequenceLayout(_axis(p, r), zigzag=True) for r in range(p)]
    assert [lay.chunks_of() for lay in layouts] == [(r, 2 * p - 1 - r) for r in range(p)]
    x = torch.arange(s).view(1, s) * 10
    parts = [lay.local(x) for lay in layouts]
    for lay, part in zip(layouts, parts):
        assert torch.equal(part[0] // 10, lay.positions(s))
    gathered = torch.cat(parts, 1)                        # what an all_gather returns
    assert torch.equal(layouts[0].serial_order(gathered), x)
    assert torch.equal(layouts[0].ring_order(x), gathered)
    assert layouts[0].owner(0, s) == (0, 0)
    pairs = [len(chunk_pairs(lay, causal=True)) for lay in layouts]
    assert pairs == [2 * p + 1] * p
    contiguous = [len(chunk_pairs(SequenceLayout(_axis(p, r), zigzag=False), True))
                  for r in range(p)]
    assert contiguous == list(range(1, p + 1))


def test_zigzag_length_not_divisible_by_2p_raises():
    layout = SequenceLayout(_axis(4, 1), zigzag=True)
    with pytest.raises(ValueError) as info:
        layout.check(20)                                   # divisible by P=4, not by 2P=8
    message = str(info.value)
    assert '20' in message and '2P = 8' in message and 'tensor.zigzag=False' in message
    assert SequenceLayout(_axis(4, 1), zigzag=False).check(20) == 5
    q = torch.zeros(B, 5, HEADS * D)
    with pytest.raises(ValueError, match='tensor.zigzag=False'):
        ring_attention(q, q, q, D, layout)                 # raised before any exchange


# ----------------------------------------------------------------- dropout: exact gradient
@contextlib.contextmanager
def _fixed_stream(rank):
    """The same dropout seed at every call (a deterministic function to differentiate)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(100 + rank)
        yield


def _dropout_worker(rank):
    """Directional derivatives of L = sum_ranks <out_r, g_r> (float64, every rank perturbing
    its q, k, v together) equal <grad, u> from the ring's backward, with dropout p=0.3."""
    layout = sequence_layout()
    axis = gpc.axis(ParallelMode.SEQUENCE)
    q, k, v, g = (layout.local(t) for t in _inputs(2, torch.float64))
    mask = _padding()

    def loss(q_, k_, v_, p=0.3):
        out = ring_attention(q_, k_, v_, D, layout, causal=True, key_padding_mask=mask,
                             dropout_p=p, rng=lambda: _fixed_stream(rank))
        return (out * g).sum(), out       # this rank's share of L

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    share, out = loss(*leaves)
    share.backward()                      # the ring's backward: d L / d (own q, k, v)
    with torch.no_grad():
        again = loss(q, k, v)[1]
        plain = loss(q, k, v, p=0.0)[1]
        gen = torch.Generator().manual_seed(7 + rank)
        checks = []
        for _ in range(3):
            u = [torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in (q, k, v)]
            eps = 1e-6
            up = C.all_reduce(loss(*(t + eps * d for t, d in zip((q, k, v), u)))[0], axis)
            down = C.all_reduce(loss(*(t - eps * d for t, d in zip((q, k, v), u)))[0], axis)
            numeric = float((up - down) / (2 * eps))
            analytic = C.all_reduce(sum((leaf.grad * d).sum() for leaf, d in zip(leaves, u)),
                                    axis)
            checks.append((numeric, float(analytic)))
    return dict(checks=checks, repeat=float((again - out.detach()).abs().max()),
                changed=float((plain - out.detach()).abs().max()))


def test_dropout_backward_is_the_exact_gradient_of_its_forward():
    for res in run_distributed(_dropout_worker, 2, seq_config(2), timeout=300):
        assert res['repeat'] == 0.0              # each block's mask is regenerated identically
        assert res['changed'] > 1e-3             # dropout did drop something
        for numeric, analytic in res['checks']:
            assert abs(numeric - analytic) <= 1e-6 * max(1.0, abs(analytic)), res['checks']


# ----------------------------------------------------------------- key tiles
def _tiled(worker, tile):
    """``worker`` with the ring's key tile set to ``tile`` (on this rank)."""
    def run(rank):
        from colossal_lite.nn.sequence import ring
        ring.KEY_TILE = tile
        return worker(rank)
    return run


def _tiled_ring_worker(rank, tile):
    return _tiled(_ring_worker, tile)(rank)


def _tiled_dropout_worker(rank, tile):
    return _tiled(_dropout_worker, tile)(rank)


def test_key_tiles_narrower_than_a_chunk_pair_equal_serial():
    """With key tiles of 5 keys (chunks of 3: tiles cut chunks and chunk pairs unevenly,
    the last one shorter) every case still equals serial SDPA, and dropout's backward is
    the exact gradient of its forward (each tile's mask regenerated)."""
    for res in run_distributed(_tiled_ring_worker, 4, seq_config(4), 5, timeout=300):
        for case, r in res.items():
            assert max(r['diffs']) <= TOL, (case, r['diffs'])
    for res in run_distributed(_tiled_dropout_worker, 2, seq_config(2), 5, timeout=300):
        assert res['repeat'] == 0.0 and res['changed'] > 1e-3
        for numeric, analytic in res['checks']:
            assert abs(numeric - analytic) <= 1e-6 * max(1.0, abs(analytic)), res['checks']


# ----------------------------------------------------------------- whole models
def _gpt_length_error(rank):
    try:  # 22 tokens: divisible by P=2 but not by 2P=4 -- raised before any collective
        with comm_profile() as stats:
            GPT.from_preset('tiny')(torch.zeros(2, 22, dtype=torch.long))
        return None, stats.calls()
    except ValueError as err:
        return str(err), stats.calls()


def test_model_with_length_not_divisible_by_2p_raises_before_any_collective():
    for message, calls in run_distributed(_gpt_length_error, 2, seq_config(2), timeout=120):
        assert message is not None and '22' in message and 'tensor.zigzag=False' in message
        assert calls == 0


MODEL_BATCH = dict(batch=2, seq=16)


@pytest.mark.parametrize('family,p', [('gpt', 2), ('llama', 2), ('llama', 4)])
def test_models_with_zigzag_ring_match_serial(family, p):
    """GPT tiny (causal, learned positions) and Llama tiny (heads=4, kv_heads=2: GQA in the
    ring; rotary tables of each rank's zigzag positions) under zigzag sequence parallelism:
    loss, outputs, every parameter's gradient and 3 AdamW steps equal the serial model."""
    states, expected = serial_traces((family,), MODEL_BATCH)
    results = run_distributed(rank_traces, p, seq_config(p), states, MODEL_BATCH, timeout=300)
    assert_matches_serial([r[family] for r in results], expected[family], TOL)
