"""The 3D cube: its groups, the two activation layouts, the two linear orientations.

The q x q x q ranks of the tensor axis have coordinates (i, j, l) on the axes
``input`` (i), ``weight`` (j) and ``output`` (l) of ``context/layout.py``.
A :class:`Cube3D` holds the five groups as :class:`ProcessGroupAxis` objects
(INPUT varies i, WEIGHT varies j, OUTPUT varies l, INPUT_X_WEIGHT varies (i, j)
with local rank j*q + i, OUTPUT_X_WEIGHT varies (l, j) with local rank l*q + j)
and is the only thing the autograd functions receive.

Activations ``[b, ..., h]`` are split along the batch into q^2 chunks and along
the hidden dim into q chunks, in one of two layouts:

* standard (``Cube3D.standard``): batch chunk j*q + i, hidden chunk l;
* swapped  (``Cube3D.swapped``):  batch chunk l*q + i, hidden chunk j.

A linear in the ``enter`` orientation maps standard -> swapped, one in the
``exit`` orientation maps swapped -> standard (see ``layers.py``), so an
enter/exit pair needs no re-layout; :func:`swap_layout` converts swapped ->
standard with one point-to-point exchange between (i, j, l) and (i, l, j).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from ...communication import collective as C
from ...communication import gather_from
from ...communication.p2p import recv, send
from ...context import ParallelMode, ProcessGroupAxis, current_context
from ...config.families import family
from .._grid import split_dim

_ROLES = ('input', 'weight', 'output', 'input_x_weight', 'output_x_weight')


@dataclass(frozen=True)
class ActLayout:
    """How a ``[b, ..., h]`` activation is cut: the batch by ``batch`` (outermost cut first),
    the last dim by ``hidden``."""

    batch: Tuple[ProcessGroupAxis, ...]
    hidden: ProcessGroupAxis

    @property
    def batch_parts(self) -> int:
        parts = 1
        for ax in self.batch:
            parts *= ax.size
        return parts

    @property
    def batch_cuts(self) -> tuple:
        """Cuts of dim 0 (the batch) of a tensor in this layout, outermost first."""
        return tuple((0, ax) for ax in self.batch)


@dataclass(frozen=True)
class Orientation:
    """One 3D matmul y = x A^T: all-gather x over ``x_gather`` (batch), A over ``w_gather``,
    multiply, reduce-scatter y over ``y_scatter`` (batch).

    Weight ``[out, in]`` -> ``[out/q^2, in/q]``: dim 0 cut by ``x_gather`` then ``w_gather``,
    dim 1 by ``y_scatter``; bias ``[out]`` -> ``[out/q^2]`` cut like dim 0.
    """

    x_gather: ProcessGroupAxis
    w_gather: ProcessGroupAxis
    y_scatter: ProcessGroupAxis

    @property
    def weight_cuts(self) -> tuple:
        return (0, self.x_gather), (0, self.w_gather), (1, self.y_scatter)

    @property
    def bias_cuts(self) -> tuple:
        return (0, self.x_gather), (0, self.w_gather)


@dataclass(frozen=True)
class Cube3D:
    """The five groups of one rank's cube and its local coordinates (i, j, l)."""

    input: ProcessGroupAxis
    weight: ProcessGroupAxis
    output: ProcessGroupAxis
    input_x_weight: ProcessGroupAxis
    output_x_weight: ProcessGroupAxis

    def __post_init__(self):
        sizes = (self.input.size, self.weight.size, self.output.size)
        if len(set(sizes)) != 1 or self.input_x_weight.size != sizes[0] ** 2 \
                or self.output_x_weight.size != sizes[0] ** 2:
            raise ValueError(f'a 3D cube needs input/weight/output groups of one size q and '
                             f'planes of q^2, got {sizes}, {self.input_x_weight.size}, '
                             f'{self.output_x_weight.size}')

    @staticmethod
    def from_context() -> 'Cube3D':
        ctx = current_context()
        roles = family('3d').roles
        return Cube3D(*(ctx.axis(roles[name]) for name in _ROLES))

    @staticmethod
    def serial() -> 'Cube3D':
        return Cube3D(*(ProcessGroupAxis.serial(family('3d').roles[name]) for name in _ROLES))

    @property
    def q(self) -> int:
        return self.input.size

    @property
    def coords(self) -> Tuple[int, int, int]:
        return self.input.rank, self.weight.rank, self.output.rank

    @property
    def standard(self) -> ActLayout:
        return ActLayout((self.input_x_weight,), self.output)

    @property
    def swapped(self) -> ActLayout:
        return ActLayout((self.output, self.input), self.weight)

    @property
    def enter(self) -> Orientation:
        """standard -> swapped."""
        return Orientation(self.weight, self.input, self.output)

    @property
    def exit(self) -> Orientation:
        """swapped -> standard."""
        return Orientation(self.output, self.input, self.weight)


def default_cube(cube: Optional[Cube3D] = None) -> Cube3D:
    """``cube`` if given; the launched cube in mode '3d'; else a one-rank cube (serial)."""
    if cube is not None:
        return cube
    if current_context().tensor_mode == '3d':
        return Cube3D.from_context()
    return Cube3D.serial()


def check_batch(batch: int, layout: ActLayout, what: str):
    parts = layout.batch_parts
    if batch % parts:
        q = layout.hidden.size
        raise ValueError(f'3D tensor parallelism needs the batch of {what} divisible by '
                         f'q^2 = {q}^2 = {parts}, got batch {batch}')


def split_batch(x: torch.Tensor, layout: ActLayout, what: str = 'the input') -> torch.Tensor:
    """This rank's batch chunk of a full tensor (no communication, no autograd edge)."""
    check_batch(x.shape[0], layout, what)
    for ax in layout.batch:
        x = C.split(x, ax, 0)
    return x


def gather_batch(x: torch.Tensor, layout: ActLayout) -> torch.Tensor:
    """Full batch from batch chunks (all_gather per cut, innermost first; backward keeps
    the own chunk, so use it where the result is replicated downstream)."""
    for ax in reversed(layout.batch):
        x = gather_from(x, ax, 0)
    return x


def split_activation(x: torch.Tensor, layout: ActLayout) -> torch.Tensor:
    """Full ``[b, ..., h]`` -> this rank's block in ``layout`` (no communication)."""
    x = split_batch(x, layout)
    return split_dim(x, layout.hidden.size, layout.hidden.rank, -1, '3D hidden split')


def gather_activation(x: torch.Tensor, layout: ActLayout) -> torch.Tensor:
    """Inverse of :func:`split_activation` (all_gathers; backward keeps the own block)."""
    return gather_batch(gather_from(x, layout.hidden, -1), layout)


class _SwapLayout(torch.autograd.Function):
    """Exchange blocks with the transposed rank of the (l, j) plane; backward is the same."""

    @staticmethod
    def forward(ctx, x, cube):
        ctx.cube = cube
        return _exchange(x, cube)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.cube), None


def _exchange(x: torch.Tensor, cube: Cube3D) -> torch.Tensor:
    _, j, l = cube.coords
    if j == l:
        return x
    peer = j * cube.q + l          # local rank of (l'=j, j'=l) in OUTPUT_X_WEIGHT
    x = x.contiguous()
    incoming = torch.empty_like(x)
    pending = [send(x, cube.output_x_weight, peer, async_op=True),
               recv(incoming, cube.output_x_weight, peer, async_op=True)]
    for p in pending:
        p.wait()
    return incoming


def swap_layout(x: torch.Tensor, cube: Cube3D) -> torch.Tensor:
    """Swapped layout -> standard layout: rank (i, j, l) holds batch l*q+i, hidden j and needs
    batch j*q+i, hidden l, which rank (i, l, j) holds. One send + recv of the local block
    over OUTPUT_X_WEIGHT (none on the diagonal j == l), forward and backward."""
    if cube.q == 1:
        return x
    return _SwapLayout.apply(x, cube)


class _SumShared(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return C.all_reduce(x, axis)

    @staticmethod
    def backward(ctx, grad):
        return C.all_reduce(grad, ctx.axis), None


def sum_partials(x: torch.Tensor, axis: ProcessGroupAxis) -> torch.Tensor:
    """All-reduce of partial sums whose result each rank then uses on *its own* shard
    (e.g. LayerNorm statistics over a split hidden dim): all_reduce forward and backward."""
    if axis.size == 1:
        return x
    return _SumShared.apply(x, axis)
