"""The ``parallel`` section: the degrees of every parallel axis as a frozen
:class:`ParallelLayout` (``world = data * pipeline * tensor``), and ``parallel.auto``
(the graph-level planner's options) as :class:`AutoSettings`."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping, Optional, Tuple

from .checks import (ConfigError, check_keys, flag, integer_root, mapping, positive_int,
                     positive_number)
from .families import TENSOR_MODES

PARALLEL_KEYS = ('data', 'pipeline', 'tensor', 'auto')
TENSOR_KEYS = ('size', 'mode', 'depth', 'sequence_parallel', 'zigzag', 'ring')
AUTO_KEYS = ('level', 'mesh', 'memory_gb')
AUTO_LEVELS = ('fast', 'optimal')


@dataclass(frozen=True)
class ParallelLayout:
    """Validated degrees of every parallel axis; ``world = data * pipeline * tensor``.

    ``mode`` is the tensor-parallel family (None when tensor == 1 and no mode
    was asked for). ``depth`` is the 2.5D depth d (1 otherwise). ``data`` may be
    None until the world size is known (see :meth:`with_world_size`).
    ``sequence_parallel``: Megatron's sequence parallelism inside 1D tensor parallelism
    (activations outside the parallel regions split along the sequence).
    ``zigzag`` (``parallel.tensor.zigzag``, modes 'sequence' and 'ulysses'; default True):
    ring rank r holds chunks r and 2R-1-r of 2R equal chunks (balanced causal attention)
    instead of the contiguous block r (``nn/sequence/layout.py``).
    ``ring`` (``parallel.tensor.ring``, mode 'ulysses'; default 1): R, the ring degree of
    the ring x Ulysses hybrid; Ulysses runs over ``tensor / R`` ranks inside each ring rank.
    """

    pipeline: int = 1
    tensor: int = 1
    mode: Optional[str] = None
    depth: int = 1
    data: Optional[int] = None
    sequence_parallel: bool = False
    zigzag: bool = True
    ring: int = 1

    @property
    def ring_size(self) -> int:
        """R: the ranks ring attention runs over (mode 'sequence': all of the tensor axis;
        mode 'ulysses': ``parallel.tensor.ring``; 1 otherwise)."""
        return self.tensor if self.mode == 'sequence' else self.ring

    @property
    def ulysses_size(self) -> int:
        """U: the ranks Ulysses' all-to-all runs over (mode 'ulysses': tensor / R; else 1)."""
        return self.tensor // self.ring if self.mode == 'ulysses' else 1

    @property
    def tensor_grid(self) -> int:
        """q: the side of the 2D/2.5D grid or of the 3D cube (1 for other modes)."""
        if self.mode == '2d':
            return integer_root(self.tensor, 2)
        if self.mode == '2.5d':
            return integer_root(self.tensor // self.depth, 2)
        if self.mode == '3d':
            return integer_root(self.tensor, 3)
        return 1

    @property
    def world_size(self) -> Optional[int]:
        return None if self.data is None else self.data * self.pipeline * self.tensor

    def with_world_size(self, world_size: int) -> 'ParallelLayout':
        """Derive the data-parallel degree; error if world is not divisible by pipeline*tensor."""
        world_size = positive_int(world_size, 'world_size')
        model_parallel = self.pipeline * self.tensor
        if world_size % model_parallel:
            raise ConfigError(
                f"world size must be divisible by pipeline*tensor = {self.pipeline}*{self.tensor} "
                f"= {model_parallel}, got world size {world_size}")
        data = world_size // model_parallel
        if self.data is not None and self.data != data:
            raise ConfigError(
                f"'parallel.data' = {self.data} disagrees with world size {world_size} / "
                f"(pipeline*tensor = {model_parallel}) = {data}")
        return replace(self, data=data)


@dataclass(frozen=True)
class AutoSettings:
    """``parallel.auto``: let the graph-level planner choose the layout. ``level``
    'fast' | 'optimal'; ``mesh``: the device-mesh shape (None: the launched data x tensor
    axes); ``memory_gb``: the per-device budget (None: the device's)."""

    level: str = 'fast'
    mesh: Optional[Tuple[int, ...]] = None
    memory_gb: Optional[float] = None


def parse_parallel(parallel: Optional[Mapping]) -> ParallelLayout:
    """Build a :class:`ParallelLayout` from the ``parallel`` section, with clear errors."""
    parallel = mapping(parallel, 'parallel', "dict(tensor=dict(size=2, mode='1d'))")
    if 'sequence' in parallel:
        raise ConfigError("sequence parallelism is a tensor mode: write "
                          "parallel=dict(tensor=dict(mode='sequence', size=P)); it cannot be "
                          "combined with another tensor-parallel mode")
    check_keys(parallel, PARALLEL_KEYS, 'parallel.')
    pipeline = parallel.get('pipeline', 1)
    if isinstance(pipeline, Mapping):  # dict(size=P, chunks=..., ...): the rest is pipeline.py's
        pipeline = positive_int(pipeline.get('size', 1), 'parallel.pipeline.size')
    else:
        pipeline = positive_int(pipeline, 'parallel.pipeline')
    data = parallel.get('data')
    if data is not None:
        data = positive_int(data, 'parallel.data')
    tensor = mapping(parallel.get('tensor'), 'parallel.tensor', "dict(size=4, mode='1d')")
    check_keys(tensor, TENSOR_KEYS, 'parallel.tensor.')
    size = positive_int(tensor.get('size', 1), 'parallel.tensor.size')
    mode = tensor.get('mode', None)
    if isinstance(mode, str):
        mode = mode.lower()
    if mode not in TENSOR_MODES:
        raise ConfigError(f"'parallel.tensor.mode' must be one of {list(TENSOR_MODES)}, "
                          f"got {tensor.get('mode')!r}")
    if mode is None and size > 1:
        raise ConfigError(f"'parallel.tensor.size' = {size} needs a 'parallel.tensor.mode' "
                          f"(one of {[m for m in TENSOR_MODES if m]})")
    depth = tensor.get('depth', None)
    if depth is not None and mode != '2.5d':
        raise ConfigError(f"'parallel.tensor.depth' applies only to mode '2.5d', "
                          f"got depth={depth!r} with mode {mode!r}")
    if mode == '2d' and integer_root(size, 2) is None:
        raise ConfigError(f"2D tensor parallelism needs 'parallel.tensor.size' = q*q, got {size}")
    if mode == '3d' and integer_root(size, 3) is None:
        raise ConfigError(f"3D tensor parallelism needs 'parallel.tensor.size' = d*d*d, got {size}")
    if mode == '2.5d':
        if depth is None:
            raise ConfigError("2.5D tensor parallelism needs 'parallel.tensor.depth' (d in size = d*q*q)")
        depth = positive_int(depth, 'parallel.tensor.depth')
        if size % depth or integer_root(size // depth, 2) is None:
            raise ConfigError(f"2.5D tensor parallelism needs 'parallel.tensor.size' = depth*q*q; "
                              f"got size={size}, depth={depth}")
    sequence_parallel = flag(tensor.get('sequence_parallel', False),
                             'parallel.tensor.sequence_parallel')
    if sequence_parallel and mode != '1d':
        raise ConfigError(f"'parallel.tensor.sequence_parallel' applies to mode '1d' (Megatron's "
                          f"sequence parallelism inside 1D tensor parallelism), got mode {mode!r}; "
                          f"mode 'sequence' splits the sequence on its own")
    zigzag = tensor.get('zigzag', None)
    if zigzag is not None and mode not in RING_MODES:
        raise ConfigError(f"'parallel.tensor.zigzag' applies only to the ring of modes "
                          f"{list(RING_MODES)}, got zigzag={zigzag!r} with mode {mode!r}")
    zigzag = True if zigzag is None else flag(zigzag, 'parallel.tensor.zigzag')
    return ParallelLayout(pipeline=pipeline, tensor=size, mode=mode, depth=depth or 1, data=data,
                          sequence_parallel=sequence_parallel, zigzag=zigzag,
                          ring=parse_ring(tensor, mode, size))


RING_MODES = ('sequence', 'ulysses')


def parse_ring(tensor: Mapping, mode: Optional[str], size: int) -> int:
    """``parallel.tensor.ring`` (mode 'ulysses' only): R dividing the tensor size."""
    ring = tensor.get('ring', None)
    if ring is None:
        return 1
    if mode != 'ulysses':
        raise ConfigError(f"'parallel.tensor.ring' applies only to mode 'ulysses' (the ring "
                          f"degree of the ring x Ulysses hybrid), got ring={ring!r} with mode "
                          f"{mode!r}; mode 'sequence' runs the ring over all its ranks")
    ring = positive_int(ring, 'parallel.tensor.ring')
    if size % ring:
        raise ConfigError(f"'parallel.tensor.ring' = {ring} must divide 'parallel.tensor.size' "
                          f"= {size} (Ulysses runs over size / ring ranks)")
    return ring


def parse_auto(parallel: Optional[Mapping]) -> Optional[AutoSettings]:
    """``parallel.auto`` (None without one)."""
    if not isinstance(parallel, Mapping) or parallel.get('auto') is None:
        return None
    auto = mapping(parallel['auto'], 'parallel.auto', "dict(level='fast')")
    check_keys(auto, AUTO_KEYS, 'parallel.auto.')
    level = auto.get('level', 'fast')
    if level not in AUTO_LEVELS:
        raise ConfigError(f"'parallel.auto.level' must be one of {list(AUTO_LEVELS)}, "
                          f"got {level!r}")
    mesh = auto.get('mesh')
    if isinstance(mesh, Mapping):
        mesh = tuple(positive_int(v, f'parallel.auto.mesh.{k}') for k, v in mesh.items())
    elif mesh is not None:
        if not isinstance(mesh, (list, tuple)) or not 1 <= len(mesh) <= 3:
            raise ConfigError(f"'parallel.auto.mesh' must be 1 to 3 axis sizes, e.g. (2, 4) "
                              f"or dict(data=2, tensor=4), got {mesh!r}")
        mesh = tuple(positive_int(v, 'parallel.auto.mesh') for v in mesh)
    memory = auto.get('memory_gb')
    if memory is not None:
        memory = positive_number(memory, 'parallel.auto.memory_gb')
    return AutoSettings(level=level, mesh=mesh, memory_gb=memory)
