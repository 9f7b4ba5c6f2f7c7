"""Collectives addressed by ParallelMode (or a ProcessGroupAxis), each counted.

Every function takes ``axis``: a :class:`ParallelMode` (resolved through the
global context) or a :class:`ProcessGroupAxis`. On a group of one rank each is
the identity and communicates nothing. ``async_op=True`` returns a
:class:`Pending` whose ``wait()`` gives the result. These are not autograd-aware
(inputs are detached); ``mappings.py`` wraps them in conjugate autograd pairs.
"""
from __future__ import annotations

from typing import Callable, Sequence, Union

import torch
import torch.distributed as dist

from ..context import ParallelMode, ProcessGroupAxis, global_context
from .profile import record

AxisLike = Union[ParallelMode, ProcessGroupAxis]


# torch >= 2.10 names the flat-buffer collectives *_single; older releases *_into_tensor / *_tensor
_all_gather_flat = getattr(dist, 'all_gather_single', None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, 'reduce_scatter_single', None) or dist.reduce_scatter_tensor


def resolve(axis: AxisLike) -> ProcessGroupAxis:
    ax = global_context.axis(axis) if isinstance(axis, ParallelMode) else axis
    if ax.group is None and ax.size > 1:
        raise RuntimeError(f'{ax.mode.name} group of {ax.size} ranks has no process group: '
                           f'the layer was built for a described layout (use_context), which '
                           f'can be inspected but not run; build it after launch() to run it')
    return ax


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Pending:
    """The result of an async collective: ``wait()`` finishes it and returns the tensor."""

    def __init__(self, work, finish: Callable[[], torch.Tensor]):
        self._work = work
        self._finish = finish
        self._result = None

    def done(self) -> bool:
        """Whether the operation finished (a later ``wait()`` returns at once)."""
        return self._work is None or self._work.is_completed()

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
            self._result = self._finish()
        elif self._result is None:
            self._result = self._finish()
        return self._result


def _done(result: torch.Tensor, async_op: bool):
    return Pending(None, lambda: result) if async_op else result


def _run(work_or_none, finish, async_op):
    if async_op:
        return Pending(work_or_none, finish)
    return finish()


def check_divisible(size: int, parts: int, what: str):
    if size % parts:
        raise ValueError(f'{what} = {size} must be divisible by the group size {parts}')


def all_reduce(tensor: torch.Tensor, axis: AxisLike, op=dist.ReduceOp.SUM,
               async_op: bool = False, inplace: bool = False):
    """Sum (or ``op``) ``tensor`` over the group; returns the reduced tensor."""
    ax = resolve(axis)
    if ax.size == 1:
        return _done(tensor, async_op)
    out = tensor if inplace else tensor.detach().clone(memory_format=torch.contiguous_format)
    record(ax.mode, 'all_reduce', _nbytes(out), ax.size)
    work = dist.all_reduce(out, op=op, group=ax.group, async_op=async_op)
    return _run(work, lambda: out, async_op)


def all_gather(tensor: torch.Tensor, axis: AxisLike, dim: int = 0, async_op: bool = False,
               pairwise: bool = False):
    """Concatenate every rank's ``tensor`` along ``dim`` in local-rank order.

    ``pairwise``: one all_to_all sends the tensor to every rank at once (a send buffer of
    the output's size) instead of the backend's all_gather (:func:`prefers_pairwise`)."""
    ax = resolve(axis)
    if ax.size == 1:
        return _done(tensor, async_op)
    dim = dim % tensor.dim()
    inp = tensor.detach().contiguous()
    buf = torch.empty((ax.size * inp.shape[0],) + tuple(inp.shape[1:]), dtype=inp.dtype,
                      device=inp.device)
    record(ax.mode, 'all_gather', _nbytes(buf), ax.size)
    if pairwise:
        copies = inp.unsqueeze(0).expand((ax.size,) + tuple(inp.shape)).reshape(
            buf.shape).contiguous()   # a copy (a view when inp.shape[0] is 1)
        work = dist.all_to_all_single(buf, copies, group=ax.group, async_op=async_op)
    else:
        work = _all_gather_flat(buf, inp, group=ax.group, async_op=async_op)

    def finish():
        if dim == 0:
            return buf
        return torch.cat(buf.view((ax.size,) + tuple(inp.shape)).unbind(0), dim=dim)
    return _run(work, finish, async_op)


def reduce_scatter(tensor: torch.Tensor, axis: AxisLike, dim: int = 0, op=dist.ReduceOp.SUM,
                   async_op: bool = False, pairwise: bool = False):
    """Sum over the group, then keep this rank's chunk along ``dim``.

    ``pairwise``: one all_to_all brings this rank every rank's chunk, summed here in rank
    order (SUM only), with a receive buffer of the input's size, instead of the backend's
    reduce_scatter (:func:`prefers_pairwise`)."""
    ax = resolve(axis)
    if ax.size == 1:
        return _done(tensor, async_op)
    dim = dim % tensor.dim()
    check_divisible(tensor.shape[dim], ax.size, f'reduce_scatter dimension {dim}')
    out_shape = list(tensor.shape)
    out_shape[dim] //= ax.size
    tensor = tensor.detach()
    if dim == 0:
        inp = tensor.contiguous()
    else:  # bring the chunks of ``dim`` to the front: [p * chunk0, ...]
        inp = torch.cat(tensor.chunk(ax.size, dim=dim), dim=0).contiguous()
    record(ax.mode, 'reduce_scatter', _nbytes(inp), ax.size)
    if pairwise:
        if op != dist.ReduceOp.SUM:
            raise ValueError(f'reduce_scatter(pairwise=True) sums; got op {op}')
        chunks = torch.empty_like(inp)
        work = dist.all_to_all_single(chunks, inp, group=ax.group, async_op=async_op)
        return _run(work, lambda: chunks.view((ax.size,) + tuple(out_shape)).sum(0), async_op)
    out = torch.empty(out_shape, dtype=tensor.dtype, device=tensor.device)
    work = _reduce_scatter_flat(out, inp, op=op, group=ax.group, async_op=async_op)
    return _run(work, lambda: out, async_op)


def prefers_pairwise(axis: AxisLike) -> bool:
    """Whether :func:`all_gather` and :func:`reduce_scatter` over ``axis`` should take
    ``pairwise`` (one all_to_all: the same wire bytes, ``(P-1)/P`` of the full tensor, in
    one round instead of P-1): on gloo. Measured there (4 ranks, 2 MiB, 2 cores): its
    reduce_scatter 6-8 ms, as slow as its all_reduce (6-7 ms), pairwise 2.4-4.2 ms; its
    all_gather 3.6-5.2 ms, pairwise 2.5-3.2 ms. Taken by activations (sequence
    parallelism), whose transient buffers are one activation; ZeRO's gradient buckets
    keep the backend's collectives."""
    ax = resolve(axis)
    return ax.size > 1 and dist.get_backend(ax.group) == 'gloo'


def broadcast(tensor: torch.Tensor, axis: AxisLike, src: int = 0, async_op: bool = False,
              inplace: bool = False):
    """Every rank gets the tensor of local rank ``src``."""
    ax = resolve(axis)
    if ax.size == 1:
        return _done(tensor, async_op)
    out = tensor if inplace else tensor.detach().clone(memory_format=torch.contiguous_format)
    record(ax.mode, 'broadcast', _nbytes(out), ax.size)
    work = dist.broadcast(out, src=ax.global_rank(src), group=ax.group, async_op=async_op)
    return _run(work, lambda: out, async_op)


def reduce(tensor: torch.Tensor, axis: AxisLike, dst: int = 0, op=dist.ReduceOp.SUM,
           async_op: bool = False):
    """Sum onto local rank ``dst`` (other ranks' results are unspecified)."""
    ax = resolve(axis)
    if ax.size == 1:
        return _done(tensor, async_op)
    out = tensor.detach().contiguous().clone()
    record(ax.mode, 'reduce', _nbytes(out), ax.size)
    work = dist.reduce(out, dst=ax.global_rank(dst), op=op, group=ax.group, async_op=async_op)
    return _run(work, lambda: out, async_op)


def all_to_all(tensor: torch.Tensor, axis: AxisLike, scatter_dim: int, gather_dim: int,
               async_op: bool = False):
    """Split ``scatter_dim`` into group-size chunks, send chunk r to rank r, concat on ``gather_dim``."""
    ax = resolve(axis)
    if ax.size == 1:
        return _done(tensor, async_op)
    check_divisible(tensor.shape[scatter_dim], ax.size, f'all_to_all dimension {scatter_dim}')
    inputs = [c.detach().contiguous() for c in tensor.chunk(ax.size, dim=scatter_dim)]
    outputs = [torch.empty_like(c) for c in inputs]
    record(ax.mode, 'all_to_all', _nbytes(tensor), ax.size)
    work = dist.all_to_all(outputs, inputs, group=ax.group, async_op=async_op)
    return _run(work, lambda: torch.cat(outputs, dim=gather_dim), async_op)


def all_to_all_uneven(tensor: torch.Tensor, axis: AxisLike, send_counts: Sequence[int],
                      recv_counts: Sequence[int], async_op: bool = False):
    """Rows of ``tensor`` (dim 0) sent in consecutive runs: the first ``send_counts[0]`` to
    local rank 0, the next ``send_counts[1]`` to rank 1, ...; returns the received rows
    concatenated in rank order (``recv_counts[r]`` from rank r; ``sum(recv_counts)`` rows).
    Recorded as one all_to_all of the input's bytes (MoE token dispatch / combine), whose
    wire bytes are those bytes (the caller sends only rows that leave the rank)."""
    ax = resolve(axis)
    send_counts, recv_counts = [int(c) for c in send_counts], [int(c) for c in recv_counts]
    if len(send_counts) != ax.size or len(recv_counts) != ax.size:
        raise ValueError(f'all_to_all_uneven over the {ax.mode.name} group of {ax.size} ranks '
                         f'needs {ax.size} send and receive counts, got {len(send_counts)} '
                         f'and {len(recv_counts)}')
    if sum(send_counts) != tensor.shape[0]:
        raise ValueError(f'all_to_all_uneven: the send counts {send_counts} sum to '
                         f'{sum(send_counts)}, the tensor has {tensor.shape[0]} rows')
    if ax.size == 1:
        return _done(tensor, async_op)
    inp = tensor.detach().contiguous()
    out = inp.new_empty((sum(recv_counts),) + tuple(inp.shape[1:]))
    record(ax.mode, 'all_to_all', _nbytes(inp), ax.size, exact_wire=True)  # rows that leave
    work = dist.all_to_all_single(out, inp, output_split_sizes=recv_counts,
                                  input_split_sizes=send_counts, group=ax.group,
                                  async_op=async_op)
    return _run(work, lambda: out, async_op)


def split(tensor: torch.Tensor, axis: AxisLike, dim: int) -> torch.Tensor:
    """This rank's chunk of ``tensor`` along ``dim`` (no communication)."""
    ax = resolve(axis)
    if ax.size == 1:
        return tensor
    check_divisible(tensor.shape[dim], ax.size, f'split dimension {dim % tensor.dim()}')
    return tensor.chunk(ax.size, dim=dim)[ax.rank].contiguous()


def barrier(axis: AxisLike = ParallelMode.GLOBAL):
    ax = resolve(axis)
    if ax.size > 1:
        dist.barrier(group=ax.group)
