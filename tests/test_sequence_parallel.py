"""Sequence parallelism equals the serial model: ring attention, BERT and GPT, with data parallelism.

Formulas asserted here are the ones of docs/sequence_parallel.md.
"""
from __future__ import annotations

import pytest
import torch

from colossal_lite.communication import all_reduce, comm_profile
from colossal_lite.context import ParallelMode, global_context as gpc
from colossal_lite.engine import allreduce_gradients
from colossal_lite.nn import gather_logits
from colossal_lite.nn.functional import attention
from colossal_lite.tensor import gather_full
from colossal_lite.formulas import ring_attention_bytes, ring_attention_saved_bytes
from colossal_lite.testing import max_rel_diff, run_distributed

B, S, H, HEADS = 2, 16, 32, 4          # ring attention case: batch, sequence, hidden, heads
TOL = 1e-5


def seq_config(p):
    return dict(parallel=dict(tensor=dict(mode='sequence', size=p)))


def rel_diff(a, b) -> float:  # NaN-safe: see colossal_lite.testing.max_rel_diff
    """max |a - b| / max(1, max |b|): the fp32 comparison measure."""
    return max_rel_diff(a, b)


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
            diffs=[rel_diff(res.detach(), local_block(ref.detach(), axis))]      # out, dq, dk, dv
                  + [rel_diff(lt.grad, local_block(ft.grad, axis)) for lt, ft in zip(local, full)],
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
def make_batch(b=4, s=16, vocab=256):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.long)
    mask[1, -3:] = 0
    mask[3, -2:] = 0
    mlm = torch.full((b, s), -100, dtype=torch.long)
    # masked positions crowd the first quarter: ranks get 4, 2, 0, 1 (+1 on one rank)
    for pos in (0, 1, 2, 3, 4, 5, 12):
        mlm[:, pos] = ids[:, pos]
    mlm[0, 8] = ids[0, 8]   # one extra per data half keeps the halves' counts equal
    mlm[2, 10] = ids[2, 10]
    nsp = torch.tensor([0, 1, 1, 0])
    images = torch.randn(b, 1, 6, 6, generator=g)   # 9 patches + class token = 10 tokens
    return dict(ids=ids, mask=mask, mlm=mlm, nsp=nsp, images=images, classes=nsp + 3)


def build(family):
    from model_zoo import BERT, GPT, BertPretrainingLoss, GPTLMLoss, ViT
    from colossal_lite.nn import CrossEntropyLoss
    if family == 'bert':
        return BERT.from_preset('tiny'), BertPretrainingLoss()
    if family == 'vit':
        return ViT.from_preset('tiny', img_size=6), CrossEntropyLoss()
    return GPT.from_preset('tiny'), GPTLMLoss()


def train(family, model, criterion, batch, steps=3):
    """``steps`` AdamW steps; loss, full logits and full gradients of the first step."""
    # eps=1e-6: a key bias has a zero gradient in exact arithmetic (softmax ignores it), so
    # Adam must not blow rounding noise up to lr-sized steps
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, eps=1e-6)
    first = None
    for step in range(steps):
        opt.zero_grad()
        if family == 'bert':
            out = model(batch['ids'], attention_mask=batch['mask'])
            loss = criterion(out, batch['mlm'], batch['nsp'])
            logits = [gather_logits(t).detach() for t in out]
        elif family == 'vit':   # class token on sequence rank 0, replicated class logits
            out = model(batch['images'])
            loss = criterion(out, batch['classes'])
            logits = [gather_logits(out).detach()]
        else:
            out = model(batch['ids'])
            loss = criterion(out, batch['ids'])
            logits = [gather_logits(out).detach()]
        loss.backward()
        allreduce_gradients(model.parameters())
        if step == 0:
            first = dict(loss=loss.detach(), logits=logits,
                         grads={n: gather_full(p.grad, p) for n, p in model.named_parameters()})
        opt.step()
    return dict(first, params=model.state_dict())


def worst(got: dict, ref: dict):
    """(largest relative difference, its key) over the serial model's keys."""
    if got.keys() != ref.keys():
        return float('inf'), sorted(set(got) ^ set(ref))
    return max((rel_diff(got[k], ref[k]), k) for k in ref)


def _train_worker(rank, family, state, batch, serial):
    """Train the sequence-parallel model; return its differences from the serial run
    (plain floats: tensors would travel through shared memory the child may release)."""
    model, criterion = build(family)
    model.load_state_dict(state)
    dp = gpc.axis(ParallelMode.DATA)
    local = {k: v.chunk(dp.size, 0)[dp.rank] for k, v in batch.items()}
    res = train(family, model, criterion, local)
    mean_loss = all_reduce(res['loss'], dp) / dp.size   # DATA replicas: mean of equal halves
    return dict(loss=rel_diff(mean_loss, serial['loss']),
                logits=[rel_diff(got, ref.chunk(dp.size, 0)[dp.rank])
                        for got, ref in zip(res['logits'], serial['logits'])],
                grads=worst(res['grads'], serial['grads']),
                params=worst(res['params'], serial['params']))


def _serial(family, batch):
    torch.manual_seed(0)
    model, criterion = build(family)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return state, train(family, model, criterion, batch)


def _models_worker(rank, states, batch, serial):
    return {f: _train_worker(rank, f, states[f], batch, serial[f]) for f in states}


def check_against_serial(results, family):
    for rank, res in enumerate(results):
        assert res['loss'] <= TOL, (family, rank, res['loss'])
        assert max(res['logits']) <= TOL, (family, rank, res['logits'])
        assert res['grads'][0] <= TOL, (family, rank, 'grad', res['grads'])
        assert res['params'][0] <= TOL, (family, rank, 'param after 3 AdamW steps', res['params'])


@pytest.mark.parametrize('world,config,families', [
    (2, seq_config(2), ('bert', 'gpt', 'vit')),
    (4, seq_config(4), ('bert', 'gpt')),
    (4, dict(parallel=dict(data=2, tensor=dict(mode='sequence', size=2))), ('bert', 'gpt')),
], ids=['P2', 'P4', 'dp2xP2'])
def test_models_match_serial(world, config, families):
    """BERT (padding mask, uneven MLM labels, NSP via first_token), GPT (causal) and, at P=2,
    ViT (class token) equal the serial model: loss, logits, gradients, 3 AdamW steps."""
    batch = make_batch()
    states, serial = {}, {}
    for family in families:
        states[family], serial[family] = _serial(family, batch)
    results = run_distributed(_models_worker, world, config, states, batch, serial, timeout=300)
    for family in families:
        check_against_serial([r[family] for r in results], family)
