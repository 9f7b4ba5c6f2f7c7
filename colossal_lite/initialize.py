"""``initialize()``: apply the launched config to a model, one transformation at a time.

Order (each step one small function):

1. reject what this release cannot do yet (``zero``, ``parallel.pipeline > 1``);
2. move the model to the run's device and broadcast its parameters and buffers
   from local rank 0 of the data-parallel group (DATA, or SEQUENCE_DP in
   sequence mode) so every replica starts from the same weights;
3. mixed precision from ``fp16`` (may cast the model and re-point the optimizer
   to fp32 master weights);
4. the data-parallel gradient handler (``gradient_handler=dict(bucket_mb=25,
   overlap=True)``), skipped when there is a single replica;
5. the Engine with ``gradient_accumulation`` and ``clip_grad_norm``.

Data loaders and the LR scheduler are returned unchanged: each data-parallel
replica's loader must yield its own slice of the global batch.
"""
from __future__ import annotations

import numbers
from typing import Any, Mapping, Optional

import torch

from .amp import build_amp
from .config import ConfigError, load_config
from .context import global_context as gpc
from .engine import Engine, GradientReducer, broadcast_parameters, data_parallel_axis

_HANDLER_KEYS = {'bucket_mb', 'overlap'}


def _check_supported(cfg: Mapping):
    if cfg.get('zero') is not None:
        raise NotImplementedError("config key 'zero' (chunk-based ZeRO) is not implemented yet; "
                                  "remove it to train with plain data parallelism")
    if gpc.layout is not None and gpc.layout.pipeline > 1:
        raise NotImplementedError(f"pipeline parallelism (parallel.pipeline = "
                                  f"{gpc.layout.pipeline}) is not implemented yet; use pipeline=1")


def _handler_options(cfg: Mapping) -> dict:
    opts = cfg.get('gradient_handler') or {}
    if not isinstance(opts, Mapping):
        raise ConfigError(f"'gradient_handler' must be a dict like dict(bucket_mb=25, overlap=True), "
                          f"got {opts!r}")
    unknown = set(opts) - _HANDLER_KEYS
    if unknown:
        raise ConfigError(f"unknown 'gradient_handler' keys {sorted(unknown)}; known: "
                          f"{sorted(_HANDLER_KEYS)}")
    bucket_mb = opts.get('bucket_mb', 25)
    if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, numbers.Real) or bucket_mb <= 0:
        raise ConfigError(f"'gradient_handler.bucket_mb' must be a positive number, got {bucket_mb!r}")
    return dict(bucket_bytes=max(1, int(bucket_mb * 1024 * 1024)),
                overlap=bool(opts.get('overlap', True)))


def build_gradient_handler(cfg: Mapping, model: torch.nn.Module) -> Optional[GradientReducer]:
    """The bucketed data-parallel all-reduce, or None with a single replica."""
    opts = _handler_options(cfg)
    if data_parallel_axis().size == 1:
        return None
    return GradientReducer(model.parameters(), **opts)


def initialize(model: torch.nn.Module, optimizer: torch.optim.Optimizer, criterion=None,
               train_dataloader: Any = None, test_dataloader: Any = None, lr_scheduler: Any = None,
               config: Optional[Mapping] = None):
    """``(engine, train_dataloader, test_dataloader, lr_scheduler)`` for the launched config.

    ``config`` (optional) replaces ``gpc.config`` for this call, e.g. for a serial
    run without ``launch()``; the parallel layout always comes from the launch.
    """
    cfg = load_config(config) if config is not None else gpc.config
    _check_supported(cfg)
    _handler_options(cfg)  # config errors before any collective
    model.to(gpc.device)
    broadcast_parameters(model)
    amp = build_amp(cfg.get('fp16'), model, optimizer)
    model, optimizer = amp.model, amp.optimizer
    engine = Engine(model, optimizer, criterion,
                    gradient_handler=build_gradient_handler(cfg, model), amp=amp,
                    clip_grad_norm=cfg.get('clip_grad_norm', 0.0),
                    gradient_accumulation=cfg.get('gradient_accumulation', 1))
    return engine, train_dataloader, test_dataloader, lr_scheduler
