"""The one adapter to torch's DTensor sharding rules: the SBP strategies of each graph node.

A placement on one mesh axis is AutoDDL's SBP state: ``Shard(d)`` (Split), ``Replicate()``
(Broadcast) or ``Partial()``. A node's *strategy* gives one placement per mesh axis for each
of its tensor inputs and for its output(s).

Strategies are enumerated one mesh axis at a time, as DTensor's own single-dimension rules
are, and combined as their product over the axes. For one axis of size k, every combination
of input states (Replicate, Shard(d) for each dim d that k divides, Partial) is offered to
DTensor's runtime propagation (``ShardingPropagator.propagate_op_sharding``, the code every
DTensor op runs); a combination is kept when DTensor runs the op on it without moving any
input, and the output placement it reports is the strategy's output. This uses only the
entry point DTensor itself uses, so it follows torch's rules as they change.

Our own rules (``OWN_RULES``) cover what DTensor lacks on CPU: scaled dot-product attention
(batch or head split; kv heads must divide too), factory ops (replicated, computed locally),
the head-aligned strided splits of fused projections (``fused.py``: ``_StridedShard``,
named ``S<dim>:<pieces>``, offered only along the marked chains), the class-split
log_softmax / gather / embedding of an LM's loss and embedding and the row-parallel addmm
with a bias (``local_rules.py``); graph asserts are no decision at all
(``space.NO_OPS``). An op with no rule at all keeps only the all-Replicate strategy;
it is listed by name (``Strategies.unruled``) in a warning and in ``Plan.explain()``.
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from .fused import MATMULS, TRANSPOSES, VIEWS as FUSED_VIEWS, transposed_dim
from .local_rules import local_rules

aten = torch.ops.aten

Placements = Tuple[Placement, ...]        # one placement per mesh axis
MAX_COMBOS = 400                           # per-axis input combinations tried per op
MAX_STRATEGIES = 256                       # per node, after the product over axes


@dataclass(frozen=True)
class Strategy:
    """Placements of a node's tensor inputs (in flattened argument order; None for a
    non-tensor argument slot) and of its outputs (one per tensor output)."""

    inputs: Tuple[Optional[Placements], ...]
    outputs: Tuple[Placements, ...]
    local: bool = False        # run on local tensors by our own rule, not DTensor dispatch


# ---------------------------------------------------------------------------- helpers
def tensor_args(node: torch.fx.Node) -> List[Optional[torch.fx.Node]]:
    """The node's arguments flattened (lists included), tensors as nodes, others None."""
    flat, _ = torch.utils._pytree.tree_flatten((node.args, node.kwargs))
    return [a if isinstance(a, torch.fx.Node) and isinstance(a.meta.get('val'), torch.Tensor)
            else None for a in flat]


def outputs_of(node: torch.fx.Node) -> List[Optional[torch.Tensor]]:
    val = node.meta.get('val')
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (tuple, list)):
        return [v if isinstance(v, torch.Tensor) else None for v in val]
    return []


def axis_states(val: torch.Tensor, k: int, partial: bool = True) -> List[Placement]:
    states: List[Placement] = [Replicate()]
    states += [Shard(d) for d in range(val.dim()) if val.shape[d] % k == 0 and val.shape[d] >= k]
    if partial and val.is_floating_point():
        states.append(Partial())
    return states


@functools.lru_cache(maxsize=None)
def _axis_mesh(k: int) -> DeviceMesh:
    return DeviceMesh('cpu', torch.arange(k), _init_backend=False, _rank=0)


def _meta(val: torch.Tensor) -> TensorMeta:
    return TensorMeta(val.shape, val.stride(), val.dtype)


# ---------------------------------------------------------------------------- DTensor rules
def _dtensor_axis_rules(node: torch.fx.Node, k: int) -> Optional[List[Strategy]]:
    """Strategies of ``node`` on one mesh axis of size k from DTensor's propagation, or
    None when DTensor has no rule for the op."""
    prop = DTensor._op_dispatcher.sharding_propagator
    op = node.target
    slots = tensor_args(node)
    vals = [s.meta['val'] if s is not None else None for s in slots]
    options = [axis_states(v, k) if v is not None else [None] for v in vals]
    combos = list(itertools.product(*options))
    if len(combos) > MAX_COMBOS:   # many tensor inputs (cat of many): same state for all
        shared = [s for s in options[slots.index(next(x for x in slots if x is not None))]]
        combos = [tuple(st if v is not None else None for v in vals) for st in shared]
    mesh = _axis_mesh(k)
    flat, spec = torch.utils._pytree.tree_flatten((node.args, node.kwargs))
    found: List[Strategy] = []
    known = False
    for combo in combos:
        args = [DTensorSpec(mesh, (p,), _meta(v)) if v is not None else
                (a.meta.get('val') if isinstance(a, torch.fx.Node) else a)
                for a, v, p in zip(flat, vals, combo)]
        a, kw = torch.utils._pytree.tree_unflatten(args, spec)
        schema = OpSchema(op, tuple(a), kw, schema_info=prop.op_to_schema_info.get(op))
        try:
            out = prop.propagate_op_sharding_non_cached(schema)
        except NotImplementedError:
            return None
        except Exception:  # the rule rejects this combination outright
            continue
        known = True
        if not _keeps_inputs(out, combo):
            continue
        outs = _output_placements(out.output_spec)
        if outs is None:
            continue
        found.append(Strategy(tuple((p,) if p is not None else None for p in combo), outs))
    if not known:
        return None
    return found


def _keeps_inputs(out, combo) -> bool:
    """True when DTensor would run the op without moving any input."""
    if out.redistribute_schema is None:
        return True
    specs = [s for s in out.redistribute_schema.args_spec]
    given = [p for p in combo if p is not None]
    if len(specs) != len(given):
        return not out.needs_redistribute
    return all(s.placements[0] == p for s, p in zip(specs, given))


def _plain(p: Placement) -> bool:
    """Replicate, Shard or Partial exactly: strided shards (a split dim merged into a
    view) are left out, their redistribution is not reliable."""
    return type(p) in (Replicate, Shard, Partial)


def _output_placements(spec) -> Optional[Tuple[Placements, ...]]:
    specs = [spec] if isinstance(spec, DTensorSpec) else list(spec) \
        if isinstance(spec, (tuple, list)) else None
    if specs is None:
        return None
    outs = []
    for s in specs:
        if isinstance(s, DTensorSpec):
            if not _plain(s.placements[0]):
                return None
            outs.append((s.placements[0],))
        else:
            outs.append(None)
    return tuple(outs)


# ---------------------------------------------------------------------------- own rules
def _sdpa_rules(node: torch.fx.Node, k: int) -> List[Strategy]:
    """Attention on one axis: all replicated, batch split, or head split (q and kv heads
    both divisible). The mask follows its own batch/head dims (size-1 dims broadcast)."""
    slots = tensor_args(node)
    q, key = slots[0].meta['val'], slots[1].meta['val']
    rules = [Replicate()]
    if q.shape[0] % k == 0:
        rules.append(Shard(0))
    if q.dim() == 4 and q.shape[1] % k == 0 and key.shape[1] % k == 0:
        rules.append(Shard(1))
    out = []
    for p in rules:
        ins = []
        for i, s in enumerate(slots):
            if s is None:
                ins.append(None)
            elif i < 3:
                ins.append((p,))
            else:  # attention mask: split only where it is not broadcast
                m = s.meta['val']        # broadcast against q from the right
                md = p.dim - q.dim() + m.dim() if isinstance(p, Shard) else -1
                broadcast = md < 0 or m.shape[md] == 1
                ins.append((Replicate(),) if broadcast else (Shard(md),))
        out.append(Strategy(tuple(ins), ((p,),), local=True))
    return out


def _replicated(node: torch.fx.Node, k: int) -> List[Strategy]:
    slots = tensor_args(node)
    ins = tuple((Replicate(),) if s is not None else None for s in slots)
    outs = tuple((Replicate(),) if o is not None else None for o in outputs_of(node))
    return [Strategy(ins, outs, local=True)]


def strided_state(val: torch.Tensor, node: torch.fx.Node, k: int) -> List[Placement]:
    """``[_StridedShard(d, m)]`` when ``node`` is on a fused chain (``meta['fused']``) whose
    m pieces each split k ways, else ``[]``."""
    mark = node.meta.get('fused')
    if mark is None or val is None:
        return []
    d, m = mark
    return [_StridedShard(d, split_factor=m)] if val.shape[d] % (m * k) == 0 else []


def strided_rules(node: torch.fx.Node, k: int) -> List[Strategy]:
    """The strided strategies of a node on a fused chain (run on local shards): the chain's
    input arrives strided and the output leaves strided; a matmul's other operand is
    replicated; the split hands out its pieces as plain ``Shard``."""
    slots = tensor_args(node)
    split = node.meta.get('fused_split')
    if split is not None:
        d, m = split
        src = slots[0].meta['val']
        if src.shape[d] % (m * k):
            return []
        outs = tuple((Shard(d),) if o is not None else None for o in outputs_of(node))
        ins = ((_StridedShard(d, split_factor=m),),) + tuple(None for _ in slots[1:])
        return [Strategy(ins, outs, local=True)]
    out = strided_state(node.meta['val'], node, k)
    if not out:
        return []
    d, m = node.meta['fused']
    if node.target in MATMULS:
        *bias, a, w = slots
        ins = tuple((_StridedShard(0, split_factor=m),) for _ in bias) + \
            ((Replicate(),), (_StridedShard(1, split_factor=m),))
    elif node.target in TRANSPOSES:
        ins = ((_StridedShard(transposed_dim(node, d), split_factor=m),),) + \
            tuple(None for _ in slots[1:])
    elif node.target in FUSED_VIEWS:
        src = slots[0].meta['val']
        ins = ((_StridedShard(src.dim() - 1, split_factor=m),),) + \
            tuple(None for _ in slots[1:])
    else:
        return []
    return [Strategy(ins, ((out[0],),), local=True)]


VIEW_OPS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default,
            aten.expand.default, aten.squeeze.dims, aten.unsqueeze.default}
# DTensor's convolution handler rejects a dim sharded on two mesh axes ("hybrid sharding")
NOT_NESTED = VIEW_OPS | {aten.convolution.default}

OWN_RULES = {
    aten.scaled_dot_product_attention.default: _sdpa_rules,
}
FACTORY = {aten.arange.default, aten.arange.start, aten.arange.start_step, aten.full.default,
           aten.zeros.default, aten.ones.default, aten.empty.memory_format,
           aten.scalar_tensor.default}


# ---------------------------------------------------------------------------- per node
def _signature(node: torch.fx.Node):
    """What the strategies of ``node`` depend on: the op, tensor metadata, other args."""
    def key(a):
        if isinstance(a, torch.fx.Node):
            v = a.meta.get('val')
            return ('T', tuple(v.shape), tuple(v.stride()), v.dtype) \
                if isinstance(v, torch.Tensor) else ('N', repr(v))
        return repr(a)
    flat, spec = torch.utils._pytree.tree_flatten((node.args, node.kwargs))
    outs = tuple((tuple(o.shape), o.dtype) if o is not None else None for o in outputs_of(node))
    return (node.target, tuple(key(a) for a in flat), str(spec), outs,
            node.meta.get('fused'), node.meta.get('fused_split'))


_CACHE: Dict[tuple, Tuple[List[Strategy], bool]] = {}


def axis_strategies(node: torch.fx.Node, k: int) -> Tuple[List[Strategy], bool]:
    """(strategies on one axis of size k, whether a rule exists); cached by signature, so
    repeated blocks cost one enumeration."""
    key = (_signature(node), k)
    if key not in _CACHE:
        _CACHE[key] = _axis_strategies(node, k)
    return _CACHE[key]


def _axis_strategies(node: torch.fx.Node, k: int) -> Tuple[List[Strategy], bool]:
    rules, ruled = _plain_axis_strategies(node, k)
    local = [Strategy(ins, outs, local=True)
             for ins, outs in local_rules(node, k, tensor_args(node))]
    return rules + strided_rules(node, k) + local, ruled or bool(local)


def _plain_axis_strategies(node: torch.fx.Node, k: int) -> Tuple[List[Strategy], bool]:
    op = node.target
    if op in OWN_RULES:
        return OWN_RULES[op](node, k), True
    if not any(s is not None for s in tensor_args(node)):
        return _replicated(node, k), op in FACTORY or not outputs_of(node)
    rules = _dtensor_axis_rules(node, k)
    if not rules:
        return _replicated(node, k), rules is not None
    if not any(all(p is None or p[0] == Replicate() for p in r.inputs) for r in rules):
        rules = rules + _replicated(node, k)   # always keep a replicated way to run it
    return rules, True


def combine(per_axis: Sequence[List[Strategy]]) -> List[Strategy]:
    """The product of per-axis strategies: placements concatenated axis by axis."""
    out = []
    for parts in itertools.product(*per_axis):
        ins = tuple(None if parts[0].inputs[i] is None else
                    tuple(p.inputs[i][0] for p in parts) for i in range(len(parts[0].inputs)))
        outs = tuple(None if parts[0].outputs[i] is None else
                     tuple(p.outputs[i][0] for p in parts) for i in range(len(parts[0].outputs)))
        out.append(Strategy(ins, outs, local=any(p.local for p in parts)))
        if len(out) >= MAX_STRATEGIES:
            break
    return out


_NODE_CACHE: Dict[tuple, Tuple[List[Strategy], bool]] = {}


def node_strategies(node: torch.fx.Node, mesh_shape: Sequence[int]) -> Tuple[List[Strategy], bool]:
    """Every strategy of ``node`` on the mesh, and whether a rule (ours or DTensor's)
    covers its op; cached by signature and mesh, so repeated blocks cost one product."""
    key = (_signature(node), tuple(mesh_shape))
    if key not in _NODE_CACHE:
        _NODE_CACHE[key] = _node_strategies(node, mesh_shape)
    kept, ruled = _NODE_CACHE[key]
    return list(kept), ruled


def _node_strategies(node: torch.fx.Node, mesh_shape: Sequence[int]) -> Tuple[List[Strategy], bool]:
    per_axis, ruled = [], True
    for k in mesh_shape:
        rules, ok = axis_strategies(node, k)
        per_axis.append(rules)
        ruled = ruled and ok
    metas = [s.meta['val'] if s is not None else None for s in tensor_args(node)]
    outs = outputs_of(node)
    if len(mesh_shape) == 1:   # a rule may split a 0-d result (DTensor's sum over dim=[])
        return [st for st in per_axis[0]
                if not any(_splits_scalar(m, p) for m, p in zip(metas, st.inputs))
                and not any(_splits_scalar(m, p) for m, p in zip(outs, st.outputs))], ruled
    nested_ok = node.target not in NOT_NESTED
    kept = [st for st in combine(per_axis)
            if all(fits(m, p, mesh_shape, nested_ok) for m, p in zip(metas, st.inputs))
            and all(fits(m, p, mesh_shape, nested_ok) for m, p in zip(outs, st.outputs))]
    return kept, ruled


def _splits_scalar(val: Optional[torch.Tensor], placements: Optional[Placements]) -> bool:
    return (isinstance(val, torch.Tensor) and val.dim() == 0 and placements is not None
            and any(isinstance(p, Shard) for p in placements))


def fits(val: Optional[torch.Tensor], placements: Optional[Placements],
         mesh_shape: Sequence[int], nested_ok: bool = True) -> bool:
    """Whether every dim split over several mesh axes is divisible by their product (and,
    with ``nested_ok`` False, whether no dim is split over two axes at all)."""
    if val is None or placements is None:
        return True
    ways: Dict[int, List[int]] = {}
    for p, k in zip(placements, mesh_shape):
        if isinstance(p, _StridedShard):   # each of its pieces splits k ways, nothing nests
            d = p.dim % max(val.dim(), 1)
            if val.dim() == 0 or d in ways or val.shape[d] % (p.split_factor * k):
                return False
            ways[d] = [k, 0]
        elif isinstance(p, Shard):
            if val.dim() == 0:
                return False
            ways.setdefault(p.dim % val.dim(), []).append(k)
    for d, ks in ways.items():
        if 0 in ks:                        # a strided dim split on another axis too
            if len(ks) > 2:
                return False
            continue
        total = 1
        for k in ks:
            total *= k
        if val.shape[d] % total or (len(ks) > 1 and not nested_ok):
            return False
    return True


def placement_name(p: Placement) -> str:
    if isinstance(p, _StridedShard):
        return f'S{p.dim}:{p.split_factor}'
    if isinstance(p, Shard):
        return f'S{p.dim}'
    if isinstance(p, Partial):
        return 'P' if p.reduce_op == 'sum' else f'P{p.reduce_op}'
    return 'R'


def placement_from_name(name: str) -> Placement:
    if name == 'R':
        return Replicate()
    if name.startswith('P'):
        return Partial(name[1:] or 'sum')
    if name.startswith('S') and ':' in name:
        dim, pieces = name[1:].split(':')
        return _StridedShard(int(dim), split_factor=int(pieces))
    if name.startswith('S'):
        return Shard(int(name[1:]))
    raise ValueError(f'unknown placement {name!r}; expected R, S<dim>, S<dim>:<pieces> or '
                     f'P[op]')
