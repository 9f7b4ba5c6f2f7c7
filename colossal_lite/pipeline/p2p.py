"""Activations and gradients between pipeline stages, with a shape/dtype handshake.

Stage ``s`` runs on pipeline rank ``s % P``; its activation goes to rank ``(s+1) % P`` and
the gradient of that activation comes back. A message goes over the PIPELINE group (counted
by ``colossal_lite.communication``) with its own tag, made from (direction, stage,
micro-batch), so a receive is never matched with another message between the same ranks.

**Handshake.** The first message for a (direction, stage) and a *signature* -- the shapes
and dtypes of the micro-batch's input tensors, which every rank has -- is preceded by an
int64 header ``[dtype, ndim, shape...]``; both sides remember the shape under that key and
later messages with the same signature carry only the payload. So batch size and sequence
length may change between steps (a new signature gets a new header) at one message per
transfer in steady state. A stage whose activation shape changes while its inputs' shapes
do not is a ValueError on the sending side.

**Scatter-gather.** Under 1D tensor parallelism the activation between stages is replicated
over the t ranks of PARALLEL_1D: each rank sends only its 1/t slice of the flattened tensor
and the receiving stage all-gathers the slices over PARALLEL_1D (Megatron's), so the link
carries 1/t of the bytes. Other modes, and 1D with sequence parallelism (whose activation
is already the rank's sequence block), send each rank's own shard to the same tensor
position of the next stage.

**Buffers.** Sends are non-blocking; a sent buffer is kept until the send is known to be
received, then released (its ``wait()`` returns at once): :func:`release_points` finds,
from the lowered action lists of every rank, the first receive from the same peer that the
peer sent after it received ours. Receives block.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from ..communication import all_gather
from ..communication import p2p
from ..context import ParallelMode, current_context
from .actions import B, F, RECV_B, RECV_F, SEND_B, SEND_F, Action, PipeShape

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
           torch.bool, torch.uint8]
_HEADER = 8  # dtype, ndim, up to 6 dims
FORWARD, BACKWARD = 0, 1
MessageKey = Tuple[str, int, int]  # (F or B, receiving stage, micro-batch)


def message_key(action: Action) -> MessageKey:
    """The message a SEND or RECV action moves: (direction, receiving stage, micro-batch)."""
    if action.kind == SEND_F:
        return F, action.stage + 1, action.microbatch
    if action.kind == SEND_B:
        return B, action.stage - 1, action.microbatch
    return (F if action.kind == RECV_F else B), action.stage, action.microbatch


def _sender_stage(key: MessageKey) -> int:
    return key[1] - 1 if key[0] == F else key[1] + 1


def release_points(shape: PipeShape, actions: Dict[int, List[Action]], rank: int
                   ) -> Dict[int, List[MessageKey]]:
    """``{action index on rank: [messages sent by rank, known received once it ran]}``.

    A send X to peer q is received at q's RECV R; q's sends after R happen after X arrived.
    So X is released after this rank's first receive (after X) of a message q sent after R.
    Sends with no such receive are released at the end of the step."""
    recv_at = {q: {message_key(a): i for i, a in enumerate(acts) if a.kind in (RECV_F, RECV_B)}
               for q, acts in actions.items()}
    send_at = {q: {message_key(a): i for i, a in enumerate(acts) if a.kind in (SEND_F, SEND_B)}
               for q, acts in actions.items()}
    mine = actions[rank]
    out: Dict[int, List[MessageKey]] = {}
    for i, a in enumerate(mine):
        if a.kind not in (SEND_F, SEND_B):
            continue
        key = message_key(a)
        peer = shape.rank_of(key[1])
        received = recv_at[peer][key]
        for j in range(i + 1, len(mine)):
            b = mine[j]
            if b.kind in (RECV_F, RECV_B):
                k2 = message_key(b)
                if shape.rank_of(_sender_stage(k2)) == peer and send_at[peer][k2] > received:
                    out.setdefault(j, []).append(key)
                    break
    return out


def input_signature(inputs) -> tuple:
    """Shapes and dtypes of the tensors in a micro-batch's inputs (the same on every rank)."""
    if torch.is_tensor(inputs):
        return ((tuple(inputs.shape), str(inputs.dtype)),)
    if isinstance(inputs, dict):
        return tuple((k,) + input_signature(v) for k, v in sorted(inputs.items()))
    if isinstance(inputs, (tuple, list)):
        return tuple(input_signature(v) for v in inputs)
    return ()


class StageLink:
    """Point-to-point messages of one pipeline rank (see module doc); lives across steps."""

    def __init__(self, stages: int):
        ctx = current_context()
        self.axis = ctx.axis(ParallelMode.PIPELINE)
        self.stages = stages
        self.device = ctx.device
        replicated = ctx.layout is not None and ctx.layout.mode == '1d' \
            and not ctx.layout.sequence_parallel  # sequence parallel: already split
        self.slice_axis = ctx.axis(ParallelMode.PARALLEL_1D) if replicated else None
        if self.slice_axis is not None and self.slice_axis.size == 1:
            self.slice_axis = None
        self.pending: Dict[MessageKey, List] = {}
        self.sent_shapes: Dict[tuple, Tuple[torch.dtype, tuple]] = {}
        self.recv_shapes: Dict[tuple, Tuple[torch.dtype, tuple]] = {}

    def _tag(self, key: MessageKey, part: int) -> int:
        direction = FORWARD if key[0] == F else BACKWARD
        return ((direction * self.stages + key[1]) * 65536 + key[2]) * 2 + part

    def _sliced(self, numel: int) -> bool:
        return self.slice_axis is not None and numel % self.slice_axis.size == 0

    def send(self, tensor: torch.Tensor, key: MessageKey, signature: tuple, first: int):
        """Send ``tensor`` as message ``key`` (see :func:`message_key`) to the rank of its
        receiving stage; ``signature``: :func:`input_signature` of the micro-batch, ``first``:
        the step's first micro-batch with that signature (the header's tag, the same for the
        receiver whichever of them it receives first)."""
        if tensor.dim() > _HEADER - 2:
            raise ValueError(f'a stage activation may have at most {_HEADER - 2} dims, got '
                             f'shape {tuple(tensor.shape)}')
        dst = key[1] % self.axis.size
        cache = (key[0], key[1], signature)
        meta = (tensor.dtype, tuple(tensor.shape))
        works = []
        if cache not in self.sent_shapes:
            header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
            header[0], header[1] = _DTYPES.index(tensor.dtype), tensor.dim()
            header[2:2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
            works.append(p2p.send(header, self.axis, dst, async_op=True,
                                  tag=self._tag(key[:2] + (first,), 0)))
            self.sent_shapes[cache] = meta
        elif self.sent_shapes[cache] != meta:
            raise ValueError(f'stage {_sender_stage(key)} produced a {meta[0]} tensor of shape '
                             f'{meta[1]} where it produced {self.sent_shapes[cache]} for inputs '
                             f'of the same shapes; a pipeline stage\'s activation shape must '
                             f'follow from its input shapes')
        data = tensor.detach().contiguous()
        if self._sliced(data.numel()):
            data = data.reshape(-1).chunk(self.slice_axis.size)[self.slice_axis.rank].clone()
        works.append(p2p.send(data, self.axis, dst, async_op=True, tag=self._tag(key, 1)))
        self.pending[key] = works

    def recv(self, key: MessageKey, signature: tuple, first: int) -> torch.Tensor:
        """Message ``key`` for this rank's stage (``signature``, ``first``: as in
        :meth:`send`); blocks until it arrives."""
        src = _sender_stage(key) % self.axis.size
        cache = (key[0], key[1], signature)
        if cache not in self.recv_shapes:
            header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
            p2p.recv(header, self.axis, src, tag=self._tag(key[:2] + (first,), 0))
            ndim = int(header[1])
            self.recv_shapes[cache] = (_DTYPES[int(header[0])],
                                       tuple(int(d) for d in header[2:2 + ndim]))
        dtype, shape = self.recv_shapes[cache]
        full = torch.empty(shape, dtype=dtype, device=self.device)
        if not self._sliced(full.numel()):
            return p2p.recv(full, self.axis, src, tag=self._tag(key, 1))
        part = torch.empty(full.numel() // self.slice_axis.size, dtype=dtype, device=self.device)
        p2p.recv(part, self.axis, src, tag=self._tag(key, 1))
        return all_gather(part, self.slice_axis).reshape(shape)

    def release(self, keys: List[MessageKey]):
        """Finish sends known to be received (their buffers are dropped)."""
        for key in keys:
            for work in self.pending.pop(key, ()):
                work.wait()

    def wait_sends(self):
        """Finish every send still pending (end of the step)."""
        self.release(list(self.pending))
