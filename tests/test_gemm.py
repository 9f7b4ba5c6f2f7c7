"""The serial layers' matmuls (``nn.gemm``: oneDNN for fp32 on the CPU) and the token cross
entropy equal torch's own ops, keep F.linear's backward split (zero-bubble B/W), and read
the weight before its gradient is accumulated (ZeRO-3 writes the gradient into it)."""
import pytest
import torch
import torch.nn.functional as F

from colossal_lite.nn import gemm
from colossal_lite.nn import functional
from colossal_lite.nn.functional import token_cross_entropy
from colossal_lite.pipeline.split_backward import SplitBackward

pytestmark = pytest.mark.skipif(not gemm.onednn_serves(torch.ones(1)),
                                reason='torch without oneDNN: linear is F.linear')


def _inputs(bias=True, shape=(2, 5, 8), out=6):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    w = torch.randn(out, shape[-1], generator=g, dtype=torch.float64)
    b = torch.randn(out, generator=g, dtype=torch.float64) if bias else None
    return x, w, b


@pytest.mark.parametrize('bias', [True, False])
@pytest.mark.parametrize('shape, out', [((2, 5, 8), 6), ((7, 3), 40)])
def test_linear_equals_f_linear(bias, shape, out):
    """Output and every gradient within fp32 rounding of the fp64 F.linear."""
    x, w, b = _inputs(bias, shape, out)
    ref = [t.clone().requires_grad_() for t in (x, w, b) if t is not None]
    ours = [t.float().requires_grad_() for t in (x, w, b) if t is not None]
    dy = torch.randn(*shape[:-1], out, dtype=torch.float64)
    expected = F.linear(*ref)
    expected.backward(dy)
    got = gemm.linear(*ours)
    got.mul_(1.0)                                   # written in place, as F.linear's output
    got.backward(dy.float())
    for a, e in zip([got] + [t.grad for t in ours], [expected] + [t.grad for t in ref]):
        assert a.dtype == torch.float32 and a.shape == e.shape
        assert (a.double() - e).abs().max() <= 1e-6 * e.abs().max()


def test_other_dtypes_and_autocast_are_f_linear():
    x, w, b = (t.to(torch.bfloat16) for t in _inputs())
    assert torch.equal(gemm.linear(x, w, b), F.linear(x, w, b))
    x, w, b = (t.float() for t in _inputs())
    with torch.autocast('cpu', dtype=torch.bfloat16):
        assert not gemm.onednn_serves(x, w, b)
        assert torch.equal(gemm.linear(x, w, b), F.linear(x, w, b))


def _counting(monkeypatch):
    """Record 'dx' for each oneDNN matmul outside the weight gradient, 'dW' for each
    weight gradient (the forward runs before counting starts)."""
    calls, inside = [], []
    real_mm, real_dw = gemm._mm_nt, gemm._weight_grad

    def mm(*args):
        if not inside:
            calls.append('dx')
        return real_mm(*args)

    def dw(*args):
        calls.append('dW')
        inside.append(True)
        try:
            return real_dw(*args)
        finally:
            inside.pop()
    monkeypatch.setattr(gemm, '_mm_nt', mm)
    monkeypatch.setattr(gemm, '_weight_grad', dw)
    return calls


def test_split_backward_runs_each_matmul_once(monkeypatch):
    """Zero-bubble's B (input gradient) runs only dx = dy W, its W only dW = dy^T x."""
    x, w, b = (t.float() for t in _inputs())
    w1, b1 = torch.nn.Parameter(w), torch.nn.Parameter(b)
    w2 = torch.nn.Parameter(torch.randn(3, 6))
    x = x.requires_grad_()
    out = gemm.linear(torch.relu(gemm.linear(x, w1, b1)), w2)
    calls = _counting(monkeypatch)
    split = SplitBackward(out, torch.ones_like(out), x, [w1, b1, w2])
    split.input_grad()
    assert calls == ['dx', 'dx'] and not split.direct      # one frontier per weight
    calls.clear()
    split.weight_grad()
    assert calls == ['dW', 'dW']
    assert all(p.grad is not None for p in (w1, b1, w2))


def test_input_gradient_reads_the_weight_before_its_gradient_lands():
    """A post-accumulate hook that overwrites the weight (as ZeRO-3's chunk reuse does)
    must not change dx: dx = dy W runs before W's gradient is accumulated."""
    x, w, _ = (t.float() if t is not None else None for t in _inputs(bias=False))
    weight = torch.nn.Parameter(w.clone())
    def overwrite(param):
        param.data.zero_()
    weight.register_post_accumulate_grad_hook(overwrite)
    x = x.requires_grad_()
    gemm.linear(x, weight).sum().backward()
    expected = torch.ones(2, 5, 6) @ w
    assert (x.grad - expected).abs().max() <= 1e-5 * expected.abs().max()


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
@pytest.mark.parametrize('block', [None, 100])
def test_token_cross_entropy_equals_f_cross_entropy(dtype, block, monkeypatch):
    """The same per-token losses (bit for bit) and gradients (rounding), 0 where ignored,
    in one row block or many (``block`` elements: 2 rows of 50 classes)."""
    if block is not None:
        monkeypatch.setattr(functional, 'BLOCK_ELEMENTS', block)
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(24, 50, generator=g).to(dtype)
    target = torch.randint(0, 50, (24,), generator=g)
    target[::5] = -100
    weights = torch.randn(24, generator=g)
    ref, ours = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    expected = F.cross_entropy(ref.float(), target, reduction='none')
    (expected * weights).sum().backward()
    got = token_cross_entropy(ours, target)
    (got * weights).sum().backward()
    assert got.dtype == torch.float32 and torch.equal(got, expected)
    assert ours.grad.dtype == dtype and (ours.grad[::5] == 0).all()
    assert (ours.grad.float() - ref.grad.float()).abs().max() <= 1e-6


def test_token_cross_entropy_of_no_tokens():
    logits = torch.zeros(0, 7, requires_grad=True)
    loss = token_cross_entropy(logits, torch.zeros(0, dtype=torch.long))
    loss.sum().backward()
    assert loss.shape == (0,) and logits.grad.shape == (0, 7)
