"""Per-mode random number generators: ``with seed(ParallelMode.TENSOR): ...``.

The default torch generator is seeded identically on every rank, so anything
drawn outside a ``seed(...)`` block (weight init, dropout on replicated
activations) is the same on all ranks and equals what the serial model draws.
Inside ``with seed(mode):`` the CPU generator (and the current CUDA generator,
when CUDA is in use) is swapped for the mode's own stream, seeded with
``base + offset(mode) + local rank in mode`` so ranks of that group draw
independent numbers (dropout on sharded activations). The stream's state is
saved on exit, so successive blocks continue the same stream.
"""
from __future__ import annotations

import contextlib
from typing import Dict, Optional

import torch

from ..config.modes import ParallelMode


def _cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


class SeedManager:
    """Holds one saved RNG state (CPU, and CUDA when used) per ParallelMode."""

    def __init__(self):
        self._states: Dict[ParallelMode, tuple] = {}
        self._seeds: Dict[ParallelMode, int] = {}
        self._active: Optional[ParallelMode] = None

    @property
    def seeds(self) -> Dict[ParallelMode, int]:
        return dict(self._seeds)

    def add_seed(self, mode: ParallelMode, value: int, overwrite: bool = False):
        if mode in self._states and not overwrite:
            raise ValueError(f'a seed for {mode} is already registered')
        cpu_gen = torch.Generator().manual_seed(value)
        cuda_state = None
        if _cuda_in_use():
            saved = torch.cuda.get_rng_state()
            torch.cuda.manual_seed(value)
            cuda_state = torch.cuda.get_rng_state()
            torch.cuda.set_rng_state(saved)
        self._states[mode] = (cpu_gen.get_state(), cuda_state)
        self._seeds[mode] = value

    def reset(self):
        self._states.clear()
        self._seeds.clear()
        self._active = None

    def get_states(self) -> Dict[ParallelMode, tuple]:
        """A snapshot of every mode's saved RNG state (for activation checkpointing)."""
        return dict(self._states)

    def set_states(self, states: Dict[ParallelMode, tuple]):
        """Restore a snapshot taken by :meth:`get_states` (modes not in it are kept)."""
        if self._active is not None:
            raise RuntimeError(f'cannot restore RNG states while seed({self._active}) is active')
        self._states.update(states)

    @contextlib.contextmanager
    def seed(self, mode: ParallelMode):
        if mode not in self._states:
            raise KeyError(f'no seed registered for {mode}; launch() registers one per built mode')
        if self._active is not None:
            raise RuntimeError(f'seed({mode}) entered while seed({self._active}) is active')
        cpu_state, cuda_state = self._states[mode]
        saved_cpu = torch.get_rng_state()
        saved_cuda = torch.cuda.get_rng_state() if cuda_state is not None else None
        torch.set_rng_state(cpu_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state(cuda_state)
        self._active = mode
        try:
            yield
        finally:
            new_cuda = torch.cuda.get_rng_state() if cuda_state is not None else None
            self._states[mode] = (torch.get_rng_state(), new_cuda)
            torch.set_rng_state(saved_cpu)
            if saved_cuda is not None:
                torch.cuda.set_rng_state(saved_cuda)
            self._active = None


seed_manager = SeedManager()


def seed(mode: ParallelMode):
    """Context manager: draw random numbers from ``mode``'s own stream."""
    return seed_manager.seed(mode)


def mode_seed(base: int, mode: ParallelMode, local_rank: int) -> int:
    """The seed of ``mode``'s stream on a rank: distinct per mode and per local rank."""
    offset = 1009 * (list(ParallelMode).index(mode) + 1)
    return base + offset + local_rank
