"""The pre-issue-24 ring self-attention, kept ONLY as the baseline of ``long_context.py``.

This is ``colossal_lite/nn/sequence/ring.py`` as of commit a4590e9 (the 2021-style ring
self-attention that materialises the ``[b*n, s/P, s]`` score and probability matrices on
every rank), copied verbatim except for two imports made absolute so it loads from
``benchmarks/``. It is not part of the library and nothing but the benchmark uses it; the
library's ring is ``colossal_lite.nn.sequence.ring`` (online softmax, zigzag chunks).

Its original docstring follows.

Ring self-attention: Q K^T and softmax(Q K^T) V while key/value blocks travel the ring.

The sequence of length ``s`` is split into P contiguous blocks over the SEQUENCE
group; rank r holds rows ``[r*s/P, (r+1)*s/P)`` of q, k and v (``[B, s/P, d]`` with
``B = batch * heads``). Every transfer is a :func:`ring_exchange` (send to r+1,
receive from r-1), so at step t rank r holds the block owned by ``(r - t) mod P``.

Two autograd functions, each with ring forward and ring backward:

* :class:`RingQK`: ``scores[:, :, block j] = q_r @ k_j^T`` -> ``[B, s/P, s]``
  (key blocks travel: P-1 exchanges). Backward: ``dq_r = sum_j g_j @ k_j`` (key
  blocks travel again: P-1 exchanges) and ``dk_j = sum_r g_j^T @ q_r`` (an
  accumulator per key block travels the ring, each rank adding its term, and
  arrives at block j's owner after P-1 exchanges).
* :class:`RingAV`: ``out_r = sum_j probs[:, :, block j] @ v_j`` (value blocks
  travel). Backward: ``dprobs_j = g_r @ v_j^T`` (values travel again) and
  ``dv_j = sum_r probs_j^T @ g_r`` (travelling accumulator).

The full sequence is never gathered: a rank holds at most one foreign block of
``[B, s/P, d]`` at a time. With ``causal=True`` the blocks ``j > r`` (all keys in
the future of every local query) are neither computed nor accumulated; they
still travel so every rank issues the same exchanges.
"""
from __future__ import annotations

import contextlib
import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from colossal_lite.communication import ring_exchange
from colossal_lite.context import ProcessGroupAxis


def _needed(j: int, axis: ProcessGroupAxis, causal: bool) -> bool:
    return not causal or j <= axis.rank


def travel(block: torch.Tensor, axis: ProcessGroupAxis, causal: bool,
           visit: Callable[[int, torch.Tensor], None]):
    """Call ``visit(j, block_j)`` for every owner j while ``block`` goes round the ring.

    The next block is requested (async) before the current one is used, so the
    transfer overlaps the computation. P-1 exchanges of ``block``'s size.
    """
    p = axis.size
    for t in range(p):
        pending = ring_exchange(block, axis, async_op=True) if t < p - 1 else None
        j = (axis.rank - t) % p
        if _needed(j, axis, causal):
            visit(j, block)
        if pending is not None:
            block = pending.wait()


def accumulate(like: torch.Tensor, axis: ProcessGroupAxis, causal: bool,
               term: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """On rank r, ``sum over all ranks r' of term_{r'}(r)``, summed by travelling accumulators.

    At step t rank r adds its term for block ``(r - 1 - t) mod P`` to the accumulator
    it holds and passes it on; after P-1 exchanges each accumulator sits at its owner.
    The next term is computed while the previous exchange is in flight.
    """
    p = axis.size
    acc, pending = torch.zeros_like(like), None
    for t in range(p):
        j = (axis.rank - 1 - t) % p
        contribution = term(j) if _needed(j, axis, causal) else None
        if pending is not None:
            acc = pending.wait()
        if contribution is not None:
            acc += contribution
        pending = ring_exchange(acc, axis, async_op=True) if t < p - 1 else None
    return acc


def _cols(t: torch.Tensor, j: int, width: int) -> torch.Tensor:
    return t[..., j * width:(j + 1) * width]


class RingQK(torch.autograd.Function):
    """``q [B, s/P, d]``, ``k [B, s/P, d]`` -> ``scores [B, s/P, s] = q @ K_full^T``."""

    @staticmethod
    def forward(ctx, q, k, axis, causal):
        ctx.save_for_backward(q, k)
        ctx.axis, ctx.causal = axis, causal
        s_l = q.shape[1]
        scores = q.new_zeros(q.shape[0], s_l, s_l * axis.size)
        travel(k, axis, causal,
               lambda j, k_j: _cols(scores, j, s_l).copy_(torch.bmm(q, k_j.transpose(1, 2))))
        return scores

    @staticmethod
    def backward(ctx, grad):
        q, k = ctx.saved_tensors
        axis, causal, s_l = ctx.axis, ctx.causal, q.shape[1]
        grad = grad.contiguous()
        dq = torch.zeros_like(q)
        travel(k, axis, causal, lambda j, k_j: dq.baddbmm_(_cols(grad, j, s_l), k_j))
        dk = accumulate(k, axis, causal,
                        lambda j: torch.bmm(_cols(grad, j, s_l).transpose(1, 2), q))
        return dq, dk, None, None


class RingAV(torch.autograd.Function):
    """``probs [B, s/P, s]``, ``v [B, s/P, d]`` -> ``out [B, s/P, d] = probs @ V_full``."""

    @staticmethod
    def forward(ctx, probs, v, axis, causal):
        ctx.save_for_backward(probs, v)
        ctx.axis, ctx.causal = axis, causal
        s_l = v.shape[1]
        out = torch.zeros_like(v)
        travel(v, axis, causal, lambda j, v_j: out.baddbmm_(_cols(probs, j, s_l), v_j))
        return out

    @staticmethod
    def backward(ctx, grad):
        probs, v = ctx.saved_tensors
        axis, causal, s_l = ctx.axis, ctx.causal, v.shape[1]
        grad = grad.contiguous()
        dprobs = torch.zeros_like(probs)
        travel(v, axis, causal,
               lambda j, v_j: _cols(dprobs, j, s_l).copy_(torch.bmm(grad, v_j.transpose(1, 2))))
        dv = accumulate(v, axis, causal,
                        lambda j: torch.bmm(_cols(probs, j, s_l).transpose(1, 2), grad))
        return dprobs, dv, None, None


def attend_mask(batch: int, s_local: int, axis: ProcessGroupAxis, causal: bool,
                key_padding_mask: Optional[torch.Tensor], device) -> Optional[torch.Tensor]:
    """Boolean ``[b|1, 1, s/P, s]`` mask (True = attend) of local queries against all keys.

    Column block j of the scores is key block j, so the user's full ``[b, s]`` key
    padding mask lines up with the columns as it is; the causal mask compares
    global positions: query ``r*s/P + i`` sees keys ``<= r*s/P + i``.
    """
    s = s_local * axis.size
    mask = None
    if key_padding_mask is not None:
        if tuple(key_padding_mask.shape) != (batch, s):
            raise ValueError(f'key_padding_mask must be the full [batch, seq] = [{batch}, {s}] '
                             f'mask, got shape {tuple(key_padding_mask.shape)}')
        mask = key_padding_mask.to(device=device, dtype=torch.bool).view(batch, 1, 1, s)
    if causal:
        rows = torch.arange(s_local, device=device) + axis.rank * s_local
        tri = torch.arange(s, device=device).view(1, s) <= rows.view(s_local, 1)
        mask = tri if mask is None else mask & tri
    return mask


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int,
                   axis: ProcessGroupAxis, causal: bool = False,
                   key_padding_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                   rng: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext):
    """softmax(Q K^T / sqrt(d) + mask) V for local sub-sequences ``[b, s/P, n*d]``.

    ``key_padding_mask``: the user's full ``[b, s]`` mask (1 = attend). Attention
    dropout draws from ``rng()`` (the per-rank stream: rows differ across ranks).
    """
    b, s_l, width = q.shape
    if width % head_dim:
        raise ValueError(f'attention width {width} is not a multiple of head_dim {head_dim}')
    heads = width // head_dim

    def to_heads(t):
        return t.view(b, s_l, heads, head_dim).transpose(1, 2).reshape(b * heads, s_l, head_dim)

    scores = RingQK.apply(to_heads(q), to_heads(k), axis, causal)
    scores = (scores * (1.0 / math.sqrt(head_dim))).view(b, heads, s_l, s_l * axis.size)
    mask = attend_mask(b, s_l, axis, causal, key_padding_mask, q.device)
    if mask is not None:
        scores = scores.masked_fill(~mask, float('-inf'))
    probs = torch.softmax(scores, dim=-1)
    if mask is not None:  # a query with no key to attend to gets zeros, as in the serial SDPA
        probs = probs.masked_fill(~mask.any(dim=-1, keepdim=True), 0.0)
    if dropout_p > 0:
        with rng():
            probs = F.dropout(probs, dropout_p, True)
    out = RingAV.apply(probs.view(b * heads, s_l, -1), to_heads(v), axis, causal)
    return out.view(b, heads, s_l, head_dim).transpose(1, 2).reshape(b, s_l, width)
