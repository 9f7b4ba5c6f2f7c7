"""The experts of a mixture-of-experts layer in a captured graph: grouped matmuls run as
local regions (``local_map`` style) with the expert weights split over a mesh axis.

A traced MoE layer (transformers' Mixtral / Qwen2-MoE under ``torch.export``) sorts the
tokens by expert and calls one grouped matmul per projection::

    out [S, o] = grouped_mm(x [S, i], W [X, i, o], offs [X])

where rows ``offs[e-1] .. offs[e]`` of ``x`` (sorted tokens) are multiplied by expert e's
``W[e]``. DTensor has no rule for it, so the planner used to replicate it: every rank
gathered every expert. Rules here, per mesh axis of k ranks (``offs`` replicated):

=====================  ==============  =====================  ========================
x                      W               out                    what it is
=====================  ==============  =====================  ========================
R                      S(2)            S(1)                   each expert's columns
S(1)                   S(1)            P                      each expert's rows
R                      S(0)            P                      expert parallelism
=====================  ==============  =====================  ========================

The last one is the expert-parallel region: rank r holds experts ``[f, f + X/k)`` and
computes only their rows ``offs[f-1] .. offs[f+X/k-1]`` (:func:`experts_mm`, a custom op,
so a lowered program records it as one call); every other row of its output is zero, so
the outputs sum to the full product over the axis (Partial). Backward: the rows' input
gradient (partial over the axis, as for any replicated input of a split op) and the local
experts' weight gradients. Its tokens are the replicated sorted rows: the dispatch is the
redistribution to R before (an all_gather when the tokens were split) and the combine the
Partial's reduction after, priced by the planner like any other edge.

The matched ops: ``transformers::grouped_mm_fallback`` (transformers' CPU / fp32 path).
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

GROUPED_MM = ('transformers::grouped_mm_fallback',)


def is_grouped_mm(target) -> bool:
    """Whether ``target`` is a grouped expert matmul with the module doc's signature."""
    return isinstance(target, torch._ops.OpOverload) and target.name() in GROUPED_MM


def grouped_mm_flops(node: torch.fx.Node) -> float:
    """``2 S i o``: every row meets one expert."""
    x, w = (a.meta['val'] for a in node.args[:2])
    return 2.0 * x.shape[0] * x.shape[1] * w.shape[2]


def grouped_mm_rules(node: torch.fx.Node, k: int, slots: Sequence) -> List[tuple]:
    """Per-axis ``(inputs, outputs)`` of the module doc's table on an axis of k ranks."""
    if len(node.args) != 3 or node.kwargs or sum(s is not None for s in slots) != 3:
        return []
    w = node.args[1].meta['val']
    experts, i, o = w.shape
    rules = []
    if o % k == 0:
        rules.append((((Replicate(),), (Shard(2),), (Replicate(),)), ((Shard(1),),)))
    if i % k == 0:
        rules.append((((Shard(1),), (Shard(1),), (Replicate(),)), ((Partial(),),)))
    if experts % k == 0:
        rules.append((((Replicate(),), (Shard(0),), (Replicate(),)), ((Partial(),),)))
    return rules


def _rows(offs: torch.Tensor, first: int, count: int) -> Tuple[int, List[int]]:
    """(first row of expert ``first``, the end row of each of the ``count`` experts)."""
    start = int(offs[first - 1]) if first > 0 else 0
    return start, [int(e) for e in offs[first:first + count].tolist()]


@torch.library.custom_op('colossal_lite::experts_mm', mutates_args=())
def experts_mm(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor,
               first: int) -> torch.Tensor:
    """Rows of experts ``first .. first + weight.shape[0] - 1`` of ``x`` (sorted, ``offs`` the
    cumulative row ends of all experts) times their ``weight [n, i, o]``; other rows 0."""
    out = x.new_zeros(x.shape[0], weight.shape[2])
    start, ends = _rows(offs, first, weight.shape[0])
    for e, end in enumerate(ends):
        if end > start:
            torch.mm(x[start:end], weight[e], out=out[start:end])
        start = end
    return out


@experts_mm.register_fake
def _(x, weight, offs, first):
    return x.new_empty(x.shape[0], weight.shape[2])


@torch.library.custom_op('colossal_lite::experts_mm_backward', mutates_args=())
def experts_mm_backward(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor,
                        first: int, grad: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(dx: the local experts' rows ``grad W[e]^T``, 0 elsewhere; dW[e] = ``x^T grad`` over
    expert e's rows)."""
    dx, dw = torch.zeros_like(x), torch.zeros_like(weight)
    start, ends = _rows(offs, first, weight.shape[0])
    for e, end in enumerate(ends):
        if end > start:
            dx[start:end] = grad[start:end].mm(weight[e].t())
            dw[e] = x[start:end].t().mm(grad[start:end])
        start = end
    return dx, dw


@experts_mm_backward.register_fake
def _(x, weight, offs, first, grad):
    return torch.empty_like(x), torch.empty_like(weight)


def _setup(ctx, inputs, output):
    x, weight, offs, first = inputs
    ctx.save_for_backward(x, weight, offs)
    ctx.first = first


def _backward(ctx, grad):
    x, weight, offs = ctx.saved_tensors
    dx, dw = experts_mm_backward(x, weight, offs, ctx.first, grad.contiguous())
    return dx, dw, None, None


experts_mm.register_autograd(_backward, setup_context=_setup)
