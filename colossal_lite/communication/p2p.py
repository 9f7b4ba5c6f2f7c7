"""Point-to-point messages inside a group, addressed by local rank, each counted."""
from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist

from .collective import AxisLike, Pending, resolve
from .profile import record


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def send(tensor: torch.Tensor, axis: AxisLike, dst: int, async_op: bool = False, tag: int = 0):
    """Send to local rank ``dst`` of the group (``tag`` tells apart messages between a pair)."""
    ax = resolve(axis)
    data = tensor.contiguous()
    record(ax.mode, 'send', _nbytes(data), ax.size)
    work = dist.isend(data, ax.global_rank(dst), group=ax.group, tag=tag)
    if async_op:
        return Pending(work, lambda: data)
    work.wait()
    return data


def recv(buffer: torch.Tensor, axis: AxisLike, src: int, async_op: bool = False, tag: int = 0):
    """Receive into ``buffer`` from local rank ``src`` of the group (the send of the same tag)."""
    ax = resolve(axis)
    record(ax.mode, 'recv', _nbytes(buffer), ax.size)
    work = dist.irecv(buffer, ax.global_rank(src), group=ax.group, tag=tag)
    if async_op:
        return Pending(work, lambda: buffer)
    work.wait()
    return buffer


def ring_exchange(tensor: torch.Tensor, axis: AxisLike, shift: int = 1,
                  async_op: bool = False):
    """Send ``tensor`` to local rank ``rank + shift`` and receive the one of ``rank - shift``.

    Returns the received tensor (same shape and dtype). With a group of one
    rank, the tensor itself.
    """
    ax = resolve(axis)
    if ax.size == 1:
        return Pending(None, lambda: tensor) if async_op else tensor
    data = tensor.contiguous()
    incoming = torch.empty_like(data)
    nbytes = _nbytes(data)
    record(ax.mode, 'send', nbytes, ax.size)
    record(ax.mode, 'recv', nbytes, ax.size)
    dst = ax.global_rank((ax.rank + shift) % ax.size)
    src = ax.global_rank((ax.rank - shift) % ax.size)
    works: List = [dist.isend(data, dst, group=ax.group), dist.irecv(incoming, src, group=ax.group)]
    pending = Pending(_Works(works), lambda: incoming)
    return pending if async_op else pending.wait()


class _Works:
    """Several works finished as one. A module-level class: a class made per call sits in a
    reference cycle, so its closure kept the sent and received buffers alive until the
    next garbage collection (every ring step's blocks piled up over a backward)."""

    def __init__(self, works: List):
        self.works = works

    def wait(self):
        for w in self.works:
            w.wait()

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)
