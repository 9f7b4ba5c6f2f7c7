"""nn.functional.dense_linear: F.linear on oneDNN (forward, input gradient) equals F.linear to
fp32 rounding, allocates the tensors F.linear allocates in backward, and keeps the forward on
F.linear inside backward (a checkpointed block's recompute)."""
import pytest
import torch
import torch.nn.functional as F

from colossal_lite.nn import functional as fn
from colossal_lite.testing.memory import peak_allocated


@pytest.mark.parametrize('bias', [False, True])
@pytest.mark.parametrize('shape', [(3, 5, 24), (7, 24)])
def test_values_and_gradients_equal_f_linear(shape, bias):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g, requires_grad=True)
    w = torch.randn(40, 24, generator=g, requires_grad=True)
    b = torch.randn(40, generator=g, requires_grad=True) if bias else None
    dy = torch.randn(*shape[:-1], 40, generator=g)
    outs = []
    for f in (F.linear, fn.dense_linear):
        y = f(x, w, b)
        grads = torch.autograd.grad(y, [x, w] + ([b] if bias else []), dy)
        outs.append((y,) + grads)
    for ref, got in zip(*outs):
        assert got.shape == ref.shape and got.is_contiguous()
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_falls_back_to_f_linear():
    x = torch.randn(6, 8).t()  # not contiguous
    w = torch.randn(4, 6)
    assert torch.equal(fn.dense_linear(x, w), F.linear(x, w))
    x64, w64 = torch.randn(3, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)
    assert torch.equal(fn.dense_linear(x64, w64), F.linear(x64, w64))


def test_backward_allocates_what_f_linear_allocates():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 16, 32, generator=g, requires_grad=True)
    w = torch.randn(96, 32, generator=g, requires_grad=True)
    peaks = {}
    for name, f in (('aten', F.linear), ('dense', fn.dense_linear)):
        held = {}

        def forward():
            held['y'] = f(x, w)

        def backward():
            held.pop('y').backward(torch.ones(1, 16, 96))
            x.grad = w.grad = None
        peaks[name] = peak_allocated([forward, backward, forward, backward])[3]
    assert peaks['dense'] == peaks['aten']


def test_forward_stays_on_f_linear_inside_backward():
    seen = []
    x = torch.ones(2, requires_grad=True)
    x.register_hook(lambda grad: seen.append(fn._forward_on_onednn()))
    (x * 2).sum().backward()
    assert seen == [False] and fn._forward_on_onednn()
