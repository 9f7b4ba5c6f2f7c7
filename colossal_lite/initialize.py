"""``initialize()``: apply the launched config to a model, one transformation at a time.

Order (each step one small function):

(What this release cannot do yet -- ZeRO stage 3 with the zero-bubble or interleaved
schedules, ZeRO with apex -- was rejected when the config was parsed: ``config/settings.py``.)

1. read the launched settings (``gpc.settings``; ``config=`` for a serial run);
2. move the model to the run's device and broadcast its parameters and buffers
   from local rank 0 of the data-parallel group (DATA, or SEQUENCE_DP in
   sequence mode) so every replica starts from the same weights -- except a model
   built on the meta device under ZeRO stage 3, which is drawn by name straight into
   its chunk shards (``zero/chunk/lazy.py``);
3. mixed precision from ``fp16`` (may cast the model and re-point the optimizer
   to fp32 master weights); with ``zero=dict(stage=1|2|3)`` the optimizer is first
   sharded (``zero/low_level.py``, ``zero/chunk/``) and its reduce-scatter replaces the
   handler of 4.;
4. the data-parallel gradient handler (``gradient_handler=dict(bucket_mb=25,
   overlap=True)``), skipped when there is a single replica;
5. the schedule: the pipeline runtime when ``parallel.pipeline`` > 1 (``pipeline/``);
6. the Engine with ``num_microbatches`` (alias ``gradient_accumulation``) and
   ``clip_grad_norm``.

Data loaders and the LR scheduler are returned unchanged: each data-parallel
replica's loader must yield its own slice of the global batch.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from .amp import build_amp
from .config import Settings, load_config
from .context import global_context as gpc
from .engine import Engine, GradientReducer, broadcast_parameters, data_parallel_axis
from .engine.foreach import prefer_foreach
from .pipeline.runtime import PipelineSchedule
from .zero.apply import apply_zero
from .zero.chunk.lazy import check_meta_model


def choose_schedule(settings: Settings, model: torch.nn.Module):
    """``(schedule, num_microbatches)``: the pipeline runtime when ``parallel.pipeline`` > 1
    (the model must be built for the launched layout), else the plain schedule."""
    pipeline = settings.pipeline
    if pipeline.size == 1:
        return None, pipeline.num_microbatches
    stages = getattr(model, 'stages', None)
    if not stages or stages[0].count != pipeline.stages:
        raise ValueError(f'parallel.pipeline = {pipeline.size} (x {pipeline.chunks} chunks) '
                         f'needs a model built after launch for this layout, cut into '
                         f'{pipeline.stages} stages (a colossal_lite.pipeline.StagedModel, '
                         f'e.g. the GPT/BERT/ViT of the model zoo); got '
                         f'{type(model).__name__}')
    return PipelineSchedule(pipeline), pipeline.num_microbatches


def build_gradient_handler(settings: Settings, model: torch.nn.Module) -> Optional[GradientReducer]:
    """The bucketed data-parallel all-reduce, or None with a single replica."""
    if data_parallel_axis().size == 1:
        return None
    return GradientReducer(model.parameters(), **settings.engine.handler_options())


def initialize(model: torch.nn.Module, optimizer: torch.optim.Optimizer, criterion=None,
               train_dataloader: Any = None, test_dataloader: Any = None, lr_scheduler: Any = None,
               config: Optional[Mapping] = None):
    """``(engine, train_dataloader, test_dataloader, lr_scheduler)`` for the launched config.

    ``config`` (optional) replaces the launched settings (``gpc.settings``) for this call,
    e.g. for a serial run without ``launch()``; the parallel layout always comes from the
    launch.
    """
    settings = load_config(config).settings if config is not None else _launched_settings()
    if getattr(model, 'synchronizes_gradients', False):   # auto.parallelize's DTensor model
        return _initialize_self_synchronizing(settings, model, optimizer, criterion,
                                              train_dataloader, test_dataloader, lr_scheduler)
    if not check_meta_model(settings.zero, model):  # a meta model goes straight into ZeRO-3
        model.to(gpc.device)
        broadcast_parameters(model)
    amp, handler = (apply_zero(settings, model, optimizer)  # ZeRO-1/2/3: its own handler
                    or (build_amp(settings.amp.as_dict(), model, optimizer), None))
    model, optimizer = amp.model, amp.optimizer
    schedule, num_microbatches = choose_schedule(settings, model)
    engine = Engine(model, optimizer, criterion,
                    gradient_handler=handler or build_gradient_handler(settings, model), amp=amp,
                    clip_grad_norm=settings.engine.clip_grad_norm,
                    num_microbatches=num_microbatches, schedule=schedule)
    return engine, train_dataloader, test_dataloader, lr_scheduler


def _initialize_self_synchronizing(settings: Settings, model, optimizer, criterion,
                                   train_dataloader, test_dataloader, lr_scheduler):
    """A model whose parameters are DTensors placed by a graph plan: its weights are
    already identical where replicated and its gradients already summed by the plan, so no
    broadcast and no data-parallel handler; the optimizer's per-tensor loop batched
    (``engine/foreach.py``); AMP, clipping and micro-steps as usual, and the
    pipeline runtime when the model holds pipeline stages (``PipelinedAutoModel``)."""
    if settings.zero is not None:
        raise NotImplementedError(f'zero stage {settings.zero.stage} with a graph-planned '
                                  f'model: the plan already shards what it shards; drop zero '
                                  f'or use a hand layout')
    if settings.amp.mode in ('naive', 'apex'):
        raise NotImplementedError(f"fp16 mode {settings.amp.mode!r} with a graph-planned model: "
                                  f"its graph was captured with fp32 weights; use "
                                  f"fp16=dict(mode='torch') with parallelize(..., autocast=dtype)")
    prefer_foreach(optimizer)          # one DTensor dispatch per op, not per parameter
    amp = build_amp(settings.amp.as_dict(), model, optimizer)
    schedule, num_microbatches = choose_schedule(settings, amp.model)  # stages: the runtime
    engine = Engine(amp.model, amp.optimizer, criterion, gradient_handler=None, amp=amp,
                    clip_grad_norm=settings.engine.clip_grad_norm,
                    num_microbatches=num_microbatches, schedule=schedule)
    return engine, train_dataloader, test_dataloader, lr_scheduler


def _launched_settings() -> Settings:
    """The launched run's settings; without a launch, those of an empty config (serial)."""
    return gpc.settings if gpc.settings is not None else load_config({}).settings
