"""Chunk ZeRO (stage 3) wired into the Engine: module hooks, the gradient handler and the
optimizer over chunk shards.

:func:`build_chunk_zero` packs the parameters of the user's optimizer into chunks
(:mod:`.manager`; module order at first, then, at the first ``zero_grad`` after the warm-up
step, re-packed in the order that step first used them: :meth:`ChunkOptimizer.repack`),
installs the hooks and returns the Engine's ``(amp, gradient_handler)``:

* forward pre-hook of every module owning parameters (a module without a forward, a
  parameter container, counts as part of its nearest ancestor with one): all_gather their
  chunks (tensors COMPUTE); post-hook: tensors HOLD, a chunk whose tensors all hold is
  released, and a tensor hook on each output re-gathers the chunks when backward reaches
  the module;
* a tensor hook per parameter gathers its chunk if its gradient arrives while the chunk is
  released (no module hook re-gathered it), then a post-accumulate-grad hook moves the
  gradient into the chunk's buffer; a
  chunk whose gradients are all in is reduce-scattered (async, overlapped with backward);
* :class:`ChunkOptimizer` (a :class:`~colossal_lite.zero.optimizer.ZeroOptimizer`, so the
  sharded step over per-parameter views -- any elementwise optimizer, a parameter without a
  gradient left as the serial optimizer leaves it -- and the full and sharded state dicts
  are the stage 1/2 ones) steps the fp32 shards with the user's optimizer; a torch
  Adam/AdamW's shards on the CPU go through ``adam_step`` (the C++ kernel, as HybridAdam's
  own step does); the updated shards are gathered on next use;
* ``model.state_dict()`` gathers every chunk (one all_gather each) and returns full tensors
  with the serial keys; ``model.load_state_dict(full)`` writes this rank's shards;
* precision: ``fp16=dict(mode='naive')`` casts the model, so the chunks become fp16/bf16
  (gradients share their storage) over fp32 masters, with the stage 1/2 ``ZeroNaiveAmp``
  (overflow agreed over every rank); ``mode='torch'`` autocasts fp32 chunks;
* pipeline parallelism ('gpipe', '1f1b'; one stage per rank): each stage's chunks over its
  DATA group. Several micro-batches are in flight on a stage, so the tensor states are
  reset per schedule action: each forward call starts a pass (``begin_pass``) and the
  first module backward hook of a micro-batch starts its backward (``begin_backward``:
  FREE -> HOLD); every backward call completes its chunks' gradients, which are reduce-scattered
  and accumulated into the shards. The weight tied across the first and the last stage is
  alone in its chunk; ``synchronize`` sums its gradient shard over EMBEDDING.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import torch

from ...amp import FullPrecision
from ...communication import collective as C
from ...config import AmpSettings, ZeroSettings
from ...context import ParallelMode
from ...context import global_context as gpc
from ...engine.gradient_handler import data_parallel_axis
from ...nn.optimizer import adam_step
from ...tensor import param_placement
from ...tensor.init import materialize
from ..buckets import agree_on_gradients, reduce_axis
from ..low_level import zero_amp
from ..optimizer import ZeroOptimizer, _parameter_names, check_optimizer
from .chunk import Chunk
from .lazy import has_meta_parameters, init_shard, swap_meta_parameters
from .manager import ChunkManager
from .search import search_chunk_size
from .tracer import MemoryTracer


class ChunkGradientHandler:
    """The Engine's gradient handler: gradients are reduced by the hooks; ``synchronize``
    waits for them (and ends the warm-up trace)."""

    sums_tied_stages = True

    def __init__(self, manager: ChunkManager, on_sync):
        self.manager, self._on_sync = manager, on_sync
        self._with_grad: Optional[set] = None

    def prepare(self, sync: bool):
        pass

    def params_with_grad(self) -> Optional[set]:
        """ids of the parameters that had a gradient this step on some rank of their reduce
        group (None before :meth:`synchronize`)."""
        return self._with_grad

    def synchronize(self):
        """Wait for the reductions; a weight held by the first and the last pipeline stage
        (its own chunk) has its gradient shard summed over EMBEDDING (one all_reduce of
        ``shard_numel`` elements)."""
        self.manager.flush()
        for chunk in self.manager.chunks:
            if chunk.tied_across_stages:
                master = chunk.master
                grad = master.grad if master.grad is not None else torch.zeros_like(master)
                master.grad = C.all_reduce(grad.to(chunk.device), ParallelMode.EMBEDDING
                                           ).to(master.device).clone()
        self._with_grad = agree_on_gradients(self.manager.chunks, self.manager.had_grad)
        self._on_sync()

    def discard(self):
        self.manager.discard()
        self._with_grad = None


class ChunkOptimizer(ZeroOptimizer):
    """The user's optimizer re-pointed to the chunks' fp32 shards (module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, names: Dict[int, str],
                 manager: ChunkManager, handler: ChunkGradientHandler):
        check_optimizer(optimizer, 3)
        optimizer.state.clear()   # only state built at construction, never stepped
        self.optim, self.stage, self.offload = optimizer, 3, False
        self._names, self.manager, self.reducer = names, manager, handler
        self.all_names = manager.names
        self._param_state: Dict[int, dict] = {}
        self._stepped: set = set()
        self.buckets: List[Chunk] = manager.chunks   # re-packing replaces its items in place
        self.hooks: Optional['_Hooks'] = None
        self.margin_ratio = 0.0        # zero.device_margin_ratio (adaptive HybridAdam)
        self.adaptive: Optional[dict] = None
        self._point_groups()

    def _point_groups(self):
        for index, group in enumerate(self.optim.param_groups):
            group['params'] = [c.master for c in self.buckets if c.group_index == index]

    def zero_grad(self, set_to_none: bool = True):
        """Clear the shards' gradients; after the warm-up step, the first clean point, re-pack
        the chunks in the traced first-use order (:meth:`repack`)."""
        super().zero_grad(set_to_none)
        order = self.hooks.take_first_use_order() if self.hooks is not None else None
        if order is None:
            return
        if self.repack(order):
            self.hooks.retrace()
        if self.margin_ratio:
            self.adapt(self.margin_ratio, self.hooks.trace.non_model_peak)

    @torch.no_grad()
    def adapt(self, ratio: float, non_model_bytes: int = 0):
        """Adaptive HybridAdam (after the warm-up step, between steps): move CPU-homed
        master shards, with their moments, to the device in chunk (first-use) order while
        their 16 bytes per element fit in ``ratio`` times the margin the warm-up left:
        ``device_memory_limit - accounted peak - traced non-model peak`` (everything when
        there is no limit). From then on those shards update on the device (the user's
        optimizer: torch's fused Adam on an accelerator) and the rest on the CPU (the C++
        kernel). No communication; ``self.adaptive`` records the margin and the chunks."""
        policy, ledger = self.manager.policy, self.manager.ledger
        margin = (math.inf if ledger.limit is None
                  else ratio * (ledger.limit - ledger.peak - non_model_bytes))
        start, promoted = margin, []
        for chunk in self.buckets:
            need = 16 * chunk.shard_numel
            if policy.on_device(chunk) or need > margin:
                continue
            policy.promote(chunk)
            margin -= need
            promoted.append(chunk.index)
            master = chunk.master
            master.data = master.data.to(policy.device)
            for key, value in self.optim.state.get(master, {}).items():
                if torch.is_tensor(value) and value.dim() > 0:
                    self.optim.state[master][key] = value.to(policy.device)
        self.adaptive = {'margin': start, 'promoted': promoted}

    @torch.no_grad()
    def repack(self, order: List[torch.nn.Parameter]) -> bool:
        """Re-form the chunks with the parameters packed in ``order`` (between steps, no
        gradients held): the fp32 masters and the optimizer's flat slots move to the new
        chunks' shards (one all_gather per old chunk and tensor, ``ChunkManager.repack``);
        the per-parameter scalars (step counts) stay with their parameters; the optimizer is
        re-pointed. False (nothing changed) when the packing is the same."""
        packed = self.manager.plan(order)
        old = list(self.buckets)
        if [[id(p) for p in ps] for ps, _ in packed] == [[id(p) for p in c.params] for c in old]:
            return False
        if any(c.master.grad is not None for c in old):
            raise RuntimeError('chunks are re-packed only without gradients (after zero_grad)')
        states = [self._slots(c) for c in old]
        keys = sorted({k for st in states for k in st})
        shards = {'master': [c.master.detach() for c in old]}
        shards.update({k: [st.get(k) for st in states] for k in keys})
        new = self.manager.repack(packed, shards)
        for c in old:
            self.optim.state.pop(c.master, None)
        self._point_groups()
        if keys:
            for index, chunk in enumerate(self.buckets):
                self.optim.state[chunk.master] = {k: new[k][index] for k in keys}
        return True

    def step(self, closure=None):
        if closure is not None:
            raise ValueError('ZeRO optimizers take no closure')
        self._step_shards()
        self.manager.policy.after_step()

    def _on_kernel(self, group: dict, view: torch.Tensor) -> bool:
        """A torch Adam/AdamW (no amsgrad, maximize, capturable, differentiable or fused) steps its
        CPU shards through the C++ kernel; HybridAdam/CPUAdam do so in their own step."""
        return (view.device.type == 'cpu'
                and type(self.optim) in (torch.optim.Adam, torch.optim.AdamW)
                and not any(group.get(k) for k in ('amsgrad', 'maximize', 'capturable',
                                                   'differentiable', 'fused')))

    @torch.no_grad()
    def _kernel_step(self, group: dict, view: torch.Tensor, state: dict):
        """torch's Adam/AdamW step of one CPU view (its state: as torch builds it) through
        ``adam_step``."""
        if not state:
            state['step'] = torch.zeros((), dtype=torch.float32)
            state['exp_avg'] = torch.zeros_like(view, memory_format=torch.preserve_format)
            state['exp_avg_sq'] = torch.zeros_like(view, memory_format=torch.preserve_format)
        state['step'] += 1
        if not view.numel():
            return
        beta1, beta2 = group['betas']
        adamw = isinstance(self.optim, torch.optim.AdamW) or group.get('decoupled_weight_decay',
                                                                        False)
        adam_step(view, view.grad, state['exp_avg'], state['exp_avg_sq'],
                  int(state['step'].item()), float(group['lr']), beta1, beta2,
                  float(group['eps']), float(group['weight_decay']), bool(adamw),
                  check_finite=False)

    def _weights_loaded(self, chunk: Chunk, locals_):
        """The parameters hold no storage: the new masters are gathered on next use (cached
        shard copies are dropped)."""
        self.manager.policy.after_step()

    def refresh_masters(self):
        raise NotImplementedError('ZeRO stage 3 keeps no unsharded parameters to refresh the '
                                  'shards from; load weights with model.load_state_dict(full)')

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


def _callable(module: torch.nn.Module) -> bool:
    """Whether ``module`` has a forward of its own (a parameter container has none)."""
    return type(module).forward is not torch.nn.Module.forward


def _used_parameters(module: torch.nn.Module) -> List[torch.nn.Parameter]:
    """The parameters ``module``'s forward may use: its own, and those of the descendants
    that have no forward (parameter containers such as a patch embedding's ``proj``, which
    can only be used by an ancestor's forward), reached through such descendants only;
    each tensor once."""
    out = list(module.parameters(recurse=False))
    for child in module.children():
        if not _callable(child):
            out.extend(_used_parameters(child))
    return list({id(p): p for p in out}.values())


class _Hooks:
    """Module and parameter hooks that drive the manager (module docstring)."""

    def __init__(self, model: torch.nn.Module, manager: ChunkManager, auto_policy,
                 pipelined: bool = False):
        self.manager, self.auto, self.pipelined = manager, auto_policy, pipelined
        ids = {id(p) for c in manager.chunks for p in c.params}
        self.tracer: Optional[MemoryTracer] = MemoryTracer(ids)
        self.trace: Optional[MemoryTracer] = None    # the finished warm-up trace
        self._pass = [False]
        self._ids = ids
        self.chunked = [p for c in manager.chunks for p in c.params]   # packing order now
        self.first_use: Optional[List[torch.nn.Parameter]] = []  # recorded in the warm-up
        self._first_ids: set = set()
        self._first_use_order: Optional[List[torch.nn.Parameter]] = None
        model.register_forward_pre_hook(self._root_pre, prepend=True)
        model.register_forward_hook(self._root_post)
        for name, module in model.named_modules():
            if not _callable(module):    # its parameters are hooked with its caller's
                continue
            own = [p for p in _used_parameters(module) if id(p) in ids]
            if own:
                module.register_forward_pre_hook(self._pre(name, own))
                module.register_forward_hook(self._post(name, own))
        for chunk in manager.chunks:
            for p in chunk.params:
                p.register_hook(self._before_grad(p))
                p.register_post_accumulate_grad_hook(manager.on_grad)
        # torch tags these hooks with an attribute, which a bound method cannot carry
        model.register_state_dict_post_hook(lambda *a: self._state_dict(*a))
        model.register_load_state_dict_pre_hook(lambda *a: self._before_load(*a))
        model.register_load_state_dict_post_hook(lambda *a: self._after_load(*a))

    # -- the warm-up trace: the first training forward/backward
    def _root_pre(self, module, args):
        self.manager.begin_pass()
        self._pass = [False]   # pipeline: whether this micro-batch's backward has started
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
        if self.first_use is not None:   # never used in forward: last, in packing order
            used = {id(p) for p in self.first_use}
            self._first_use_order = self.first_use + [p for p in self.chunked
                                                       if id(p) not in used]
            self.first_use = None
        if self.auto is not None:
            self.auto.set_trace(self.tracer.order, self.tracer.non_model_peak)
        self.trace, self.tracer = self.tracer, None

    def take_first_use_order(self) -> Optional[List[torch.nn.Parameter]]:
        """The parameters in the order the warm-up step first used them (once; None before
        the warm-up ended or after it was taken)."""
        order, self._first_use_order = self._first_use_order, None
        return order

    def retrace(self):
        """The chunks were re-packed: the next training step traces their access order."""
        self.tracer = MemoryTracer(self._ids)

    def _pre(self, name, own):
        def hook(module, args):
            if self.first_use is not None and self.manager.access_log is not None:
                fresh = [p for p in own if id(p) not in self._first_ids]
                self._first_ids.update(id(p) for p in fresh)
                self.first_use.extend(fresh)
            self.manager.pre_forward(own)
            if self.tracer is not None and self.manager.access_log is not None:
                self.tracer.module_start(name, sum(c.full_bytes
                                                   for c in self.manager.chunks_of(own)))
        return hook

    def _before_grad(self, param):
        def hook(grad):
            self.manager.before_grad(param)
        return hook

    def _post(self, name, own):
        def hook(module, args, output):
            if self.tracer is not None and self.manager.access_log is not None:
                self.tracer.module_end(name)
            self.manager.post_forward(own)
            if torch.is_grad_enabled():
                started = self._pass

                def backward_hook(grad):
                    if self.pipelined and not started[0]:   # the first module of this
                        started[0] = True                   # micro-batch's backward
                        self.manager.begin_backward()
                    self.manager.pre_backward(own)
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


def _meta_init(names: Dict[int, str]):
    """For a model built on meta: each chunk's shard drawn by name (``lazy.init_shard``)."""
    seed = torch.initial_seed()

    def init(params, size):
        axis = reduce_axis(params[0])
        return init_shard(params, [p.numel() for p in params], size, axis.rank, axis.size,
                          names, seed)
    return init


def build_chunk_zero(settings: ZeroSettings, amp_settings: AmpSettings, model: torch.nn.Module,
                     optimizer: torch.optim.Optimizer
                     ) -> Tuple[FullPrecision, ChunkGradientHandler]:
    """``(amp, gradient_handler)`` for ``zero=dict(stage=3, ...)`` (``model`` on its device
    and equal on every replica)."""
    check_optimizer(optimizer, 3)
    lazy = has_meta_parameters(model) and swap_meta_parameters(model, optimizer, gpc.device)
    ordered, seen = [], set()
    group_of = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g['params']}
    for p in model.parameters():          # module order until the warm-up re-packs
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
                           scale=1.0 / gpc.get_world_size(ParallelMode.DATA),
                           init_shard=_meta_init(names) if lazy else None)
    manager.names = all_names
    if has_meta_parameters(model):   # what is not chunked (frozen parameters): drawn whole
        materialize(model, device=gpc.device)
    auto = manager.policy if manager.policy.name == 'auto' else None
    pipelined = gpc.get_world_size(ParallelMode.PIPELINE) > 1
    hooks = _Hooks(model, manager, auto, pipelined)
    handler = ChunkGradientHandler(manager, hooks.finish_trace)
    zero = ChunkOptimizer(optimizer, names, manager, handler)
    zero.hooks, zero.margin_ratio = hooks, settings.device_margin_ratio
    amp = zero_amp(amp_settings, model, zero)   # naive: casts the model to fp16/bf16
    for chunk in manager.chunks:                    # fp16/bf16 chunks, fp32 masters
        chunk.set_dtype(chunk.params[0].dtype)
    return amp, handler
