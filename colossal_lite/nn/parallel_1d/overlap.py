"""Column-parallel matmul whose backward overlaps the dx all_reduce with the weight gradient.

    forward : y = x W^T + b                              (no communication)
    backward: dx = dy W          -> async all_reduce(dx)  (started first)
              dW = dy^T x, db = sum dy                    (computed while dx travels)
              wait(dx)

Under sequence parallelism (x split along the sequence, Megatron-style) the forward
all_gathers x first; backward re-gathers it while dx = dy W is computed, then
reduce_scatters dx while dW is computed, so only the local chunk of x is kept.

Rank-major order. The gathered x arrives as ``[p, b, s/p, in]`` (rank r's block r-th), and
reduce_scatter sends ``[p, b, s/p, in]``: ``[b, s, in]`` in the batch-first layout is a
permuting copy of either (``rank_major`` / ``from_rank_major``). A linear is token-wise, so
when the output is narrower than 1.5x the input the matmuls run in rank-major order
instead: forward ``y = from_rank_major(gathered W^T)`` (one copy of the output),
backward ``dy' = rank_major(dy)``, ``dx' = dy' W`` reduce_scattered as it is and
``dW = dy'^T gathered`` (one copy of dy instead of two copies of x-sized tensors).

The counts equal ``copy_to`` + ``F.linear``: one all_reduce of dx per call. Under
autocast the operands are cast as autocast would cast them and saved in that dtype, so
backward needs no autocast context; gradients are returned in the inputs' dtypes.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from ...communication import collective as C
from ...context import ProcessGroupAxis
from ...tensor.adjacent import join_rows, joined_rows


def rank_major(x: torch.Tensor, parts: int, dim: int) -> torch.Tensor:
    """``x [.., n, ..]`` (``n`` along ``dim``) as ``[parts, .., n/parts, ..]``: chunk r of
    ``dim`` first (a copy), the order of a gathered or to-be-scattered tensor."""
    return x.unflatten(dim, (parts, x.shape[dim] // parts)).movedim(dim, 0).contiguous()


def from_rank_major(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse of :func:`rank_major`: ``[parts, .., c, ..]`` -> ``[.., parts * c, ..]`` with
    the chunks along ``dim`` (of the result; a copy)."""
    return x.movedim(0, dim).flatten(dim, dim + 1)


def _autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


class _ColumnMatmul(torch.autograd.Function):
    """``blocks`` weights ``[rows_i, in]`` then their biases (or none): W and b are their
    row-wise joins (a view when adjacent, ``tensor.adjacent.joined_rows``), and backward
    hands each block its rows of dW, db (views).

    ``seq_dim`` None: x is replicated; backward all_reduces dx (overlapped with dW).
    ``seq_dim`` = d (sequence parallelism): x is this rank's chunk of dim d; forward
    all_gathers it along d and saves only the chunk; backward all_gathers it again (async,
    overlapped with dx = dy W) and reduce_scatters dx along d."""

    @staticmethod
    def forward(ctx, x, axis, seq_dim, blocks, *params):
        weights, biases = params[:blocks], params[blocks:]
        weight = weights[0] if blocks == 1 else joined_rows(weights)
        bias = None if not biases else biases[0] if blocks == 1 else joined_rows(biases)
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.rows = [w.shape[0] for w in weights]
        device_type = x.device.type
        cast = _autocast_dtype(device_type)
        if cast is not None:
            x, weight = x.to(cast), weight.to(cast)
            bias = None if bias is None else bias.to(cast)
        ctx.rank_major = seq_dim is not None and 2 * weight.shape[0] < 3 * weight.shape[1]
        if seq_dim is None:
            full = x
        elif ctx.rank_major:
            full = C.all_gather(x.unsqueeze(0), axis, 0, pairwise=C.prefers_pairwise(axis))
        else:
            full = C.all_gather(x, axis, seq_dim, pairwise=C.prefers_pairwise(axis))
        with torch.autocast(device_type=device_type, enabled=False):
            y = F.linear(full, weight, bias)
        if ctx.rank_major:
            y = from_rank_major(y, seq_dim)
        ctx.save_for_backward(x, weight)
        ctx.axis, ctx.seq_dim, ctx.has_bias = axis, seq_dim, bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        dy = dy.to(weight.dtype)
        if ctx.seq_dim is None:
            full = x
            pending = C.all_reduce(dy.matmul(weight), ctx.axis, async_op=True, inplace=True)
        elif ctx.rank_major:
            pairwise = C.prefers_pairwise(ctx.axis)
            gathering = C.all_gather(x.unsqueeze(0), ctx.axis, 0, async_op=True,
                                     pairwise=pairwise)
            dy = rank_major(dy, ctx.axis.size, ctx.seq_dim)
            dx_full = dy.matmul(weight)
            full = gathering.wait()
            scattering = C.reduce_scatter(dx_full, ctx.axis, 0, async_op=True,
                                          pairwise=pairwise)
            pending = C.Pending(None, lambda: scattering.wait().squeeze(0))
        else:
            pairwise = C.prefers_pairwise(ctx.axis)
            gathering = C.all_gather(x, ctx.axis, ctx.seq_dim, async_op=True, pairwise=pairwise)
            dx_full = dy.matmul(weight)
            full = gathering.wait()
            pending = C.reduce_scatter(dx_full, ctx.axis, ctx.seq_dim, async_op=True,
                                       pairwise=pairwise)
        dy2d = dy.reshape(-1, dy.shape[-1])
        dw = dy2d.t().matmul(full.reshape(-1, full.shape[-1])).to(w_dtype).split(ctx.rows)
        db = dy2d.sum(0).to(b_dtype).split(ctx.rows) if ctx.has_bias else ()
        return (pending.wait().to(x_dtype), None, None, None) + dw + db


def column_matmul(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  axis: ProcessGroupAxis, seq_dim: Optional[int] = None) -> torch.Tensor:
    """``F.linear(copy_to(x, axis), weight, bias)`` with the overlapped backward above;
    ``seq_dim``: x is split along it (sequence parallelism), gathered here."""
    if axis.size == 1:
        return F.linear(x, weight, bias)
    return _ColumnMatmul.apply(x, axis, seq_dim, 1, weight, *(() if bias is None else (bias,)))


def column_matmul_rows(x: torch.Tensor, weights: Sequence[torch.Tensor],
                       biases: Optional[Sequence[torch.Tensor]],
                       axis: ProcessGroupAxis, seq_dim: Optional[int] = None) -> torch.Tensor:
    """:func:`column_matmul` of the row-wise joins of ``weights`` and ``biases`` (None: no
    bias): no copy when they are adjacent (``tensor.adjacent``), and one autograd node
    for the join and the matmul when ``axis`` has more than one rank."""
    if axis.size == 1:
        return F.linear(x, *join_rows(weights, biases))
    return _ColumnMatmul.apply(x, axis, seq_dim, len(weights), *weights, *(biases or ()))
