"""Chunk ZeRO (stage 3) wired into the Engine: module hooks, the gradient handler and the
optimizer over chunk shards.

:func:`build_chunk_zero` packs the parameters of the user's Adam/AdamW (module order: the
order a transformer first uses them) into chunks (:mod:`.manager`), installs the hooks and
returns the Engine's ``(amp, gradient_handler)``:

* forward pre-hook of every module owning parameters: all_gather their chunks (tensors
  COMPUTE); post-hook: tensors HOLD, a chunk whose tensors all hold is released, and a
  tensor hook on each output re-gathers the chunks when backward reaches the module;
* a post-accumulate-grad hook per parameter moves its gradient into the chunk's buffer; a
  chunk whose gradients are all in is reduce-scattered (async, overlapped with backward);
* :class:`ChunkOptimizer` (a :class:`~colossal_lite.zero.optimizer.ZeroOptimizer`, so the
  full and sharded state dicts are the stage 1/2 ones) steps the fp32 shards with the user's
  hyperparameters: shards on the CPU through ``adam_step`` (the C++ kernel), shards on an
  accelerator through the user's optimizer; the updated shards are gathered on next use;
* ``model.state_dict()`` gathers every chunk (one all_gather each) and returns full tensors
  with the serial keys; ``model.load_state_dict(full)`` writes this rank's shards;
* precision: ``fp16=dict(mode='naive')`` casts the model, so the chunks become fp16/bf16
  (gradients share their storage) over fp32 masters, with the stage 1/2 ``ZeroNaiveAmp``
  (overflow agreed over every rank); ``mode='torch'`` autocasts fp32 chunks.
"""
from __future__ import annotations

import math
from typing import Dict, List, Mapping, Optional, Tuple

import torch

from ...amp import FullPrecision
from ...context import ParallelMode, global_context as gpc
from ...engine.gradient_handler import data_parallel_axis
from ...nn.optimizer import CPUAdam, adam_step
from ...tensor import param_placement
from ..low_level import zero_amp
from ..optimizer import ZeroOptimizer, _parameter_names, check_optimizer
from .chunk import Chunk
from .manager import ChunkManager
from .search import search_chunk_size
from .tracer import MemoryTracer


def check_chunk_zero(cfg: Mapping):
    """What stage 3 does not run yet raises NotImplementedError (no communication)."""
    from ...settings import parse_settings
    settings = parse_settings(cfg)
    if (settings.amp.as_dict() or {}).get('mode') == 'apex':
        raise NotImplementedError("fp16 mode 'apex' is not supported with ZeRO (apex amp keeps "
                                  "its own unsharded master weights); use mode 'torch' or 'naive'")
    if settings.layout.pipeline > 1:
        raise NotImplementedError(f'ZeRO stage 3 does not run with pipeline parallelism, got '
                                  f'pipeline = {settings.layout.pipeline}; use '
                                  f'zero=dict(stage=2) with pipelines')


class ChunkGradientHandler:
    """The Engine's gradient handler: gradients are reduced by the hooks; ``synchronize``
    waits for them (and ends the warm-up trace)."""

    sums_tied_stages = True

    def __init__(self, manager: ChunkManager, on_sync):
        self.manager, self._on_sync = manager, on_sync

    def prepare(self, sync: bool):
        pass

    def synchronize(self):
        self.manager.flush()
        self._on_sync()

    def discard(self):
        self.manager.discard()


class ChunkOptimizer(ZeroOptimizer):
    """The user's Adam/AdamW re-pointed to the chunks' fp32 shards (module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, names: Dict[int, str],
                 manager: ChunkManager, handler: ChunkGradientHandler):
        check_optimizer(optimizer)
        for group in optimizer.param_groups:
            if group.get('amsgrad') or group.get('maximize'):
                raise NotImplementedError('ZeRO stage 3 steps Adam/AdamW without amsgrad or '
                                          'maximize')
        self.optim, self.stage, self.offload = optimizer, 3, False
        self._names, self.manager, self.reducer = names, manager, handler
        self.buckets: List[Chunk] = manager.chunks
        for index, group in enumerate(optimizer.param_groups):
            group['params'] = [c.master for c in self.buckets if c.group_index == index]

    def step(self, closure=None):
        if closure is not None:
            raise ValueError('ZeRO optimizers take no closure')
        host = [c.master for c in self.buckets
                if c.master.device.type == 'cpu' and c.master.grad is not None]
        if isinstance(self.optim, CPUAdam) or not host:
            self.optim.step()
        else:
            grads = [m.grad for m in host]
            for m in host:          # the user's optimizer steps the device shards only
                m.grad = None
            try:
                self.optim.step()
            finally:
                for m, g in zip(host, grads):
                    m.grad = g
            on_host = {id(m) for m in host}
            for group in self.optim.param_groups:
                for m in group['params']:
                    if id(m) in on_host:
                        self._host_step(group, m)
        self.manager.policy.after_step()

    @torch.no_grad()
    def _host_step(self, group: dict, master: torch.nn.Parameter):
        state = self.optim.state[master]
        if not state:
            state['step'] = torch.zeros((), dtype=torch.float32)
            state['exp_avg'] = torch.zeros_like(master, memory_format=torch.preserve_format)
            state['exp_avg_sq'] = torch.zeros_like(master, memory_format=torch.preserve_format)
        state['step'] += 1
        beta1, beta2 = group['betas']
        adamw = isinstance(self.optim, torch.optim.AdamW) or group.get('decoupled_weight_decay',
                                                                        False)
        adam_step(master.data, master.grad, state['exp_avg'], state['exp_avg_sq'],
                  int(state['step'].item()), float(group['lr']), beta1, beta2,
                  float(group['eps']), float(group['weight_decay']), bool(adamw),
                  check_finite=False)

    def refresh_masters(self):
        raise NotImplementedError('ZeRO stage 3 keeps no unsharded parameters to refresh the '
                                  'shards from; load weights with model.load_state_dict(full)')

    def full_gradients(self) -> Dict[str, torch.Tensor]:
        """Every parameter's data-parallel averaged gradient, full shape, by serial name (a
        tied weight under each name); one all_gather per chunk over its reduce group."""
        out = {}
        for chunk in self.buckets:
            grad = chunk.master.grad
            if grad is None:
                continue
            for p, view in zip(chunk.params, chunk.views(chunk.gather(grad.to(chunk.dtype)))):
                full = param_placement(p).gather(view).clone().cpu()
                for name in self.manager.names[id(p)]:
                    out[name] = full
        return out


# ---------------------------------------------------------------------------- hooks
def _tensors(obj):
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


class _Hooks:
    """Module and parameter hooks that drive the manager (module docstring)."""

    def __init__(self, model: torch.nn.Module, manager: ChunkManager, auto_policy):
        self.manager, self.auto = manager, auto_policy
        ids = {id(p) for c in manager.chunks for p in c.params}
        self.tracer: Optional[MemoryTracer] = MemoryTracer(ids)
        model.register_forward_pre_hook(self._root_pre, prepend=True)
        model.register_forward_hook(self._root_post)
        for name, module in model.named_modules():
            own = [p for p in module.parameters(recurse=False) if id(p) in ids]
            if own:
                module.register_forward_pre_hook(self._pre(name, own))
                module.register_forward_hook(self._post(name, own))
        for chunk in manager.chunks:
            for p in chunk.params:
                p.register_post_accumulate_grad_hook(manager.on_grad)
        # torch tags these hooks with an attribute, which a bound method cannot carry
        model.register_state_dict_post_hook(lambda *a: self._state_dict(*a))
        model.register_load_state_dict_pre_hook(lambda *a: self._before_load(*a))
        model.register_load_state_dict_post_hook(lambda *a: self._after_load(*a))

    # -- the warm-up trace: the first training forward/backward
    def _root_pre(self, module, args):
        self.manager.begin_pass()
        if self.tracer is not None and self.manager.access_log is not None:
            self.finish_trace()
        if self.tracer is not None and torch.is_grad_enabled():
            self.manager.access_log = []
            self.tracer.start_forward()

    def _root_post(self, module, args, output):
        if self.tracer is not None:
            self.tracer.end_forward()

    def finish_trace(self):
        if self.tracer is None or self.manager.access_log is None:
            return
        self.tracer.order = self.manager.access_log
        self.manager.access_log = None
        if self.auto is not None:
            self.auto.set_trace(self.tracer.order, self.tracer.non_model_peak)
        self.trace, self.tracer = self.tracer, None

    def _pre(self, name, own):
        def hook(module, args):
            self.manager.pre_forward(own)
            if self.tracer is not None and self.manager.access_log is not None:
                self.tracer.module_start(name, sum(c.full_bytes
                                                   for c in self.manager.chunks_of(own)))
        return hook

    def _post(self, name, own):
        def backward_hook(grad):
            self.manager.pre_backward(own)

        def hook(module, args, output):
            if self.tracer is not None and self.manager.access_log is not None:
                self.tracer.module_end(name)
            self.manager.post_forward(own)
            if torch.is_grad_enabled():
                for t in _tensors(output):
                    if t.requires_grad:
                        t.register_hook(backward_hook)
        return hook

    # -- full state dicts
    def _state_dict(self, module, state_dict, prefix, local_metadata):
        for chunk in self.manager.chunks:
            full = chunk.gather(chunk.master.detach().to(chunk.dtype))
            for p, view in zip(chunk.params, chunk.views(full)):
                value = param_placement(p).gather(view).clone()
                for name in self.manager.names[id(p)]:
                    if prefix + name in state_dict:
                        state_dict[prefix + name] = value

    def _before_load(self, module, state_dict, prefix, *args):
        self.manager.flush()
        for chunk in self.manager.chunks:
            self.manager.release(chunk)
            chunk.attach(chunk.gather(chunk.master.detach().to(chunk.dtype)).clone())

    @torch.no_grad()
    def _after_load(self, module, incompatible_keys):
        for chunk in self.manager.chunks:
            chunk.master.copy_(chunk.own(chunk.full).to(torch.float32))
            chunk.detach_params()
        self.manager.policy.after_step()


# ---------------------------------------------------------------------------- build
def chunk_capacity(settings, params: List[torch.nn.Parameter], dp_size: int) -> int:
    """Chunk elements: ``chunk_size_mb`` rounded up to a multiple of the data-parallel
    size, or the searched size (:func:`search_chunk_size`)."""
    if settings.chunk_size_mb is None:
        return search_chunk_size([p.numel() for p in params], dp_sizes=(dp_size,)).capacity
    elems = math.ceil(settings.chunk_size_mb * 1024 * 1024 / params[0].element_size())
    return -(-elems // dp_size) * dp_size


def build_chunk_zero(settings, cfg: Mapping, model: torch.nn.Module,
                     optimizer: torch.optim.Optimizer
                     ) -> Tuple[FullPrecision, ChunkGradientHandler]:
    """``(amp, gradient_handler)`` for ``zero=dict(stage=3, ...)`` (``model`` on its device
    and equal on every replica)."""
    check_chunk_zero(cfg)
    check_optimizer(optimizer)
    ordered, seen = [], set()
    group_of = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g['params']}
    for p in model.parameters():          # module order: a transformer's first-use order
        if id(p) in group_of and p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            ordered.append((p, group_of[id(p)]))
    names = _parameter_names(model, [p for g in optimizer.param_groups for p in g['params']])
    all_names: Dict[int, List[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        all_names.setdefault(id(p), []).append(name)
    axis = data_parallel_axis()
    capacity = chunk_capacity(settings, [p for p, _ in ordered], axis.size)
    manager = ChunkManager(ordered, capacity, settings, gpc.device,
                           scale=1.0 / gpc.get_world_size(ParallelMode.DATA))
    manager.names = all_names
    auto = manager.policy if manager.policy.name == 'auto' else None
    hooks = _Hooks(model, manager, auto)
    handler = ChunkGradientHandler(manager, hooks.finish_trace)
    zero = ChunkOptimizer(optimizer, names, manager, handler)
    zero.hooks = hooks
    amp = zero_amp(cfg.get('fp16'), model, zero)   # naive: casts the model to fp16/bf16
    for chunk in manager.chunks:                    # fp16/bf16 chunks, fp32 masters
        chunk.set_dtype(chunk.params[0].dtype)
    return amp, handler
