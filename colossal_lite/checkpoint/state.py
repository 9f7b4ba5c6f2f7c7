"""An engine's training state as layout-free pieces keyed by serial names.

Keys: ``'model.<key>'`` (the model's ``state_dict()`` keys; under naive AMP the fp32
master weight) and ``'optim.<name>.<slot>'`` (``exp_avg``, ``exp_avg_sq``, ``step`` of the
parameter with serial name ``<name>``), every tensor at its full (serial) shape. A
pipeline stage holds only its own keys; a tied weight appears on each stage that holds
it with the same value.

* :func:`sharded_tensor_state` / :func:`sharded_targets` / :func:`load_sharded_tensor_state`
  -- the launched route: parameters and plain-optimizer slots as ``DTensor`` views of
  the local shards (:class:`DTensorViews`, no communication); ZeRO 1/2 slots and any
  placement without a DTensor form as full tensors (all_gather over the cuts and the
  ZeRO reduce group). Loading copies DTensor local shards in place and cuts full tensors.
  Chunk ZeRO (stage 3) and ZeRO 1/2 under naive fp16 keep their weights in the ZeRO fp32
  masters: their ``'model.'`` tensors go full, gathered from the masters
  (``ZeroOptimizer.full_weights``), and load back into the masters (``load_full_weights``).
* :func:`tensor_state` / :func:`load_tensor_state` -- everything as full tensors (a plain
  serial script with no process group).
* :func:`side_state` / :func:`load_side_state`, :func:`rng_state` / :func:`load_rng_state`
  -- the small rest: global step, AMP scaler, LR scheduler, optimizer hyperparameters,
  per-mode RNG states.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Tuple

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.placement_types import _StridedShard

from ..context import ParallelMode, seed_manager
from ..tensor import param_placement, to_dtensor
from ..zero.chunk.engine import ChunkOptimizer
from ..zero.low_level import ZeroNaiveAmp
from ..zero.optimizer import ZeroOptimizer

MODEL, OPTIM = 'model.', 'optim.'


def _is_chunk_optimizer(optimizer) -> bool:
    return isinstance(optimizer, ChunkOptimizer)


def check_supported(engine) -> None:
    """Every engine checkpoints (ZeRO stage 3 and ZeRO with naive fp16 through their fp32
    masters, :func:`_zero_weights`); kept as the hook for what may not."""


def _weights_in_zero_masters(engine) -> bool:
    """Chunk ZeRO (the parameters hold no storage between passes) and ZeRO 1/2 under naive
    fp16 (the parameters are half-precision copies): the weights are the ZeRO fp32 masters."""
    return isinstance(engine.optimizer, ZeroOptimizer) and (
        _is_chunk_optimizer(engine.optimizer) or isinstance(engine.amp, ZeroNaiveAmp))


def _zero_weights(engine) -> Dict[str, torch.Tensor]:
    """``{'model.<key>': full tensor}`` of every parameter (under each tied name) from the
    ZeRO fp32 masters, plus the persistent buffers (collective: ``full_weights``)."""
    by_id = engine.optimizer.full_weights()
    flat = {MODEL + name: by_id[id(p)] for name, p in _model_params(engine.model)
            if id(p) in by_id}
    missing = [name for name, p in _model_params(engine.model) if id(p) not in by_id]
    if missing:
        raise ValueError(f'ZeRO does not step {len(missing)} parameter(s) of the model (e.g. '
                         f'{missing[:3]}); a checkpoint of their weights needs them in the '
                         f'optimizer')
    for key, buf in persistent_buffers(engine.model):
        flat[MODEL + key] = buf.detach()
    return flat


@torch.no_grad()
def _load_zero_weights(engine, flat: Dict[str, torch.Tensor]) -> None:
    """The inverse of :func:`_zero_weights` (full tensors; no communication)."""
    weights = {id(p): flat[MODEL + name] for name, p in _model_params(engine.model)
               if MODEL + name in flat}
    engine.optimizer.load_full_weights(weights)
    for key, buf in persistent_buffers(engine.model):
        if MODEL + key in flat:
            buf.copy_(flat[MODEL + key])


# ---------------------------------------------------------------------- names
def model_keys(model: torch.nn.Module) -> List[str]:
    """The keys of ``model.state_dict()`` without gathering anything: every parameter
    (tied ones under each name) and every persistent buffer."""
    keys = [n for n, p in model.named_parameters(remove_duplicate=False)]
    keys += [k for k, _ in persistent_buffers(model)]
    return list(dict.fromkeys(keys))


def persistent_buffers(model: torch.nn.Module) -> List[Tuple[str, torch.Tensor]]:
    """``(state_dict key, buffer)`` of every persistent buffer (whole on every rank)."""
    out = []
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                out.append((f'{prefix}.{name}' if prefix else name, buf))
    return out


def optimizer_params(engine) -> List[Tuple[str, torch.Tensor, torch.Tensor]]:
    """``(serial name, model parameter, tensor the optimizer steps)`` for a plain torch
    optimizer; the stepped tensor is the fp32 master of naive AMP, else the parameter."""
    names: Dict[int, str] = {}
    for name, p in engine.model.named_parameters():
        names.setdefault(id(p), name)
    masters = {id(m): p for p, m in getattr(engine.amp, 'pairs', ())}
    out = []
    for group in engine.optimizer.param_groups:
        for t in group['params']:
            p = masters.get(id(t), t)
            if id(p) not in names:
                raise ValueError(f'the optimizer steps a tensor of shape {tuple(t.shape)} that '
                                 f'is not a parameter of the model; it cannot be checkpointed '
                                 f'by name')
            out.append((names[id(p)], p, t))
    return out


# ---------------------------------------------------------------------- tensors
def dcp_ready(t: DTensor) -> DTensor:
    """``t`` as DCP can store it, one contiguous chunk per rank: a strided shard (a graph
    plan's head-aligned split of a fused projection) is replicated on its mesh axis
    (collective over that axis); other placements are kept."""
    if not any(isinstance(p, _StridedShard) for p in t.placements):
        return t
    return t.redistribute(t.device_mesh, [Replicate() if isinstance(p, _StridedShard) else p
                                          for p in t.placements])


def _full_optimizer_state(engine) -> Dict[str, Dict[str, object]]:
    """``{serial name: {slot: full tensor or number}}`` (collective over the cuts)."""
    optimizer = engine.optimizer
    if isinstance(optimizer, ZeroOptimizer):
        return optimizer.state_dict()['state']
    state: Dict[str, Dict[str, object]] = {}
    for name, p, t in optimizer_params(engine):
        placement = param_placement(p)
        for slot, value in optimizer.state.get(t, {}).items():
            if isinstance(value, DTensor):
                value = value.full_tensor().detach()
            elif torch.is_tensor(value) and value.dim() > 0:
                value = placement.gather(value.detach())
            state.setdefault(name, {})[slot] = value
    return state


def tensor_state(engine) -> Dict[str, torch.Tensor]:
    """Flat ``{'model.<key>' | 'optim.<name>.<slot>': full tensor}`` (collective)."""
    check_supported(engine)
    if _weights_in_zero_masters(engine):
        flat = _zero_weights(engine)
        masters = {}
    else:
        flat = {MODEL + k: (v.full_tensor() if isinstance(v, DTensor) else v).detach()
                for k, v in engine.model.state_dict().items()}
        masters = _masters(engine)
    for name, p in _model_params(engine.model):
        if id(p) in masters:
            flat[MODEL + name] = param_placement(p).gather(masters[id(p)].detach())
    for name, slots in _full_optimizer_state(engine).items():
        for slot, value in slots.items():
            flat[f'{OPTIM}{name}.{slot}'] = (value.detach() if torch.is_tensor(value)
                                             else torch.tensor(value))
    return flat


class DTensorViews:
    """Placements as ``DTensor`` views over the layout's ``DeviceMesh`` (``layout_mesh``):
    a shard keeps its local memory, DCP writes each distinct chunk once and, on load,
    reads exactly the chunks covering this rank's shard (resharding). Used for model
    parameters and the slots of a plain torch optimizer; ZeRO slices go full."""

    def __init__(self, mesh, layout):
        self.mesh, self.layout = mesh, layout

    def view(self, local: torch.Tensor, placement) -> Optional[torch.Tensor]:
        """The DTensor of ``local`` (None when the cuts have no DTensor form)."""
        try:
            return to_dtensor(local, placement, self.mesh, self.layout)
        except NotImplementedError:
            return None


def _model_params(model) -> List[Tuple[str, torch.Tensor]]:
    return list(model.named_parameters(remove_duplicate=False))


def _masters(engine) -> Dict[int, torch.Tensor]:
    """``id(param) -> fp32 master`` under naive AMP (the weights a checkpoint keeps)."""
    return {id(p): m for p, m in getattr(engine.amp, 'pairs', ())}


def sharded_tensor_state(engine, views: DTensorViews) -> Dict[str, torch.Tensor]:
    """As :func:`tensor_state`, with model parameters and plain-optimizer slots as DTensor
    views of the local shards (no gather); the rest full (collective only where full)."""
    check_supported(engine)
    flat, masters = {}, _masters(engine)
    if _weights_in_zero_masters(engine):
        flat = _zero_weights(engine)
    else:
        for name, p in _model_params(engine.model):
            if isinstance(p, DTensor):    # placed by a graph plan: its own DTensor
                flat[MODEL + name] = dcp_ready(p.detach())
                continue
            placement, weight = param_placement(p), masters.get(id(p), p).detach()
            dt = views.view(weight, placement)
            flat[MODEL + name] = dt if dt is not None else placement.gather(weight)
        for key, buf in persistent_buffers(engine.model):
            flat[MODEL + key] = buf.detach()
    optimizer = engine.optimizer
    if isinstance(optimizer, ZeroOptimizer):
        slots = _full_optimizer_state(engine)
    else:
        slots = {}
        for name, p, t in optimizer_params(engine):
            placement = param_placement(p)
            for slot, value in optimizer.state.get(t, {}).items():
                if isinstance(value, DTensor):
                    value = dcp_ready(value.detach())
                elif torch.is_tensor(value) and value.dim() > 0:
                    dt = views.view(value.detach(), placement)
                    value = dt if dt is not None else placement.gather(value.detach())
                slots.setdefault(name, {})[slot] = value
    for name, named_slots in slots.items():
        for slot, value in named_slots.items():
            flat[f'{OPTIM}{name}.{slot}'] = (value.detach() if torch.is_tensor(value)
                                             else torch.tensor(value))
    return flat


def sharded_targets(engine, saved: dict, views: DTensorViews) -> Dict[str, torch.Tensor]:
    """Empty tensors DCP fills in place for this rank's keys (``saved``: DCP's
    ``state_dict_metadata``): DTensor views of this rank's shard where the placement has
    one (DCP reads only the chunks covering it), full tensors otherwise."""
    keys, masters = wanted_keys(engine, saved), _masters(engine)
    params = ({} if _weights_in_zero_masters(engine)  # full tensors, cut by the masters
              else {MODEL + n: p for n, p in _model_params(engine.model)})
    if not isinstance(engine.optimizer, ZeroOptimizer):
        for name, p, _ in optimizer_params(engine):
            params[f'{OPTIM}{name}.'] = p
    out = {}
    for key in keys:
        meta = saved[key]
        p = params.get(key)
        if p is None:
            p = params.get(key[:key.rfind('.') + 1])
        if isinstance(p, DTensor) and tuple(meta.size) == tuple(p.shape):
            same = key.startswith(MODEL) and p.dtype == meta.properties.dtype
            out[key] = dcp_ready(p.detach() if same else
                                 torch.empty_like(p.detach(), dtype=meta.properties.dtype))
            continue
        placement = param_placement(p) if p is not None else None
        if placement is not None and tuple(meta.size) == placement.shape:
            weight = masters.get(id(p), p).detach() if key.startswith(MODEL) else None
            if weight is not None and weight.dtype == meta.properties.dtype \
                    and weight.is_contiguous():
                local = weight  # DCP reads straight into the weight: no second copy
            else:
                local = torch.empty(placement.local_shape(), dtype=meta.properties.dtype,
                                    device=p.device)
            dt = views.view(local, placement)
            if dt is not None:
                out[key] = dt
                continue
        out[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
    return out


def load_sharded_tensor_state(engine, flat: Dict[str, torch.Tensor]) -> None:
    """Load what :func:`sharded_targets` received: DTensor entries are this rank's shards,
    the others full tensors cut as :func:`load_tensor_state` does (no communication)."""
    if _weights_in_zero_masters(engine):
        _load_zero_weights(engine, flat)
        load_tensor_state_optimizer(engine, flat)
        return
    local = {k: v for k, v in flat.items() if isinstance(v, DTensor)}
    full = {k: v for k, v in flat.items() if k not in local}
    with torch.no_grad():
        for name, p in _model_params(engine.model):
            if MODEL + name in local:
                loaded = local[MODEL + name]
                if isinstance(p, DTensor) and tuple(loaded.placements) != tuple(p.placements):
                    loaded = loaded.redistribute(p.device_mesh, p.placements)
                (p.to_local() if isinstance(p, DTensor) else p).copy_(loaded.to_local())
    model_full = {k[len(MODEL):]: v for k, v in full.items() if k.startswith(MODEL)}
    if model_full:
        engine.model.load_state_dict(model_full, strict=False)
    if isinstance(engine.optimizer, ZeroOptimizer):
        engine.optimizer.refresh_masters()
    load_tensor_state_optimizer(engine, flat)


def wanted_keys(engine, saved: Iterable[str]) -> List[str]:
    """The saved keys this rank's engine loads: its model keys and its parameters' slots."""
    saved = set(saved)
    keys = [MODEL + k for k in model_keys(engine.model)]
    missing = [k for k in keys if k not in saved]
    if missing:
        raise KeyError(f'the checkpoint lacks {len(missing)} model tensor(s) of this layout, '
                       f'e.g. {missing[:3]}')
    for name in optimizer_names(engine):
        prefix = f'{OPTIM}{name}.'
        keys += [k for k in saved if k.startswith(prefix) and '.' not in k[len(prefix):]]
    return keys


def optimizer_names(engine) -> List[str]:
    optimizer = engine.optimizer
    if isinstance(optimizer, ZeroOptimizer):
        return [optimizer._names[id(p)] for b in optimizer.buckets for p in b.params]
    return [name for name, _, _ in optimizer_params(engine)]


def _named_slots(engine, flat: Dict[str, torch.Tensor]) -> Dict[str, Dict[str, torch.Tensor]]:
    slots: Dict[str, Dict[str, torch.Tensor]] = {}
    for name in optimizer_names(engine):
        prefix = f'{OPTIM}{name}.'
        for key, value in flat.items():
            if key.startswith(prefix) and '.' not in key[len(prefix):]:
                slots.setdefault(name, {})[key[len(prefix):]] = value
    return slots


def load_tensor_state_optimizer(engine, flat: Dict[str, torch.Tensor]) -> None:
    """Optimizer slots from full tensors (ZeRO: cut and sliced; plain: cut)."""
    slots = _named_slots(engine, flat)
    optimizer = engine.optimizer
    if isinstance(optimizer, ZeroOptimizer):
        if slots:
            optimizer._load_full({'state': slots, 'param_groups': [
                {} for _ in optimizer.param_groups]})
        return
    _load_plain_optimizer(engine, slots)
    _load_masters(engine, flat)


def load_tensor_state(engine, flat: Dict[str, torch.Tensor]) -> None:
    """Load full tensors (keys as :func:`tensor_state`) into this rank's layout."""
    check_supported(engine)
    if _weights_in_zero_masters(engine):
        _load_zero_weights(engine, flat)
        load_tensor_state_optimizer(engine, flat)
        return
    model_state = {k[len(MODEL):]: v for k, v in flat.items() if k.startswith(MODEL)}
    engine.model.load_state_dict(model_state)
    load_tensor_state_optimizer(engine, flat)


def _load_plain_optimizer(engine, slots: Dict[str, Dict[str, torch.Tensor]]) -> None:
    """Each slot cut with its parameter's placement (or a DTensor's local shard)."""
    optimizer = engine.optimizer
    for name, p, t in optimizer_params(engine):
        if name not in slots:
            continue
        placement = param_placement(p)
        state = {}
        for slot, value in slots[name].items():
            if isinstance(value, DTensor) and isinstance(t, DTensor):  # a graph plan's
                value = value.redistribute(t.device_mesh, t.placements).to(t.dtype)
            elif isinstance(value, DTensor):  # already this rank's shard
                value = value.to_local().to(t.device, t.dtype)
            elif value.dim() > 0:
                value = placement.shard(value).to(t.device, t.dtype)
            raw = value.to_local() if isinstance(value, DTensor) else value
            whole = raw.untyped_storage().nbytes() == raw.numel() * raw.element_size()
            state[slot] = value if whole else value.clone()  # a loaded target is kept, not copied
        place = getattr(optimizer, 'place_state', None)  # HybridAdam: step counts beside t
        optimizer.state[t] = place(t, state) if place is not None else state


@torch.no_grad()
def _load_masters(engine, flat: Dict[str, torch.Tensor]) -> None:
    """Naive AMP: each fp32 master takes the saved weight itself (a DTensor's local
    shard, or the full tensor cut by the placement), not its half-precision copy."""
    masters = _masters(engine)
    for name, p in _model_params(engine.model):
        if id(p) not in masters or MODEL + name not in flat:
            continue
        value = flat[MODEL + name]
        value = (value.to_local() if isinstance(value, DTensor)
                 else param_placement(p).shard(value))
        masters[id(p)].copy_(value)


# ---------------------------------------------------------------------- small state
def _hyperparameters(optimizer) -> List[dict]:
    return [{k: v for k, v in g.items() if k != 'params'} for g in optimizer.param_groups]


def side_state(engine, lr_scheduler=None) -> dict:
    """Global step, AMP, optimizer hyperparameters, LR scheduler (identical on every rank)."""
    return {'global_step': engine.global_step, 'amp': engine.amp.state_dict(),
            'param_groups': _hyperparameters(engine.optimizer),
            'lr_scheduler': lr_scheduler.state_dict() if lr_scheduler is not None else None}


def rng_state() -> dict:
    """This rank's RNG states: the default CPU (and CUDA) generator and every per-mode
    stream of ``seed_manager`` (these depend on the rank's place in the layout), as data:
    ``{'cpu': uint8 tensor, 'cuda': uint8 tensor | None, 'modes': {ParallelMode value:
    [cpu state, cuda state | None]}}``."""
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and \
        torch.cuda.is_initialized() else None
    modes = {mode.value: list(states) for mode, states in seed_manager.get_states().items()}
    return {'cpu': torch.get_rng_state(), 'cuda': cuda, 'modes': modes}


def load_rng_state(state: dict, where: str = 'the RNG state') -> None:
    """The inverse of :func:`rng_state`; a ``ValueError`` naming ``where`` for another form."""
    def generator_state(value, optional=False):
        if (value is None and optional) or (torch.is_tensor(value) and value.dtype == torch.uint8):
            return value
        raise ValueError(f'{where}: an RNG state must be a uint8 tensor, got '
                         f'{type(value).__name__}')

    def mode(name):
        if name not in {m.value for m in ParallelMode}:
            raise ValueError(f'{where}: no ParallelMode is called {name!r}')
        return ParallelMode(name)
    try:
        cpu, cuda = generator_state(state['cpu']), generator_state(state['cuda'], True)
        modes = {mode(name): (generator_state(s[0]), generator_state(s[1], True))
                 for name, s in state['modes'].items()}
    except (KeyError, TypeError, IndexError) as err:
        raise ValueError(f'{where}: not an RNG state of colossal_lite ({err!r})') from None
    torch.set_rng_state(cpu)
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda)
    seed_manager.set_states(modes)


def load_side_state(engine, state: dict, lr_scheduler=None) -> None:
    engine.global_step = state['global_step']
    engine.amp.load_state_dict(state['amp'])
    groups = state['param_groups']
    if len(groups) != len(engine.optimizer.param_groups):
        raise ValueError(f'the checkpoint has {len(groups)} optimizer param groups, this '
                         f'optimizer {len(engine.optimizer.param_groups)}')
    for group, saved in zip(engine.optimizer.param_groups, groups):
        group.update(saved)
    if lr_scheduler is not None:
        if state['lr_scheduler'] is None:
            raise ValueError('an lr_scheduler was given to load() but the checkpoint was saved '
                             'without one')
        lr_scheduler.load_state_dict(state['lr_scheduler'])
