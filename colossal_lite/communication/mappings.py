"""Autograd-aware collectives: conjugate pairs whose backward is the transpose of forward.

=====================  ==========================  ===========================
function               forward                     backward
=====================  ==========================  ===========================
copy_to                identity                    all_reduce
reduce_from            all_reduce                  identity
split_to               keep own chunk of ``dim``   all_gather ``dim``
gather_from            all_gather ``dim``          keep own chunk of ``dim``
all_gather_to          all_gather ``dim``          reduce_scatter ``dim``
reduce_scatter_to      reduce_scatter ``dim``      all_gather ``dim``
all_to_all_to          all_to_all ``s`` -> ``g``   all_to_all ``g`` -> ``s``
all_to_all_rows        rows sent by counts         rows sent back by the counts swapped
=====================  ==========================  ===========================

``copy_to``/``reduce_from`` bracket a region where a replicated input feeds
partial computations; ``split_to``/``gather_from`` move between a replicated
tensor and its shards when every rank computes the same thing downstream;
``all_gather_to``/``reduce_scatter_to`` are the pair for sharded operands
whose products are partial sums (3D, sequence); ``all_to_all_to`` re-splits a tensor
from one dimension to another (Ulysses: sequence-split to head-split and back);
``all_to_all_rows`` sends uneven runs of rows (MoE: tokens to the ranks of their experts,
and the inverse exchange brings the outputs back).
"""
from __future__ import annotations

import torch

import colossal_lite.communication.collective as C

from .collective import AxisLike, resolve


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return x

    @staticmethod
    def backward(ctx, grad):
        return C.all_reduce(grad, ctx.axis), None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, inplace):
        if inplace:
            ctx.mark_dirty(x)
        return C.all_reduce(x, axis, inplace=inplace)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _SplitTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, dim):
        ctx.axis, ctx.dim = axis, dim
        return C.split(x, axis, dim)

    @staticmethod
    def backward(ctx, grad):
        return C.all_gather(grad, ctx.axis, ctx.dim), None, None


class _GatherFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, dim):
        ctx.axis, ctx.dim = axis, dim
        return C.all_gather(x, axis, dim)

    @staticmethod
    def backward(ctx, grad):
        return C.split(grad, ctx.axis, ctx.dim), None, None


class _AllGatherTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, dim):
        ctx.axis, ctx.dim = axis, dim
        return C.all_gather(x, axis, dim)

    @staticmethod
    def backward(ctx, grad):
        return C.reduce_scatter(grad, ctx.axis, ctx.dim), None, None


class _ReduceScatterTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, dim, pairwise):
        ctx.axis, ctx.dim, ctx.pairwise = axis, dim, pairwise
        return C.reduce_scatter(x, axis, dim, pairwise=pairwise)

    @staticmethod
    def backward(ctx, grad):
        return C.all_gather(grad, ctx.axis, ctx.dim, pairwise=ctx.pairwise), None, None, None


class _AllToAllTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, scatter_dim, gather_dim):
        ctx.axis, ctx.dims = axis, (scatter_dim, gather_dim)
        return C.all_to_all(x, axis, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return C.all_to_all(grad, ctx.axis, gather_dim, scatter_dim), None, None, None


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, send_counts, recv_counts):
        ctx.axis, ctx.counts = axis, (send_counts, recv_counts)
        return C.all_to_all_uneven(x, axis, send_counts, recv_counts)

    @staticmethod
    def backward(ctx, grad):
        send_counts, recv_counts = ctx.counts
        return C.all_to_all_uneven(grad, ctx.axis, recv_counts, send_counts), None, None, None


def _skip(axis: AxisLike):
    ax = resolve(axis)
    return ax, ax.size == 1


def copy_to(x: torch.Tensor, axis: AxisLike) -> torch.Tensor:
    """Identity forward; gradients summed over the group backward."""
    ax, trivial = _skip(axis)
    return x if trivial else _CopyTo.apply(x, ax)


def reduce_from(x: torch.Tensor, axis: AxisLike, inplace: bool = False) -> torch.Tensor:
    """Partial sums all-reduced forward; gradient passed through backward. ``inplace``: ``x``
    is the caller's own temporary (e.g. a matmul's output nothing else reads), reduced in
    its own buffer instead of a copy."""
    ax, trivial = _skip(axis)
    return x if trivial else _ReduceFrom.apply(x, ax, inplace)


def split_to(x: torch.Tensor, axis: AxisLike, dim: int) -> torch.Tensor:
    """Own chunk of ``dim`` forward; gradient chunks all-gathered backward."""
    ax, trivial = _skip(axis)
    return x if trivial else _SplitTo.apply(x, ax, dim)


def gather_from(x: torch.Tensor, axis: AxisLike, dim: int) -> torch.Tensor:
    """Chunks all-gathered along ``dim`` forward; own gradient chunk kept backward."""
    ax, trivial = _skip(axis)
    return x if trivial else _GatherFrom.apply(x, ax, dim)


def all_gather_to(x: torch.Tensor, axis: AxisLike, dim: int) -> torch.Tensor:
    """All-gather along ``dim`` forward; reduce-scatter of the gradient backward."""
    ax, trivial = _skip(axis)
    return x if trivial else _AllGatherTo.apply(x, ax, dim)


def reduce_scatter_to(x: torch.Tensor, axis: AxisLike, dim: int,
                      pairwise: bool = False) -> torch.Tensor:
    """Reduce-scatter along ``dim`` forward; all-gather of the gradient backward
    (``pairwise``: both as one all_to_all, :func:`.collective.prefers_pairwise`)."""
    ax, trivial = _skip(axis)
    return x if trivial else _ReduceScatterTo.apply(x, ax, dim, pairwise)


def all_to_all_to(x: torch.Tensor, axis: AxisLike, scatter_dim: int, gather_dim: int
                  ) -> torch.Tensor:
    """``scatter_dim`` cut in group-size chunks, chunk r sent to rank r, the received chunks
    concatenated along ``gather_dim`` (in rank order) forward; the inverse all_to_all of the
    gradient backward."""
    ax, trivial = _skip(axis)
    return x if trivial else _AllToAllTo.apply(x, ax, scatter_dim, gather_dim)


def all_to_all_rows(x: torch.Tensor, axis: AxisLike, send_counts, recv_counts) -> torch.Tensor:
    """Rows of ``x`` sent in runs of ``send_counts`` (run r to local rank r), the received
    runs (``recv_counts``) concatenated in rank order forward; backward sends each gradient
    row back where its row came from (the same exchange, counts swapped)."""
    ax, trivial = _skip(axis)
    return x if trivial else _AllToAllRows.apply(x, ax, tuple(int(c) for c in send_counts),
                                                 tuple(int(c) for c in recv_counts))
