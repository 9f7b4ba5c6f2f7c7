"""The non-pipeline schedule: one optimizer step's M micro-batches -> forward, loss, backward.

A batch is ``(inputs, labels)`` or a dict:

* ``inputs``: a tensor (``model(x)``), a tuple/list (``model(*inputs)``) or a dict
  (``model(**inputs)``);
* ``labels``: a tensor (``criterion(out, y)``), a tuple/list (``criterion(out, *labels)``),
  a dict (``criterion(out, **labels)``) or None (``criterion(out)``);
* a dict batch: its ``'labels'`` (or ``'label'``) entry is the labels, the rest the
  model's keyword inputs.

The M micro-batches of a step come from

* a batch: every tensor (with a batch dim) is cut along dim 0 into M equal parts;
  other values go to every micro-batch. A batch size M does not divide is a
  ``ValueError`` before any forward;
* an iterator (e.g. ``iter(dataloader)``): its next M batches, one per micro-batch.
  When it runs out first, ``StopIteration`` is raised and nothing is computed (the
  batches drawn are dropped).

Every tensor is moved to the run's device. Each data-parallel replica passes its
own slice of the global batch; tensor-parallel ranks pass the same full batch.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, List, Tuple

import torch

from ..context import global_context as gpc
from ..tensor.placement import placement_of, set_placement


def _rebuild(obj, items):
    """A tuple/list (or namedtuple) like ``obj`` holding ``items``."""
    return type(obj)(*items) if hasattr(obj, '_fields') else type(obj)(items)


def _map(fn: Callable, obj: Any) -> Any:
    """``fn`` applied to every tensor in nested tuples/lists/dicts."""
    if torch.is_tensor(obj):
        return fn(obj)
    if isinstance(obj, (tuple, list)):
        return _rebuild(obj, [_map(fn, o) for o in obj])
    if isinstance(obj, dict):
        return {k: _map(fn, v) for k, v in obj.items()}
    return obj


def to_device(obj: Any, device: torch.device) -> Any:
    return _map(lambda t: t.to(device, non_blocking=True), obj)


def _detach(t: torch.Tensor) -> torch.Tensor:
    """``t.detach()`` that keeps its placement (logits stay gatherable)."""
    out = t.detach()
    placement = placement_of(t)
    return set_placement(out, placement) if placement is not None else out


def detached(obj: Any) -> Any:
    return _map(_detach, obj)


def _cat(parts: List[torch.Tensor]) -> torch.Tensor:
    """Micro-batch outputs joined along dim 0, keeping their placement when none of them is
    cut along dim 0 (local rows of batch-cut shards would interleave in the wrong order)."""
    out = torch.cat(parts, dim=0)
    placements = [placement_of(p) for p in parts]
    if all(pl is not None and not pl.cut_modes(0) for pl in placements):
        shape = list(placements[0].shape)
        shape[0] = sum(pl.shape[0] for pl in placements)
        set_placement(out, placements[0].with_shape(shape))
    return out


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


def chunk(obj: Any, num: int, where: str = 'batch') -> list:
    """``num`` micro-batches of ``obj``: tensors cut into equal parts along dim 0."""
    if torch.is_tensor(obj) and obj.dim() > 0:
        if obj.shape[0] % num:
            raise ValueError(f'num_microbatches = {num} does not divide the batch size '
                             f'{obj.shape[0]} of {where} (shape {tuple(obj.shape)}); use a '
                             f'batch size that is a multiple of {num}')
        return list(obj.tensor_split(num))
    if isinstance(obj, (tuple, list)):
        parts = [chunk(o, num, f'{where}[{i}]') for i, o in enumerate(obj)]
        return [_rebuild(obj, [p[m] for p in parts]) for m in range(num)]
    if isinstance(obj, dict):
        parts = {k: chunk(v, num, f'{where}[{k!r}]') for k, v in obj.items()}
        return [{k: p[m] for k, p in parts.items()} for m in range(num)]
    return [obj] * num


def concat(parts: list) -> Any:
    """The micro-batch results ``parts`` joined: tensors with a batch dim concatenated along
    dim 0, anything else taken from the last part."""
    last = parts[-1]
    if len(parts) == 1:
        return last
    if torch.is_tensor(last):
        return _cat(parts) if last.dim() > 0 else last
    if isinstance(last, (tuple, list)):
        return _rebuild(last, [concat([p[i] for p in parts]) for i in range(len(last))])
    if isinstance(last, dict):
        return {k: concat([p[k] for p in parts]) for k in last}
    return last


def micro_batches(data: Any, num: int) -> List[Tuple[Any, Any]]:
    """The ``num`` ``(inputs, labels)`` micro-batches of a batch or the next ``num`` batches
    of an iterator (``StopIteration`` if it has fewer)."""
    if not isinstance(data, Iterator):
        inputs, labels = split_batch(data)
        return list(zip(chunk(inputs, num, 'inputs'), chunk(labels, num, 'labels')))
    drawn = []
    for _ in range(num):
        try:
            drawn.append(next(data))
        except StopIteration:
            raise StopIteration(f'the data iterator ran out after {len(drawn)} of '
                                f'num_microbatches = {num} batches; nothing was computed') from None
    return [split_batch(batch) for batch in drawn]


class NonPipelineSchedule:
    """Every micro-batch of a step, one after the other, on the whole model of this rank."""

    def synchronize_gradients(self, engine):
        """Gradient sums the schedule owes besides the data-parallel one (none here)."""

    def run(self, engine, data: Any, num_microbatches: int, forward_only: bool = False,
            return_loss: bool = True, return_output: bool = False):
        """``(output, labels, loss)``: the micro-batches' outputs and labels concatenated
        (None unless ``return_output``), the mean of their losses (detached; None unless
        ``return_loss``). Without ``forward_only`` each micro-batch's loss goes through
        ``engine.backward`` (which scales it by 1/M)."""
        need_loss = return_loss or not forward_only
        if need_loss and engine.criterion is None:
            raise ValueError('execute_schedule needs a criterion to compute the loss; '
                             'pass one to initialize() or use return_loss=False')
        micro = micro_batches(data, num_microbatches)  # every check before any forward
        outputs, labels, losses = [], [], []
        for batch in micro:
            output, label, loss = self._micro_step(engine, batch, forward_only, need_loss)
            if return_output:
                outputs.append(detached(output))
                labels.append(label)
            if loss is not None:
                losses.append(loss.detach())
        return (concat(outputs) if return_output else None,
                concat(labels) if return_output else None,
                _mean(losses) if return_loss else None)

    @staticmethod
    def _micro_step(engine, batch, forward_only: bool, need_loss: bool):
        inputs, labels = to_device(batch, gpc.device)
        with torch.set_grad_enabled(not forward_only and torch.is_grad_enabled()):
            output = call_with(engine, (), inputs)
            loss = None
            if need_loss:
                with engine.autocast():
                    loss = call_with(engine.criterion, (output,), labels)
            if not forward_only:
                engine.backward(loss)
        return output, labels, loss


def _mean(losses: list) -> torch.Tensor:
    """The mean micro-batch loss (fp32 when there are several; one is returned as is)."""
    return losses[0] if len(losses) == 1 else torch.stack(losses).float().mean()
