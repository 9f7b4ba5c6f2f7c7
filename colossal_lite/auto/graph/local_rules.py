"""Rules DTensor lacks, run on local shards: the vocab-parallel loss and embedding, the
row-parallel matmul with a bias, and grouped expert matmuls (``experts.py``).

**Class split.** A causal LM's loss decomposes into ``log_softmax(logits, -1)``, ``gather``
of each target's entry, a mean; its embedding is a row lookup. With the vocabulary split
over a mesh axis of k ranks (rank r holds classes ``[o_r, o_r + V/k)``), DTensor has no
rule that keeps the split, so every plan gathered ``[tokens, V]`` logits. These rules keep
it (Megatron's vocab-parallel embedding and cross entropy):

* ``_log_softmax(x S(d)) -> S(d)``: ``m = max_all(max_d x)``, ``s = sum_all(sum_d e^(x-m))``,
  ``y = x - m - log s``; backward ``dx = g - e^y * sum_all(sum_d g)``. Collectives: two
  all_reduce of ``[tokens, 1]`` forward (max, sum), one backward (:func:`inner_collectives`).
* ``gather(y S(d), d, index R) -> P``: each rank reads the targets it holds (index shifted
  by ``o_r``, others masked to 0); the sum over the axis is the full read.
* ``embedding(W S(0), ids R) -> P``: rows outside ``[o_r, o_r + V/k)`` read as zeros.

``offset`` follows DTensor's chunking (axes left to right, each splitting the previous
piece), so a dim split over several axes works too.

**Row-parallel addmm.** ``addmm(b R, x S(1), W S(0)) -> P`` (GPT-2's Conv1D, any
``nn.Linear`` traced with its bias fused): DTensor would add the replicated bias on every
rank of the partial sum, so it has no such rule and the planner could not row-split a
biased projection. Here rank 0 of the axis adds the bias, the others add nothing. The
bias's gradient needs no collective on that axis: the gradient of a partial output reaches
every rank whole (DTensor keeps it replicated), so each rank sums it over the rows itself
(:class:`_RowParallelAddmm`) and the bias's gradient is whole where the output was partial
(:func:`whole_grad_slots`; the executor and ``GraphCost`` both read it).
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard

from .experts import experts_mm, grouped_mm_rules, is_grouped_mm

aten = torch.ops.aten

LOG_SOFTMAX = aten._log_softmax.default
GATHER = aten.gather.default
EMBEDDING = aten.embedding.default
ADDMM = aten.addmm.default


def split_axes(placements, dim: int) -> List[int]:
    """The mesh axes on which ``placements`` shard ``dim``."""
    return [a for a, p in enumerate(placements) if isinstance(p, Shard) and p.dim == dim]


def offset(mesh: DeviceMesh, placements, dim: int, size: int) -> int:
    """Where this rank's shard of ``dim`` (full length ``size``) starts."""
    start = 0
    for axis, p in enumerate(placements):
        if isinstance(p, Shard) and p.dim == dim:
            size //= mesh.size(axis)
            start += mesh.get_local_rank(axis) * size
    return start


class _LogSoftmax(torch.autograd.Function):
    """log_softmax over a dim split on ``axes`` of ``mesh`` (local shards in and out)."""

    @staticmethod
    def forward(ctx, x, dim, mesh, axes):
        m = x.detach().amax(dim, keepdim=True)
        for a in axes:
            m = funcol.all_reduce(m, 'max', (mesh, a))
        z = x - m
        s = z.exp().sum(dim, keepdim=True)
        for a in axes:
            s = funcol.all_reduce(s, 'sum', (mesh, a))
        y = z - s.log()
        ctx.save_for_backward(y)
        ctx.dim, ctx.mesh, ctx.axes = dim, mesh, axes
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        total = g.sum(ctx.dim, keepdim=True)
        for a in ctx.axes:
            total = funcol.all_reduce(total, 'sum', (ctx.mesh, a))
        return g - y.exp() * total, None, None, None


class _RowParallelAddmm(torch.autograd.Function):
    """``bias + x @ w`` on the rank that adds the bias, ``x @ w`` elsewhere; the bias's
    gradient is the whole output gradient summed over rows on every rank."""

    @staticmethod
    def forward(ctx, bias, x, w, first: bool):
        ctx.save_for_backward(x, w)
        return torch.addmm(bias, x, w) if first else torch.mm(x, w)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return (g.sum(0) if ctx.needs_input_grad[0] else None,
                g @ w.t() if ctx.needs_input_grad[1] else None,
                x.t() @ g if ctx.needs_input_grad[2] else None, None)


def whole_grad_slots(node: torch.fx.Node) -> Tuple[int, ...]:
    """Input slots whose local gradient is whole on every rank along the mesh axes where
    the op's output is a partial sum (not the dual rule's partial): the row-parallel
    addmm's bias."""
    return (0,) if node.target is ADDMM else ()


def run_local(node: torch.fx.Node, args: Sequence, mesh: DeviceMesh, placements,
              out_placements=(), inputs=()) -> object:
    """Run ``node`` on local shards by one of these rules (``placements``: its first tensor
    input's, ``out_placements``: its output's, ``inputs``: every input's); None when none
    applies (the op itself runs on the local shards)."""
    if is_grouped_mm(node.target):   # the expert-parallel region when W's experts are split
        weight = inputs[1] if len(inputs) > 1 else None
        if weight is None or not split_axes(weight, 0):
            return None
        experts = node.args[1].meta['val'].shape[0]
        return experts_mm(*args[:3], offset(mesh, weight, 0, experts))
    if node.target is LOG_SOFTMAX:
        x, dim = args[0], args[1] % args[0].dim()
        axes = split_axes(placements, dim)
        return _LogSoftmax.apply(x, dim, mesh, axes) if axes else None
    if node.target is GATHER:
        y, dim, index = args[0], args[1] % args[0].dim(), args[2]
        if not split_axes(placements, dim):
            return None
        full = node.args[0].meta['val'].shape[dim]
        local = index - offset(mesh, placements, dim, full)
        mine = (local >= 0) & (local < y.shape[dim])
        read = torch.gather(y, dim, torch.where(mine, local, torch.zeros_like(local)))
        return torch.where(mine, read, torch.zeros_like(read))
    if node.target is ADDMM:
        if not any(isinstance(p, Partial) for p in out_placements):
            return None
        first = all(mesh.get_local_rank(a) == 0 for a, p in enumerate(out_placements)
                    if isinstance(p, Partial))
        return _RowParallelAddmm.apply(*args[:3], first)
    if node.target is EMBEDDING:
        weight, ids = args[0], args[1]
        if not split_axes(placements, 0):
            return None
        full = node.args[0].meta['val'].shape[0]
        local = ids - offset(mesh, placements, 0, full)
        mine = (local >= 0) & (local < weight.shape[0])
        rows = torch.nn.functional.embedding(torch.where(mine, local, torch.zeros_like(local)),
                                             weight)
        return rows * mine.unsqueeze(-1).to(rows.dtype)
    return None


def local_rules(node: torch.fx.Node, k: int, slots: Sequence) -> List[tuple]:
    """Per-axis ``(inputs, outputs)`` of these rules on an axis of size k (``slots``: the
    node's flattened arguments, tensor ones as nodes, others None); empty for other ops or
    a class dim k does not divide. Grouped expert matmuls: ``experts.py``."""
    if is_grouped_mm(node.target):
        return grouped_mm_rules(node, k, slots)
    if node.target is ADDMM:
        if len(node.args) > 3 or node.kwargs or node.args[0].meta['val'].dim() != 1 \
                or node.args[1].meta['val'].shape[1] % k:
            return []
        return [(((Replicate(),), (Shard(1),), (Shard(0),)), ((Partial(),),))]
    if node.target is LOG_SOFTMAX:
        x = node.args[0].meta['val']
        dim = node.args[1] % x.dim()
        given, out = [(Shard(dim),)], (Shard(dim),)
    elif node.target is GATHER:
        y = node.args[0].meta['val']
        dim = node.args[1] % y.dim()
        if len(node.args) > 3 or node.kwargs.get('sparse_grad'):
            return []
        given, out = [(Shard(dim),), (Replicate(),)], (Partial(),)
    elif node.target is EMBEDDING:
        y, dim = node.args[0].meta['val'], 0
        if len(node.args) > 2 or node.kwargs:
            return []
        given, out = [(Shard(0),), (Replicate(),)], (Partial(),)
    else:
        return []
    if (y if node.target is not LOG_SOFTMAX else x).shape[dim] % k:
        return []
    it = iter(given)
    inputs = tuple(next(it, (Replicate(),)) if s is not None else None for s in slots)
    return [(inputs, (out,))]


def inner_collectives(node: torch.fx.Node, inputs, mesh_shape: Sequence[int]
                      ) -> List[Tuple[str, int, int]]:
    """``(op, axis, buffer bytes)`` issued inside the op by the log_softmax rule (its two
    forward all_reduces and one backward), for input placements ``inputs[0]`` as names."""
    if node.target is not LOG_SOFTMAX or not inputs or inputs[0] is None:
        return []
    x = node.args[0].meta['val']
    dim = node.args[1] % x.dim()
    axes = [a for a, p in enumerate(inputs[0]) if p == f'S{dim}']
    if not axes:
        return []
    rows = x.numel() // x.shape[dim] * x.element_size()
    for a, p in enumerate(inputs[0]):
        if p.startswith('S') and p != f'S{dim}':
            rows //= mesh_shape[a]
    return [('all_reduce', a, rows) for a in axes for _ in range(3)]
