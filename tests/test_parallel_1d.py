"""1D layers alone equal serial torch layers; exact communication of one MLP block."""
import pytest
import torch
import torch.nn.functional as F

import colossal_lite.nn as col_nn
from colossal_lite.communication import comm_profile
from colossal_lite.context import ParallelMode as PM
from colossal_lite.nn.parallel_1d import (Classifier1D, ColumnLinear1D, Dropout1D, Embedding1D,
                                          RowLinear1D, VocabParallelClassifier1D,
                                          VocabParallelEmbedding1D)
from colossal_lite.formulas import mlp_1d_bytes
from colossal_lite.tensor import placement_of
from colossal_lite.testing import Trace, assert_matches_serial, full_gradients, run_distributed

B, S, H, V = 2, 4, 8, 16


def _x():
    return torch.randn(B, S, H, generator=torch.Generator().manual_seed(5))


def _ids():
    return torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(6))


def _run_layer(module, inp, loss_of=lambda y: (y * y).sum() / 2, autocast=None):
    """Forward (under ``autocast`` to that dtype), a fixed loss, backward as a one-step
    trace: the full output, the input's gradient, every full gradient, the full state."""
    if inp.is_floating_point():
        inp = inp.clone().requires_grad_()
    torch.manual_seed(0)
    with torch.autocast('cpu', dtype=autocast, enabled=autocast is not None):
        y = module(inp)
    if placement_of(y) is not None:  # classifier logits: the full serial logits
        y = col_nn.gather_logits(y)
    loss_of(y).backward()
    record = {'output.0': y.detach()}
    if inp.is_floating_point():
        record['input_grad.0'] = inp.grad
    record.update({f'grad:{k}': g for k, g in full_gradients(module).items()})
    record.update({f'param:{k}': v for k, v in module.state_dict().items()})
    return Trace([record])


def _layers():
    torch.manual_seed(0)
    emb = VocabParallelEmbedding1D(V, H)
    return {
        'column': (ColumnLinear1D(H, 2 * H, gather_output=True), _x()),
        'row': (RowLinear1D(H, 2 * H, input_is_parallel=False), _x()),
        'vocab_embedding': (emb, _ids()),
        'embedding': (Embedding1D(V, H, padding_idx=3), _ids()),
        'vocab_classifier_tied': (VocabParallelClassifier1D(H, V, weight=emb.weight, bias=True), _x()),
        'classifier': (Classifier1D(H, 5), _x()),
    }


def _all_layers(rank):
    return {name: _run_layer(module, inp) for name, (module, inp) in _layers().items()}


@pytest.mark.parametrize('tp', [2, 4])
def test_each_1d_layer_equals_serial(tp):
    expected = _all_layers(0)  # serial: no context launched, one-rank groups
    config = dict(parallel=dict(tensor=dict(size=tp, mode='1d')))
    results = run_distributed(_all_layers, tp, config, timeout=300)
    for name, trace in expected.items():
        assert_matches_serial([r[name] for r in results], trace, dict(param=0.0, default=1e-6))


def _mlp_block_counts(rank):
    torch.manual_seed(0)
    fc1 = col_nn.Linear(H, 4 * H, region='enter')
    fc2 = col_nn.Linear(4 * H, H, region='exit')
    x = _x().requires_grad_()
    with comm_profile() as stats:
        fc2(F.gelu(fc1(x))).sum().backward()
    return {op: (stats.calls(PM.PARALLEL_1D, op), stats.bytes(PM.PARALLEL_1D, op),
                 stats.wire_bytes(PM.PARALLEL_1D, op)) for op in ('all_reduce', 'all_gather')}, \
        stats.calls()


@pytest.mark.parametrize('p', [2, 4])
def test_mlp_block_communication_matches_formula(p):
    """docs/parallel_1d.md: forward all_reduce of y and backward all_reduce of dx,
    each b*s*h fp32 elements; ring wire bytes 2 * 2(p-1)/p * 4bsh."""
    config = dict(parallel=dict(tensor=dict(size=p, mode='1d')))
    for counts, total_calls in run_distributed(_mlp_block_counts, p, config, timeout=300):
        nbytes = mlp_1d_bytes(p, B, S, H)
        assert counts['all_reduce'] == (2, nbytes, 2 * (p - 1) / p * nbytes)
        assert counts['all_gather'] == (0, 0, 0)
        assert total_calls == 2


def _dropout_masks(rank):
    x = torch.ones(4, 64)
    torch.manual_seed(123)
    outside = Dropout1D(0.5, inside_region=False)(x)
    inside = Dropout1D(0.5, inside_region=True)(x)
    return outside, inside


def test_dropout_masks_agree_when_replicated_and_differ_when_sharded():
    config = dict(parallel=dict(tensor=dict(size=2, mode='1d')))
    (out0, in0), (out1, in1) = run_distributed(_dropout_masks, 2, config, timeout=300)
    torch.manual_seed(123)
    serial = F.dropout(torch.ones(4, 64), 0.5, True)
    assert torch.equal(out0, out1) and torch.equal(out0, serial)
    assert not torch.equal(in0, in1)
    assert (in0 == 0).any() and (in0 == 2).any()


def _bad_shapes(rank):
    errors = []
    for build in (lambda: ColumnLinear1D(8, 6), lambda: RowLinear1D(6, 8),
                  lambda: VocabParallelEmbedding1D(10, 8), lambda: col_nn.Linear(8, 6, region='sideways')):
        try:
            build()
        except ValueError as err:
            errors.append(str(err))
    return errors


def test_divisibility_errors_name_the_numbers():
    config = dict(parallel=dict(tensor=dict(size=4, mode='1d')))
    errors = run_distributed(_bad_shapes, 4, config, timeout=300)[0]
    assert errors == [
        'Linear out_features (1D column split) = 6 must be divisible by the group size 4',
        'Linear in_features (1D row split) = 6 must be divisible by the group size 4',
        'VocabParallelEmbedding num_embeddings = 10 must be divisible by the group size 4',
        "Linear region must be 'enter', 'exit' or None, got 'sideways'",
    ]


def _load_wrong_shape(rank):
    layer = ColumnLinear1D(H, 2 * H)
    result = layer.load_state_dict({'weight': torch.zeros(H, H), 'bias': torch.zeros(2 * H)},
                                   strict=False)
    return result


def test_load_state_dict_rejects_a_wrong_full_shape():
    config = dict(parallel=dict(tensor=dict(size=2, mode='1d')))
    with pytest.raises(Exception, match=r"expected the full \(serial\) tensor"):
        run_distributed(_load_wrong_shape, 2, config, timeout=300)


def _column_under_autocast(rank):
    torch.manual_seed(0)
    layer = ColumnLinear1D(H, 2 * H, gather_output=True)
    return _run_layer(layer, _x(), lambda y: (y.float() ** 2).sum(), autocast=torch.bfloat16)


def test_column_linear_under_bf16_autocast_equals_serial():
    """The overlapped backward casts like autocast: same bf16 results as the serial layer;
    gradients in fp32 like the weights."""
    expected = _column_under_autocast(0)
    config = dict(parallel=dict(tensor=dict(size=2, mode='1d')))
    results = run_distributed(_column_under_autocast, 2, config, timeout=300)
    assert_matches_serial(results, expected, dict(output=1e-2, input_grad=2e-2, grad=2e-2,
                                                  param=0.0))
    for trace in results:
        assert all(v.dtype == torch.float32 for k, v in trace[0].items() if k != 'output.0')
