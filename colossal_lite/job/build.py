"""Building a :class:`~colossal_lite.config.job.JobSpec`: the model, loss, data loaders,
optimizer and scheduler that ``colossal_lite.initialize`` takes, built for the current
context (:func:`describe_model`: on the meta device for a described layout)."""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..config import PipelineSettings
from ..config.job import JobSpec, ModelSection
from ..context import ParallelContext, use_context
from ..data import DataParallelLoader, digits_datasets, text_datasets
from ..data.hf import hf_datasets, tokenizer_vocab
from ..nn import CrossEntropyLoss
from ..pipeline import resolve_partition

OPTIMIZER_CLASSES = {'adamw': torch.optim.AdamW, 'adam': torch.optim.Adam, 'sgd': torch.optim.SGD}


def resolve_vocab(spec: JobSpec) -> JobSpec:
    """``spec`` with the vocabulary of an ``hf`` tokenizer file in its model options (a BPE
    tokenizer's is known from the config already: ``JobSpec.with_vocab``). Reads the file."""
    tokenizer = spec.data.tokenizer
    if tokenizer is None or tokenizer.type != 'file':
        return spec
    return spec.with_vocab(tokenizer_vocab(spec.data))


def build_model(model):
    """The registered model of a :class:`JobSpec` (or of a :class:`ModelSection`), built for
    the current context: ``builder(**options)``."""
    if isinstance(model, JobSpec):
        return model.entry.builder(**model.options)
    if not isinstance(model, ModelSection):
        raise TypeError(f'build_model takes a JobSpec or a ModelSection, got {type(model).__name__}')
    entry, options = model.resolve()
    return entry.builder(**options)


def describe_model(spec: JobSpec, layout, rank: int = 0,
                   pipeline: Optional[PipelineSettings] = None) -> torch.nn.Module:
    """The job's model built on the meta device for ``layout`` as ``rank`` holds it, cut by
    ``pipeline`` as the run cuts it, with no process group (``ParallelContext.describe``):
    local shapes and placements, no memory. Under ``partition='cost'`` the parts are timed
    here first (:func:`resolve_model_partition`; described: no collective)."""
    with use_context(ParallelContext.describe(layout, rank, pipeline)):
        resolve_model_partition(spec)
        with torch.device('meta'):
            return build_model(spec)


def resolve_model_partition(spec: JobSpec):
    """The explicit partition step, before the job's model is built for the current context
    (``pipeline.resolve_partition``): under ``partition='cost'`` it times the model's parts
    and, launched, agrees on them over GLOBAL (a collective: every rank calls it); the cut
    (blocks per stage, or None for other partitions) is kept on the context for the build."""
    return resolve_partition(spec.entry.builder, **spec.options)


def build_criterion(spec: JobSpec):
    """The loss the model was registered with (default: ``colossal_lite.nn.CrossEntropyLoss``)."""
    return (spec.entry.loss or CrossEntropyLoss)()


def build_data(spec: JobSpec, device: Optional[torch.device] = None, microbatches: int = 1,
               replicated: bool = False):
    """(train loader, test loader, items per sample) with each DATA rank's slice of each batch.
    The train loader yields micro-batches: ``global_batch_size / microbatches`` samples, so
    one optimizer step (M of them) sees ``global_batch_size`` samples. ``replicated``
    (``parallel.auto``: the graph plan splits the batch itself): every rank reads the whole
    micro-batch, and the test batches have its size too (the planned graph runs one shape)."""
    data = spec.data
    if data.type == 'shakespeare':
        train, test = text_datasets(data.seq_len, data.val_fraction, data.plays)
        per_sample = data.seq_len
    elif data.type == 'hf':
        train, test, _ = hf_datasets(data, spec.run_dir)
        per_sample = data.seq_len
    else:
        train, test = digits_datasets(data.test_fraction)
        per_sample = 1
    batch, seed = spec.train.global_batch_size, spec.train.shuffle_seed
    whole = dict(data_rank=0, data_size=1) if replicated else {}
    return (DataParallelLoader(train, batch // microbatches, shuffle=True, seed=seed,
                               device=device, **whole),
            DataParallelLoader(test, batch // microbatches if replicated else batch,
                               shuffle=False, device=device, **whole), per_sample)


def build_optimizer(spec: JobSpec, model: torch.nn.Module) -> torch.optim.Optimizer:
    opt = spec.optimizer
    return OPTIMIZER_CLASSES[opt.type](model.parameters(), lr=opt.lr, **opt.options)


def build_scheduler(spec: JobSpec, optimizer, total_steps: int):
    """Linear warm-up over ``warmup_steps``, then constant or cosine decay to ``min_lr_ratio``."""
    sched = spec.lr_scheduler
    warmup, floor = sched.warmup_steps, sched.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if sched.type == 'constant':
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
