"""Run a plan: the captured graph interpreted over DTensors with the plan's placements.

``GraphRunner(captured, mesh, choice, placeholders)``, built once, walks the graph once per
step. Each tensor input
of a node is redistributed (DTensor ``redistribute``: all_gather, all_reduce, reduce_scatter,
all_to_all or a local slice, all autograd-aware) to the placements the plan chose for that
node; then the node runs

* through DTensor dispatch, which finds the inputs already where its rule wants them and
  moves nothing (a node whose output comes back elsewhere than planned is redistributed to
  the plan and counted in ``deviations``), or
* by our own rule (``Strategy.local``: attention, factory ops, ops with no rule) on the
  local shards, its outputs wrapped back with the planned placements.

Parameters are ``nn.Parameter(DTensor)`` with the plan's placements; each parameter read
passes through :class:`_GradToPlacement`, whose backward redistributes the gradient to the
parameter's placements (a data-parallel ``Partial`` gradient is all-reduced there).

:class:`CollectiveCounter` records every functional collective DTensor issues (forward and
backward) in our communication profile, with the buffer-byte convention of
``communication/profile.py``, under the ``ParallelMode`` named like the mesh axis.
"""
from __future__ import annotations

import operator
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils._python_dispatch import TorchDispatchMode

from ...communication import profile as comm_profile
from ...config.modes import ParallelMode
from .local_rules import run_local, whole_grad_slots
from .space import NO_OPS
from .strategies import Strategy
from .trace import Captured

_c10d = torch.ops._c10d_functional
# functional collective -> (our op name, buffer bytes from (input bytes, group size))
_COLLECTIVES = {
    _c10d.all_reduce.default: ('all_reduce', lambda n, p: n),
    _c10d.all_reduce_.default: ('all_reduce', lambda n, p: n),     # the gradient bucket's
    _c10d.all_gather_into_tensor.default: ('all_gather', lambda n, p: n * p),
    _c10d.reduce_scatter_tensor.default: ('reduce_scatter', lambda n, p: n),
    _c10d.all_to_all_single.default: ('all_to_all', lambda n, p: n),
}


_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default,
          torch.ops.aten.reshape.default)


class CollectiveCounter(TorchDispatchMode):
    """Counts DTensor's collectives into ``communication.profile`` while active."""

    def __init__(self, mesh: DeviceMesh):
        super().__init__()
        self.modes: Dict[str, ParallelMode] = {}
        names = mesh.mesh_dim_names or tuple(f'axis{i}' for i in range(mesh.ndim))
        for i, name in enumerate(names):
            group = mesh.get_group(i)
            mode = next((m for m in ParallelMode if m.value == name), ParallelMode.GLOBAL)
            self.modes[group.group_name] = (mode, mesh.size(i))

    def entry(self, func, args, kwargs) -> Optional[Tuple[ParallelMode, str, int, int]]:
        """``(mode, op, buffer bytes, group size)`` of a functional collective call (None
        for any other op or a one-rank group); ``args[0]`` needs ``numel``/``element_size``
        or a ``meta['val']`` holding them (an fx node)."""
        if func not in _COLLECTIVES:
            return None
        op, nbytes = _COLLECTIVES[func]
        tensor = args[0]
        if isinstance(tensor, torch.fx.Node):
            tensor = tensor.meta['val']
        group_name = args[-1] if isinstance(args[-1], str) else kwargs.get('group_name')
        mode, size = self.modes.get(group_name, (ParallelMode.GLOBAL, 1))
        if size <= 1:
            return None
        return mode, op, nbytes(tensor.numel() * tensor.element_size(), size), size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented       # let DTensor lower to collectives first
        hit = self.entry(func, args, kwargs)
        if hit is not None:
            comm_profile.record(*hit)
        return func(*args, **kwargs)


class _GradToPlacement(torch.autograd.Function):
    """Identity on a parameter, or on a local op's input; its gradient is redistributed to the
    forward placements at once: a Partial gradient (the dual rule) is reduced at the edge,
    where the planner prices it, not wherever DTensor's lazy propagation meets an op that
    needs it whole (which can be a larger tensor, e.g. after a cat)."""

    @staticmethod
    def forward(ctx, param):
        ctx.mesh, ctx.placements = param.device_mesh, param.placements
        return param.view_as(param)

    @staticmethod
    def backward(ctx, grad):
        if isinstance(grad, DTensor) and grad.placements != ctx.placements:
            grad = grad.redistribute(ctx.mesh, ctx.placements)
        return grad


def _grad_placements(given, out, whole: bool = False) -> tuple:
    """Where the gradient of a local op's input lands (the dual rule): on an axis where
    the input is replicated but the op's output is split (or partial), each rank's local
    gradient is a partial sum; elsewhere it has the input's placement. ``whole``: the op
    gives this input's gradient whole where its output is partial
    (``local_rules.whole_grad_slots``)."""
    if out is None:
        return tuple(given)
    return tuple(Partial() if isinstance(g, Replicate) and not isinstance(o, Replicate)
                 and not (whole and isinstance(o, Partial)) else g for g, o in zip(given, out))


def _as_dtensor(value, mesh: DeviceMesh):
    if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
        return DTensor.from_local(value, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return value


class GraphRunner(torch.fx.Interpreter):
    """See the module doc. ``choice[node.name]`` is the node's chosen :class:`Strategy`;
    ``placeholders[name]`` the planned placements of a graph input."""

    def __init__(self, captured: Captured, mesh: DeviceMesh, choice: Dict[str, Strategy],
                 placeholders: Dict[str, tuple]):
        super().__init__(captured.graph_module, garbage_collect_values=True)
        self.mesh = mesh
        self.choice = choice
        self.placeholders = placeholders
        self.deviations: Dict[str, int] = {}   # of the last run
        self.check_shards = False      # tests: every output's local shape matches placements
        self._placeholder_names = {n.target: n.name for n in self.graph.nodes
                                   if n.op == 'placeholder'}

    def _to(self, value, placements):
        value = _as_dtensor(value, self.mesh)
        if placements is not None and tuple(value.placements) != tuple(placements):
            value = value.redistribute(self.mesh, placements)
        return value

    def placeholder(self, target, args, kwargs):
        value = super().placeholder(target, args, kwargs)
        if isinstance(value, nn.Parameter) and isinstance(value, DTensor):
            return _GradToPlacement.apply(value)
        if isinstance(value, torch.Tensor):
            return self._to(value, self.placeholders.get(self._node_name(target)))
        return value

    def _node_name(self, target):
        return self._placeholder_names[target]

    def run(self, *args):
        self.deviations = {}
        return super().run(*args)

    def run_node(self, node):
        out = self._run_node(node)
        if self.check_shards:
            for value in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(value, DTensor):
                    _check_shard(node, value, self.mesh)
        return out

    def _run_node(self, node):
        if node.op != 'call_function' or node.target is operator.getitem:
            return super().run_node(node)
        if node.target in NO_OPS:
            return None
        strategy = self.choice[node.name]
        args, kwargs = self.fetch_args_kwargs_from_env(node)
        flat, spec = torch.utils._pytree.tree_flatten((args, kwargs))
        slot = 0
        moved = []
        whole = whole_grad_slots(node) if strategy.local else ()
        for value in flat:
            want = strategy.inputs[slot] if slot < len(strategy.inputs) else None
            if isinstance(value, torch.Tensor):
                value = self._to(value, want)
                if strategy.local and node.target not in _VIEWS:
                    if value.requires_grad:
                        value = _GradToPlacement.apply(value)
                    value = value.to_local(grad_placements=_grad_placements(
                        value.placements, strategy.outputs[0], slot in whole))
            moved.append(value)
            slot += 1
        args, kwargs = torch.utils._pytree.tree_unflatten(moved, spec)
        if node.target in _VIEWS:
            return self._local_view(node, args[0], strategy)
        split = node.meta.get('fused_split')
        out = None
        if split is not None and strategy.local:    # a strided fused output into its pieces
            dim, pieces = split
            out = torch.split(args[0], args[0].shape[dim] // pieces, dim=dim)
        elif strategy.local and strategy.inputs and strategy.inputs[0] is not None:
            out = run_local(node, args, self.mesh, strategy.inputs[0],
                            strategy.outputs[0] or (), strategy.inputs)
        if out is None:
            out = node.target(*args, **kwargs)
        out = self._place_outputs(node, out, strategy)
        return out

    def _local_view(self, node, value: DTensor, strategy: Strategy) -> DTensor:
        """A view run as a local reshape to the planned output's local shape: the trace
        proved the view stride-compatible for the full tensor, which a shard that went
        through a collective or a local kernel need not be."""
        meta = node.meta['val']
        want = strategy.outputs[0]
        shape = local_shape(meta.shape, self.mesh, want)
        local = value.to_local().reshape(shape)
        return DTensor.from_local(local, self.mesh, want, run_check=False,
                                  shape=meta.shape, stride=meta.stride())

    def _place_outputs(self, node, out, strategy: Strategy):
        vals = node.meta.get('val')
        single = isinstance(out, torch.Tensor)
        outs = [out] if single else list(out) if isinstance(out, (tuple, list)) else None
        if outs is None:
            return out
        metas = [vals] if single else list(vals)
        placed = []
        for i, (value, meta) in enumerate(zip(outs, metas)):
            want = strategy.outputs[i] if i < len(strategy.outputs) else None
            if isinstance(value, torch.Tensor) and want is not None:
                if not isinstance(value, DTensor):
                    value = DTensor.from_local(value, self.mesh, want, run_check=False,
                                               shape=meta.shape, stride=meta.stride())
                elif tuple(value.placements) != tuple(want):
                    self.deviations[node.name] = self.deviations.get(node.name, 0) + 1
                    value = value.redistribute(self.mesh, want)
            placed.append(value)
        return placed[0] if single else type(out)(placed)

    def output(self, target, args, kwargs):
        (loss,) = args[0]
        return loss.full_tensor() if isinstance(loss, DTensor) else loss


def local_shape(shape, mesh: DeviceMesh, placements) -> List[int]:
    """This rank's shard shape: computed from sizes alone (no tensor op, so a trace of the
    step does not read a value), as DTensor's chunking gives it."""
    shape = list(shape)
    for axis, p in enumerate(placements):
        if isinstance(p, _StridedShard):        # evenly split pieces (strategies.fits)
            shape[p.dim] //= mesh.size(axis)
        elif isinstance(p, Shard):
            ways, index = mesh.size(axis), mesh.get_local_rank(axis)
            size = shape[p.dim]
            if size % ways == 0:
                shape[p.dim] = size // ways
            else:       # torch.chunk: ceil-sized pieces, the last ones short or empty
                piece = -(-size // ways)
                shape[p.dim] = max(0, min(piece, size - piece * index))
    return shape


def _check_shard(node, value: DTensor, mesh: DeviceMesh) -> None:
    shape = local_shape(value.shape, mesh, value.placements)
    if tuple(shape) != tuple(value.to_local().shape):
        raise AssertionError(f'{node.name} ({node.target}): local shape '
                             f'{tuple(value.to_local().shape)} does not match placements '
                             f'{value.placements} of global {tuple(value.shape)}')


def distribute_parameters(model: nn.Module, mesh: DeviceMesh,
                          placements: Dict[str, Sequence]) -> None:
    """Replace each parameter (and planned buffer) of ``model`` in place by its DTensor with
    the planned placements, sliced locally from the full tensor every rank holds. A tensor
    under several names (tied weights) becomes one DTensor under all of them, placed as the
    plan places whichever name the graph reads."""
    named = list(model.named_parameters(remove_duplicate=False)) + \
        list(model.named_buffers(remove_duplicate=False))
    aliases: Dict[int, List[str]] = {}
    values: Dict[int, torch.Tensor] = {}
    for fqn, value in named:
        aliases.setdefault(id(value), []).append(fqn)
        values[id(value)] = value
    for key, fqns in aliases.items():
        value = values[key]
        want = next((placements[f] for f in fqns if f in placements), None)
        if want is None or isinstance(value, DTensor):
            continue
        shard = distribute_tensor(value.detach(), mesh, list(want), src_data_rank=None)
        if isinstance(value, nn.Parameter):
            shard = nn.Parameter(shard, requires_grad=value.requires_grad)
        for fqn in fqns:
            owner, name = _owner(model, fqn)
            table = owner._parameters if isinstance(value, nn.Parameter) else owner._buffers
            table[name] = shard


def _owner(model: nn.Module, fqn: str):
    *path, name = fqn.split('.')
    owner = model
    for part in path:
        owner = getattr(owner, part)
    return owner, name
