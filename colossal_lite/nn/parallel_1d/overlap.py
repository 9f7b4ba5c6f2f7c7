"""Column-parallel matmul whose backward overlaps the dx all_reduce with the weight gradient.

    forward : y = x W^T + b                              (no communication)
    backward: dx = dy W          -> async all_reduce(dx)  (started first)
              dW = dy^T x, db = sum dy                    (computed while dx travels)
              wait(dx)

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


def _autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


class _ColumnMatmul(torch.autograd.Function):
    """``blocks`` weights ``[rows_i, in]`` then their biases (or none): W and b are their
    row-wise joins (a view when adjacent, ``tensor.adjacent.joined_rows``), and backward
    hands each block its rows of dW, db (views)."""

    @staticmethod
    def forward(ctx, x, axis, blocks, *params):
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
        with torch.autocast(device_type=device_type, enabled=False):
            y = F.linear(x, weight, bias)
        ctx.save_for_backward(x, weight)
        ctx.axis, ctx.has_bias = axis, bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        dy = dy.to(weight.dtype)
        dx = dy.matmul(weight)
        pending = C.all_reduce(dx, ctx.axis, async_op=True, inplace=True)
        dy2d = dy.reshape(-1, dy.shape[-1])
        dw = dy2d.t().matmul(x.reshape(-1, x.shape[-1])).to(w_dtype).split(ctx.rows)
        db = dy2d.sum(0).to(b_dtype).split(ctx.rows) if ctx.has_bias else ()
        return (pending.wait().to(x_dtype), None, None) + dw + db


def column_matmul(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  axis: ProcessGroupAxis) -> torch.Tensor:
    """``F.linear(copy_to(x, axis), weight, bias)`` with the overlapped backward above."""
    if axis.size == 1:
        return F.linear(x, weight, bias)
    return _ColumnMatmul.apply(x, axis, 1, weight, *(() if bias is None else (bias,)))


def column_matmul_rows(x: torch.Tensor, weights: Sequence[torch.Tensor],
                       biases: Optional[Sequence[torch.Tensor]],
                       axis: ProcessGroupAxis) -> torch.Tensor:
    """:func:`column_matmul` of the row-wise joins of ``weights`` and ``biases`` (None: no
    bias): no copy when they are adjacent (``tensor.adjacent``), and one autograd node
    for the join and the matmul when ``axis`` has more than one rank."""
    if axis.size == 1:
        return F.linear(x, *join_rows(weights, biases))
    return _ColumnMatmul.apply(x, axis, len(weights), *weights, *(biases or ()))
