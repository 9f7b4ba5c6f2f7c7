"""The 2.5D device grid ``d x q x q`` (2D is the case d = 1) and its standard layout.

A rank sits at (k, i, j) = (depth, row, column). Three groups:

* ``row``: the ranks of my row in my depth layer (they vary in j); ``row.rank == j``;
* ``col``: the ranks of my column in my depth layer (they vary in i); ``col.rank == i``;
* ``dep``: the ranks at my (i, j) in every depth layer; ``dep.rank == k``.

Standard activation layout: ``X [b, ..., h]`` is split along the batch into
``d*q`` chunks, rank (k, i, j) holding chunk ``k*q + i`` (so the batch is split
over ``dep`` x ``col``), and along the hidden dimension into ``q`` chunks over
``row`` (chunk j): ``[b, s, h] -> [b/(d q), s, h/q]``.

Weights ``W [out, in]`` are split ``q x q``: ``[out, in] -> [out/q, in/q]`` with the
out-chunk i (over ``col``) and the in-chunk j (over ``row``), replicated over
``dep``. Anything replicated over ``col`` or ``dep`` sees different batch rows there,
so its gradient is summed over those groups (:meth:`Grid2p5D.shared`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

import colossal_lite.nn._grid as _grid

from ...config.families import family
from ...context import ParallelMode, ProcessGroupAxis, current_context


@dataclass(frozen=True)
class Grid2p5D:
    """Frozen description of this rank's place in the ``d x q x q`` grid (see module doc)."""

    row: ProcessGroupAxis
    col: ProcessGroupAxis
    dep: ProcessGroupAxis

    def __post_init__(self):
        if self.row.size != self.col.size:
            raise ValueError(f'a 2D/2.5D grid is q x q: row group has {self.row.size} ranks, '
                             f'column group {self.col.size}')

    # ------------------------------------------------------------ construction
    @staticmethod
    def current() -> 'Grid2p5D':
        """The current context's grid in mode '2d' / '2.5d'; a one-rank grid otherwise (serial)."""
        ctx = current_context()
        if ctx.tensor_mode not in ('2d', '2.5d'):
            return Grid2p5D.serial()
        roles = family(ctx.tensor_mode).roles
        dep = roles.get('dep')
        dep_axis = ctx.axis(dep) if dep is not None else \
            ProcessGroupAxis.serial(ParallelMode.PARALLEL_2P5D_DEP)
        return Grid2p5D(ctx.axis(roles['row']), ctx.axis(roles['col']), dep_axis)

    @staticmethod
    def serial() -> 'Grid2p5D':
        return Grid2p5D(ProcessGroupAxis.serial(ParallelMode.PARALLEL_2P5D_ROW),
                        ProcessGroupAxis.serial(ParallelMode.PARALLEL_2P5D_COL),
                        ProcessGroupAxis.serial(ParallelMode.PARALLEL_2P5D_DEP))

    # ------------------------------------------------------------ coordinates
    @property
    def q(self) -> int:
        return self.row.size

    @property
    def d(self) -> int:
        return self.dep.size

    @property
    def i(self) -> int:
        """My row (index in the column group)."""
        return self.col.rank

    @property
    def j(self) -> int:
        """My column (index in the row group)."""
        return self.row.rank

    @property
    def k(self) -> int:
        """My depth layer."""
        return self.dep.rank

    @property
    def size(self) -> int:
        return self.d * self.q * self.q

    @property
    def name(self) -> str:
        return '2D' if self.row.mode is ParallelMode.PARALLEL_2D_ROW else '2.5D'

    def describe(self) -> str:
        return f'{self.name} (q={self.q}, d={self.d})' if self.name == '2.5D' else f'2D (q={self.q})'

    # ------------------------------------------------------------ checks
    def check_hidden(self, size: int, what: str):
        if size % self.q:
            raise ValueError(f'{self.describe()} splits {what} over q={self.q}: '
                             f'{size} is not divisible by {self.q}')

    def check_batch(self, batch: int):
        parts = self.d * self.q
        if batch % parts:
            raise ValueError(f'{self.describe()} needs the batch divisible by d*q = '
                             f'{self.d}*{self.q} = {parts}, got {batch}')

    # ------------------------------------------------------------ layout
    def split_batch(self, full: torch.Tensor) -> torch.Tensor:
        """My batch chunk ``k*q + i`` of a full ``[b, ...]`` tensor (no communication)."""
        self.check_batch(full.shape[0])
        return _grid.split_dim(full, self.d * self.q, self.k * self.q + self.i, 0, 'batch')

    def split_depth(self, full: torch.Tensor) -> torch.Tensor:
        """My depth layer's ``b/d`` batch rows (all q rows of the layer)."""
        self.check_batch(full.shape[0])
        return _grid.split_dim(full, self.d, self.k, 0, 'batch')

    def gather_batch(self, local: torch.Tensor) -> torch.Tensor:
        """Full batch from the chunks: all_gather over ``col`` then ``dep`` (dim 0)."""
        return _grid.gather_dims(local, [(self.dep, 0), (self.col, 0)])

    def split_activation(self, full: torch.Tensor) -> torch.Tensor:
        """Standard layout of a full ``[b, ..., h]`` activation: ``[b/(d q), ..., h/q]``."""
        self.check_hidden(full.shape[-1], 'the hidden dimension')
        return _grid.split_dim(self.split_batch(full), self.q, self.j, -1, 'hidden')

    def gather_activation(self, local: torch.Tensor) -> torch.Tensor:
        """Full ``[b, ..., h]`` on every rank from the standard layout."""
        return self.gather_batch(_grid.gather_dims(local, [(self.row, -1)]))

    def shared(self, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor replicated over ``col`` and ``dep`` (which see other batch rows):
        identity forward, gradient summed over ``col`` and ``dep`` backward."""
        return _grid.shared_over(tensor, (self.col, self.dep))


def resolve_grid(grid: Optional[Grid2p5D]) -> Grid2p5D:
    return grid if grid is not None else Grid2p5D.current()
