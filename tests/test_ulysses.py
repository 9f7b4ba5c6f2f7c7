"""Ulysses attention and the ring x Ulysses hybrid (mode 'ulysses') equal serial attention.

Attention level: out, dq, dk, dv of ``ulysses_attention`` against serial SDPA for MHA, GQA and
MQA (kv heads split over U, or repeated when fewer than U), causal or not, with or without a
key padding mask, at U=2, U=4, and R=2 x U=2 with zigzag and contiguous ring chunks; the
all_to_all bytes are ``formulas.ulysses_attention_bytes`` and the ring's are its own formula.
Model level: GPT and Llama (GQA) train 3 AdamW steps equal to serial. Config and head errors
name the numbers before any collective.
"""
from __future__ import annotations

import pytest
import torch

from colossal_lite import formulas
from colossal_lite.communication import comm_profile
from colossal_lite.config import ConfigError, load_config, parse_parallel
from colossal_lite.context import ParallelMode
from colossal_lite.context.layout import build_groups
from colossal_lite.nn.sequence import (SequenceLayout, sequence_axis, sequence_layout,
                                       ulysses_attention)
from colossal_lite.testing import assert_matches_serial, run_distributed

from tests.model_cases import rank_traces, serial_traces
from tests.test_ring_attention import B, D, HEADS, S, TOL, attention_cases


def ulysses_config(p, ring=1, zigzag=True):
    return dict(parallel=dict(tensor=dict(mode='ulysses', size=p, ring=ring, zigzag=zigzag)))


# ----------------------------------------------------------------- attention vs serial SDPA
def _ulysses_worker(rank):
    layout = sequence_layout()
    ulysses = sequence_axis(ParallelMode.ULYSSES)
    ring = SequenceLayout.of(sequence_axis(ParallelMode.SEQUENCE_RING))

    def run(local, causal, mask, grad):
        with comm_profile() as stats:
            res = ulysses_attention(*local, D, ulysses, ring, causal=causal,
                                    key_padding_mask=mask)
            res.backward(grad)
        return res, dict(
            all_to_all=stats.bytes(ParallelMode.ULYSSES, 'all_to_all'),
            ring=stats.bytes(ParallelMode.SEQUENCE_RING, 'send'),
            other=stats.bytes() - stats.bytes(ParallelMode.ULYSSES)
            - stats.bytes(ParallelMode.SEQUENCE_RING))
    return attention_cases(layout, run)


LAYOUTS = [(2, 1, True), (4, 1, True), (4, 2, True), (4, 2, False)]


@pytest.fixture(scope='module', params=LAYOUTS,
                ids=[f'P{p}-R{r}-{"zigzag" if z else "contiguous"}' for p, r, z in LAYOUTS])
def ulysses(request):
    p, ring, zigzag = request.param
    return p, ring, run_distributed(_ulysses_worker, p, ulysses_config(p, ring, zigzag),
                                    timeout=300)


def test_ulysses_matches_serial_sdpa_out_dq_dk_dv(ulysses):
    """MHA, GQA 4:2 and MQA 4:1 (kv heads repeated to U where fewer), causal or not, with
    or without a padding mask that leaves a causal query no key: out, dq, dk, dv equal
    serial SDPA on every rank."""
    _, _, results = ulysses
    for rank, res in enumerate(results):
        for case, r in res.items():
            assert max(r['diffs']) <= TOL, (rank, case, 'out, dq, dk, dv', r['diffs'])


def test_ulysses_bytes_follow_the_formulas(ulysses):
    """all_to_all over ULYSSES: q, out and the stacked k, v twice (forward, backward) =
    ``ulysses_attention_bytes``; with R > 1 the ring sends ``ring_attention_bytes`` of the
    ``s/R`` block's ``n'/U`` kv heads; nothing else communicates."""
    p, ring, results = ulysses
    u = p // ring
    for res in results:
        for (kv_heads, _, _), r in res.items():
            assert r['all_to_all'] == formulas.ulysses_attention_bytes(p, u, B, S, HEADS,
                                                                       kv_heads, D)
            local_kv = max(kv_heads, u) // u
            assert r['ring'] == (formulas.ring_attention_bytes(ring, B, S, local_kv * D)
                                 if ring > 1 else 0)
            assert r['other'] == 0


# ----------------------------------------------------------------- layout and config
@pytest.mark.parametrize('ring,zigzag', [(1, True), (2, True), (2, False), (4, True)])
def test_hybrid_layout_gives_each_ulysses_group_its_ring_block(ring, zigzag):
    """The positions of ranks r*U .. r*U+U-1, concatenated, are ring rank r's block of a
    ring-only layout over R ranks (what the all_to_all reassembles); together all ranks
    hold every position once; ring_order / serial_order invert each other."""
    from colossal_lite.context import ProcessGroupAxis
    p, s = 8, 32
    u = p // ring

    def axis(size, rank):
        return ProcessGroupAxis(ParallelMode.SEQUENCE, None, tuple(range(size)), rank, size)
    full = [SequenceLayout(axis(p, r), zigzag, u) for r in range(p)]
    rings = [SequenceLayout(axis(ring, r), zigzag) for r in range(ring)]
    for r in range(ring):
        block = torch.cat([full[r * u + i].positions(s) for i in range(u)])
        assert torch.equal(block, rings[r].positions(s))
    everything = torch.cat([lay.positions(s) for lay in full])
    assert sorted(everything.tolist()) == list(range(s))
    x = torch.arange(s).view(1, s)
    assert torch.equal(full[0].serial_order(full[0].ring_order(x)), x)
    for r in range(p):
        assert torch.equal(full[r].local(x)[0], full[r].positions(s))
        for offset, pos in enumerate(full[r].positions(s).tolist()):
            assert full[0].owner(pos, s) == (r, offset)


def test_ulysses_groups_are_inner_and_ring_groups_outer():
    """tensor=dict(mode='ulysses', size=4, ring=2) on 8 ranks (data 2): ULYSSES groups are
    consecutive ranks, SEQUENCE_RING strides by U, SEQUENCE is the whole tensor axis and
    SEQUENCE_DP every rank."""
    layout = parse_parallel(dict(tensor=dict(mode='ulysses', size=4, ring=2))
                            ).with_world_size(8)
    groups = build_groups(layout)
    assert groups[ParallelMode.ULYSSES] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert groups[ParallelMode.SEQUENCE_RING] == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert groups[ParallelMode.SEQUENCE] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert groups[ParallelMode.SEQUENCE_DP] == [tuple(range(8))]
    assert (layout.ring_size, layout.ulysses_size) == (2, 2)


@pytest.mark.parametrize('tensor,needle', [
    (dict(mode='ulysses', size=4, ring=3), "'parallel.tensor.ring' = 3 must divide"),
    (dict(mode='sequence', size=4, ring=2), "applies only to mode 'ulysses'"),
    (dict(mode='1d', size=2, zigzag=True), "'parallel.tensor.zigzag' applies only"),
])
def test_config_errors_name_the_key(tensor, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(dict(parallel=dict(tensor=tensor)))


def _build_error(rank, model_kw):
    from model_zoo import Llama
    from colossal_lite.communication import comm_profile as profile
    with profile() as stats:
        try:
            Llama.from_preset('tiny', **model_kw)
            return None, stats.calls()
        except ValueError as err:
            return str(err), stats.calls()


@pytest.mark.parametrize('model_kw,needle', [
    (dict(heads=2, kv_heads=2), 'U = 4 ranks: it needs the heads (2)'),
    (dict(heads=12, kv_heads=3, hidden=96), 'kv heads (3) divisible by U = 4'),
])
def test_heads_the_ulysses_size_cannot_split_raise_before_any_collective(model_kw, needle):
    for message, calls in run_distributed(_build_error, 4, ulysses_config(4), model_kw,
                                          timeout=120):
        assert message is not None and needle in message, message
        assert calls == 0


# ----------------------------------------------------------------- models
MODEL_BATCH = dict(batch=2, seq=16)


@pytest.mark.parametrize('family,p,ring', [('gpt', 2, 1), ('llama', 2, 1), ('llama', 4, 1),
                                           ('llama', 4, 2)])
def test_models_under_ulysses_match_serial(family, p, ring):
    """GPT tiny and Llama tiny (heads 4, kv_heads 2: split at U=2, repeated at U=4; GQA in
    the hybrid's ring) under Ulysses and ring x Ulysses: loss, outputs, every gradient and
    3 AdamW steps equal the serial model."""
    states, expected = serial_traces((family,), MODEL_BATCH)
    results = run_distributed(rank_traces, p, ulysses_config(p, ring), states, MODEL_BATCH,
                              timeout=300)
    assert_matches_serial([r[family] for r in results], expected[family], TOL)
