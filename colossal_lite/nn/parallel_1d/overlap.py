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

from typing import Optional

import torch
import torch.nn.functional as F

from ...communication import collective as C
from ...context import ProcessGroupAxis


def _autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


class _ColumnMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, axis):
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
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
        dw = dy2d.t().matmul(x.reshape(-1, x.shape[-1])).to(w_dtype)
        db = dy2d.sum(0).to(b_dtype) if ctx.has_bias else None
        return pending.wait().to(x_dtype), dw, db, None


def column_matmul(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  axis: ProcessGroupAxis) -> torch.Tensor:
    """``F.linear(copy_to(x, axis), weight, bias)`` with the overlapped backward above."""
    if axis.size == 1:
        return F.linear(x, weight, bias)
    return _ColumnMatmul.apply(x, weight, bias, axis)
