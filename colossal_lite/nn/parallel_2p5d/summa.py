"""SUMMA on the q x q grid of one depth layer, written once for 2D and 2.5D.

Blocks: rank (i, j) holds ``X_ij`` (batch rows i, in-chunk j) and ``W_ij``
(out-chunk i, in-chunk j) of a weight ``W [out, in]``. A linear layer
``Y = X W^T`` is then, with ``m`` running over the q steps of the loop,

* forward   ``Y_im  = sum_j X_ij W_mj^T``: step m broadcasts ``W_mj`` down each
  column (``col`` group, from row m); every rank multiplies and the partial
  products are reduced along the row (``row`` group) onto column m;
* backward  ``dX_ij = sum_m dY_im W_mj``: step m broadcasts ``dY_im`` along the row
  (from column m) and ``W_mj`` down the column (from row m) and accumulates;
* backward  ``dW_mj = sum_i dY_im^T X_ij``: the same step reuses the broadcast
  ``dY_im``, multiplies by the local ``X_ij`` and reduces down the column onto
  row m; then the depth layers' copies are summed (all_reduce over ``dep``).

So one backward loop serves dX and dW (the dY broadcast is shared). Every
loop issues the broadcasts of step m+1 before the multiply of step m, and the
reduces are asynchronous, waited for after the last multiply.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch

from ...communication import collective as C
from ...context import ProcessGroupAxis
from ..functional import matmul_dtype
from .grid import Grid2p5D

Operand = Tuple[torch.Tensor, ProcessGroupAxis]
Step = Callable[..., Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]]


def summa_loop(q: int, operands: Sequence[Operand], step: Step,
               reduce_axis: Optional[ProcessGroupAxis] = None):
    """The SUMMA loop: ``for m in range(q)``, broadcast each operand from member m of its
    group, call ``step(*blocks) -> (term, partial)``; terms are summed locally, partials
    reduced onto member m of ``reduce_axis``. Returns (sum of terms, my reduced partial)."""
    def issue(m):
        return [C.broadcast(t, axis, src=m, async_op=True) for t, axis in operands]

    total, mine = None, None
    reduces: List[Tuple[int, C.Pending]] = []
    upcoming = issue(0)
    for m in range(q):
        current = upcoming
        if m + 1 < q:
            upcoming = issue(m + 1)  # next broadcast in flight during this multiply
        term, partial = step(*[p.wait() for p in current])
        if term is not None:
            total = term if total is None else total.add_(term)
        if partial is not None:
            reduces.append((m, C.reduce(partial, reduce_axis, dst=m, async_op=True)))
    for m, pending in reduces:
        result = pending.wait()
        if m == reduce_axis.rank:
            mine = result
    return total, mine


class SummaLinear(torch.autograd.Function):
    """``y = x W^T`` on the grid: x ``[.., in/q]``, weight block ``[out/q, in/q]`` -> y ``[.., out/q]``.

    Forward: q broadcasts of a W block (col) + q reduces of a y block (row).
    Backward: q broadcasts of a dy block (row), q of a W block (col, only when x needs a
    gradient), q reduces of a dW block (col), one all_reduce of dW over dep.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, grid: Grid2p5D):
        ctx.grid = grid
        ctx.dtypes, ctx.compute_dtype = (x.dtype, weight.dtype), matmul_dtype(x, weight)
        ctx.save_for_backward(x, weight)
        x2 = x.reshape(-1, x.shape[-1])
        _, y = summa_loop(grid.q, [(weight, grid.col)], lambda w: (None, x2 @ w.t()),
                          reduce_axis=grid.row)
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        compute = ctx.compute_dtype
        x, weight = (t.to(compute) for t in ctx.saved_tensors)
        grid = ctx.grid
        need_dx = ctx.needs_input_grad[0]
        x2 = x.reshape(-1, x.shape[-1])
        dy2 = grad_y.to(compute).reshape(-1, grad_y.shape[-1]).contiguous()
        operands = [(dy2, grid.row)] + ([(weight, grid.col)] if need_dx else [])

        def step(dy_m, w_m=None):
            return (dy_m @ w_m if need_dx else None), dy_m.t() @ x2

        dx, dw = summa_loop(grid.q, operands, step, reduce_axis=grid.col)
        dw = C.all_reduce(dw, grid.dep).to(ctx.dtypes[1])
        return (dx.view_as(x).to(ctx.dtypes[0]) if need_dx else None), dw, None


def summa_linear(x: torch.Tensor, weight: torch.Tensor, grid: Grid2p5D) -> torch.Tensor:
    """``x W^T`` in the standard layout (see :class:`SummaLinear`)."""
    return SummaLinear.apply(x, weight, grid)
