"""Training traces: what one rank saw in a few training steps, in full (serial) tensors.

:func:`training_trace` runs ``steps`` training steps of a model or an
:class:`~colossal_lite.engine.Engine` and records, after each step, under these keys:

* ``'loss'``: the step's loss, averaged over the DATA replicas (each replica's loss is
  the mean over its rows of the batch, so with equal label counts per replica this is
  the serial loss); only on ranks whose step returns one (a pipeline's last stage);
* ``'output.<k>'``: the k-th output, gathered over the tensor-parallel cuts
  (``gather_logits``) and over DATA (rows concatenated): the serial model's output;
* ``'grad:<name>'``: every parameter's gradient gathered to full shape (its
  ``placement``), by serial name -- a tied weight under each of its names;
* ``'param:<key>'``: ``model.state_dict()`` after the optimizer step (full tensors,
  serial keys);
* any extra value the step returns: a number or tensor under its own key (e.g.
  ``'grad_norm'``), a dict ``{name: tensor}`` under ``'<key>:<name>'`` (e.g. an
  optimizer's ``exp_avg`` by serial name).

Every rank passes the same *global* batch; the trace slices each DATA replica's rows.
The serial model (no launch) and every layout -- a pipeline stage holding some
parameters, a ZeRO engine -- run the same code; per-rank traces are merged and
compared with ``compare.py``. Recording is collective (all_gathers over the cut modes
and DATA, an all_reduce of the loss over DATA): call on every rank. Tensors that share
their cuts are gathered together (one all_gather per cut, :func:`gather_many`); the
parameters are read once through ``state_dict()`` and then by placement where that
gives the same tensors (:func:`parameter_reader`).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

import colossal_lite.nn as col_nn

from ..communication import collective as C
from ..context import ParallelMode
from ..context import global_context as gpc
from ..engine import Engine, allreduce_gradients
from ..engine.schedule import call_with, chunk, split_batch
from ..tensor import gather_full, param_placement, placement_of

STEP_KEYS = ('loss', 'outputs', 'grads')


@dataclass
class Trace:
    """``steps[i]``: key -> tensor recorded after training step ``i`` (keys: module doc)."""
    steps: List[Dict[str, torch.Tensor]] = field(default_factory=list)

    def __getitem__(self, step: int) -> Dict[str, torch.Tensor]:
        return self.steps[step]

    def __len__(self) -> int:
        return len(self.steps)

    def named(self, step: int, kind: str) -> Dict[str, torch.Tensor]:
        """``{name: tensor}`` of one kind ('grad', 'param', 'output', a dict extra's key)
        at ``step``."""
        prefix = 'output.' if kind == 'output' else f'{kind}:'
        return {k[len(prefix):]: v for k, v in self.steps[step].items()
                if k.startswith(prefix)}


def kind_of(key: str) -> str:
    """'loss', 'output', 'grad', 'param' or an extra's name."""
    return key.split(':')[0].split('.')[0]


def make_optimizer(params, lr: float = 1e-3):
    """The suite's AdamW. eps=1e-6 (torch: 1e-8): the attention key bias has a gradient
    that is 0 in exact arithmetic (softmax ignores a per-query constant), so every run holds
    ~1e-10 rounding noise there, which eps=1e-8 would turn into lr-sized, layout-dependent
    steps."""
    return torch.optim.AdamW(params, lr=lr, eps=1e-6, weight_decay=0.01)


def replica_batch(batch: Any) -> Any:
    """This rank's DATA replica's rows of a global batch (every tensor cut along dim 0)."""
    data = gpc.axis(ParallelMode.DATA)
    return batch if data.size == 1 else chunk(batch, data.size, 'batch')[data.rank]


def gather_many(tensors: Sequence[torch.Tensor], places: Sequence) -> List[torch.Tensor]:
    """Each local shard gathered to its full tensor by its placement, as
    ``Placement.gather`` does, with one all_gather per cut for all the tensors that share
    their cuts and dtype (flattened and concatenated) instead of one per tensor."""
    out = [t.detach() for t in tensors]
    groups: Dict[tuple, List[int]] = {}
    for i, (t, place) in enumerate(zip(out, places)):
        if place.cuts:
            groups.setdefault((place.cuts, t.dtype), []).append(i)
    for (cuts, _), members in groups.items():
        for dim, mode in reversed(cuts):           # innermost cut first, as Placement.gather
            flat = torch.cat([out[i].reshape(-1) for i in members])
            parts = C.all_gather(flat, mode).view(-1, flat.numel())   # [ranks, elements]
            offset = 0
            for i in members:
                n, shape = out[i].numel(), out[i].shape
                out[i] = torch.cat([part[offset:offset + n].view(shape) for part in parts],
                                   dim=dim)
                offset += n
    return [t.clone() for t in out]


def _by_name(named: Sequence, values: Sequence[torch.Tensor],
             places: Sequence) -> Dict[str, torch.Tensor]:
    """``{name: full tensor}`` for (name, tensor) pairs; a tensor under several names (a
    tied weight) is gathered once."""
    index: Dict[int, int] = {}
    for value in values:
        index.setdefault(id(value), len(index))
    unique = {id(v): (v, pl) for v, pl in zip(values, places)}
    full = gather_many([v for v, _ in unique.values()], [pl for _, pl in unique.values()])
    return {name: full[index[id(v)]] for (name, _), v in zip(named, values)}


def full_gradients(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """Every parameter's gradient gathered to full shape, by serial name (a tied weight
    under each of its names). Collective over the shard groups: call on every rank."""
    named = [(n, p) for n, p in model.named_parameters(remove_duplicate=False)
             if p.grad is not None]
    grads = {id(p): p.grad for _, p in named}
    return _by_name(named, [grads[id(p)] for _, p in named],
                    [param_placement(p) for _, p in named])


def full_parameters(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """``model.state_dict()``: the full tensors by serial key (the model's contract)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def placed_parameters(model: torch.nn.Module) -> Optional[Dict[str, torch.Tensor]]:
    """Every parameter gathered by its placement (:func:`gather_many`), by serial name;
    None when some parameter is not the shard its placement describes (an engine keeping
    parameters in its own form)."""
    named = list(model.named_parameters(remove_duplicate=False))
    places = [param_placement(p) for _, p in named]
    if any(tuple(p.shape) != pl.local_shape() for (_, p), pl in zip(named, places)):
        return None
    return _by_name(named, [p for _, p in named], places)


def parameter_reader(model: torch.nn.Module):
    """``(read, first)``: a function giving the full parameters, and its first reading.
    ``read`` is :func:`placed_parameters` (a few batched all_gathers) where it gives
    exactly ``state_dict()`` -- same keys, bitwise equal, checked once here -- otherwise
    :func:`full_parameters` itself."""
    contract = full_parameters(model)
    placed = placed_parameters(model)
    if placed is None or set(placed) != set(contract):
        return full_parameters, contract
    for key, value in contract.items():
        if not torch.equal(placed[key], value):
            raise AssertionError(f'{key}: gathering the parameter by its placement differs '
                                 f'from model.state_dict()')
    return placed_parameters, contract


def full_outputs(outputs) -> List[torch.Tensor]:
    """The serial model's outputs from this rank's: tagged logits gathered over their cuts
    (an untagged output is taken as whole), DATA replicas' rows concatenated."""
    outs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    with torch.no_grad():
        whole = [o if placement_of(o) is None else col_nn.gather_logits(o) for o in outs]
        return [C.all_gather(o.detach(), ParallelMode.DATA).clone() for o in whole]


def replica_mean(value: torch.Tensor) -> torch.Tensor:
    """Mean over the DATA replicas (each holds the mean over its own rows)."""
    data = gpc.axis(ParallelMode.DATA)
    value = torch.as_tensor(value).detach().float()
    return (C.all_reduce(value, data) / data.size).clone()


def plain_step(loss_fn: Callable, optimizer=None, clip: float = 0.0, outputs: bool = True,
               autocast: Optional[torch.dtype] = None) -> Callable:
    """The step of a bare model: forward (under ``torch.autocast`` to ``autocast`` when
    given), ``loss_fn(outputs, *labels)``, backward, the data-parallel gradient sum
    (SEQUENCE_DP in sequence mode), then ``optimizer``'s step -- without an optimizer the
    step is backward only (gradients at the current weights).
    ``clip > 0``: torch's ``clip_grad_norm_`` before the update (recorded as 'grad_norm';
    a reference independent of the engine's clipping, so whole parameters only).
    ``outputs=False``: the outputs are not recorded (e.g. to compare with an engine)."""

    def step(model, batch):
        inputs, labels = split_batch(batch)
        if optimizer is not None:
            optimizer.zero_grad()
        else:
            model.zero_grad(set_to_none=True)
        device = next(model.parameters()).device.type
        with torch.autocast(device, dtype=autocast) if autocast else contextlib.nullcontext():
            out = call_with(model, (), inputs)
            loss = call_with(loss_fn, (out,), labels)
        loss.backward()
        allreduce_gradients(model.parameters())
        result = {'loss': loss, 'outputs': out if outputs else None}
        if clip > 0:
            if not all(param_placement(p).is_replicated for p in model.parameters()):
                raise NotImplementedError('plain_step clips with torch.nn.utils.clip_grad_norm_, '
                                          'which needs whole parameters; clip sharded ones '
                                          'through an Engine with clip_grad_norm')
            result['grad_norm'] = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if optimizer is not None:
            optimizer.step()
        return result
    return step


def engine_step(engine, batch) -> dict:
    """One engine step: ``execute_schedule`` over its micro-batches, then ``step()``
    (which must update); the clipping norm when the engine clips."""
    engine.zero_grad()
    _, _, loss = engine.execute_schedule(batch)
    if not engine.step():
        raise AssertionError('engine.step() did not end the step after execute_schedule')
    result = {'loss': loss}
    if engine.clip_grad_norm > 0:
        result['grad_norm'] = torch.tensor(engine.last_grad_norm)
    return result


def _extras(result: dict) -> Dict[str, torch.Tensor]:
    """The step's extra values: ``key`` -> value, or ``'key:name'`` for a dict's entries."""
    out = {}
    for key, value in result.items():
        if key in STEP_KEYS or value is None:
            continue
        for name, v in (value.items() if isinstance(value, dict) else [(None, value)]):
            out[key if name is None else f'{key}:{name}'] = torch.as_tensor(v).detach().clone()
    return out


def _record(model, result: dict, params: Optional[Dict[str, torch.Tensor]]):
    """The step's record; ``params`` None: loss and extras only."""
    record = {}
    if result.get('loss') is not None:
        record['loss'] = replica_mean(result['loss'])
    record.update(_extras(result))
    if params is None:
        return record
    if result.get('outputs') is not None:
        record.update({f'output.{k}': o for k, o in enumerate(full_outputs(result['outputs']))})
    grads = result['grads'] if result.get('grads') is not None else full_gradients(model)
    record.update({f'grad:{k}': g for k, g in grads.items()})
    record.update({f'param:{k}': v for k, v in params.items()})
    return record


def training_trace(target, batches, loss_fn: Optional[Callable] = None, steps: int = 3,
                   step_fn: Optional[Callable] = None, optimizer=None,
                   detail_steps: Optional[Sequence[int]] = None) -> Trace:
    """Run ``steps`` training steps of ``target`` (a model or an Engine) and record them.

    ``batches``: one global batch ``(inputs, labels)`` for every step, or a list (step i
    takes ``batches[i % len]``); inputs/labels are spread as the engine spreads them
    (``model(*inputs)``, ``loss_fn(outputs, *labels)``). ``step_fn(target, replica_batch)``
    runs one step and returns a dict with any of ``loss``, ``outputs``, ``grads`` (full,
    by serial name: for engines whose gradients do not live in ``p.grad``) and extra
    values to record; default: :func:`engine_step` for an Engine, else :func:`plain_step`
    with ``loss_fn`` and ``optimizer`` (default :func:`make_optimizer`).
    ``detail_steps``: the steps that record outputs, gradients and parameters (default
    all; the loss and extras are recorded at every step).
    """
    model = target.model if isinstance(target, Engine) else target
    if step_fn is None:
        if isinstance(target, Engine):
            step_fn = engine_step
        else:
            if loss_fn is None:
                raise ValueError('training_trace of a bare model needs loss_fn (or a step_fn)')
            step_fn = plain_step(loss_fn, optimizer or make_optimizer(model.parameters()))
    per_step = batches if isinstance(batches, list) else [batches]
    trace, read_params = Trace(), None
    for step in range(steps):
        result = step_fn(target, replica_batch(per_step[step % len(per_step)])) or {}
        params = None
        if detail_steps is None or step in detail_steps:
            if read_params is None:
                read_params, params = parameter_reader(model)
            else:
                params = read_params(model)
        trace.steps.append(_record(model, result, params))
    return trace
