"""``partial_grad_param``: a replicated parameter that sees only this rank's share of the
tokens, its gradient summed over a group -- once per backward pass, bucketed.

Under 1D sequence parallelism every norm weight (and a row linear's bias) multiplies only
the rank's sequence block, so its gradient is partial and must be summed over the group.
``copy_to`` does it at once: one all_reduce of ``[h]`` per weight per backward, each a
synchronization point of all ranks in the middle of the backward pass (on 2 shared cores
with 4 ranks, each such wait costs about as much as the all_reduce of an activation).

``partial_grad_param(weight, axis)`` is the identity forward. Backward, when the gradient
is going to be accumulated into ``weight.grad`` and nothing observes it on the way (no
tensor or post-accumulate-grad hook: ZeRO's and the overlapping data-parallel reducer's
hooks read ``.grad`` as soon as it is accumulated), it hands autograd zeros and keeps the
partial gradient ``g_r``; at the end of the backward pass (an autograd engine callback)
the kept gradients of every such weight are flattened per (group, dtype), summed by ONE
all_reduce, and added to ``.grad``:

    .grad <- .grad + sum_r g_r            (the same value as copy_to's: .grad + 0 + S)

Otherwise (a hook is registered, the weight is not a leaf, or autograd will not accumulate
into ``.grad``: ``torch.autograd.grad``, ``backward(inputs=...)`` without this weight) it
all-reduces at once, exactly as ``copy_to``. Bytes are the same either way; the calls drop
from one per weight to one per group and backward pass.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch
from torch.autograd.graph import get_gradient_edge

import colossal_lite.communication.collective as C

from ..context import ProcessGroupAxis
from .collective import AxisLike, resolve


def _accumulated_unobserved(weight: torch.Tensor) -> bool:
    """Whether this backward pass accumulates ``weight``'s gradient into ``.grad`` with no
    hook reading it before the pass ends."""
    if not (weight.is_leaf and weight.requires_grad):
        return False
    if weight._backward_hooks or getattr(weight, '_post_accumulate_grad_hooks', None):
        return False
    try:
        return torch._C._will_engine_execute_node(get_gradient_edge(weight).node)
    except RuntimeError:   # torch.autograd.grad: it does not say for a leaf, and accumulates
        return False       # nothing into .grad anyway


class _PendingSums:
    """The partial gradients kept during one backward pass, summed by its end callback."""

    def __init__(self):
        self.entries: List[Tuple[torch.Tensor, torch.Tensor, ProcessGroupAxis]] = []

    def keep(self, weight: torch.Tensor, grad: torch.Tensor, axis: ProcessGroupAxis):
        if not self.entries:
            torch.autograd.Variable._execution_engine.queue_callback(self.flush)
        self.entries.append((weight, grad, axis))

    def flush(self):
        entries, self.entries = self.entries, []
        groups: Dict[tuple, List[Tuple[torch.Tensor, torch.Tensor]]] = {}
        axes: Dict[tuple, ProcessGroupAxis] = {}
        for weight, grad, axis in entries:   # the same order on every rank
            key = (axis.mode, axis.ranks, grad.dtype)
            groups.setdefault(key, []).append((weight, grad))
            axes[key] = axis
        for key, items in groups.items():
            flat = C.all_reduce(torch.cat([g.reshape(-1) for _, g in items]), axes[key],
                                inplace=True)
            for (weight, grad), total in zip(items, flat.split([g.numel() for _, g in items])):
                total = total.view(grad.shape)
                if weight.grad is None:
                    weight.grad = total.to(weight.dtype).clone()
                else:
                    weight.grad.add_(total)


_PENDING = _PendingSums()


class _PartialGradParam(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, axis):
        ctx.weight, ctx.axis = weight, axis
        return weight

    @staticmethod
    def backward(ctx, grad):
        weight, axis = ctx.weight, ctx.axis
        ctx.weight = None
        if _accumulated_unobserved(weight):
            _PENDING.keep(weight, grad, axis)
            return torch.zeros_like(grad), None
        return C.all_reduce(grad, axis), None


def partial_grad_param(weight: torch.Tensor, axis: AxisLike) -> torch.Tensor:
    """``weight`` itself forward; its gradient summed over ``axis`` (module doc: bucketed at
    the end of the backward pass when nothing observes it earlier, else at once)."""
    ax = resolve(axis)
    return weight if ax.size == 1 else _PartialGradParam.apply(weight, ax)
