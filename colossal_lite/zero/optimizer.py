"""ZeRO-1/2 optimizer: the user's Adam/AdamW stepping this rank's flat fp32 slices.

:class:`ZeroOptimizer` takes a plain ``torch.optim.Adam``/``AdamW`` (or colossal_lite's
``HybridAdam``/``CPUAdam``, whose CPU slices update through the C++ kernel) built on the
model's parameters and re-points each of its param groups to the ``master`` slices of that
group's :class:`~colossal_lite.zero.buckets.FlatBucket` s, so the user's own optimizer
(its hyperparameters, its LR scheduler, torch's exact Adam math) updates only this
rank's 1/D of the fp32 weights and keeps Adam moments of that size (on the CPU with
``offload_optimizer``). ``param_groups`` and ``state`` are the wrapped optimizer's, so
``torch.amp.GradScaler`` unscales and steps it like any optimizer.

:meth:`step`: the wrapped step on the slices, then one all_gather per bucket over its
reduce group (``padded_numel`` elements in the model dtype) writes the updated weights
back into the model's parameters.

State dicts: :meth:`state_dict` is the full form -- ``{'state': {serial name: {'step',
'exp_avg', 'exp_avg_sq', ...}}, 'param_groups': [{..., 'params': [serial names]}]}``,
the moments at the parameters' full (serial) shapes, as ``torch.optim.AdamW.state_dict()``
of the serial model with indices replaced by names (collective: all_gather over the
reduce group and the tensor-parallel cuts). :meth:`sharded_state_dict` is this rank's
slices (no communication). :meth:`load_state_dict` takes either.
"""
from __future__ import annotations

from typing import Dict, List

import torch

from ..nn.optimizer import CPUAdam
from ..tensor import param_placement
from .buckets import FlatBucket, build_buckets
from .reducer import ShardedGradientReducer


def check_optimizer(optimizer) -> None:
    """Adam/AdamW of torch, or colossal_lite's CPUAdam/HybridAdam (same state keys; CPU
    slices, e.g. with ``offload_optimizer``, then update through the C++ kernel)."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW, CPUAdam)):
        raise TypeError(f'ZeRO stages 1 and 2 shard a torch.optim.Adam or AdamW (or '
                        f'colossal_lite.nn.optimizer.HybridAdam/CPUAdam), got '
                        f'{type(optimizer).__name__}')
    if any(optimizer.state.values()):
        raise ValueError('ZeRO needs an optimizer that has not stepped yet (its state refers '
                         'to the unsharded parameters)')


class ZeroOptimizer:
    """The user's optimizer re-pointed to this rank's fp32 slices (see module docstring);
    ``reducer`` is the gradient handler that fills the slices' gradients."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module, stage: int,
                 bucket_bytes: int, overlap: bool = True, offload: bool = False):
        check_optimizer(optimizer)
        self.optim, self.stage, self.offload = optimizer, stage, offload
        params = [p for g in optimizer.param_groups for p in g['params']]
        self._names = _parameter_names(model, params)
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
        self.optim.step()
        self._gather_into_params()

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
        return self.optim.state.get(bucket.master, {})

    def state_dict(self) -> dict:
        """Full form (see module docstring); every rank must call it."""
        state: Dict[str, dict] = {}
        for b in self.buckets:
            for key, value in self._slots(b).items():
                if not _is_slice(value, b):
                    for p in b.params:  # a scalar (the step count): the same for each
                        state.setdefault(self._names[id(p)], {})[key] = (
                            value.clone() if torch.is_tensor(value) else value)
                    continue
                full_flat = b.gather(value.detach())
                for p, view in zip(b.params, b.views(full_flat)):
                    full = param_placement(p).gather(view.to(torch.float32))
                    state.setdefault(self._names[id(p)], {})[key] = full.cpu()
        return {'state': state, 'param_groups': self._named_groups()}

    def _named_groups(self) -> List[dict]:
        groups = []
        for index, group in enumerate(self.optim.param_groups):
            names = [self._names[id(p)] for b in self.buckets if b.group_index == index
                     for p in b.params]
            groups.append({**{k: v for k, v in group.items() if k != 'params'}, 'params': names})
        return groups

    def sharded_state_dict(self) -> dict:
        """This rank's slices: the wrapped optimizer's state_dict plus the bucket layout."""
        return {'zero_shard': [(b.group_index, [self._names[id(p)] for p in b.params],
                                b.axis.rank, b.axis.size) for b in self.buckets],
                'optimizer': self.optim.state_dict()}

    def load_state_dict(self, state_dict: dict):
        """Load a full (serial names, full moments) or a sharded state dict."""
        if 'zero_shard' in state_dict:
            mine = self.sharded_state_dict()['zero_shard']
            if [tuple(x) for x in state_dict['zero_shard']] != [tuple(x) for x in mine]:
                raise ValueError('a sharded ZeRO optimizer state loads only into the same '
                                 'buckets and data-parallel rank; use the full state_dict()')
            self.optim.load_state_dict(state_dict['optimizer'])
            return
        self._load_full(state_dict)

    def _load_full(self, state_dict: dict):
        groups = state_dict['param_groups']
        if len(groups) != len(self.optim.param_groups):
            raise ValueError(f'state dict has {len(groups)} param groups, the optimizer '
                             f'{len(self.optim.param_groups)}')
        for group, saved in zip(self.optim.param_groups, groups):
            group.update({k: v for k, v in saved.items() if k != 'params'})
        full_state = state_dict['state']
        for b in self.buckets:
            names = [self._names[id(p)] for p in b.params]
            present = [n for n in names if n in full_state]
            if not present:
                continue
            if len(present) != len(names):
                raise ValueError(f'state dict holds state for {present} but not for '
                                 f'{sorted(set(names) - set(present))}')
            slots = {}
            for key, value in full_state[names[0]].items():
                if not torch.is_tensor(value) or value.dim() == 0:
                    slots[key] = value.clone() if torch.is_tensor(value) else value
                    continue
                locals_ = [param_placement(p).shard(full_state[n][key].to(p.device))
                           for p, n in zip(b.params, names)]
                flat = b.flatten([t.to(torch.float32) for t in locals_])
                slots[key] = b.own(flat).to(b.master.device, torch.float32).clone()
            self.optim.state[b.master] = slots


def _is_slice(value, bucket: FlatBucket) -> bool:
    return torch.is_tensor(value) and value.dim() == 1 and value.numel() == bucket.shard_numel


def _parameter_names(model: torch.nn.Module, params) -> Dict[int, str]:
    names = {}
    for name, p in model.named_parameters():
        names.setdefault(id(p), name)
    missing = [tuple(p.shape) for p in params if id(p) not in names]
    if missing:
        raise ValueError(f'ZeRO shards only parameters of the model; the optimizer holds '
                         f'{len(missing)} other tensor(s), shapes {missing[:3]}')
    return names
