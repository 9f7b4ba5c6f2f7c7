"""The ``parallel`` section: the degrees of every parallel axis as a frozen
:class:`ParallelLayout` (``world = data * pipeline * tensor``), and ``parallel.auto``
(the graph-level planner's options) as :class:`AutoSettings`.

``parallel.expert`` = E (expert parallelism, first version): carved out of the data axis
only, so E must divide the data-parallel degree (Megatron's folding of E into data x tensor
is not built)."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Dict, Mapping, Optional, Tuple, Union

from .checks import (ConfigError, check_keys, flag, integer_root, mapping, positive_int,
                     positive_number)
from .families import TENSOR_MODES

PARALLEL_KEYS = ('data', 'pipeline', 'tensor', 'expert', 'auto')
#: tensor modes expert parallelism composes with (2D/2.5D/3D split the batch over the
#: tensor grid, whose expert gradients no group sums yet)
EXPERT_TENSOR_MODES = (None, '1d', 'sequence', 'ulysses')
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
    ``expert`` (``parallel.expert``; default 1): E, the expert-parallel degree, carved out of
    the data axis (E divides ``data``): the data axis unfolds into ``expert_data`` (data / E,
    outer) x ``expert`` (E, inner); see ``context/layout.py``.
    """

    pipeline: int = 1
    tensor: int = 1
    mode: Optional[str] = None
    depth: int = 1
    data: Optional[int] = None
    sequence_parallel: bool = False
    zigzag: bool = True
    ring: int = 1
    expert: int = 1

    @property
    def expert_data(self) -> Optional[int]:
        """data / E: the replicas of one expert shard along the data axis (None until the
        data size is known)."""
        return None if self.data is None else self.data // self.expert

    def check_expert(self):
        """ConfigError unless E divides the data-parallel degree (once it is known)."""
        check_expert_divides(self.expert, self.data, self.pipeline, self.tensor)

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
        check_expert_divides(self.expert, data, self.pipeline, self.tensor, world_size)
        return replace(self, data=data)


def check_expert_divides(expert: int, data: Optional[int], pipeline: int, tensor: int,
                         world_size: Optional[int] = None):
    """``parallel.expert`` = E must divide the data-parallel degree (the expert axis is carved
    out of the data axis only); nothing to check while ``data`` is unknown."""
    if data is None or data % expert == 0:
        return
    where = (f"'parallel.data' = {data}" if world_size is None else
             f"data = {data} (= world size {world_size} / (pipeline*tensor = "
             f"{pipeline}*{tensor}))")
    raise ConfigError(f"'parallel.expert' = {expert} must divide the data-parallel size "
                      f"{where}: expert parallelism is carved out of the data axis only")


@dataclass(frozen=True)
class AutoSettings:
    """``parallel.auto``: the graph-level planner (``auto.parallelize``) chooses how the
    model is split over a device mesh. ``level`` 'fast' | 'optimal'; ``mesh``: the mesh's
    axis sizes (None: the launched data x tensor axes) and ``axes`` their names (None: named
    by position, ``tensor`` / ``data, tensor`` / ``data, tensor, tensor2``); ``memory_gb``:
    the per-device budget (None: unconstrained)."""

    level: str = 'fast'
    mesh: Optional[Tuple[int, ...]] = None
    memory_gb: Optional[float] = None
    axes: Optional[Tuple[str, ...]] = None

    @property
    def devices(self) -> Optional[int]:
        """The processes the mesh spans (None without a mesh)."""
        return None if self.mesh is None else math.prod(self.mesh)

    @property
    def mesh_spec(self) -> Union[None, Dict[str, int], Tuple[int, ...]]:
        """The ``mesh`` argument of ``auto.parallelize``: ``{name: size}`` when the config
        named the axes, else the sizes."""
        if self.mesh is None or self.axes is None:
            return self.mesh
        return dict(zip(self.axes, self.mesh))

    def mesh_text(self) -> str:
        spec = self.mesh_spec
        if isinstance(spec, dict):
            return 'dict(' + ', '.join(f'{k}={v}' for k, v in spec.items()) + ')'
        return repr(spec)


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
    expert = parse_expert(parallel, mode)
    check_expert_divides(expert, data, pipeline, size)
    return ParallelLayout(pipeline=pipeline, tensor=size, mode=mode, depth=depth or 1, data=data,
                          sequence_parallel=sequence_parallel, zigzag=zigzag,
                          ring=parse_ring(tensor, mode, size), expert=expert)


def parse_expert(parallel: Mapping, mode: Optional[str]) -> int:
    """``parallel.expert``: E >= 1, an integer; E > 1 only with the tensor modes of
    :data:`EXPERT_TENSOR_MODES` (NotImplementedError otherwise)."""
    expert = positive_int(parallel.get('expert', 1), 'parallel.expert')
    if expert > 1 and mode not in EXPERT_TENSOR_MODES:
        raise NotImplementedError(
            f"'parallel.expert' = {expert} with tensor mode {mode!r} is not supported: expert "
            f"parallelism composes with tensor modes {list(EXPERT_TENSOR_MODES)} (2D/2.5D/3D "
            f"split each replica's batch over the tensor grid, and no group sums an expert's "
            f"gradient over it yet)")
    return expert


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
    """``parallel.auto`` (None without one): ``level`` in :data:`AUTO_LEVELS`, ``mesh`` a
    dict of positive axis sizes (``dict(data=2, tensor=2)``) or a list of 1 to 3 of them,
    ``memory_gb`` positive or None. The plan picks the layout, so ``parallel.tensor`` /
    ``parallel.pipeline`` / ``parallel.data`` beside it are errors (sizes of 1 aside)."""
    if not isinstance(parallel, Mapping) or parallel.get('auto') is None:
        return None
    auto = mapping(parallel['auto'], 'parallel.auto', "dict(level='fast', mesh=dict(data=2, "
                                                      "tensor=2), memory_gb=None)")
    check_keys(auto, AUTO_KEYS, 'parallel.auto.')
    _alone(parallel)
    level = auto.get('level', 'fast')
    if level not in AUTO_LEVELS:
        raise ConfigError(f"'parallel.auto.level' must be one of {list(AUTO_LEVELS)}, "
                          f"got {level!r}")
    mesh, axes = _auto_mesh(auto.get('mesh'))
    memory = positive_number(auto.get('memory_gb'), 'parallel.auto.memory_gb', allow_none=True)
    return AutoSettings(level=level, mesh=mesh, memory_gb=memory, axes=axes)


def _auto_mesh(mesh) -> Tuple[Optional[Tuple[int, ...]], Optional[Tuple[str, ...]]]:
    """(axis sizes, axis names or None) of ``parallel.auto.mesh``."""
    example = "e.g. dict(data=2, tensor=2) or [2, 2]"
    if mesh is None:
        return None, None
    if isinstance(mesh, Mapping):
        if not 1 <= len(mesh) <= 3:
            raise ConfigError(f"'parallel.auto.mesh' must have 1 to 3 axes, {example}, "
                              f"got {dict(mesh)!r}")
        for name in mesh:
            if not isinstance(name, str) or not name.isidentifier():
                raise ConfigError(f"'parallel.auto.mesh' axis names must be identifiers like "
                                  f"'data' or 'tensor', got {name!r}")
        return (tuple(positive_int(v, f'parallel.auto.mesh.{k}') for k, v in mesh.items()),
                tuple(mesh))
    if not isinstance(mesh, (list, tuple)) or not 1 <= len(mesh) <= 3:
        raise ConfigError(f"'parallel.auto.mesh' must be a dict of axis sizes or a list of 1 "
                          f"to 3 of them, {example}, got {mesh!r}")
    return tuple(positive_int(v, f'parallel.auto.mesh[{i}]') for i, v in enumerate(mesh)), None


def _alone(parallel: Mapping):
    """No hand layout beside ``parallel.auto``: the plan splits the model over its mesh
    (``parallel.pipeline`` may stand beside it: the plan's graph is cut into its stages,
    docs/auto_graph.md section 6)."""
    for key in ('tensor', 'data', 'expert'):
        value = parallel.get(key)
        size = value.get('size', 1) if isinstance(value, Mapping) else value
        if size not in (None, 1):
            raise ConfigError(f"'parallel.{key}' = {value!r} cannot be combined with "
                              f"'parallel.auto': the graph plan chooses how the model is split; "
                              f"give the device mesh as 'parallel.auto.mesh' "
                              f"(e.g. dict(data=2, tensor=2)) and drop 'parallel.{key}'")
