"""Packed documents (docs/llama.md, "Packed documents"): several documents in one row, told
apart by position ids that restart at 0; attention stays inside a document, the label of a
document's first token is ignored, and a KV-cached decode continues only the last document.

Specifications:

* ``pack_documents`` rows, positions and labels (-100 at each document start and padding);
* a packed batch's logits at each document's positions equal the document run alone
  (Llama, GPT), and they do not without ``packed=True`` (the mask is what makes them equal);
* the packed loss is the mean next-token loss over the documents' own tokens;
* KV-cached decoding of a packed prompt equals decoding its last document alone;
* ring attention with document ids equals serial attention with them (zigzag P=2), skips
  the chunk pairs sharing no document, and stays exact for ids that are not sorted;
* training on a packed batch (Llama and GPT, loss, every gradient, weights after 2 AdamW
  steps) equals the serial packed model in 1D t=2, 2D, 2.5D (d=2), 3D, sequence P=2
  (zigzag), Ulysses U=2 and ring x Ulysses (2 x 2); packed ``generate`` equals the last document's in the tensor layouts.
"""
from __future__ import annotations

import pytest
import torch

import colossal_lite as clt
import colossal_lite.nn as col_nn
from colossal_lite.data import pack_documents
from colossal_lite.generation import generate
from colossal_lite.nn.functional import attention, document_ids
from colossal_lite.nn.sequence import record_blocks, ring_attention, sequence_layout
from colossal_lite.testing import (assert_matches_serial, make_optimizer, max_rel_diff,
                                   run_distributed, training_trace)
from model_zoo import GPT, GPTLMLoss, Llama

MODELS = {'llama': Llama, 'gpt': GPT}
SEQ = 16
# next-fit into rows of 16: [5, 7, 3] + 1 pad, [9, 4, 3], [6, 6, 4], [3, 8, 5]; under zigzag
# P=2 (chunks of 4) query chunk 3 shares no document with key chunk 0 in any row
LENGTHS = (5, 7, 3, 9, 4, 3, 6, 6, 4, 3, 8, 5)
TOL = 1e-5


def _documents():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(1, 256, (n,), generator=g).tolist() for n in LENGTHS]


def _packed():
    return pack_documents(_documents(), SEQ)


def _spans():
    """(row, start, document) of every document in the packed rows."""
    out, row, col = [], 0, 0
    for doc in _documents():
        if col + len(doc) > SEQ:
            row, col = row + 1, 0
        out.append((row, col, doc))
        col += len(doc)
    return out


def _model(name, seed=0):
    torch.manual_seed(seed)
    return MODELS[name].from_preset('tiny', dropout=0.0)


# ----------------------------------------------------------------------------- data
def test_pack_documents_rows_positions_labels():
    ids, pos, labels = pack_documents([[1, 2, 3], [4, 5], [6, 7, 8, 9], [], [10]], 6)
    assert ids.tolist() == [[1, 2, 3, 4, 5, 0], [6, 7, 8, 9, 10, 0]]
    assert pos.tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 0]]
    assert labels.tolist() == [[-100, 2, 3, -100, 5, -100], [-100, 7, 8, 9, -100, -100]]
    assert document_ids(pos).tolist() == [[1, 1, 1, 2, 2, 3], [1, 1, 1, 1, 2, 3]]
    with pytest.raises(ValueError, match='more than seq_len 6'):
        pack_documents([[1] * 7], 6)
    assert pack_documents([[1] * 7], 6, truncate=True)[0].tolist() == [[1] * 6]


# --------------------------------------------------------------------- serial model
@pytest.mark.parametrize('name', list(MODELS))
def test_packed_logits_equal_each_document_alone(name):
    ids, pos, _ = _packed()
    model = _model(name).eval()
    with torch.no_grad():
        packed = model(ids, position_ids=pos, packed=True)
        unmasked = model(ids, position_ids=pos)        # same positions, no document mask
        diffs, unmasked_diffs = [], []
        for row, start, doc in _spans():
            alone = model(torch.tensor([doc]))[0]
            diffs.append(max_rel_diff(packed[row, start:start + len(doc)], alone))
            unmasked_diffs.append(max_rel_diff(unmasked[row, start:start + len(doc)], alone))
    assert max(diffs) <= TOL, diffs
    # a row's first document sees nothing else either way; every later one needs the mask
    later = [d for (_, start, _), d in zip(_spans(), unmasked_diffs) if start > 0]
    assert min(later) > 1e-3, unmasked_diffs


def test_packed_loss_is_the_mean_over_each_documents_own_targets():
    """GPTLMLoss on pack_documents' labels = sum over documents of their next-token losses
    (targets inside the document only) / their number: no document predicts the next one's
    first token, padding trains nothing, ignore_index is averaged out as in torch."""
    ids, pos, labels = _packed()
    model = _model('llama').eval()
    with torch.no_grad():
        loss = GPTLMLoss()(model(ids, position_ids=pos, packed=True), labels)
        total, count = 0.0, 0
        for _, _, doc in _spans():
            logits = model(torch.tensor([doc]))[0, :-1]
            total += torch.nn.functional.cross_entropy(logits, torch.tensor(doc[1:]),
                                                       reduction='sum').item()
            count += len(doc) - 1
    assert abs(loss.item() - total / count) <= 1e-5 * max(1.0, abs(loss.item()))


@pytest.mark.parametrize('name', list(MODELS))
def test_cached_decode_of_a_packed_prompt_continues_the_last_document(name):
    """Prefill row 0's three documents (packed) then 3 one-token steps through the KV cache:
    the logits equal those of the last document alone with its own cache; ``generate``
    with ``position_ids`` gives the last document's tokens."""
    ids, pos, _ = _packed()
    prompt, prompt_pos = ids[:1, :15], pos[:1, :15]
    last = torch.tensor([_spans()[2][2]])
    model = _model(name).eval()
    nxt = torch.tensor([[17], [42], [99]])
    with torch.no_grad():
        packed_cache, alone_cache = model.new_kv_cache(), model.new_kv_cache()
        got = [model(prompt, kv_cache=packed_cache, position_ids=prompt_pos, packed=True,
                     last_only=True)]
        want = [model(last, kv_cache=alone_cache, last_only=True)]
        for token in nxt:
            got.append(model(token[None], kv_cache=packed_cache, last_only=True))
            want.append(model(token[None], kv_cache=alone_cache, last_only=True))
        unmasked = model(prompt, kv_cache=model.new_kv_cache(), last_only=True)
    assert max(max_rel_diff(g, w) for g, w in zip(got, want)) <= TOL
    assert max_rel_diff(unmasked, want[0]) > 1e-3
    tokens = generate(model, prompt[0], 6, position_ids=prompt_pos[0])
    assert tokens[15:].tolist() == generate(model, last[0], 6)[last.shape[1]:].tolist()


def test_packed_needs_position_ids():
    model = _model('llama')
    with pytest.raises(ValueError, match='needs position_ids'):
        model(torch.zeros(1, 4, dtype=torch.long), packed=True)


# ------------------------------------------------------------ ring attention (P = 2)
def _ring_documents(rank):
    layout = sequence_layout()
    _, pos, _ = _packed()
    sorted_ids = document_ids(pos[:2])
    unsorted = torch.tensor([[0, 1, 0, 2, 1, 1, 2, 0, 2, 1, 0, 0, 1, 2, 2, 0]] * 2)
    g = torch.Generator().manual_seed(3)
    q, k, v, grad = [torch.randn(2, SEQ, w, generator=g) for w in (32, 16, 16, 32)]
    out = {}
    for case, docs in (('sorted', sorted_ids), ('unsorted', unsorted), ('none', None)):
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = attention(*full, 8, causal=True, document_ids=docs)
        ref.backward(grad)
        local = [layout.local(t).detach().clone().requires_grad_() for t in (q, k, v)]
        with record_blocks() as blocks:
            res = ring_attention(*local, 8, layout, causal=True, document_ids=docs)
            res.backward(layout.local(grad))
        out[case] = dict(
            diffs=[max_rel_diff(res.detach(), layout.local(ref.detach()))]
            + [max_rel_diff(lt.grad, layout.local(ft.grad)) for lt, ft in zip(local, full)],
            forward=sorted((a, b) for phase, a, b in blocks if phase == 'forward'),
            backward=sorted((a, b) for phase, a, b in blocks if phase == 'backward'))
    return out


def test_ring_document_mask_equals_serial_and_skips_disjoint_chunk_pairs():
    config = dict(parallel=dict(tensor=dict(mode='sequence', size=2, zigzag=True)))
    results = run_distributed(_ring_documents, 2, config)
    for rank, res in enumerate(results):
        for case, r in res.items():
            assert max(r['diffs']) <= TOL, (rank, case, r['diffs'])
            assert r['forward'] == r['backward'], (rank, case)
        assert res['unsorted']['forward'] == res['none']['forward']   # no skipping
    # rank 0 holds chunks 0 and 3: query chunk 3 shares no document with key chunk 0
    assert (3, 0) in results[0]['none']['forward']
    assert (3, 0) not in results[0]['sorted']['forward']
    assert set(results[0]['sorted']['forward']) < set(results[0]['none']['forward'])


# ------------------------------------------------------------------------ layouts
def _train(rank, generate_too=False, steps=2):
    """Per model: the engine's trace on the packed batch; with ``generate_too`` also the
    packed prompt's and the last document's generated tokens."""
    ids, pos, labels = _packed()
    batch = (dict(input_ids=ids, position_ids=pos, packed=True), labels)
    out = {}
    for name in MODELS:
        model = _model(name)
        engine, *_ = clt.initialize(model, make_optimizer(model.parameters()), GPTLMLoss())
        out[name] = training_trace(engine, batch, steps=steps)
        if generate_too:
            model.eval()
            last = torch.tensor(_spans()[2][2])
            out[name, 'generate'] = (generate(model, ids[0, :15], 4, position_ids=pos[0, :15])[15:],
                                     generate(model, last, 4)[len(last):])
    return out


@pytest.fixture(scope='module')
def serial():
    return run_distributed(_train, 1, {})[0]


LAYOUTS = {  # id: (world, parallel config, generate too)
    '1d': (2, dict(tensor=dict(size=2, mode='1d')), True),
    '2d': (4, dict(tensor=dict(size=4, mode='2d')), True),
    '2.5d': (8, dict(tensor=dict(size=8, mode='2.5d', depth=2)), True),
    '3d': (8, dict(tensor=dict(size=8, mode='3d')), True),
    'sequence-zigzag': (2, dict(tensor=dict(size=2, mode='sequence', zigzag=True)), False),
    'ulysses2': (2, dict(tensor=dict(size=2, mode='ulysses')), False),
    'ring2xulysses2': (4, dict(tensor=dict(size=4, mode='ulysses', ring=2)), False),
}


@pytest.mark.parametrize('layout', list(LAYOUTS))
def test_packed_training_equals_serial(serial, layout):
    world, parallel, gen = LAYOUTS[layout]
    results = run_distributed(_train, world, dict(parallel=parallel), gen, timeout=300)
    for name in MODELS:
        assert_matches_serial([r[name] for r in results], serial[name])
        if gen:
            for r in results:
                packed_tokens, alone_tokens = r[name, 'generate']
                assert packed_tokens.tolist() == alone_tokens.tolist(), (name, r)
