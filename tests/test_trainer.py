"""Trainer and hooks: hooks run in priority order at every point; the metric hooks compute
what a plain loop computes; one trainer step is one schedule of M loader batches (steps per
epoch, step losses, outputs and weights as a plain accumulation loop, partial steps dropped,
also for a loader without len); a dp=2 run with gradient accumulation through Trainer.fit
saves (rank 0) a checkpoint equal to the serial model trained on the concatenated batches."""
from __future__ import annotations

import os

import pytest
import torch

import colossal_lite as clt
from colossal_lite.trainer import hooks as H
from colossal_lite.trainer import Trainer
from colossal_lite.testing import (assert_close_dict, make_optimizer, max_rel_diff,
                                   replica_batch, run_distributed)
from colossal_lite.engine import Engine
from tests.model_cases import build, criterion, global_batch, reference_trace, serial_state


class Recorder(H.BaseHook):
    EVENTS = ('before_train', 'after_train', 'before_epoch', 'after_epoch', 'before_train_iter',
              'after_train_iter', 'before_test', 'after_test', 'before_test_iter', 'after_test_iter')

    def __init__(self, name, log, priority):
        super().__init__(priority)
        self.name, self.log = name, log
        for event in self.EVENTS:
            setattr(self, event, self._recorder(event))

    def _recorder(self, event):
        return lambda trainer, *args: self.log.append((event, self.name))


def _serial_engine(family='vit', **config):
    model = build(family)
    return clt.initialize(model, make_optimizer(model.parameters()), criterion(family),
                          config=config or None)[0]


def test_hooks_run_in_priority_order():
    log = []
    hooks = [Recorder('late', log, 10), Recorder('first', log, -1), Recorder('mid_a', log, 5),
             Recorder('mid_b', log, 5)]
    data = [global_batch('vit', seed=i, batch=2) for i in range(3)]
    Trainer(_serial_engine()).fit(data, epochs=2, max_steps=4, test_dataloader=data[:1],
                                  hooks=hooks, display_progress=True)
    order = ['first', 'mid_a', 'mid_b', 'late']
    events = [e for e, _ in log[::4]]
    assert all([n for _, n in log[i:i + 4]] == order for i in range(0, len(log), 4)), log
    epoch = (['before_epoch'] + ['before_train_iter', 'after_train_iter'] * 3 + ['after_epoch']
             + ['before_test', 'before_test_iter', 'after_test_iter', 'after_test'])
    last = (['before_epoch', 'before_train_iter', 'after_train_iter', 'after_epoch']
            + ['before_test', 'before_test_iter', 'after_test_iter', 'after_test'])
    assert events == ['before_train'] + epoch + last + ['after_train'], events


def test_metric_hooks_match_a_plain_computation(tmp_path):
    engine = _serial_engine()
    init = {k: v.clone() for k, v in engine.model.state_dict().items()}
    sched = torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=1, gamma=0.5)
    data = [global_batch('vit', seed=i, batch=4) for i in range(3)]
    test = [global_batch('vit', seed=10 + i, batch=4) for i in range(2)]
    lines = []
    path = os.path.join(str(tmp_path), 'ckpt_{epoch}')
    hooks = [H.LogMetricByStepHook(printer=lines.append), H.LogMetricByEpochHook(printer=lines.append),
             H.SaveCheckpointHook(path), H.LRSchedulerHook(sched), H.LossHook(), H.AccuracyHook(),
             H.ThroughputHook(warmup=1), H.MemoryHook()]
    trainer = Trainer(engine)
    metrics = trainer.fit(data, epochs=1, test_dataloader=test, hooks=hooks)
    assert [h.priority for h in trainer.hooks] == sorted(h.priority for h in hooks)
    assert metrics['lr'] == pytest.approx(1e-3 * 0.5 ** 3)
    model = engine.model.eval()
    with torch.no_grad():
        logits = [model(x) for x, _ in test]
        acc = sum((lg.argmax(-1) == y).sum().item() for lg, (_, y) in zip(logits, test)) / 8
        test_loss = sum(criterion('vit')(lg, y).item() for lg, (_, y) in zip(logits, test)) / 2
    assert metrics['test_accuracy'] == pytest.approx(acc)
    assert metrics['test_loss'] == pytest.approx(test_loss, rel=1e-6)
    first = build('vit')
    first.load_state_dict(init)
    assert trainer.history[0]['loss'] == pytest.approx(
        criterion('vit')(first(data[0][0]), data[0][1]).item(), rel=1e-6)
    assert metrics['epoch_loss'] == pytest.approx(sum(r['loss'] for r in trainer.history) / 3)
    params = sum(p.numel() for p in model.parameters())
    assert metrics['tflops'] == pytest.approx(6 * params * metrics['tokens_per_s'] / 1e12)
    assert metrics['samples_per_s'] == pytest.approx(4 / metrics['step_time_s'])
    assert len(metrics['peak_memory_mb']) == 1 and metrics['peak_memory_mb'][0] > 10
    saved, step = _saved_model('vit', path.format(epoch=0))
    assert step == 3 and all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
    assert len(lines) == 3 + 2 and lines[0].startswith('step=1')


def test_tensorboard_hook_needs_tensorboard(tmp_path):
    if H.tensorboard_available():
        H.TensorBoardHook(str(tmp_path))
    else:
        with pytest.raises(ImportError, match='tensorboard'):
            H.TensorBoardHook(str(tmp_path))


class OutputRecorder(H.BaseHook):
    def __init__(self, uses_output=True):
        super().__init__()
        self.uses_train_output, self.seen = uses_output, []

    def after_train_iter(self, trainer, output, label, loss):
        self.seen.append((output, label))


def _plain_accumulation(init, data, m, epochs):
    """Step losses, step outputs and final weights of a plain torch loop over full steps."""
    model = build('vit')
    model.load_state_dict(init)
    opt, crit = make_optimizer(model.parameters()), criterion('vit')
    losses, outputs = [], []
    for _ in range(epochs):
        for step in range(len(data) // m):
            opt.zero_grad()
            micro = [model(x) for x, _ in data[step * m:(step + 1) * m]]
            step_losses = [crit(out, y) for out, (_, y) in zip(micro, data[step * m:])]
            (sum(step_losses) / m).backward()
            opt.step()
            losses.append(torch.stack(step_losses).mean().item())
            outputs.append(torch.cat([o.detach() for o in micro]))
    return losses, outputs, model.state_dict()


class _NoLen:
    def __init__(self, data):
        self.data = data

    def __iter__(self):
        return iter(self.data)


@pytest.mark.parametrize('loader', ['list', 'no_len'])
def test_fit_steps_are_schedules_of_m_loader_batches(loader):
    m, epochs = 2, 2
    data = [global_batch('vit', seed=30 + i, batch=4) for i in range(7)]    # 3 steps, 1 left
    torch.manual_seed(0)
    model = build('vit')
    init = {k: v.clone() for k, v in model.state_dict().items()}
    losses, outputs, params = _plain_accumulation(init, data, m, epochs)
    engine = Engine(model, make_optimizer(model.parameters()), criterion('vit'), num_microbatches=m)
    trainer, rec = Trainer(engine), OutputRecorder()
    trainer.fit(data if loader == 'list' else _NoLen(data), epochs=epochs,
                hooks=[H.LogMetricByStepHook(printer=lambda line: None), H.LossHook(), rec,
                       H.ThroughputHook(warmup=0)])
    assert trainer.steps_per_epoch == (3 if loader == 'list' else None)
    assert trainer.cur_step == 6 and len(trainer.history) == 6
    assert [r['loss'] for r in trainer.history] == pytest.approx(losses, rel=1e-6)
    assert trainer.metrics['samples_per_s'] * trainer.metrics['step_time_s'] == pytest.approx(8)
    for step, ((out, label), expected) in enumerate(zip(rec.seen, outputs)):
        labels = torch.cat([y for _, y in data[(step % 3) * m:(step % 3 + 1) * m]])
        assert max_rel_diff(out, expected) <= 1e-5 and torch.equal(label, labels), step
    worst = max(max_rel_diff(engine.model.state_dict()[k], v) for k, v in params.items())
    assert worst <= 1e-6, worst
    quiet = OutputRecorder(uses_output=False)      # no hook reads outputs: none are kept
    Trainer(engine).fit(data, max_steps=1, hooks=[quiet, H.LossHook()])
    assert quiet.seen == [(None, None)]
    odd = global_batch('vit', seed=40, batch=3)    # a test batch is one micro-batch
    with torch.no_grad():
        expected = criterion('vit')(engine.model.eval()(odd[0]), odd[1]).item()
    assert trainer.evaluate([odd], hooks=[H.LossHook()])['test_loss'] == pytest.approx(expected)


ACCUM, STEPS = 2, 2


def _saved_model(kind, path):
    """(full model state dict, global step) of the checkpoint directory ``path``, read in
    this (serial) process."""
    from colossal_lite import checkpoint
    model = build(kind)
    checkpoint.load_model(path, model)
    common = torch.load(os.path.join(path, 'common.pt'), weights_only=True)
    return model.state_dict(), common['global_step']


def _fit_worker(rank, state, micro_batches, path):
    model = build('gpt')
    model.load_state_dict(state)
    engine, loader, *_ = clt.initialize(model, make_optimizer(model.parameters()),
                                        criterion('gpt'),
                                        train_dataloader=[replica_batch(b) for b in micro_batches])
    trainer = Trainer(engine)
    trainer.fit(loader, epochs=1, hooks=[H.LossHook(), H.SaveCheckpointHook(path),
                                         H.ThroughputHook(warmup=0), H.MemoryHook()])
    return trainer.metrics['loss'], trainer.cur_step, trainer.metrics['peak_memory_mb'], \
        trainer.metrics['samples_per_s'] * trainer.metrics['step_time_s']


def test_fit_dp2_with_accumulation_equals_serial(tmp_path):
    micro = [global_batch('gpt', seed=20 + i, batch=4) for i in range(ACCUM * STEPS)]
    big = [tuple(torch.cat([m[j] for m in micro[s * ACCUM:(s + 1) * ACCUM]]) for j in range(2))
           for s in range(STEPS)]
    state = serial_state('gpt')
    ref = reference_trace('gpt', state, big, steps=STEPS)
    path = os.path.join(str(tmp_path), 'fit')
    results = run_distributed(_fit_worker, 2, dict(gradient_accumulation=ACCUM), state, micro,
                              path, timeout=300)
    assert [r[1] for r in results] == [STEPS, STEPS]
    assert results[0][0] == results[1][0]          # loss metric averaged over replicas
    assert results[0][2] == results[1][2] and len(results[0][2]) == 2   # per-rank peaks
    assert results[0][3] == pytest.approx(ACCUM * 4)     # global samples per step
    saved, step = _saved_model('gpt', path)
    assert step == STEPS
    assert_close_dict(saved, ref.named(STEPS - 1, 'param'), 1e-5,
                      'parameter after fit:')
