"""Helpers shared by the multi-dimensional tensor-parallel families (2D, 2.5D, 3D).

Each family describes its device grid with a small frozen object holding
:class:`ProcessGroupAxis` objects; these helpers act on such axes and know
nothing about a particular grid:

* :func:`split_dim` -- a rank's chunk of a full tensor (no communication),
  with an error naming the numbers when the size does not divide;
* :func:`gather_dims` -- the inverse: all-gathers over a list of (axis, dim),
  innermost cut first;
* :func:`shared_over` -- marks a parameter (or any tensor) that is replicated
  over groups whose members see *different data*: identity forward, gradient
  all-reduced over each of those groups backward (``copy_to`` per axis), so
  every replica ends with the complete gradient.
"""
from __future__ import annotations

from typing import Iterable, Sequence, Tuple

import torch

from ..communication import collective as C
from ..communication import copy_to
from ..context import ProcessGroupAxis


def split_dim(tensor: torch.Tensor, parts: int, index: int, dim: int, what: str) -> torch.Tensor:
    """Chunk ``index`` of ``parts`` equal chunks of ``tensor`` along ``dim``."""
    if parts == 1:
        return tensor
    size = tensor.shape[dim]
    if size % parts:
        raise ValueError(f'{what}: size {size} of dimension {dim % tensor.dim()} must be '
                         f'divisible by {parts}')
    return tensor.chunk(parts, dim=dim)[index].contiguous()


def gather_dims(tensor: torch.Tensor, cuts: Sequence[Tuple[ProcessGroupAxis, int]]) -> torch.Tensor:
    """Undo ``cuts`` (outermost first, as they were applied) with one all_gather each.

    Not differentiable: the result is detached (for outputs, metrics, tests)."""
    out = tensor.detach().contiguous()
    for axis, dim in reversed(list(cuts)):
        out = C.all_gather(out, axis, dim=dim)
    return out


def shared_over(tensor: torch.Tensor, axes: Iterable[ProcessGroupAxis]) -> torch.Tensor:
    """Identity forward; backward sums the gradient over every group in ``axes``."""
    for axis in axes:
        tensor = copy_to(tensor, axis)
    return tensor
