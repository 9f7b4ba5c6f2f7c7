"""The fused, head-aligned q/k/v projection (``col_nn.project_qkv``) equals the serial
unfused one (three linears) in every family that fuses it: 1D and sequence.

A tiny block ``dense(q * k + v)`` (an 'exit' linear closes the region, so the output is
the full tensor in 1D) is run fused under the layout and unfused serially, from the same
seeded weights: output, input gradient and every parameter's gradient must agree.
"""
import pytest
import torch
from torch import nn

import colossal_lite.nn as col_nn
from colossal_lite.communication import comm_profile
from colossal_lite.context import ParallelMode as PM, global_context as gpc
from colossal_lite.nn.parallel_1d import ColumnLinear1D, qkv_1d
from colossal_lite.testing import (Trace, assert_close_dict, assert_matches_serial,
                                   full_gradients, run_distributed)

B, S, H = 2, 4, 8
TOL = dict(param=0.0, default=1e-6)


class Block(nn.Module):
    def __init__(self, fused: bool = True):
        super().__init__()
        self.fused = fused
        self.query, self.key, self.value = (col_nn.Linear(H, H, region='enter') for _ in range(3))
        self.dense = col_nn.Linear(H, H, region='exit')

    def forward(self, x):
        if self.fused:
            q, k, v = col_nn.project_qkv(x, self.query, self.key, self.value)
        else:
            q, k, v = self.query(x), self.key(x), self.value(x)
        return self.dense(q * k + v)


def _x():
    return torch.randn(B, S, H, generator=torch.Generator().manual_seed(5)).requires_grad_()


def _block_trace(rank, fused=True):
    torch.manual_seed(0)
    block = Block(fused)
    x = _x()
    y = block(x)
    (y * y).sum().div(2).backward()
    record = {'output.0': y.detach(), 'input_grad.0': x.grad}
    record.update({f'grad:{k}': g for k, g in full_gradients(block).items()})
    record.update({f'param:{k}': v for k, v in block.state_dict().items()})
    return Trace([record])


def test_serial_fused_equals_serial_unfused():
    assert_matches_serial([_block_trace(0, fused=True)], _block_trace(0, fused=False), TOL)


@pytest.mark.parametrize('tp', [2, 4])
def test_fused_qkv_1d_equals_serial(tp):
    expected = _block_trace(0, fused=False)
    config = dict(parallel=dict(tensor=dict(size=tp, mode='1d')))
    assert_matches_serial(run_distributed(_block_trace, tp, config, timeout=300), expected, TOL)


def _qkv_counts(rank):
    torch.manual_seed(0)
    block = Block()
    x = _x()
    with comm_profile() as stats:
        q, k, v = col_nn.project_qkv(x, block.query, block.key, block.value)
        (q.sum() + k.sum() + v.sum()).backward()
    return stats.calls(PM.PARALLEL_1D, 'all_reduce'), stats.bytes(PM.PARALLEL_1D, 'all_reduce'), \
        stats.calls()


@pytest.mark.parametrize('tp', [2, 4])
def test_fused_qkv_1d_reduces_dx_once(tp):
    """docs/parallel_1d.md: one backward all_reduce of dx (b*s*h fp32), not three."""
    config = dict(parallel=dict(tensor=dict(size=tp, mode='1d')))
    for calls, nbytes, total in run_distributed(_qkv_counts, tp, config, timeout=300):
        assert (calls, nbytes, total) == (1, 4 * B * S * H, 1)


def _sequence_block(rank):
    from colossal_lite.nn.sequence import local_block, sequence_layout
    torch.manual_seed(0)
    block = Block()
    x = _x()
    y = block(local_block(x, gpc.axis(PM.SEQUENCE)))
    (y * y).sum().div(2).backward()
    positions = sequence_layout().positions(x.shape[1])   # zigzag chunks by default
    return y.detach(), x.grad, {k: p.grad for k, p in block.named_parameters()}, positions


def test_fused_qkv_sequence_equals_serial():
    """Sequence mode: replicated weights, each rank its (zigzag) part of the tokens; the
    parts' outputs, each at its positions, are the serial output and their gradients sum
    to the serial ones."""
    torch.manual_seed(0)
    block, x = Block(fused=False), _x()
    y = block(x)
    (y * y).sum().div(2).backward()
    config = dict(parallel=dict(tensor=dict(size=2, mode='sequence')))
    results = run_distributed(_sequence_block, 2, config, timeout=300)
    grads = {k: sum(r[2][k] for r in results) for k, _ in block.named_parameters()}
    output = torch.empty_like(y)
    for r in results:
        output[:, r[3]] = r[0]        # each rank's tokens at their serial positions
    assert_close_dict({'output': output,
                       'input_grad': sum(r[1] for r in results), **grads},
                      {'output': y.detach(), 'input_grad': x.grad,
                       **{k: p.grad for k, p in block.named_parameters()}}, tol=1e-6)


def test_forward_hooks_of_the_three_layers_fire():
    """ZeRO's chunk gathering hangs on module hooks: each layer's pre-hook runs before
    the fused matmul and its hook sees its own output."""
    torch.manual_seed(0)
    block, seen = Block(), []
    for name in ('query', 'key', 'value'):
        layer = getattr(block, name)
        layer.register_forward_pre_hook(lambda m, a, name=name: seen.append(('pre', name)))
        layer.register_forward_hook(lambda m, a, out, name=name: seen.append((name, out)))
    q, k, v = col_nn.project_qkv(_x(), block.query, block.key, block.value)
    assert [s[0] for s in seen] == ['pre'] * 3 + ['query', 'key', 'value']
    assert all(out is mine for (_, out), mine in zip(seen[3:], (q, k, v)))
    assert torch.allclose(k, block.key(_x()), atol=1e-6)


def test_fused_qkv_rejects_a_gathered_linear():
    torch.manual_seed(0)
    block = Block()
    with pytest.raises(ValueError, match=r"three ColumnLinear1D or GroupedKVLinear1D layers, 'enter' "
                                         r"\(gather_output=False\) over one axis, with "
                                         r"in_features 8; key is ColumnLinear1D"):
        qkv_1d(_x(), block.query, ColumnLinear1D(H, H, gather_output=True), block.value)
