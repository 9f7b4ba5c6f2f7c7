"""ZeRO-1/2 optimizer: the user's optimizer stepping this rank's flat fp32 slices.

:class:`ZeroOptimizer` takes any elementwise ``torch.optim`` optimizer (SGD, Adam, AdamW,
Adagrad, RMSprop, ...: :data:`ELEMENTWISE`; or colossal_lite's ``HybridAdam``/``CPUAdam``,
whose CPU slices update through the C++ kernel) built on the model's parameters and
re-points each of its param groups to the ``master`` slices of that group's
:class:`~colossal_lite.zero.buckets.FlatBucket` s, so the user's own optimizer (its class,
hyperparameters, LR scheduler, torch's exact math) updates only this rank's 1/D of the
fp32 weights and keeps state of that size (on the CPU with ``offload_optimizer``).
``param_groups`` and ``state`` are the wrapped optimizer's, so ``torch.amp.GradScaler``
unscales and steps it like any optimizer.

:meth:`step` runs the wrapped optimizer over per-parameter views of the slices
(:meth:`_step_shards`): each parameter's part of this rank's slice (possibly empty) is one
tensor with its own state -- its elements' slots are views into flat per-bucket slot
tensors (``state[master]``, ``shard_numel`` elements each), its scalars (the step count)
are its own (``_param_state``) -- and a parameter that had no gradient this step on any
data-parallel rank (the gradient handler's ``params_with_grad()``) has no gradient there,
so the optimizer skips it exactly as the serial one does: no weight decay, no moment
update, no step count. An elementwise optimizer computes each element from that element
alone (and per-parameter scalars), so stepping slices is exact; an optimizer with
per-tensor quantities (LAMB's or LARS's trust ratio, Adafactor's factored moments,
L-BFGS) is refused (:func:`check_optimizer`). Then one all_gather per bucket over its
reduce group (``padded_numel`` elements in the model dtype) writes the updated weights
back into the model's parameters.

State dicts: :meth:`state_dict` is the full form -- ``{'state': {serial name: {'step',
'exp_avg', ...}}, 'param_groups': [{..., 'params': [serial names]}]}``, the slots at the
parameters' full (serial) shapes, as the serial optimizer's ``state_dict()`` with indices
replaced by names (no entry for a parameter that never had a gradient; collective:
all_gather over the reduce group and the tensor-parallel cuts). :meth:`sharded_state_dict`
is this rank's slices (no communication). :meth:`load_state_dict` takes either.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Optional, Set, Tuple

import torch

from ..nn.optimizer import CPUAdam
from ..tensor import param_placement
from .buckets import FlatBucket, build_buckets
from .reducer import ShardedGradientReducer

#: torch optimizers whose update of an element reads only that element's gradient and state
#: (and per-parameter scalars: the step count, NAdam's mu product, ASGD's eta and mu)
ELEMENTWISE = tuple(getattr(torch.optim, name) for name in (
    'SGD', 'Adam', 'AdamW', 'Adamax', 'NAdam', 'RAdam', 'Adagrad', 'Adadelta', 'RMSprop',
    'Rprop', 'ASGD') if hasattr(torch.optim, name))

#: why known optimizers are not elementwise (by lower-case class name)
NOT_ELEMENTWISE = {
    'lbfgs': 'a line search over all parameters at once, driven by a closure',
    'sparseadam': 'sparse gradients (ZeRO reduces dense ones)',
    'adafactor': 'second moments factored over the rows and columns of each matrix',
    'muon': 'each matrix update orthogonalized as a whole',
    'lamb': 'a per-tensor trust ratio (the norm of the weights over the norm of the update)',
    'fusedlamb': 'a per-tensor trust ratio (the norm of the weights over the norm of the '
                 'update)',
    'lars': 'a per-tensor trust ratio (the norm of the weights over the norm of the gradient)',
}


def check_optimizer(optimizer, stage: Optional[int] = None) -> None:
    """ZeRO shards an optimizer only when it is elementwise (module docstring): one of
    :data:`ELEMENTWISE` (the class itself, not a subclass, which may change the math),
    colossal_lite's CPUAdam/HybridAdam, or a class that declares ``elementwise = True``;
    a TypeError names the optimizer and the stage otherwise. Its state must be empty or
    built eagerly at construction and never stepped (torch's Adagrad)."""
    cls = type(optimizer)
    where = f'ZeRO stage {stage}' if stage is not None else 'ZeRO'
    if not (cls in ELEMENTWISE or isinstance(optimizer, CPUAdam)
            or getattr(cls, 'elementwise', False) is True):
        name = f'{cls.__module__}.{cls.__qualname__}'
        why = NOT_ELEMENTWISE.get(cls.__name__.lower())
        supported = ', '.join(c.__name__ for c in ELEMENTWISE)
        raise TypeError(
            f'{where} cannot shard the optimizer {name}: '
            + (f'it is not elementwise ({why}). ' if why else
               'it is not a known elementwise optimizer. ')
            + f'ZeRO gives each data-parallel rank a slice of every parameter\'s elements, '
              f'which is exact only for optimizers whose update of an element reads only '
              f'that element (and per-parameter scalars such as the step count): torch.optim.'
              f'{{{supported}}}, colossal_lite.nn.optimizer.HybridAdam/CPUAdam, or a class '
              f'that declares `elementwise = True`')
    if not all(_never_stepped(s) for s in optimizer.state.values() if s):
        raise ValueError(f'{where} needs an optimizer that has not stepped yet (its state '
                         f'refers to the unsharded parameters)')


def _never_stepped(state: dict) -> bool:
    """State built at construction (torch's Adagrad: step 0); the optimizer builds the same
    again when a parameter first has a gradient."""
    step = state.get('step')
    if torch.is_tensor(step):
        return step.is_meta or float(step) == 0
    return step == 0


class ZeroOptimizer:
    """The user's optimizer re-pointed to this rank's fp32 slices (see module docstring);
    ``reducer`` is the gradient handler that fills the slices' gradients."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module, stage: int,
                 bucket_bytes: int, overlap: bool = True, offload: bool = False):
        check_optimizer(optimizer, stage)
        optimizer.state.clear()   # only state built at construction, never stepped
        self.optim, self.stage, self.offload = optimizer, stage, offload
        params = [p for g in optimizer.param_groups for p in g['params']]
        self._names = _parameter_names(model, params)
        self.all_names = _all_names(model)
        self._param_state: Dict[int, dict] = {}   # id(param) -> its scalars (step, ...)
        self._stepped: Set[int] = set()   # ids of the parameters stepped at least once here
        master_device = torch.device('cpu') if offload else params[0].device
        self.buckets: List[FlatBucket] = build_buckets(
            [g['params'] for g in optimizer.param_groups], bucket_bytes, master_device)
        for index, group in enumerate(optimizer.param_groups):
            group['params'] = [b.master for b in self.buckets if b.group_index == index]
        self.reducer = ShardedGradientReducer(self.buckets, accumulate_locally=stage == 1,
                                              overlap=overlap)
        model.register_load_state_dict_post_hook(lambda module, keys: self.refresh_masters())

    # ------------------------------------------------------------------ optimizer protocol
    @property
    def param_groups(self):
        return self.optim.param_groups

    @property
    def state(self):
        return self.optim.state

    def zero_grad(self, set_to_none: bool = True):
        self.reducer.discard()
        for b in self.buckets:
            b.master.grad = None

    def step(self, closure=None):
        if closure is not None:
            raise ValueError('ZeRO optimizers take no closure')
        self._step_shards()
        self._gather_into_params()

    # ------------------------------------------------------------------ the sharded step
    def _params_with_grad(self) -> Optional[Set[int]]:
        """ids of the parameters that had a gradient this step on some data-parallel rank
        (the gradient handler's, after its ``synchronize``), or None when unknown (then
        every parameter of a bucket with a gradient counts)."""
        return self.reducer.params_with_grad()

    @torch.no_grad()
    def _step_shards(self):
        """One step of the wrapped optimizer over per-parameter views of the slices (module
        docstring): its param groups and state are swapped for the views' for the call, and
        what it leaves in the views' state is kept (:meth:`_keep`). A step in which some
        parameter gets its first state runs bucket by bucket, so the state the optimizer
        creates per view before it is moved into the flat slots stays within one bucket."""
        stepped = self._params_with_grad()
        shards, state = [], defaultdict(dict)
        for b in self.buckets:
            grad, slots, data = b.master.grad, self._slots(b), b.master.detach()
            for p, (lo, hi) in zip(b.params, _param_ranges(b)):
                view = data[lo:hi]
                if grad is not None and (stepped is None or id(p) in stepped):
                    view.grad = grad[lo:hi]
                given = {}
                if id(p) in self._param_state:
                    given = {**self._param_state[id(p)],
                             **{k: t[lo:hi] for k, t in slots.items()}}
                    state[view] = dict(given)
                shards.append((view, p, b, lo, hi, given))
        if any(view.grad is not None and id(p) not in self._stepped
               and id(p) not in self._param_state for view, p, *_ in shards):
            batches = [[s for s in shards if s[2] is b] for b in self.buckets]
        else:
            batches = [shards]
        for batch in batches:
            self._run(batch, state)
            self._keep(batch, state)
            for view, *_ in batch:
                state.pop(view, None)

    def _run(self, shards, state: Dict[torch.Tensor, dict]):
        """The wrapped optimizer's step over the views of ``shards`` (``state``: theirs);
        the views :meth:`_on_kernel` picks go through :meth:`_kernel_step` instead."""
        groups = self.optim.param_groups
        views: List[List[torch.Tensor]] = [[] for _ in groups]
        kernel = []
        for view, _, b, _, _, _ in shards:
            group = groups[b.group_index]
            if self._on_kernel(group, view):
                kernel.append((group, view))
            else:
                views[b.group_index].append(view)
        own_params, own_state = [g['params'] for g in groups], self.optim.state
        try:
            for group, vs in zip(groups, views):
                group['params'] = vs
            self.optim.state = state
            self.optim.step()
            for group, view in kernel:
                if view.grad is not None:
                    self._kernel_step(group, view, state[view])
        finally:
            for group, ps in zip(groups, own_params):
                group['params'] = ps
            self.optim.state = own_state

    def _on_kernel(self, group: dict, view: torch.Tensor) -> bool:
        """Whether ``view`` steps through :meth:`_kernel_step` instead of the optimizer."""
        return False

    def _kernel_step(self, group: dict, view: torch.Tensor, state: dict):
        raise NotImplementedError

    def _keep(self, shards, state: Dict[torch.Tensor, dict]):
        """Store what the optimizer left in each view's state: tensors of the view's shape
        in the bucket's flat slots (created at the first parameter that has one), the rest
        as the parameter's scalars."""
        for view, p, b, lo, hi, given in shards:
            if view.grad is not None:
                self._stepped.add(id(p))
            new = state.get(view)
            if not new:
                continue          # never had a gradient: no state, as in the serial optimizer
            slots = self.optim.state.setdefault(b.master, {})
            scalars = {}
            for key, value in new.items():
                if not (torch.is_tensor(value) and value.dim() > 0):
                    scalars[key] = value
                    continue
                if value.shape != view.shape:
                    raise TypeError(f'{type(self.optim).__name__} keeps {key!r} of shape '
                                    f'{tuple(value.shape)} for a parameter slice of shape '
                                    f'{tuple(view.shape)}: it is not elementwise, ZeRO cannot '
                                    f'shard it')
                slot = slots.get(key)
                if slot is None:
                    slot = slots[key] = torch.zeros(b.shard_numel, dtype=value.dtype,
                                                    device=value.device)
                if value is not given.get(key):
                    slot[lo:hi].copy_(value)
            self._param_state[id(p)] = scalars

    def full_gradients(self) -> Dict[str, torch.Tensor]:
        """Every parameter's data-parallel averaged gradient that had one this step, full
        shape, by serial name (a tied weight under each name), as the serial model's
        ``p.grad``; one all_gather per bucket with a gradient over its reduce group."""
        stepped = self._params_with_grad()
        out = {}
        for b in self.buckets:
            grad = b.master.grad
            if grad is None:
                continue
            for p, view in zip(b.params, b.views(b.gather(grad))):
                full = param_placement(p).gather(view).clone().cpu()
                if stepped is not None and id(p) not in stepped:
                    continue
                for name in self.all_names[id(p)]:
                    out[name] = full
        return out

    @torch.no_grad()
    def _gather_into_params(self):
        pending = [b.gather(b.master.detach().to(b.dtype), async_op=True) for b in self.buckets]
        for b, work in zip(self.buckets, pending):
            for p, view in zip(b.params, b.views(work.wait())):
                p.copy_(view)

    @torch.no_grad()
    def refresh_masters(self):
        """Copy the model's parameters into the fp32 slices (after the model's weights were
        loaded or changed outside the optimizer; no communication)."""
        for b in self.buckets:
            b.master.copy_(b.own(b.flatten([p.detach() for p in b.params])))

    # ------------------------------------------------------------------ fp32 weights
    def full_weights(self) -> Dict[int, torch.Tensor]:
        """``id(param) -> full fp32 weight`` read from the masters (the weights a checkpoint
        keeps under naive AMP or stage 3; collective: one all_gather of ``padded_numel``
        fp32 elements per bucket over its reduce group, then the tensor-parallel gathers)."""
        out = {}
        for b in self.buckets:
            flat = b.gather(b.master.detach())
            for p, view in zip(b.params, b.views(flat)):
                out[id(p)] = param_placement(p).gather(view.clone()).cpu()
        return out

    @torch.no_grad()
    def load_full_weights(self, weights: Dict[int, torch.Tensor]):
        """Masters from full fp32 weights (``id(param) -> tensor``; cut over the
        tensor-parallel modes, sliced; no communication), then the model's parameters from
        them (:meth:`_weights_loaded`)."""
        for b in self.buckets:
            locals_ = [param_placement(p).shard(weights[id(p)]).to(b.master.device, torch.float32)
                       for p in b.params]
            b.master.copy_(b.own(b.flatten(locals_)))
            self._weights_loaded(b, locals_)

    def _weights_loaded(self, bucket: FlatBucket, locals_: List[torch.Tensor]):
        """Stages 1/2: the (possibly half-precision) parameters take the loaded weights."""
        for p, value in zip(bucket.params, locals_):
            p.copy_(value.to(p.device, p.dtype))

    # ------------------------------------------------------------------ state dicts
    def _slots(self, bucket: FlatBucket) -> dict:
        """The bucket's flat slot tensors (``shard_numel`` elements each) by state key."""
        return self.optim.state.get(bucket.master, {})

    def state_dict(self) -> dict:
        """Full form (see module docstring); every rank must call it."""
        state: Dict[str, dict] = {}
        for b in self.buckets:
            for key, flat in self._slots(b).items():
                full_flat = b.gather(flat.detach())
                for p, view in zip(b.params, b.views(full_flat)):
                    full = param_placement(p).gather(view.to(torch.float32))
                    if id(p) in self._param_state:
                        state.setdefault(self._names[id(p)], {})[key] = full.cpu()
            for p in b.params:
                scalars = self._param_state.get(id(p))
                if scalars is not None:
                    state.setdefault(self._names[id(p)], {}).update(_copied(scalars))
        return {'state': state, 'param_groups': self._named_groups()}

    def _named_groups(self) -> List[dict]:
        groups = []
        for index, group in enumerate(self.optim.param_groups):
            names = [self._names[id(p)] for b in self.buckets if b.group_index == index
                     for p in b.params]
            groups.append({**{k: v for k, v in group.items() if k != 'params'}, 'params': names})
        return groups

    def _layout(self) -> list:
        return [(b.group_index, [self._names[id(p)] for p in b.params], b.axis.rank,
                 b.axis.size) for b in self.buckets]

    def sharded_state_dict(self) -> dict:
        """This rank's slices (no communication): the bucket layout, the param groups'
        hyperparameters, each bucket's flat slots (the live tensors, as torch's
        ``state_dict()`` gives them) and the parameters' scalars by serial name."""
        return {'zero_shard': self._layout(),
                'param_groups': [{k: v for k, v in g.items() if k != 'params'}
                                 for g in self.optim.param_groups],
                'slots': [dict(self._slots(b)) for b in self.buckets],
                'param_state': {self._names[id(p)]: _copied(self._param_state[id(p)])
                                for b in self.buckets for p in b.params
                                if id(p) in self._param_state}}

    def load_state_dict(self, state_dict: dict):
        """Load a full (serial names, full slots) or a sharded state dict."""
        if 'zero_shard' not in state_dict:
            self._load_full(state_dict)
            return
        if [tuple(x) for x in state_dict['zero_shard']] != [tuple(x) for x in self._layout()]:
            raise ValueError('a sharded ZeRO optimizer state loads only into the same '
                             'buckets and data-parallel rank; use the full state_dict()')
        if 'slots' not in state_dict:
            raise ValueError('this sharded ZeRO optimizer state has an older form; load the '
                             'full state_dict() instead')
        for group, saved in zip(self.optim.param_groups, state_dict['param_groups']):
            group.update(saved)
        for b, slots in zip(self.buckets, state_dict['slots']):
            self.optim.state.pop(b.master, None)
            if slots:
                self.optim.state[b.master] = {k: t.to(b.master.device).clone()
                                              for k, t in slots.items()}
        by_name = {self._names[id(p)]: p for b in self.buckets for p in b.params}
        self._param_state = {id(by_name[n]): _copied(s)
                             for n, s in state_dict['param_state'].items()}

    def _load_full(self, state_dict: dict):
        groups = state_dict['param_groups']
        if len(groups) != len(self.optim.param_groups):
            raise ValueError(f'state dict has {len(groups)} param groups, the optimizer '
                             f'{len(self.optim.param_groups)}')
        for group, saved in zip(self.optim.param_groups, groups):
            group.update({k: v for k, v in saved.items() if k != 'params'})
        full_state = state_dict['state']
        for b in self.buckets:
            group = self.optim.param_groups[b.group_index]
            flats: Dict[str, torch.Tensor] = {}
            for p, offset, numel in zip(b.params, b.offsets, b.numels):
                saved = full_state.get(self._names[id(p)])
                if not saved:      # no state: as a parameter that never had a gradient
                    self._param_state.pop(id(p), None)
                    continue
                scalars = {}
                for key, value in saved.items():
                    if not (torch.is_tensor(value) and value.dim() > 0):
                        scalars[key] = _scalar(value, group, b.master.device)
                        continue
                    if key not in flats:
                        flats[key] = torch.zeros(b.padded_numel, dtype=torch.float32)
                    local = param_placement(p).shard(value.detach().cpu().to(torch.float32))
                    flats[key][offset:offset + numel].copy_(local.reshape(-1))
                self._param_state[id(p)] = scalars
            self.optim.state.pop(b.master, None)
            if flats:
                self.optim.state[b.master] = {k: b.own(f).to(b.master.device).clone()
                                              for k, f in flats.items()}


def _param_ranges(bucket: FlatBucket) -> List[Tuple[int, int]]:
    """Each parameter's elements in this rank's slice, as ``[lo, hi)`` within the slice
    (``(0, 0)`` for a parameter outside it)."""
    out = []
    for offset, numel in zip(bucket.offsets, bucket.numels):
        lo = max(offset, bucket.start) - bucket.start
        hi = min(offset + numel, bucket.start + bucket.shard_numel) - bucket.start
        out.append((lo, hi) if lo < hi else (0, 0))
    return out


def _copied(scalars: dict) -> dict:
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in scalars.items()}


def _scalar(value, group: dict, device: torch.device):
    """A loaded per-parameter scalar: a tensor is copied, to the slices' device where the
    group steps there (``fused``/``capturable``, as torch's own loading does)."""
    if not torch.is_tensor(value):
        return value
    value = value.detach().clone()
    if group.get('fused') or group.get('capturable'):
        value = value.to(device)
    return value


def _all_names(model: torch.nn.Module) -> Dict[int, List[str]]:
    """``id(param) -> every serial name of it`` (a tied weight has several)."""
    names: Dict[int, List[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def _parameter_names(model: torch.nn.Module, params) -> Dict[int, str]:
    names = {}
    for name, p in model.named_parameters():
        names.setdefault(id(p), name)
    missing = [tuple(p.shape) for p in params if id(p) not in names]
    if missing:
        raise ValueError(f'ZeRO shards only parameters of the model; the optimizer holds '
                         f'{len(missing)} other tensor(s), shapes {missing[:3]}')
    return names
