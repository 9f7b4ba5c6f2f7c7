"""Trainer hooks: called at before/after train, epoch, train iteration and test points.

The Trainer sorts hooks by ascending ``priority`` (ties keep the given order).
Metric hooks (priority 0) fill ``trainer.metrics``; the LR scheduler (1) steps
after them; loggers, checkpointing and TensorBoard (10) read the metrics last.
Hooks that reduce a metric across ranks issue the same collectives on every rank,
so every rank must be given the same hooks.
"""
from __future__ import annotations

import math
import resource
import time
from typing import Callable, Optional

import torch

import colossal_lite.checkpoint as checkpoint

from ..communication import collective as C
from ..context import ParallelMode
from ..context import global_context as gpc
from ..nn import gather_logits
from ..tensor import param_placement

METRIC_PRIORITY, SCHEDULER_PRIORITY, OUTPUT_PRIORITY = 0, 1, 10


def _is_rank0() -> bool:
    return gpc.get_global_rank() == 0


def _data_sum(values) -> torch.Tensor:
    """Sum ``values`` (a list of floats) over the DATA group (replicas)."""
    return C.all_reduce(torch.tensor(values, dtype=torch.float64, device=gpc.device),
                        ParallelMode.DATA).cpu()


class BaseHook:
    """A no-op at every point; subclasses override what they need. ``uses_train_output``:
    whether ``after_train_iter`` reads ``output``/``label`` (the step's micro-batch outputs
    are kept only when a hook does; otherwise both are None)."""

    priority = OUTPUT_PRIORITY
    uses_train_output = True

    def __init__(self, priority: Optional[int] = None):
        if priority is not None:
            self.priority = priority

    def before_train(self, trainer): pass
    def after_train(self, trainer): pass
    def before_epoch(self, trainer): pass
    def after_epoch(self, trainer): pass
    def before_train_iter(self, trainer): pass
    def after_train_iter(self, trainer, output, label, loss): pass
    def before_test(self, trainer): pass
    def after_test(self, trainer): pass
    def before_test_iter(self, trainer): pass
    def after_test_iter(self, trainer, output, label, loss): pass


class LossHook(BaseHook):
    """``loss``: this step's loss averaged over data-parallel replicas; ``epoch_loss`` and
    ``test_loss``: means over the epoch's steps / the test batches. One DATA all_reduce each."""

    uses_train_output = False
    priority = METRIC_PRIORITY

    def before_epoch(self, trainer):
        self._sum, self._n = 0.0, 0

    def after_train_iter(self, trainer, output, label, loss):
        value = _data_sum([loss.item()]).item() / gpc.get_world_size(ParallelMode.DATA)
        trainer.metrics['loss'] = value
        self._sum, self._n = self._sum + value, self._n + 1

    def after_epoch(self, trainer):
        if self._n:
            trainer.metrics['epoch_loss'] = self._sum / self._n

    def before_test(self, trainer):
        self._test = [0.0, 0.0]

    def after_test_iter(self, trainer, output, label, loss):
        self._test[0] += loss.item()
        self._test[1] += 1

    def after_test(self, trainer):
        total, count = _data_sum(self._test).tolist()
        trainer.metrics['test_loss'] = total / max(count, 1.0)


def default_accuracy(output, label):
    """(correct, counted) for class logits ``[.., C]`` (possibly vocab-split) against labels;
    labels equal to -100 are not counted. Tuples use their first element."""
    logits = output[0] if isinstance(output, (tuple, list)) else output
    labels = label[0] if isinstance(label, (tuple, list)) else label
    predicted = gather_logits(logits).argmax(dim=-1)
    counted = labels != -100
    return ((predicted == labels) & counted).sum().item(), counted.sum().item()


class AccuracyHook(BaseHook):
    """``test_accuracy``: correct / counted over the test set and all replicas.
    ``accuracy_fn(output, label) -> (correct, counted)`` (default: argmax of class logits)."""

    priority = METRIC_PRIORITY

    def __init__(self, accuracy_fn: Callable = default_accuracy, priority: Optional[int] = None):
        super().__init__(priority)
        self.accuracy_fn = accuracy_fn

    def before_test(self, trainer):
        self._counts = [0.0, 0.0]

    def after_test_iter(self, trainer, output, label, loss):
        if output is None:  # a pipeline stage before the last: no logits here
            return
        correct, counted = self.accuracy_fn(output, label)
        self._counts[0] += correct
        self._counts[1] += counted

    def after_test(self, trainer):
        counts = _data_sum(self._counts)
        if gpc.get_world_size(ParallelMode.PIPELINE) > 1:  # only the last stage counted
            counts = C.all_reduce(counts.to(gpc.device), ParallelMode.PIPELINE).cpu()
        correct, counted = counts.tolist()
        trainer.metrics['test_accuracy'] = correct / max(counted, 1.0)


class LRSchedulerHook(BaseHook):
    """Steps ``lr_scheduler`` after every optimizer step (or epoch with ``by_epoch``); ``lr``."""

    uses_train_output = False
    priority = SCHEDULER_PRIORITY

    def __init__(self, lr_scheduler, by_epoch: bool = False, priority: Optional[int] = None):
        super().__init__(priority)
        self.lr_scheduler, self.by_epoch = lr_scheduler, by_epoch

    def _step(self, trainer):
        self.lr_scheduler.step()
        trainer.metrics['lr'] = trainer.engine.optimizer.param_groups[0]['lr']

    def after_train_iter(self, trainer, output, label, loss):
        if not self.by_epoch:
            self._step(trainer)

    def after_epoch(self, trainer):
        if self.by_epoch:
            self._step(trainer)


def full_parameter_count(model: torch.nn.Module) -> int:
    """Parameters of the serial model (full shapes from the placements), tied ones once --
    summed over the pipeline stages (a weight held by the first and last stage counted on
    the first). One PIPELINE all_reduce when pipelined."""
    total = 0
    for p in model.parameters():
        if ParallelMode.EMBEDDING in param_placement(p).grad_sum \
                and gpc.get_local_rank(ParallelMode.EMBEDDING) != 0:
            continue
        total += math.prod(param_placement(p).shape)
    if gpc.get_world_size(ParallelMode.PIPELINE) > 1:
        total = int(C.all_reduce(torch.tensor([total], dtype=torch.float64, device=gpc.device),
                                 ParallelMode.PIPELINE).item())
    return total


def _sync_device():
    if gpc.device.type == 'cuda':
        torch.cuda.synchronize()


class ThroughputHook(BaseHook):
    """After ``warmup`` steps: ``samples_per_s`` and, when the samples are token sequences
    (``tokens=True``), ``tokens_per_s`` (global: local counts x data-parallel size / step
    time) and ``tflops`` = 6 * parameters * tokens/s / 1e12 (the forward+backward estimate;
    TFLOPS is the one unit everything prints); ``step_time_s`` (mean). ``replicas``: how
    many different batches the ranks read per step (default: the DATA size; 1 when every
    rank reads the whole batch, as under a graph plan)."""

    uses_train_output = False
    priority = METRIC_PRIORITY

    def __init__(self, warmup: int = 1, priority: Optional[int] = None, tokens: bool = True,
                 replicas: Optional[int] = None):
        super().__init__(priority)
        self.warmup, self.tokens, self.replicas = warmup, tokens, replicas

    def before_train(self, trainer):
        self._params = full_parameter_count(trainer.engine.model)
        self._time = self._samples = self._tokens = 0.0
        self._steps = 0

    def before_train_iter(self, trainer):
        _sync_device()
        self._start = time.perf_counter()

    def after_train_iter(self, trainer, output, label, loss):
        _sync_device()
        elapsed = time.perf_counter() - self._start
        self._steps += 1
        if self._steps <= self.warmup:
            return
        replicas = self.replicas or gpc.get_world_size(ParallelMode.DATA)
        self._time += elapsed
        self._samples += trainer.step_samples * replicas
        self._tokens += trainer.step_tokens * replicas
        measured = self._steps - self.warmup
        trainer.metrics['samples_per_s'] = self._samples / self._time
        if self.tokens:
            trainer.metrics.update(tokens_per_s=self._tokens / self._time,
                                   tflops=6 * self._params * self._tokens / self._time / 1e12)
        trainer.metrics['step_time_s'] = self._time / measured


class MoEStatsHook(BaseHook):
    """Mixture-of-experts statistics of each step (models with ``colossal_lite.nn.MoE``
    layers; ``engine.moe_layers`` empty: nothing, no collective):

    * ``expert_tokens_min`` / ``expert_tokens_max``: the fewest / most routed slots (tokens
      x top-k, before capacity drops, global over the replicas) that any expert of any MoE
      layer received in the step (all micro-batches);
    * ``expert_tokens_mean``: slots per expert, the same for every layer (step tokens x k /
      experts; with layers of different experts or k, the mean of the layers' means);
    * ``expert_tokens_max_over_mean``: the worst layer's max / mean (1 = balanced);
    * ``moe_aux_loss`` (and ``moe_z_loss`` with a z loss): the serial model's auxiliary
      losses summed over the MoE layers, coefficients included, averaged over the step's
      micro-batches.

    Read from ``MoE.step_tokens_per_expert`` / ``step_aux_loss`` / ``step_z_loss`` (closed by
    the engine's ``update_balance_bias`` after the step). One all_gather over GLOBAL of 6
    floats per step: pipeline stages hold different layers, and a layer's loss is the mean
    of the ``world / pipeline`` ranks holding it."""

    uses_train_output = False
    priority = METRIC_PRIORITY

    def after_train_iter(self, trainer, output, label, loss):
        layers = getattr(trainer.engine, 'moe_layers', None)
        if not layers:
            return
        mins, maxs, means, ratios = [], [], [], []
        aux = z = 0.0
        for layer in layers:
            counts = layer.step_tokens_per_expert.double()
            mean = float(counts.mean())
            mins.append(float(counts.min()))
            maxs.append(float(counts.max()))
            means.append(mean)
            ratios.append(float(counts.max()) / mean if mean > 0 else 1.0)
            aux += float(layer.step_aux_loss)
            z += float(layer.step_z_loss)
        mine = torch.tensor([[min(mins), max(maxs), sum(means), len(means), aux, z,
                              max(ratios)]], dtype=torch.float64, device=gpc.device)
        table = C.all_gather(mine, ParallelMode.GLOBAL).cpu()
        held = table[table[:, 3] > 0]
        holders = gpc.get_world_size(ParallelMode.GLOBAL) / gpc.get_world_size(
            ParallelMode.PIPELINE)
        trainer.metrics.update(
            expert_tokens_min=float(held[:, 0].min()),
            expert_tokens_mean=float(held[:, 2].sum() / held[:, 3].sum()),
            expert_tokens_max=float(held[:, 1].max()),
            expert_tokens_max_over_mean=float(held[:, 6].max()),
            moe_aux_loss=float(held[:, 4].sum() / holders))
        if any(layer.z_loss_coef for layer in layers):
            trainer.metrics['moe_z_loss'] = float(held[:, 5].sum() / holders)


MOE_METRICS = ('expert_tokens_min', 'expert_tokens_mean', 'expert_tokens_max',
               'expert_tokens_max_over_mean', 'moe_aux_loss', 'moe_z_loss')


def peak_memory_mb() -> float:
    """This process's peak: max allocated CUDA memory on GPU runs, peak RSS on CPU (MiB)."""
    if gpc.device.type == 'cuda':
        return torch.cuda.max_memory_allocated(gpc.device) / 2 ** 20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


class MemoryHook(BaseHook):
    """``peak_memory_mb``: list of every rank's peak (all_gather over GLOBAL) after each
    epoch and test, and every ``interval`` steps when given."""

    uses_train_output = False
    priority = METRIC_PRIORITY

    def __init__(self, interval: Optional[int] = None, priority: Optional[int] = None):
        super().__init__(priority)
        self.interval = interval

    def _record(self, trainer):
        mine = torch.tensor([peak_memory_mb()], dtype=torch.float64, device=gpc.device)
        trainer.metrics['peak_memory_mb'] = C.all_gather(mine, ParallelMode.GLOBAL).cpu().tolist()

    def after_train_iter(self, trainer, output, label, loss):
        if self.interval and trainer.cur_step % self.interval == 0:
            self._record(trainer)

    def after_epoch(self, trainer):
        self._record(trainer)

    def after_test(self, trainer):
        self._record(trainer)


def _scalars(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float))}


def _is_test_metric(key: str) -> bool:
    return key.startswith('test_')


def train_metrics(metrics: dict) -> dict:
    """The metrics of training (the last test's ``test_*`` left out)."""
    return {k: v for k, v in metrics.items() if not _is_test_metric(k)}


def step_metrics(metrics: dict) -> dict:
    """The metrics of the last step (the last epoch's ``epoch_*`` and test's ``test_*`` left out)."""
    return {k: v for k, v in metrics.items() if not (_is_test_metric(k) or k.startswith('epoch_'))}


def test_metrics(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if _is_test_metric(k)}


def _format(metrics: dict) -> str:
    parts = []
    for k, v in metrics.items():
        if isinstance(v, float):
            parts.append(f'{k}={v:.4g}')
        elif isinstance(v, list):
            parts.append(f"{k}=[{', '.join(f'{x:.0f}' for x in v)}]")
        else:
            parts.append(f'{k}={v}')
    return ' '.join(parts)


class LogMetricByStepHook(BaseHook):
    """Every ``interval`` steps: append ``{step, epoch, **metrics}`` (this step's metrics only:
    no stale ``test_*`` or ``epoch_*``) to ``trainer.history`` and print it on rank 0 with
    ``printer``."""

    uses_train_output = False

    def __init__(self, interval: int = 1, printer: Callable[[str], object] = print,
                 priority: Optional[int] = None):
        super().__init__(priority)
        self.interval, self.printer = interval, printer

    def after_train_iter(self, trainer, output, label, loss):
        if trainer.cur_step % self.interval:
            return
        record = dict(step=trainer.cur_step, epoch=trainer.cur_epoch,
                      **step_metrics(trainer.metrics))
        trainer.history.append(record)
        if _is_rank0():
            self.printer(_format(record))


class LogMetricByEpochHook(BaseHook):
    """After every epoch (training metrics) and test (``test_*`` metrics only): print on rank 0."""

    def __init__(self, printer: Callable[[str], object] = print, priority: Optional[int] = None):
        super().__init__(priority)
        self.printer = printer

    def after_epoch(self, trainer):
        if _is_rank0():
            self.printer(f'epoch {trainer.cur_epoch} ' + _format(train_metrics(trainer.metrics)))

    def after_test(self, trainer):
        if _is_rank0():
            self.printer(f'test (epoch {trainer.cur_epoch}) ' + _format(test_metrics(trainer.metrics)))


class ProgressBarHook(BaseHook):
    """A tqdm bar of the ``total`` steps on rank 0 with the loss and the throughput, when
    ``stream`` (default stdout) is a terminal and tqdm is installed (``force`` draws it on any
    stream); :meth:`printer` prints a line above the bar (or plainly when there is none)."""

    uses_train_output = False

    def __init__(self, total: int, unit: str = 'tokens/s', stream=None, force: bool = False,
                 priority: Optional[int] = None):
        super().__init__(priority)
        import sys
        self.total, self.unit, self.stream = total, unit, stream or sys.stdout
        self.enabled = _is_rank0() and (force or self.stream.isatty()) and _tqdm() is not None
        self.bar = None

    def printer(self, *parts):
        line = ' '.join(str(p) for p in parts)
        if self.bar is not None:
            self.bar.write(line, file=self.stream)
        elif _is_rank0():
            print(line, file=self.stream, flush=True)

    def before_train(self, trainer):
        if self.enabled:
            self.bar = _tqdm()(total=self.total, file=self.stream, dynamic_ncols=True,
                               unit='step', desc='train')

    def after_train_iter(self, trainer, output, label, loss):
        if self.bar is None:
            return
        shown = {'loss': f"{trainer.metrics['loss']:.4f}"} if 'loss' in trainer.metrics else {}
        rate = trainer.metrics.get('tokens_per_s' if self.unit == 'tokens/s' else 'samples_per_s')
        if rate is not None:
            shown[self.unit] = f'{rate:.0f}'
        if 'expert_tokens_max' in trainer.metrics:   # MoE: tokens per expert min/mean/max
            shown['experts'] = '/'.join(f"{trainer.metrics[f'expert_tokens_{k}']:.0f}"
                                        for k in ('min', 'mean', 'max'))
        self.bar.set_postfix(shown, refresh=False)
        self.bar.update(1)

    def after_train(self, trainer):
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _tqdm():
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm


class SaveCheckpointHook(BaseHook):
    """``colossal_lite.checkpoint.save`` (collective: sharded, atomic, loads into any layout)
    every ``interval`` epochs (or steps with ``by_step``) and, with ``at_end``, after the
    last step unless that one was just saved. ``path`` may hold ``{epoch}``/``{step}``
    (one directory per save) or not (each save replaces the previous one atomically). The
    LR scheduler, the dataloader position and ``extra`` are saved with the engine. Runs
    after the scheduler has stepped and the loggers have read the metrics. With
    ``async_save`` a save's files are written in the background during the next step and
    completed (barrier + rename) after it; the last save is completed before training ends.
    Resume with ``checkpoint.load(dir, engine, lr_scheduler, dataloader)``."""

    uses_train_output = False
    priority = OUTPUT_PRIORITY + 1

    def __init__(self, path: str, interval: int = 1, by_step: bool = False, lr_scheduler=None,
                 dataloader=None, extra=None, async_save: bool = False, at_end: bool = True,
                 priority: Optional[int] = None):
        super().__init__(priority)
        if interval < 1:
            raise ValueError(f'SaveCheckpointHook interval must be a positive integer, got '
                             f'{interval}')
        self.path, self.interval, self.by_step, self.at_end = path, interval, by_step, at_end
        self.lr_scheduler, self.dataloader, self.extra = lr_scheduler, dataloader, extra
        self.async_save = async_save
        self.saved_at = self.pending = None

    def _save(self, trainer, async_save: bool):
        self._complete()
        path = self.path.format(epoch=trainer.cur_epoch, step=trainer.cur_step)
        self.pending = checkpoint.save(path, trainer.engine, lr_scheduler=self.lr_scheduler,
                                       dataloader=self.dataloader, extra=self.extra,
                                       async_save=async_save)
        self.saved_at = trainer.cur_step

    def _complete(self):
        if self.pending is not None:
            self.pending.wait()
            self.pending = None

    def after_train_iter(self, trainer, output, label, loss):
        self._complete()
        if self.by_step and trainer.cur_step % self.interval == 0:
            self._save(trainer, self.async_save)

    def after_epoch(self, trainer):
        if not self.by_step and (trainer.cur_epoch + 1) % self.interval == 0:
            self._save(trainer, self.async_save)

    def after_train(self, trainer):
        if self.at_end and self.saved_at != trainer.cur_step:
            self._save(trainer, False)
        self._complete()


class TensorBoardHook(BaseHook):
    """Scalar metrics to TensorBoard on rank 0 after every step and test; needs tensorboard."""

    uses_train_output = False

    def __init__(self, log_dir: str, priority: Optional[int] = None):
        super().__init__(priority)
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise ImportError('TensorBoardHook needs the tensorboard package '
                              '(pip install tensorboard)') from err
        self.writer = SummaryWriter(log_dir) if _is_rank0() else None

    def _write(self, trainer, prefix: str):
        if self.writer is not None:
            for key, value in _scalars(trainer.metrics).items():
                self.writer.add_scalar(f'{prefix}/{key}', value, trainer.cur_step)

    def after_train_iter(self, trainer, output, label, loss):
        self._write(trainer, 'train')

    def after_test(self, trainer):
        self._write(trainer, 'test')

    def after_train(self, trainer):
        if self.writer is not None:
            self.writer.flush()


def tensorboard_available() -> bool:
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return False
    return True
