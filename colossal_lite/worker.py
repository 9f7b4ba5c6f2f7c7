"""One rank of ``colossal-lite train``: launch from the launcher's environment, build the
job of the config (``colossal_lite/job/``) -- under ``parallel.auto`` planned and split by
``auto.parallelize`` (every rank reads the whole batch; rank 0 prints the plan) --, train
it through ``initialize`` + ``Trainer``, and print the report on rank 0.

Printed on rank 0: the world (``world size W on N node(s) x K process(es): node R holds
ranks R*K..R*K+K-1``, gathered from each rank's agent), the loss (mean over data-parallel
replicas) every ``train.log_every`` steps, the throughput (tokens/s for GPT, samples/s for ViT, global), the peak memory
of every rank (peak RSS on CPU, max allocated on CUDA), the bytes every rank sent
into collectives per ParallelMode during training (buffer bytes as counted by
``colossal_lite.communication``, summed over ranks; the few bytes of the metric
hooks' own reductions included), the evaluation result (validation loss, and
accuracy for ViT) and a final ``summary:`` line with the first and last loss. A tqdm bar
shows the steps, loss and throughput when stdout is a terminal. ``worker_main`` then
writes ``metrics.jsonl`` (one JSON object per step and per evaluation) and, with
matplotlib, ``loss.png`` into ``train.run_dir`` and says where.
"""
from __future__ import annotations

import json
import math
import os
import time
from typing import Optional

import torch

import colossal_lite.run_state as run_state

from .amp.torch_amp import autocast_dtype
from .auto.graph import parallelize
from .communication import all_gather, all_reduce, total_stats
from .config import ConfigError, Settings, load_config
from .context import ParallelMode
from .context import global_context as gpc
from .initialize import initialize
from .job import (build_criterion, build_data, build_model, build_optimizer, build_scheduler,
                  check_data, prepare_data, resolve_model_partition)
from .launch import launch_from_torch
from .trainer import Trainer
from .trainer import hooks as H
from .zero.chunk import building_into_chunks

# ParallelMode names in a fixed order for the byte table (gathered as one tensor)
_MODES = [m for m in ParallelMode]


def _print0(*args):
    if gpc.get_global_rank() == 0:
        print(*args, flush=True)


class _LossHistory(H.BaseHook):
    """Keeps the loss of every step (after LossHook has averaged it over replicas) and a
    record per step (``step, loss, lr``) and per test (``step, test_*``)."""

    priority = H.SCHEDULER_PRIORITY + 1
    uses_train_output = False

    def before_train(self, trainer):
        self.losses, self.records = [], []

    def after_train_iter(self, trainer, output, label, loss):
        self.losses.append(trainer.metrics['loss'])
        self.records.append(dict(step=trainer.cur_step, loss=trainer.metrics['loss'],
                                 lr=trainer.metrics.get('lr'),
                                 **{k: trainer.metrics[k] for k in H.MOE_METRICS
                                    if k in trainer.metrics}))

    def after_test(self, trainer):
        self.records.append(dict(step=trainer.cur_step, **H.test_metrics(trainer.metrics)))


def _gathered_report():
    """(peak MiB per rank, {mode name: bytes summed over ranks}); one GLOBAL all_gather."""
    mine = [H.peak_memory_mb()] + [float(total_stats.bytes(mode=m)) for m in _MODES]
    table = all_gather(torch.tensor([mine], dtype=torch.float64, device=gpc.device),
                       ParallelMode.GLOBAL).cpu()
    peaks = table[:, 0].tolist()
    sums = table[:, 1:].sum(dim=0).tolist()
    return peaks, {m.name: int(b) for m, b in zip(_MODES, sums) if b > 0}


def _report(trainer, spec, history: _LossHistory, elapsed: float):
    peaks, comm = _gathered_report()
    m = trainer.metrics
    text = spec.is_text
    unit = 'tokens/s' if text else 'samples/s'
    rate = m.get('tokens_per_s' if text else 'samples_per_s')
    if rate is None or rate != rate:
        _print0('throughput: not measured (the first 2 steps are warm-up; run more steps)')
    else:
        flops = f', tflops={m["tflops"]:.4g} (6 x parameters x tokens/s)' if 'tflops' in m else ''
        _print0(f'throughput: {rate:.1f} {unit} (global), {m.get("step_time_s", float("nan")):.3f} '
                f's/step{flops}')
    _print0('peak memory per rank (MiB): ' + ', '.join(f'rank {r}: {p:.0f}' for r, p in enumerate(peaks)))
    _print0('bytes communicated per ParallelMode (all ranks): ' +
            (', '.join(f'{k}: {v / 2**20:.2f} MiB' for k, v in sorted(comm.items())) or 'none'))
    if 'expert_tokens_max' in m:
        _print0(f"tokens per expert (last step, all MoE layers): min={m['expert_tokens_min']:.0f} "
                f"mean={m['expert_tokens_mean']:.1f} max={m['expert_tokens_max']:.0f} "
                f"(worst layer max/mean {m['expert_tokens_max_over_mean']:.2f}); "
                f"aux loss={m['moe_aux_loss']:.4g}")
    evals = [f'{k}={m[k]:.4f}' for k in ('test_loss', 'test_accuracy') if k in m]
    if evals:
        _print0('evaluation: ' + ' '.join(evals))
    first, last = history.losses[0], history.losses[-1]
    _print0(f'summary: steps={trainer.cur_step} first_loss={first:.4f} last_loss={last:.4f} '
            f'({"fell" if last < first else "did not fall"}) wall={elapsed:.1f}s')


def train(settings: Settings, spec=None, resume: Optional[str] = None,
          config_path: Optional[str] = None) -> dict:
    """Train the launched config's job (``spec``: default ``settings.job``), continuing
    from checkpoint ``resume`` when given (``run_state``: also after an elastic restart);
    ``config_path`` goes into the job's checkpoints. Returns the trainer's metrics plus
    ``losses`` (every step's loss, averaged over replicas) on every rank."""
    spec = spec or settings.job
    text = spec.is_text
    if spec.data_type == 'hf':
        spec = _prepare_on_rank0_first(spec)
    resolve_model_partition(spec)  # partition='cost': timed and agreed before the build
    with building_into_chunks(settings.zero):  # ZeRO-3: on meta, drawn into chunk shards
        model = build_model(spec)
    accumulation = settings.engine.num_microbatches
    auto = settings.auto
    train_dl, test_dl, _ = build_data(spec, gpc.device, accumulation, replicated=auto is not None)
    if auto is not None:
        model = _auto_parallel(model, spec, auto, accumulation, settings.amp)
    optimizer = build_optimizer(spec, model)
    steps_per_epoch = len(train_dl) // accumulation
    if steps_per_epoch == 0:  # same on every rank, before any collective
        raise ConfigError(f"'num_microbatches' (or 'gradient_accumulation') = {accumulation} "
                          f"exceeds the {len(train_dl)} micro-batches of an epoch")
    total = spec.train.steps or spec.train.epochs * steps_per_epoch
    epochs = max(1, math.ceil(total / max(1, steps_per_epoch)))
    scheduler = build_scheduler(spec, optimizer, total)
    engine, train_dl, test_dl, scheduler = initialize(model, optimizer, build_criterion(spec),
                                                      train_dl, test_dl, scheduler)
    resumed_at = run_state.resume(spec, engine, scheduler, train_dl, resume)
    if resumed_at >= total:
        raise ConfigError(f'the checkpoint was saved at step {resumed_at}: nothing is left of '
                          f'the {total} steps of this job (raise --steps or train.steps)')
    history = _LossHistory()
    bar = H.ProgressBarHook(total - resumed_at, 'tokens/s' if text else 'samples/s')
    hooks = [H.LossHook(), history,
             H.ThroughputHook(warmup=2, tokens=text, replicas=1 if auto is not None else None),
             H.LRSchedulerHook(scheduler), bar,
             H.MoEStatsHook(),   # MoE models: tokens per expert, aux loss (else nothing)
             H.LogMetricByStepHook(spec.train.log_every, printer=bar.printer)]
    if not text:
        hooks += [H.AccuracyHook(), H.LogMetricByEpochHook(printer=bar.printer)]
    hooks += run_state.hooks(settings, spec, resumed_at, total, config_path, scheduler, train_dl)
    if spec.log.tensorboard is not None:
        hooks.append(H.TensorBoardHook(spec.log.tensorboard))
    params = H.full_parameter_count(engine.model)
    _print0(f'model: {spec.kind} {params / 1e6:.2f}M parameters; {total} steps of global batch '
            f'{spec.train.global_batch_size} ({accumulation} micro-batches); '
            f'{steps_per_epoch} steps per epoch')
    total_stats.reset()
    start = time.perf_counter()
    trainer = Trainer(engine)
    trainer.fit(train_dl, epochs=epochs + (resumed_at > 0), max_steps=total, hooks=hooks,
                test_dataloader=None if text else test_dl)
    elapsed = time.perf_counter() - start
    if text:
        trainer.evaluate(_limited(test_dl, spec.train.eval_batches), hooks=[H.LossHook(), history])
    _report(trainer, spec, history, elapsed)
    return dict(trainer.metrics, losses=list(history.losses), records=list(history.records))


def _auto_parallel(model, spec, auto, microbatches: int, amp):
    """``parallel.auto``: the graph plan of ``model`` (built alike on every rank) for the
    launched ranks, captured on token ids of one micro-batch's shape ``[B / M, S]`` (every
    rank reads that whole micro-batch; the plan splits it) under the autocast of
    ``fp16=dict(mode='torch')`` when set; rank 0 searches and prints the plan. Returns the
    :class:`~colossal_lite.auto.graph.AutoParallelModel`."""
    ids = torch.zeros(spec.train.global_batch_size // microbatches, spec.data.seq_len,
                      dtype=torch.long, device=gpc.device)
    autocast = (autocast_dtype(getattr(torch, amp.dtype), gpc.device.type)
                if amp.mode == 'torch' else None)
    pmodel, plan = parallelize(model.to(gpc.device), (ids,), mesh=auto.mesh_spec,
                               memory_gb=auto.memory_gb, level=auto.level, autocast=autocast)
    _print0(plan.explain(limit=20))
    return pmodel


def _prepare_on_rank0_first(spec):
    """Rank 0 trains / loads the tokenizer and fills ``datasets``' cache, then the others read
    it (one GLOBAL all_reduce as the barrier); ``colossal-lite train`` did it already in the
    parent, so this only loads. Returns ``spec`` with a tokenizer file's vocabulary."""
    spec = check_data(spec)
    if gpc.get_global_rank() == 0:
        prepare_data(spec)
    all_reduce(torch.zeros(1, device=gpc.device), ParallelMode.GLOBAL)
    return spec


def write_run_files(records, run_dir: str) -> list:
    """``metrics.jsonl`` (one JSON object per record) and, when matplotlib is installed,
    ``loss.png`` (train and test loss against step) in ``run_dir``; the paths written."""
    os.makedirs(run_dir, exist_ok=True)
    written = [os.path.join(run_dir, 'metrics.jsonl')]
    with open(written[0], 'w') as f:
        for record in records:
            f.write(json.dumps(record) + '\n')
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        return written
    fig, ax = plt.subplots(figsize=(6, 4))
    train = [(r['step'], r['loss']) for r in records if 'loss' in r]
    test = [(r['step'], r['test_loss']) for r in records if 'test_loss' in r]
    if train:
        ax.plot(*zip(*train), label='train loss')
    if test:
        ax.plot(*zip(*test), 'o-', label='test loss')
    ax.set_xlabel('step')
    ax.set_ylabel('loss')
    ax.legend()
    fig.tight_layout()
    written.append(os.path.join(run_dir, 'loss.png'))
    fig.savefig(written[-1], dpi=100)
    plt.close(fig)
    return written


class _limited:
    """The first ``n`` batches of a loader (all when n is None)."""

    def __init__(self, loader, n: Optional[int]):
        self.loader, self.n = loader, n

    def __iter__(self):
        for i, batch in enumerate(self.loader):
            if self.n is not None and i >= self.n:
                return
            yield batch


def _nodes_of_ranks() -> list:
    """The node (the elastic agent's ``GROUP_RANK``) of every global rank; one GLOBAL
    all_gather, before the byte counter is reset."""
    node = int(os.environ.get('GROUP_RANK', '0'))
    mine = torch.tensor([node], dtype=torch.int64, device=gpc.device)
    return all_gather(mine, ParallelMode.GLOBAL).cpu().tolist()


def world_line(nodes: list) -> str:
    """``world size W on N node(s) ...``: which ranks each node holds (``nodes[r]``: the
    node of rank r), in one phrase when node R holds ranks R*K .. R*K+K-1."""
    world, count = len(nodes), len(set(nodes))
    per = world // count
    if nodes == [r // per for r in range(world)]:
        held = (f'ranks 0..{world - 1}' if count == 1 else
                f'node R holds ranks R*{per}..R*{per}+{per - 1}')
        return f'world size {world} on {count} node(s) x {per} process(es): {held}'
    held = ', '.join(f'node {n}: ranks {[r for r in range(world) if nodes[r] == n]}'
                     for n in sorted(set(nodes)))
    return f'world size {world} on {count} node(s): {held}'


def launch_worker(cfg) -> None:
    """One thread per worker process, then ``launch_from_torch(cfg)`` with the config's
    backend (default: NCCL where CUDA is available, else gloo)."""
    os.environ['OMP_NUM_THREADS'] = '1'
    torch.set_num_threads(1)
    backend = load_config(cfg).settings.run.backend or ('nccl' if torch.cuda.is_available() else 'gloo')
    launch_from_torch(cfg, backend=backend)


def worker_main(config_path: str, steps: Optional[int] = None, resume: Optional[str] = None):
    """Entry point of each process the elastic launcher starts; ``resume``: a checkpoint
    directory to continue from."""
    cfg = load_config(config_path)
    spec = cfg.settings.job.with_steps(steps)
    launch_worker(cfg)
    try:
        _print0(world_line(_nodes_of_ranks()))
        result = train(gpc.settings, spec, resume=resume, config_path=config_path)
        if gpc.get_global_rank() == 0:
            written = write_run_files(result['records'], spec.run_dir)
            print('wrote ' + ', '.join(written), flush=True)
        return result
    finally:
        gpc.destroy()
