"""Sequence parallelism equals the serial model: ring attention, BERT and GPT, with data parallelism.

Formulas asserted here are the ones of docs/sequence_parallel.md. The layout is zigzag by
default (``parallel.tensor.zigzag``); ViT's 1 + k^2 tokens never split into 2P chunks, so
its case runs the contiguous layout. tests/test_ring_attention.py tests the ring itself
(GQA, masks, dropout, memory, balance).
"""
from __future__ import annotations

import pytest
import torch

from colossal_lite.communication import comm_profile
from colossal_lite.context import ParallelMode, global_context as gpc
from colossal_lite.nn.functional import attention
from colossal_lite.formulas import ring_attention_bytes, ring_attention_saved_bytes
from colossal_lite.testing import assert_matches_serial, max_rel_diff, run_distributed

from tests.model_cases import rank_traces, serial_traces

B, S, H, HEADS = 2, 16, 32, 4          # ring attention case: batch, sequence, hidden, heads
TOL = 1e-5


def seq_config(p, zigzag=None):
    tensor = dict(mode='sequence', size=p)
    if zigzag is not None:
        tensor['zigzag'] = zigzag
    return dict(parallel=dict(tensor=tensor))


def saved_tensor_bytes(fn):
    """Bytes of the distinct storages autograd saves while running ``fn``."""
    storages = {}

    def pack(t):
        st = t.untyped_storage()
        storages[st.data_ptr()] = st.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(storages.values())


# ----------------------------------------------------------------- ring attention alone
def _ring_worker(rank):
    from colossal_lite.nn.sequence import local_block, ring_attention
    from model_zoo import BERT
    axis = gpc.axis(ParallelMode.SEQUENCE)
    torch.manual_seed(0)  # identical full tensors on every rank
    q, k, v, g = (torch.randn(B, S, H) for _ in range(4))
    pad = torch.ones(B, S)
    pad[1, -5:] = 0
    pad[0, 3] = 0
    cases = {'plain': (False, None), 'padding': (False, pad), 'causal': (True, None),
             'causal_padding': (True, pad)}
    out = {}
    for name, (causal, mask) in cases.items():
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = attention(*full, H // HEADS, causal=causal, key_padding_mask=mask)
        ref.backward(g)
        local = [local_block(t, axis).detach().clone().requires_grad_() for t in (q, k, v)]
        with comm_profile() as stats:
            res, saved = saved_tensor_bytes(
                lambda: ring_attention(*local, H // HEADS, axis, causal=causal,
                                       key_padding_mask=mask))
            res.backward(local_block(g, axis))
        out[name] = dict(
            diffs=[max_rel_diff(res.detach(), local_block(ref.detach(), axis))]      # out, dq, dk, dv
                  + [max_rel_diff(lt.grad, local_block(ft.grad, axis)) for lt, ft in zip(local, full)],
            send_bytes=stats.bytes(ParallelMode.SEQUENCE, 'send'),
            recv_bytes=stats.bytes(ParallelMode.SEQUENCE, 'recv'),
            other_bytes=stats.bytes() - stats.bytes(ParallelMode.SEQUENCE),
            saved=saved)
    from colossal_lite.nn import Dropout
    drop = Dropout(0.5)
    out['dropout_split'] = drop(torch.ones(B, S // axis.size, H)).eq(0).flatten().tolist()
    out['dropout_replicated'] = drop(torch.ones(B, H)).eq(0).flatten().tolist()
    try:  # 15 tokens over P ranks: must fail before any collective
        BERT.from_preset('tiny')(torch.zeros(2, S - 1, dtype=torch.long))
        out['error'] = None
    except ValueError as err:
        out['error'] = str(err)
    return out


@pytest.fixture(scope='module')
def ring_results():
    return run_distributed(_ring_worker, 4, seq_config(4), timeout=300)


@pytest.mark.parametrize('case', ['plain', 'padding', 'causal', 'causal_padding'])
def test_ring_attention_matches_serial_outputs_and_dq_dk_dv(ring_results, case):
    for rank, res in enumerate(ring_results):
        assert max(res[case]['diffs']) <= TOL, (rank, case, 'out, dq, dk, dv', res[case]['diffs'])


def test_ring_attention_bytes_equal_formula(ring_results):
    expected = ring_attention_bytes(4, B, S, H)
    for res in ring_results:
        for case in ('plain', 'padding', 'causal', 'causal_padding'):
            assert res[case]['send_bytes'] == expected
            assert res[case]['recv_bytes'] == expected
            assert res[case]['other_bytes'] == 0


def test_ring_attention_saved_activations_equal_formula(ring_results):
    for res in ring_results:
        assert res['plain']['saved'] == ring_attention_saved_bytes(4, B, S, H, HEADS)


def test_dropout_masks_independent_per_sequence_rank(ring_results):
    split = [tuple(r['dropout_split']) for r in ring_results]
    assert len(set(split)) == len(split)                 # [b, s/P, h] blocks: own stream
    replicated = [tuple(r['dropout_replicated']) for r in ring_results]
    assert len(set(replicated)) == 1                     # [b, h] per-sample: same on all ranks


def test_sequence_length_not_divisible_raises(ring_results):
    for res in ring_results:
        assert res['error'] is not None and 'divisible' in res['error']
        assert 'P=4' in res['error'] and str(S - 1) in res['error']


# ----------------------------------------------------------------- BERT and GPT vs serial
SEQ_BATCH = dict(batch=4, seq=16)   # BERT labels at positions 0..5 and 12: P=4 ranks hold 4, 2, 0, 1


@pytest.mark.parametrize('world,config,families', [
    (2, seq_config(2), ('bert', 'gpt')),
    (2, seq_config(2, zigzag=False), ('bert', 'gpt', 'vit')),
    (4, seq_config(4), ('bert', 'gpt')),
    (4, dict(parallel=dict(data=2, tensor=dict(mode='sequence', size=2))), ('bert', 'gpt')),
], ids=['P2', 'P2-contiguous', 'P4', 'dp2xP2'])
def test_models_match_serial(world, config, families):
    """BERT (padding mask, uneven MLM labels over the sequence ranks, NSP via first_token),
    GPT (causal) and, with contiguous blocks at P=2, ViT (class token: 1 + 9 patches of a
    6x6 image) equal the serial model: loss, logits, every gradient, parameters at each of
    3 AdamW steps. Zigzag (the default): the loss cuts the labels and gather_logits returns
    the logits in serial order."""
    case_kw = dict(SEQ_BATCH, img_size=6)
    states, expected = serial_traces(families, case_kw)
    results = run_distributed(rank_traces, world, config, states, case_kw, timeout=300)
    for family in families:
        assert_matches_serial([r[family] for r in results], expected[family], TOL)
