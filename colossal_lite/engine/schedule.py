"""The non-pipeline schedule: one batch -> forward, loss, backward.

A batch is ``(inputs, labels)`` or a dict:

* ``inputs``: a tensor (``model(x)``), a tuple/list (``model(*inputs)``) or a dict
  (``model(**inputs)``);
* ``labels``: a tensor (``criterion(out, y)``), a tuple/list (``criterion(out, *labels)``),
  a dict (``criterion(out, **labels)``) or None (``criterion(out)``);
* a dict batch: its ``'labels'`` (or ``'label'``) entry is the labels, the rest the
  model's keyword inputs.

Every tensor is moved to the run's device. Each data-parallel replica passes its
own slice of the global batch; tensor-parallel ranks pass the same full batch.
"""
from __future__ import annotations

from typing import Any, Iterator, Tuple

import torch

from ..context import global_context as gpc


def to_device(obj: Any, device: torch.device) -> Any:
    if torch.is_tensor(obj):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, (tuple, list)):
        return type(obj)(to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj


def split_batch(batch: Any) -> Tuple[Any, Any]:
    """``(inputs, labels)`` of a batch in one of the forms of the module docstring."""
    if isinstance(batch, dict):
        label_key = 'labels' if 'labels' in batch else 'label' if 'label' in batch else None
        labels = batch[label_key] if label_key else None
        return {k: v for k, v in batch.items() if k != label_key}, labels
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise ValueError(f'a batch must be (inputs, labels) or a dict with a "labels" entry, got '
                     f'{type(batch).__name__}' + (f' of length {len(batch)}'
                                                  if isinstance(batch, (tuple, list)) else ''))


def call_with(fn, first, obj):
    """``fn(*first, obj...)`` with ``obj`` spread as the forms above describe."""
    if obj is None:
        return fn(*first)
    if isinstance(obj, dict):
        return fn(*first, **obj)
    if isinstance(obj, (tuple, list)):
        return fn(*first, *obj)
    return fn(*first, obj)


class NonPipelineSchedule:
    """Forward (and backward) of one batch on the whole model held by this rank."""

    def run(self, engine, data: Any, forward_only: bool = False, return_loss: bool = True,
            return_output: bool = False):
        batch = next(data) if isinstance(data, Iterator) else data
        inputs, labels = to_device(split_batch(batch), gpc.device)
        with torch.set_grad_enabled(not forward_only and torch.is_grad_enabled()):
            output = call_with(engine, (), inputs)
            loss = None
            if return_loss or not forward_only:
                if engine.criterion is None:
                    raise ValueError('execute_schedule needs a criterion to compute the loss; '
                                     'pass one to initialize() or use return_loss=False')
                with engine.autocast():
                    loss = call_with(engine.criterion, (output,), labels)
            if not forward_only:
                engine.backward(loss)
        return (output if return_output else None, labels if return_output else None,
                loss.detach() if (return_loss and loss is not None) else None)
