"""Trainer: epochs of optimizer steps over an Engine, with hooks at fixed points.

Call order (hooks sorted by ascending ``priority``, ties in the order given)::

    before_train
      before_epoch
        before_train_iter ; <one step: M micro-batches> ; after_train_iter(output, label, loss)
        ...
      after_epoch
      [every test_interval epochs] before_test ; (before_test_iter ; after_test_iter)* ; after_test
    after_train

One trainer step is ``engine.execute_schedule(loader_iterator)`` (the engine's
schedule draws its M = ``engine.num_microbatches`` loader batches, one per
micro-batch) and ``engine.step()``; the step's loss is the mean of the micro-batch
losses, output and label those of the M micro-batches concatenated (kept only when
a hook's ``uses_train_output`` asks for them). ``steps_per_epoch`` is
``len(loader) // M``; a partial step at the end of an epoch is dropped (a loader
without ``len`` ends an epoch when the schedule raises ``StopIteration``; then
that last ``before_train_iter`` has no ``after_train_iter``). ``max_steps``
counts steps over all epochs. Each test batch is one forward-only micro-batch.
``trainer.metrics`` holds what metric hooks computed; ``trainer.history`` one
dict per logged step.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch

from ..context import global_context as gpc
from .hooks import BaseHook


def _progress(total: Optional[int], desc: str, enabled: bool):
    if not enabled or gpc.get_global_rank() != 0:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, dynamic_ncols=True)


def _count(batch: Any) -> tuple:
    """(samples, tokens) of a batch: the first tensor's batch size; tokens = b*s for 2-D ids."""
    first = batch
    while isinstance(first, (tuple, list, dict)) and len(first):
        first = next(iter(first.values())) if isinstance(first, dict) else first[0]
    if not torch.is_tensor(first) or first.dim() == 0:
        return 0, 0
    samples = first.shape[0]
    tokens = first.numel() if first.dim() == 2 and not first.is_floating_point() else samples
    return samples, tokens


class _CountingIterator:
    """A loader iterator that adds up the samples and tokens of the batches it yields."""

    def __init__(self, iterator):
        self._iterator = iterator
        self.samples = self.tokens = 0

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self._iterator)
        samples, tokens = _count(batch)
        self.samples += samples
        self.tokens += tokens
        return batch


class Trainer:
    def __init__(self, engine):
        self.engine = engine
        self.hooks: List[BaseHook] = []
        self.metrics: dict = {}
        self.history: List[dict] = []
        self.cur_epoch = 0
        self.cur_step = 0            # optimizer steps done in fit()
        self.steps_per_epoch: Optional[int] = None
        self.step_samples = self.step_tokens = 0   # local, of the last step
        self.training = False

    # ------------------------------------------------------------------ hooks
    def _set_hooks(self, hooks: Optional[Sequence[BaseHook]]):
        hooks = list(hooks or [])
        for h in hooks:
            if not isinstance(h, BaseHook):
                raise ValueError(f'hooks must be colossal_lite.trainer.hooks.BaseHook instances, '
                                 f'got {type(h).__name__}')
        self.hooks = sorted(hooks, key=lambda h: h.priority)  # stable: ties keep order

    def call_hooks(self, event: str, *args):
        for hook in self.hooks:
            getattr(hook, event)(self, *args)

    # --------------------------------------------------------------- training
    def _wants_train_output(self) -> bool:
        """Whether some hook's (overridden) after_train_iter reads the step's output."""
        base = BaseHook.after_train_iter
        return any(h.uses_train_output and getattr(h.after_train_iter, '__func__', None) is not base
                   for h in self.hooks)

    def _train_step(self, batches: _CountingIterator) -> tuple:
        """One optimizer step over the next M batches: (output, label, mean loss).
        Raises StopIteration (nothing computed) when fewer than M are left."""
        engine = self.engine
        batches.samples = batches.tokens = 0
        engine.zero_grad()
        result = engine.execute_schedule(batches, return_output=self._wants_train_output())
        engine.step()
        self.step_samples, self.step_tokens = batches.samples, batches.tokens
        return result

    def _train_epoch(self, train_dataloader, max_steps: Optional[int], display_progress: bool):
        self.engine.train()
        self.call_hooks('before_epoch')
        bar = _progress(self.steps_per_epoch, f'epoch {self.cur_epoch}', display_progress)
        batches, done = _CountingIterator(iter(train_dataloader)), 0
        while ((max_steps is None or self.cur_step < max_steps)
               and (self.steps_per_epoch is None or done < self.steps_per_epoch)):
            self.call_hooks('before_train_iter')
            try:
                result = self._train_step(batches)
            except StopIteration:  # fewer than M batches left: the partial step is dropped
                break
            self.cur_step, done = self.cur_step + 1, done + 1
            self.call_hooks('after_train_iter', *result)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f'{result[2].item():.4f}')
        if bar is not None:
            bar.close()
        self.call_hooks('after_epoch')

    def fit(self, train_dataloader, epochs: int = 1, max_steps: Optional[int] = None,
            test_dataloader=None, test_interval: int = 1, hooks: Optional[Sequence[BaseHook]] = None,
            display_progress: bool = False):
        """Train for ``epochs`` (or until ``max_steps`` optimizer steps); returns ``self.metrics``."""
        if epochs < 1 or test_interval < 1 or (max_steps is not None and max_steps < 1):
            raise ValueError(f'fit needs epochs >= 1, test_interval >= 1 and max_steps >= 1 or None; '
                             f'got epochs={epochs}, test_interval={test_interval}, '
                             f'max_steps={max_steps}')
        self._set_hooks(hooks)
        try:
            self.steps_per_epoch = len(train_dataloader) // self.engine.num_microbatches
        except TypeError:
            self.steps_per_epoch = None
        self.cur_step, self.training = 0, True
        self.call_hooks('before_train')
        for epoch in range(epochs):
            self.cur_epoch = epoch
            self._train_epoch(train_dataloader, max_steps, display_progress)
            if test_dataloader is not None and (epoch + 1) % test_interval == 0:
                self._evaluate(test_dataloader, display_progress)
            if max_steps is not None and self.cur_step >= max_steps:
                break
        self.training = False
        self.call_hooks('after_train')
        return self.metrics

    # ------------------------------------------------------------- evaluation
    def _evaluate(self, test_dataloader, display_progress: bool):
        self.engine.eval()
        self.call_hooks('before_test')
        bar = _progress(None, 'test', display_progress)
        with torch.no_grad():
            for batch in test_dataloader:
                self.call_hooks('before_test_iter')
                output, label, loss = self.engine.execute_schedule(
                    batch, forward_only=True, return_output=True, num_microbatches=1)
                self.call_hooks('after_test_iter', output, label, loss)
                if bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        self.call_hooks('after_test')
        self.engine.train()

    def evaluate(self, test_dataloader, hooks: Optional[Sequence[BaseHook]] = None,
                 display_progress: bool = False) -> dict:
        """One pass over ``test_dataloader`` without gradients; returns ``self.metrics``."""
        self._set_hooks(hooks)
        self._evaluate(test_dataloader, display_progress)
        return self.metrics
