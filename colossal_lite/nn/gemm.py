"""The matmuls of the linear layers, on the faster of torch's two fp32 CPU GEMMs.

torch's fp32 ``F.linear`` / ``mm`` on the CPU call MKL's sgemm, and MKL runs its AVX2
kernels on x86 CPUs that are not Intel's (e.g. the AMD EPYC with AVX-512 our benchmarks
run on); the oneDNN library that torch also ships (``torch.ops.mkldnn._linear_pointwise``,
the kernel Inductor emits for CPU linears) picks its kernels from the CPU's features, and
runs AVX-512 there. Measured there, one thread: 2.0-2.3x MKL's FLOP rate for the
attention / MLP shapes of benchmarks/serial_vs_hf.py, 1.3-1.8x for the LM head. Both sum
fp32 products in fp32 (no reduced-precision math); they differ in summation order only,
i.e. by rounding, as two GEMMs or two blockings of one GEMM do::

    linear(x, W, b)        = x W^T + b     [.., in] x [out, in] -> [.., out]  (autograd)
    forward_linear(x, W, b) = the same, no autograd (inside an autograd Function)
    input_grad(dy, W)      = dy W          [.., out] x [out, in] -> [.., in]
    weight_grad(dy, x)     = dy^T x        [N, out] x [N, in]  -> [out, in]

:func:`linear`'s autograd graph has F.linear's shape: dx and dW in separate nodes (the
zero-bubble pipeline's split backward relies on it; ``pipeline/split_backward.py``).
oneDNN serves plain fp32 CPU tensors while torch has it enabled (``torch.backends.mkldnn``,
which a user may switch off) and CPU autocast is off; every other case (other devices and
dtypes, tensor subclasses such as DTensor or fake tensors, compiling, tracing, empty
tensors) goes to torch's own ops, exactly as before. No communication.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

_PLAIN = (torch.Tensor, nn.Parameter)


@functools.lru_cache(maxsize=None)
def _kernel():
    """oneDNN's ``linear(input [.., k], weight [n, k], bias [n] or None)``, or None."""
    if not torch.backends.mkldnn.is_available():
        return None
    op = getattr(torch.ops.mkldnn, '_linear_pointwise', None)
    return None if op is None else functools.partial(op, attr='none', scalars=[],
                                                     algorithm='')


def onednn_serves(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether these tensors' (None: absent) matmuls run on oneDNN (module doc)."""
    if (_kernel() is None or not torch._C._get_mkldnn_enabled()
            or torch.is_autocast_enabled('cpu') or torch.compiler.is_compiling()
            or torch.jit.is_tracing()):
        return False
    return all(t is None or (type(t) in _PLAIN and t.device.type == 'cpu'
                             and t.dtype == torch.float32 and t.numel() > 0) for t in tensors)


def _mm_nt(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor] = None):
    """``a [.., k] @ b[n, k]^T (+ bias [n]) -> [.., n]`` on oneDNN (any strides). The kernel
    returns an N-d result as a view of its 2-d one; ``detach`` drops that view relation
    (nothing else holds the base), so an autograd Function may return it and callers may
    write into it in place, as into F.linear's output (the row-parallel all_reduce does)."""
    return _kernel()(a, b, bias).detach()


def forward_linear(x: torch.Tensor, weight: torch.Tensor,
                   bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, no autograd: ``[.., in] -> [.., out]``."""
    if not onednn_serves(x, weight, bias):
        return F.linear(x, weight, bias)
    return _mm_nt(x, weight, bias)


def input_grad(dy: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``dy [.., out] @ weight [out, in] -> [.., in]``, no autograd."""
    if not onednn_serves(dy, weight):
        return dy.matmul(weight)
    return _mm_nt(dy, weight.t())


def weight_grad(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``dy [N, out]^T @ x [N, in] -> [out, in]`` (contiguous), no autograd. oneDNN runs the
    wide LM-head shape (out >> in) faster as ``(x^T dy)^T``; the copy is ``out * in``."""
    if not onednn_serves(dy, x):
        return dy.t().matmul(x)
    return _weight_grad(dy, x)


def _weight_grad(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """:func:`weight_grad` on oneDNN, unchecked."""
    if dy.shape[1] > x.shape[1]:
        return _mm_nt(x.t(), dy.t()).t().contiguous()
    return _mm_nt(dy.t(), x.t())


class _InputSide(torch.autograd.Function):
    """Forward ``y = x W^T + b``; backward ``dx = dy W`` only. W comes in a tuple and b
    detached, so the node has no edge to them; W is saved itself, as F.linear saves it (its
    ``.data`` may be swapped before backward, e.g. by ZeRO-3's re-gathering). Both matmuls
    on oneDNN (:func:`linear` checked that it serves)."""

    @staticmethod
    def forward(ctx, x, weight_holder, bias):
        (weight,) = weight_holder
        ctx.save_for_backward(weight)
        return _mm_nt(x, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        (weight,) = ctx.saved_tensors
        return _mm_nt(dy.contiguous(), weight.t()), None, None


class _WeightSide(torch.autograd.Function):
    """No forward work (a zero-strided placeholder shaped as y); backward ``dW = dy^T x``,
    ``db = sum dy`` only (x comes in detached)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x)
        return x.new_zeros(()).expand(*x.shape[:-1], weight.shape[0])

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        _, need_w, need_b = ctx.needs_input_grad
        dy2d = dy.contiguous().view(-1, dy.shape[-1])
        dw = _weight_grad(dy2d, x.reshape(-1, x.shape[-1])) if need_w else None
        return None, dw, dy2d.sum(0) if need_b else None


class _Join(torch.autograd.Function):
    """``y`` of :class:`_InputSide`; backward hands dy to both sides (no work). Detached, so
    callers may write into it in place as into F.linear's output."""

    @staticmethod
    def forward(ctx, y, placeholder):
        return y.detach()

    @staticmethod
    def backward(ctx, dy):
        return dy, dy


def linear(x: torch.Tensor, weight: torch.Tensor,
           bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (differentiable), on oneDNN where it serves.

    Its graph keeps F.linear's split: one node computes dx, another (off the input's path)
    dW and db, joined by a node that does no work -- so an input-gradient-only backward
    (the zero-bubble pipeline's B, ``autograd.grad(out, [x])``) never runs the weight
    matmul, and the weight pass (W, from the join's gradient) never runs the input one."""
    if not onednn_serves(x, weight, bias):
        return F.linear(x, weight, bias)
    if not torch.is_grad_enabled():
        return _mm_nt(x, weight, bias)
    placeholder = _WeightSide.apply(x.detach(), weight, bias)
    # Created after the weight side, the input side runs first when the join hands both
    # dy (autograd's engine runs the later-created of two ready nodes first), so dx reads W
    # before W's gradient is accumulated, whose hooks may overwrite W (ZeRO-3 writes the
    # gradient into the weight's own slot). tests/test_gemm.py checks this order.
    y = _InputSide.apply(x, (weight,), None if bias is None else bias.detach())
    return _Join.apply(y, placeholder)
