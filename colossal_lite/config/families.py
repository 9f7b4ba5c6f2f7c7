"""What each tensor-parallel family knows about itself, in one registry.

A :class:`TensorFamily` describes one tensor mode (``None`` = serial / pure data
parallelism, '1d', '2d', '2.5d', '3d', 'sequence', 'ulysses') without touching a process:

* its tensor sub-axes (how the tensor axis of the rank grid unfolds) and the
  process groups it needs, each named by the sub-axes that vary inside it;
* which sizes must divide what: how it splits a replica's batch, the attention
  heads (hidden dimension), the vocabulary and the sequence, and which of those splits
  it replicates instead where the size is smaller (``replicates``: 1D's kv heads);
* the module holding its layers (imported on first use by ``nn/registry.py``);
* the communication bytes of its layers as formulas (``formulas``).

Config validation, the rank layout (``context/layout.py``), the layer registry, the
CLI's pre-start checks and the tests all read this table; nothing else keeps a
per-mode table.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Tuple

from .modes import ParallelMode as PM

Sizes = Callable[['object'], int]  # layout -> int


@dataclass(frozen=True)
class TensorFamily:
    """One tensor-parallel mode (see module doc). Size functions take a ``ParallelLayout``."""

    mode: Optional[str]
    layers: str
    axes: Callable[['object'], Tuple[Tuple[str, int], ...]]
    groups: Dict[PM, Tuple[str, ...]] = field(default_factory=dict)
    roles: Dict[str, PM] = field(default_factory=dict)   # what the layers call each group
    batch_split: Sizes = lambda layout: 1
    head_split: Sizes = lambda layout: 1
    hidden_split: Sizes = lambda layout: 1
    vocab_split: Sizes = lambda layout: 1
    sequence_split: Sizes = lambda layout: 1
    replicates: Tuple[str, ...] = ()   # splits whose too-few items it replicates per group
    # weights replicated, activations split along the sequence over the whole tensor axis
    # (SEQUENCE); every parameter gradient is summed over SEQUENCE_DP = data x tensor
    splits_sequence: bool = False
    description: str = ''

    @property
    def tensor_axis_names(self) -> Tuple[str, ...]:
        return tuple(name for name, _ in self.axes(_UnitLayout()))


class _UnitLayout:
    """Stand-in layout of size 1 everywhere, to read a family's axis names."""

    tensor = depth = tensor_grid = ring = 1


def _grid(layout) -> int:
    return layout.tensor_grid


def _sequence_split(layout) -> int:
    """What the sequence length must divide by: the ring's chunks (2R under zigzag, else R)
    and the P ranks that each hold ``s/P`` of them."""
    ring = layout.ring_size
    chunks = 2 * ring if layout.zigzag and ring > 1 else ring
    return math.lcm(chunks, layout.tensor)


_SERIAL_AXES = lambda layout: (('t', layout.tensor),)  # noqa: E731

FAMILIES: Dict[Optional[str], TensorFamily] = {f.mode: f for f in (
    TensorFamily(None, 'colossal_lite.nn.parallel_1d', _SERIAL_AXES,
                 description='no tensor parallelism'),
    TensorFamily('1d', 'colossal_lite.nn.parallel_1d', _SERIAL_AXES,
                 groups={PM.PARALLEL_1D: ('t',)}, roles={'t': PM.PARALLEL_1D},
                 head_split=lambda l: l.tensor, hidden_split=lambda l: l.tensor,
                 vocab_split=lambda l: l.tensor, replicates=('head',),
                 description='1D (Megatron): weights split by rows or columns over t ranks'),
    TensorFamily('2d', 'colossal_lite.nn.parallel_2d',
                 lambda l: (('row', _grid(l)), ('col', _grid(l))),
                 groups={PM.PARALLEL_2D_ROW: ('col',), PM.PARALLEL_2D_COL: ('row',)},
                 roles={'row': PM.PARALLEL_2D_ROW, 'col': PM.PARALLEL_2D_COL},
                 batch_split=_grid, head_split=_grid, hidden_split=_grid, vocab_split=_grid,
                 description='2D (SUMMA) on a q x q grid'),
    TensorFamily('2.5d', 'colossal_lite.nn.parallel_2p5d',
                 lambda l: (('dep', l.depth), ('row', _grid(l)), ('col', _grid(l))),
                 groups={PM.PARALLEL_2P5D_ROW: ('col',), PM.PARALLEL_2P5D_COL: ('row',),
                         PM.PARALLEL_2P5D_DEP: ('dep',), PM.PARALLEL_2P5D_XZ: ('col', 'dep')},
                 roles={'row': PM.PARALLEL_2P5D_ROW, 'col': PM.PARALLEL_2P5D_COL,
                        'dep': PM.PARALLEL_2P5D_DEP},
                 batch_split=lambda l: l.depth * _grid(l), head_split=_grid,
                 hidden_split=_grid, vocab_split=_grid,
                 description='2.5D: d layers of a q x q SUMMA grid'),
    TensorFamily('3d', 'colossal_lite.nn.parallel_3d',
                 lambda l: (('output', _grid(l)), ('weight', _grid(l)), ('input', _grid(l))),
                 groups={PM.PARALLEL_3D_INPUT: ('input',), PM.PARALLEL_3D_WEIGHT: ('weight',),
                         PM.PARALLEL_3D_OUTPUT: ('output',),
                         PM.PARALLEL_3D_INPUT_X_WEIGHT: ('input', 'weight'),
                         PM.PARALLEL_3D_OUTPUT_X_WEIGHT: ('output', 'weight')},
                 roles={'input': PM.PARALLEL_3D_INPUT, 'weight': PM.PARALLEL_3D_WEIGHT,
                        'output': PM.PARALLEL_3D_OUTPUT,
                        'input_x_weight': PM.PARALLEL_3D_INPUT_X_WEIGHT,
                        'output_x_weight': PM.PARALLEL_3D_OUTPUT_X_WEIGHT},
                 batch_split=lambda l: _grid(l) ** 2, head_split=_grid,
                 hidden_split=lambda l: _grid(l) ** 2, vocab_split=lambda l: _grid(l) ** 2,
                 description='3D: a q x q x q cube'),
    TensorFamily('sequence', 'colossal_lite.nn.sequence', _SERIAL_AXES,
                 groups={PM.SEQUENCE: ('t',), PM.SEQUENCE_DP: ('data', 't')},
                 roles={'t': PM.SEQUENCE, 'dp': PM.SEQUENCE_DP},
                 sequence_split=_sequence_split, splits_sequence=True,
                 description='sequence parallelism: ring self-attention over t sub-sequences'),
    TensorFamily('ulysses', 'colossal_lite.nn.sequence',
                 lambda l: (('ring', l.ring), ('ulysses', l.tensor // l.ring)),
                 groups={PM.SEQUENCE: ('ring', 'ulysses'),
                         PM.SEQUENCE_DP: ('data', 'ring', 'ulysses'),
                         PM.ULYSSES: ('ulysses',), PM.SEQUENCE_RING: ('ring',)},
                 roles={'t': PM.SEQUENCE, 'dp': PM.SEQUENCE_DP, 'ulysses': PM.ULYSSES,
                        'ring': PM.SEQUENCE_RING},
                 head_split=lambda l: l.tensor // l.ring, replicates=('head',),
                 sequence_split=_sequence_split, splits_sequence=True,
                 description='Ulysses: all-to-all from sequence to head split around attention '
                             '(with ring=R: ring attention over R groups of it, USP)'),
)}

TENSOR_MODES = tuple(FAMILIES)


def family(mode: Optional[str]) -> TensorFamily:
    try:
        return FAMILIES[mode]
    except KeyError:
        raise ValueError(f'unknown tensor mode {mode!r}; modes: {list(FAMILIES)}') from None
