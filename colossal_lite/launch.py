"""Start a run: parse the config once (``cfg.settings``), create the default group, build
every parallel group.

Backend: ``nccl`` when CUDA is available, else ``gloo`` (override with
``backend=`` or the config's ``backend``). Device: ``cuda:<local_rank>`` when
CUDA is available, else CPU. Multi-node runs use torchrun (``launch_from_torch``)
or the SLURM / OpenMPI environment variables.
"""
from __future__ import annotations

import os
from typing import Any, Optional

import torch

from .config import ConfigError, load_config
from .context import global_context as gpc


def _default_backend() -> str:
    return 'nccl' if torch.cuda.is_available() else 'gloo'


def launch(config: Any, rank: int, world_size: int, host: str, port: int,
           backend: Optional[str] = None, seed: int = 1024, local_rank: Optional[int] = None,
           init_method: Optional[str] = None):
    """Initialize torch.distributed and every process group the config's layout needs.

    All checks of the config and of ``world_size`` against the layout happen
    before any process group is created, so a bad config fails on every rank
    at once instead of hanging.
    """
    settings = load_config(config).settings
    run = settings.run
    settings.layout.with_world_size(world_size)
    if not 0 <= rank < world_size:
        raise ConfigError(f'rank must be in [0, world_size={world_size}), got {rank}')
    backend = backend or run.backend or _default_backend()
    if backend == 'nccl' and not torch.cuda.is_available():
        raise ConfigError("backend 'nccl' needs CUDA, which is not available; use 'gloo'")
    timeout = run.timeout
    init_method = init_method or f'tcp://{host}:{port}'
    seed = run.seed if run.seed is not None else seed

    gpc.init_global_dist(rank, world_size, backend, init_method, timeout)
    gpc.set_device(local_rank)
    gpc.init_parallel_groups(settings)
    gpc.set_seed(seed)
    return gpc


def _env_int(name: str) -> int:
    if name not in os.environ:
        raise RuntimeError(f'environment variable {name} is not set; '
                           f'is this process started by the matching launcher?')
    return int(os.environ[name])


def launch_from_torch(config: Any, backend: Optional[str] = None, seed: int = 1024):
    """Launch from the variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT)."""
    rank, world = _env_int('RANK'), _env_int('WORLD_SIZE')
    local_rank = _env_int('LOCAL_RANK')
    host = os.environ.get('MASTER_ADDR', '127.0.0.1')
    port = _env_int('MASTER_PORT')
    return launch(config, rank, world, host, port, backend=backend, seed=seed,
                  local_rank=local_rank)


def launch_from_slurm(config: Any, host: str, port: int, backend: Optional[str] = None,
                      seed: int = 1024):
    """Launch from SLURM_PROCID, SLURM_NPROCS and SLURM_LOCALID."""
    return launch(config, _env_int('SLURM_PROCID'), _env_int('SLURM_NPROCS'), host, port,
                  backend=backend, seed=seed, local_rank=_env_int('SLURM_LOCALID'))


def launch_from_openmpi(config: Any, host: str, port: int, backend: Optional[str] = None,
                        seed: int = 1024):
    """Launch from OMPI_COMM_WORLD_RANK, _SIZE and _LOCAL_RANK."""
    return launch(config, _env_int('OMPI_COMM_WORLD_RANK'), _env_int('OMPI_COMM_WORLD_SIZE'),
                  host, port, backend=backend, seed=seed,
                  local_rank=_env_int('OMPI_COMM_WORLD_LOCAL_RANK'))
