"""Activations and gradients between pipeline stages, with a shape/dtype handshake.

Stage ``s`` runs on pipeline rank ``s % P``; its activation goes to rank ``(s+1) % P`` and
the gradient of that activation comes back. A message is two sends over the PIPELINE group
(both counted by ``colossal_lite.communication``): an int64 header ``[dtype, ndim, shape...]``
and the payload, so batch size and sequence length may change from one step to the next.
Each message has its own tag, made from (direction, stage, micro-batch), so a receive can
never be matched with another message between the same two ranks.

Under 1D tensor parallelism the activation between stages is replicated over the t ranks
of PARALLEL_1D: each rank sends only its 1/t slice of the flattened tensor and the receiving
stage all-gathers the slices over PARALLEL_1D (Megatron's scatter-gather), so the link
carries 1/t of the bytes. Other modes send each rank's own shard to the same tensor
position of the next stage.

Sends are non-blocking (their buffers are dropped once the send completed, and every send
is waited for at the end of the step); receives block.
"""
from __future__ import annotations

from typing import List, Tuple

import torch

from ..communication import all_gather
from ..communication import p2p
from ..context import ParallelMode, current_context

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
           torch.bool, torch.uint8]
_HEADER = 8  # dtype, ndim, up to 6 dims
FORWARD, BACKWARD = 0, 1


class StageLink:
    """Point-to-point messages of one pipeline rank (see module doc)."""

    def __init__(self, stages: int, microbatches: int):
        ctx = current_context()
        self.axis = ctx.axis(ParallelMode.PIPELINE)
        self.stages, self.microbatches = stages, microbatches
        self.device = ctx.device
        mode = ctx.layout.mode if ctx.layout is not None else None
        self.slice_axis = ctx.axis(ParallelMode.PARALLEL_1D) if mode == '1d' else None
        if self.slice_axis is not None and self.slice_axis.size == 1:
            self.slice_axis = None
        self.pending: List = []

    def _tag(self, direction: int, stage: int, microbatch: int, part: int) -> int:
        return ((direction * self.stages + stage) * self.microbatches + microbatch) * 2 + part

    def _sliced(self, tensor: torch.Tensor) -> bool:
        return self.slice_axis is not None and tensor.numel() % self.slice_axis.size == 0

    def send(self, tensor: torch.Tensor, direction: int, stage: int, microbatch: int):
        """Send the activation (FORWARD: of ``stage`` to ``stage + 1``) or gradient
        (BACKWARD: of ``stage``'s input to ``stage - 1``) of ``microbatch``."""
        if tensor.dim() > _HEADER - 2:
            raise ValueError(f'a stage activation may have at most {_HEADER - 2} dims, got '
                             f'shape {tuple(tensor.shape)}')
        target = stage + 1 if direction == FORWARD else stage - 1
        dst = target % self.axis.size
        header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
        header[0], header[1] = _DTYPES.index(tensor.dtype), tensor.dim()
        header[2:2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        data = tensor.detach().contiguous()
        if self._sliced(data):
            data = data.reshape(-1).chunk(self.slice_axis.size)[self.slice_axis.rank].clone()
        self.pending = [work for work in self.pending if not work.done()]  # free sent buffers
        for part, payload in ((0, header), (1, data)):
            self.pending.append(p2p.send(payload, self.axis, dst, async_op=True,
                                         tag=self._tag(direction, target, microbatch, part)))

    def recv(self, direction: int, stage: int, microbatch: int) -> torch.Tensor:
        """The activation (FORWARD) or gradient (BACKWARD) that ``stage`` needs for
        ``microbatch``; blocks until it arrives."""
        source = stage - 1 if direction == FORWARD else stage + 1
        src = source % self.axis.size
        header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
        p2p.recv(header, self.axis, src, tag=self._tag(direction, stage, microbatch, 0))
        dtype, ndim = _DTYPES[int(header[0])], int(header[1])
        shape: Tuple[int, ...] = tuple(int(d) for d in header[2:2 + ndim])
        full = torch.empty(shape, dtype=dtype, device=self.device)
        if not self._sliced(full):
            return p2p.recv(full, self.axis, src, tag=self._tag(direction, stage, microbatch, 1))
        part = torch.empty(full.numel() // self.slice_axis.size, dtype=dtype, device=self.device)
        p2p.recv(part, self.axis, src, tag=self._tag(direction, stage, microbatch, 1))
        return all_gather(part, self.slice_axis).reshape(shape)

    def wait_sends(self):
        """Finish every send of the step (their buffers are released afterwards)."""
        for work in self.pending:
            work.wait()
        self.pending = []
