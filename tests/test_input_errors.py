"""Bad inputs fail the same way on every rank, before any collective: out-of-range labels
and token ids, and logits that lost their classifier layout (sliced, detached)."""
import pytest
import torch

import colossal_lite.nn as col_nn
from colossal_lite.communication import comm_profile
from colossal_lite.testing import run_distributed

from tests.model_cases import make_case

LAYOUTS = {
    '1d': (2, dict(tensor=dict(size=2, mode='1d'))),
    '2d': (4, dict(tensor=dict(size=4, mode='2d'))),
    'sequence': (2, dict(tensor=dict(size=2, mode='sequence'))),
}


def _outcome(fn):
    """(exception type, message, collectives issued before it) -- or 'ok'."""
    with comm_profile() as stats:
        try:
            fn()
        except (IndexError, ValueError) as err:
            return type(err).__name__, str(err), stats.calls()
    return 'ok', '', stats.calls()


def _bad_inputs(rank):
    build, (ids,), labels, build_loss = make_case('gpt')
    torch.manual_seed(0)
    model = build()
    loss = build_loss()
    bad_ids = ids.clone()
    bad_ids[-1, -1] = 256                      # one token past the vocabulary, on one rank's block
    bad_labels = labels.clone()
    bad_labels[-1, -1] = 300
    logits = model(ids)
    return {
        'id': _outcome(lambda: model(bad_ids)),
        'label': _outcome(lambda: col_nn.CrossEntropyLoss()(logits, bad_labels)),
        'sliced': _outcome(lambda: col_nn.CrossEntropyLoss()(logits[:, :-1], labels[:, 1:])),
        'detached': _outcome(lambda: col_nn.gather_logits(logits.detach())),
    }


@pytest.mark.parametrize('mode', list(LAYOUTS))
def test_bad_inputs_raise_on_every_rank_before_communicating(mode):
    world, parallel = LAYOUTS[mode]
    results = run_distributed(_bad_inputs, world, dict(parallel=parallel), timeout=300,
                              collective_timeout=30)
    for rank, out in enumerate(results):
        kind, message, calls = out['id']
        assert (kind, calls) == ('IndexError', 0), (rank, out['id'])
        assert 'index 256 is out of range for 256 embeddings' in message
        kind, message, calls = out['label']
        assert (kind, calls) == ('IndexError', 0), (rank, out['label'])
        assert 'target 300 is out of bounds for 256 classes' in message
        assert out['sliced'][0] == 'ValueError' and out['sliced'][2] == 0, (rank, out['sliced'])
        if mode != 'sequence':  # sequence logits are whole-vocabulary: a detached copy is fine
            assert out['detached'][0] == 'ValueError', (rank, out['detached'])
            assert 'lost their layout' in out['detached'][1]


def test_serial_loss_on_sliced_logits_still_works():
    """Without tensor parallelism nothing is split, so untagged logits are whole."""
    build, (ids,), labels, _ = make_case('gpt')
    logits = build()(ids)
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 256),
                                                 labels[:, 1:].reshape(-1))
    assert torch.allclose(col_nn.CrossEntropyLoss()(logits[:, :-1], labels[:, 1:]), expected)


def _indivisible_heads(rank):
    from model_zoo import GPT
    with comm_profile() as stats:
        try:
            GPT.from_preset('tiny', heads=1, hidden=32)
        except ValueError as err:
            return str(err), stats.calls()
    return 'built', stats.calls()


@pytest.mark.parametrize('mode', ['1d', '2d'])
def test_heads_not_divisible_by_the_split_fail_at_construction(mode):
    world, parallel = LAYOUTS[mode]
    for message, calls in run_distributed(_indivisible_heads, world, dict(parallel=parallel),
                                          timeout=300):
        assert '1 attention heads cannot be divided among the 2 ranks' in message
        assert calls == 0
