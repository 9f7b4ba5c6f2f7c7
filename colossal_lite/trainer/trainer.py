"""Trainer: epochs of optimizer steps over an Engine, with hooks at fixed points.

Call order (hooks sorted by ascending ``priority``, ties in the order given)::

    before_train
      before_epoch
        before_train_iter ; <gradient_accumulation micro-batches> ; after_train_iter(output, label, loss)
        ...
      after_epoch
      [every test_interval epochs] before_test ; (before_test_iter ; after_test_iter)* ; after_test
    after_train

One trainer step is one optimizer update: ``engine.gradient_accumulation``
micro-batches, each through ``engine.execute_schedule``; the step's loss is the
mean of the micro-batch losses. ``max_steps`` counts these steps over all epochs.
A partial accumulation at the end of an epoch is dropped. ``trainer.metrics``
holds what metric hooks computed; ``trainer.history`` one dict per logged step.
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
    def _next_micro_batches(self, batches) -> Optional[list]:
        """The next ``gradient_accumulation`` batches, or None if the loader runs out first."""
        micro = []
        for _ in range(self.engine.gradient_accumulation):
            try:
                micro.append(next(batches))
            except StopIteration:
                return None
        return micro

    def _train_step(self, micro_batches: list) -> tuple:
        """One optimizer update over the micro-batches: (last output, last label, mean loss)."""
        engine, losses = self.engine, []
        self.step_samples = self.step_tokens = 0
        engine.zero_grad()
        output = label = None
        for batch in micro_batches:
            samples, tokens = _count(batch)
            self.step_samples += samples
            self.step_tokens += tokens
            output, label, loss = engine.execute_schedule(batch, return_output=True)
            losses.append(loss)
        engine.step()
        return output, label, torch.stack(losses).float().mean()

    def _train_epoch(self, train_dataloader, max_steps: Optional[int], display_progress: bool):
        self.engine.train()
        self.call_hooks('before_epoch')
        bar = _progress(self.steps_per_epoch, f'epoch {self.cur_epoch}', display_progress)
        batches = iter(train_dataloader)
        while max_steps is None or self.cur_step < max_steps:
            micro_batches = self._next_micro_batches(batches)
            if micro_batches is None:  # a partial accumulation at the end is dropped
                break
            self.call_hooks('before_train_iter')
            result = self._train_step(micro_batches)
            self.cur_step += 1
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
            self.steps_per_epoch = len(train_dataloader) // self.engine.gradient_accumulation
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
                output, label, loss = self.engine.execute_schedule(batch, forward_only=True,
                                                                   return_output=True)
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
