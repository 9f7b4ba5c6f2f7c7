"""2D (SUMMA, q x q ranks) tensor parallelism: the 2.5D family with depth 1.

The layers, the grid and the SUMMA loop live in ``colossal_lite.nn.parallel_2p5d``;
this module registers them for mode '2d', whose groups are PARALLEL_2D_ROW / _COL
(``Grid2p5D.current()`` picks them and a one-rank depth group).
"""
from ..parallel_2p5d import FAMILY, Grid2p5D, register_family

register_family('2d')

__all__ = ['FAMILY', 'Grid2p5D']
