"""ParallelContext: the process groups of one run, built from a validated layout.

``global_context`` (imported by users as ``gpc``) is the one instance a run
uses. Layers never read mode flags from it at run time: facades ask it once,
at construction, for the mode and for :class:`ProcessGroupAxis` objects, which
they keep and pass to the autograd functions.
"""
from __future__ import annotations

import contextlib
import contextvars
import datetime
from dataclasses import dataclass
from typing import Dict, Iterator, Optional, Tuple

import torch
import torch.distributed as dist

from ..config import ParallelLayout, PipelineSettings, Settings
from ..config.modes import ParallelMode
from .layout import build_groups
from .random import mode_seed, seed_manager


@dataclass(frozen=True)
class ProcessGroupAxis:
    """One process group as a layer sees it: who is in it and where this rank sits."""

    mode: ParallelMode
    group: Optional[object]          # torch ProcessGroup; None for a serial (size-1) stand-in
                                     # or an axis of a described (not launched) layout
    ranks: Tuple[int, ...]           # global ranks, in local-rank order
    rank: int                        # this rank's local rank in the group
    size: int

    def global_rank(self, local_rank: int) -> int:
        return self.ranks[local_rank]

    @staticmethod
    def serial(mode: ParallelMode) -> 'ProcessGroupAxis':
        return ProcessGroupAxis(mode, None, (0,), 0, 1)


class ParallelContext:
    """Process groups, local ranks and RNG seeds of the current run."""

    def __init__(self):
        self.settings: Optional[Settings] = None   # the launched config's typed sections
        self._pipeline: Optional[PipelineSettings] = None
        self.layout: Optional[ParallelLayout] = None
        self.device: torch.device = torch.device('cpu')
        self._axes: Dict[ParallelMode, ProcessGroupAxis] = {}
        self._owns_default_group = False
        self._described_rank: Optional[int] = None
        self.meshes: Dict = {}  # (layout, device type) -> DeviceMesh (tensor.layout_mesh)
        self.partition_cuts: Dict = {}  # model key -> blocks per stage (pipeline.resolve_partition)

    # ---------------------------------------------------------------- set-up
    def init_global_dist(self, rank: int, world_size: int, backend: str, init_method: str,
                         timeout_s: float):
        if dist.is_initialized():
            if dist.get_world_size() != world_size or dist.get_rank() != rank:
                raise RuntimeError(
                    f'torch.distributed is already initialized with rank {dist.get_rank()} of '
                    f'{dist.get_world_size()}, but launch() was asked for rank {rank} of {world_size}')
        else:
            dist.init_process_group(backend=backend, init_method=init_method, rank=rank,
                                    world_size=world_size,
                                    timeout=datetime.timedelta(seconds=timeout_s))
            self._owns_default_group = True

    @staticmethod
    def describe(layout: ParallelLayout, rank: int = 0,
                 pipeline: Optional[PipelineSettings] = None) -> 'ParallelContext':
        """A context for ``layout`` (with its data size set) as rank ``rank`` would see it,
        with no process group: layers built under it (``use_context``) get their shapes,
        splits and placements, and any collective on a group of several ranks raises.
        ``pipeline``: the run's pipeline settings (chunks, schedule, partition), so a model
        built here is cut exactly as the run cuts it (default: ``layout.pipeline`` uniform
        stages, one per rank)."""
        if layout.world_size is None:
            raise ValueError('describe() needs a layout with its data size; call '
                             'layout.with_world_size(world) first')
        if not 0 <= rank < layout.world_size:
            raise ValueError(f'rank must be in [0, {layout.world_size}), got {rank}')
        if pipeline is not None and pipeline.size != layout.pipeline:
            raise ValueError(f'pipeline settings of size {pipeline.size} do not describe a '
                             f'layout with pipeline = {layout.pipeline}')
        ctx = ParallelContext()
        ctx.layout = layout
        ctx._pipeline = pipeline
        for mode, groups in build_groups(layout).items():
            members = next(g for g in groups if rank in g)
            ctx._axes[mode] = ProcessGroupAxis(mode, None, members, members.index(rank),
                                               len(members))
        ctx._described_rank = rank
        return ctx

    @property
    def is_described(self) -> bool:
        """Whether this context describes a layout without process groups."""
        return self._described_rank is not None

    @property
    def pipeline(self) -> PipelineSettings:
        """The pipeline settings models are cut by: the launched config's, those given to
        :meth:`describe`, else ``layout.pipeline`` uniform stages."""
        if self._pipeline is not None:
            return self._pipeline
        if self.settings is not None:
            return self.settings.pipeline
        return PipelineSettings(size=self.layout.pipeline if self.layout is not None else 1)

    def init_parallel_groups(self, settings: Settings):
        """Build every group of the configured layout (all ranks create all groups, same order)."""
        self.settings = settings
        world = dist.get_world_size()
        rank = dist.get_rank()
        self.layout = settings.layout.with_world_size(world)
        for mode, groups in build_groups(self.layout).items():
            for members in groups:
                if mode is ParallelMode.GLOBAL:
                    handle = dist.group.WORLD
                else:
                    handle = dist.new_group(list(members))
                if rank in members:
                    self._axes[mode] = ProcessGroupAxis(mode, handle, members, members.index(rank),
                                                        len(members))

    def set_device(self, local_rank: Optional[int] = None):
        if torch.cuda.is_available():
            index = (local_rank if local_rank is not None else self.get_global_rank()) \
                % torch.cuda.device_count()
            torch.cuda.set_device(index)
            self.device = torch.device('cuda', index)
        else:
            self.device = torch.device('cpu')

    def set_seed(self, base: int):
        """Same default generator on every rank; one independent stream per built mode."""
        torch.manual_seed(base)
        seed_manager.reset()
        for mode in (ParallelMode.DATA, ParallelMode.PIPELINE, ParallelMode.TENSOR):
            seed_manager.add_seed(mode, mode_seed(base, mode, self.get_local_rank(mode)))

    # ---------------------------------------------------------------- queries
    def is_initialized(self, mode: ParallelMode = ParallelMode.GLOBAL) -> bool:
        return mode in self._axes

    def axis(self, mode: ParallelMode) -> ProcessGroupAxis:
        """The group of ``mode`` containing this rank; a size-1 stand-in when serial."""
        if mode in self._axes:
            return self._axes[mode]
        if not self._axes:
            return ProcessGroupAxis.serial(mode)
        raise KeyError(f'{mode} is not part of the launched layout '
                       f'(tensor mode {self.tensor_mode!r}); built modes: '
                       f'{sorted(m.name for m in self._axes)}')

    def get_world_size(self, mode: ParallelMode = ParallelMode.GLOBAL) -> int:
        return self.axis(mode).size

    def get_local_rank(self, mode: ParallelMode = ParallelMode.GLOBAL) -> int:
        return self.axis(mode).rank

    def get_global_rank(self) -> int:
        if self._described_rank is not None:
            return self._described_rank
        return dist.get_rank() if dist.is_initialized() else 0

    def get_group(self, mode: ParallelMode):
        return self.axis(mode).group

    def get_ranks_in_group(self, mode: ParallelMode):
        return list(self.axis(mode).ranks)

    def is_first_rank(self, mode: ParallelMode) -> bool:
        return self.get_local_rank(mode) == 0

    def is_last_rank(self, mode: ParallelMode) -> bool:
        return self.get_local_rank(mode) == self.get_world_size(mode) - 1

    @property
    def tensor_mode(self) -> Optional[str]:
        return self.layout.mode if self.layout is not None else None

    # ---------------------------------------------------------------- teardown
    def destroy(self):
        """Destroy the groups (and the default group if launch() created it)."""
        if dist.is_initialized() and self._owns_default_group:
            dist.destroy_process_group()
        self._axes.clear()
        self.meshes.clear()
        self.partition_cuts.clear()
        self.layout = None
        self.settings = None
        self._pipeline = None
        self._owns_default_group = False
        seed_manager.reset()


global_context = ParallelContext()

_current: contextvars.ContextVar = contextvars.ContextVar('colossal_lite_context', default=None)


def current_context() -> ParallelContext:
    """The context layers are built for: the one of an enclosing :func:`use_context`,
    else the launched ``global_context``."""
    return _current.get() or global_context


@contextlib.contextmanager
def use_context(ctx: ParallelContext) -> Iterator[ParallelContext]:
    """Build layers for ``ctx`` (e.g. ``ParallelContext.describe(layout, rank)``) inside."""
    token = _current.set(ctx)
    try:
        yield ctx
    finally:
        _current.reset(token)
