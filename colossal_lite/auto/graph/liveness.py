"""Per-rank memory of a plan: what one training step holds at its peak (docs/auto_graph.md §3).

**What autograd saves** (:func:`saved_tensors`). Each op is run once on fake tensors (its
inputs fresh leaves, requiring grad where the graph's do) under
``torch.autograd.graph.saved_tensors_hooks``: the hook sees exactly what the op's backward
keeps, matched to the op's tensor inputs (by slot), its outputs, or neither (an internal
result such as attention's log-sum-exp: its bytes). The same run tells which outputs alias
an input's storage (views). Cached by op and input metadata, so repeated blocks cost one run.

**The step** (:meth:`Liveness.peak`), per rank, ``P`` the local parameter bytes, ``s`` the
optimizer's states per element (2 for Adam)::

    peak = held + max(s P + J,          the forward and backward (the states of the previous step)
                      (s + 2) P,        end of the lowered step's backward: the program's gradients
                                        and the scaled copies it hands to autograd (lower.py),
                                        or the gradients and their bucket (buckets.py)
                      (s + 1) P + 3 p)  the optimizer step: gradients, states, AdamW's temporaries
                                        (3 of the largest local parameter, p)

``held`` is the local parameters, buffers, constants and inputs. ``J`` is the liveness peak
of the joint program, simulated op by op in graph order and then in reverse for the
backward, each storage counted once while anything holds it:

* forward: a matmul (``mm`` / ``addmm``) run on oneDNN (CPU, ``onednn.py``) holds its scratch
  (``onednn.scratch_bytes`` of the local contraction) for the call;
  an op's input that arrives elsewhere than its producer placed it is a new storage
  of the moved size (DTensor copies on every move; Shard(a) -> Shard(d) with ``d`` leading
  keeps the all_gather buffer, ``p`` times the moved size, of which the shard is a view); its
  outputs are new storages of ``bytes / shard ways`` (a view shares its input's); a value is
  freed after its last use unless saved; what the op saves stays until its backward;
* backward: an op's output gradient lives from its first consumer's backward to its own; the
  input gradients it makes are new storages at the input's placements, moved back to the
  producer's (a new storage) when the forward moved the input, accumulated per producer, and
  a parameter's gradient stays to the end.

**The solver's linear part** (:meth:`Liveness.node_memory`), per node and strategy: a
parameter ``s bytes / ways``, plus its weight when no op saves it (an op that saves it counts
it); a buffer, constant or input ``bytes / ways``; an op, the outputs and internal results it
saves at its output's ways, and each input it saves at its own placement of it (the moved
copy, or the producer's storage where nothing moves) unless the producer saves that output
itself. A per-node sum cannot see whether an edge moves (an unmoved input saved by several
consumers is counted by each, a moved parameter keeps its shard and the copy), nor the
backward's transients and the phases: ``api.search`` checks each solution's :meth:`peak`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from .onednn import MATMULS, ONEDNN_LINEAR, scratch_bytes
from .space import Space
from .strategies import outputs_of, tensor_args

ADAMW_TEMPORARIES = 3      # largest-parameter-sized temporaries of AdamW's per-tensor step


@dataclass(frozen=True)
class Saved:
    """What one op keeps for its backward and how its outputs alias its inputs."""
    inputs: Tuple[int, ...] = ()           # tensor slots saved
    outputs: Tuple[int, ...] = ()          # outputs saved
    other: Tuple[int, ...] = ()            # bytes (full tensors) of internal results saved
    aliases: Tuple[Optional[int], ...] = ()   # per output: the slot whose storage it shares
    grad: Tuple[bool, ...] = ()            # per output: requires grad


def _is_view_output(out, ins) -> Optional[int]:
    for k, t in enumerate(ins):
        if t is not None and out.untyped_storage()._cdata == t.untyped_storage()._cdata:
            return k
    return None


_CACHE: Dict[tuple, Saved] = {}


def _key(node: torch.fx.Node, slots, grads) -> tuple:
    flat, spec = torch.utils._pytree.tree_flatten((node.args, node.kwargs))
    parts = []
    for a, s in zip(flat, slots):
        if s is not None:
            v = s.meta['val']
            parts.append((tuple(v.shape), tuple(v.stride()), v.dtype))
        else:
            parts.append(repr(a.meta.get('val') if isinstance(a, torch.fx.Node) else a))
    return (node.target, tuple(parts), str(spec), tuple(grads))


def _probe(node: torch.fx.Node, slots, grads, mode: FakeTensorMode) -> Saved:
    flat, spec = torch.utils._pytree.tree_flatten((node.args, node.kwargs))
    metas = outputs_of(node)
    try:
        with mode:
            ins, values = [], []
            for a, s, g in zip(flat, slots, grads):
                if s is None:
                    values.append(a.meta.get('val') if isinstance(a, torch.fx.Node) else a)
                    ins.append(None)
                    continue
                v = s.meta['val']
                t = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device,
                                        requires_grad=g)
                ins.append(t)
                values.append(t)
            args, kwargs = torch.utils._pytree.tree_unflatten(values, spec)
            packed = []
            with torch.autograd.graph.saved_tensors_hooks(
                    lambda t: packed.append(t) or len(packed), lambda i: None):
                out = node.target(*args, **kwargs)
    except Exception:   # noqa: BLE001 -- no fake kernel: assume it saves every input
        return Saved(inputs=tuple(k for k, s in enumerate(slots) if s is not None),
                     aliases=tuple(None for _ in metas),
                     grad=tuple(any(grads) and m is not None and m.is_floating_point()
                                for m in metas))
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    saved_in, saved_out, other = set(), set(), []
    for p in packed:
        hit = next((('out', k) for k, o in enumerate(outs) if p is o), None)
        if hit is None:
            k = next((k for k, t in enumerate(ins) if t is not None and p is t), None)
            k = _is_view_output(p, ins) if k is None else k
            hit = ('in', k) if k is not None else None
        if hit is None:
            other.append(int(math.prod(p.shape)) * p.element_size())
        elif hit[0] == 'in':
            saved_in.add(hit[1])
        else:
            saved_out.add(hit[1])
    aliases = tuple(_is_view_output(o, ins) if isinstance(o, torch.Tensor) else None
                    for o in outs)
    return Saved(tuple(sorted(saved_in)), tuple(sorted(saved_out)), tuple(other), aliases,
                 tuple(isinstance(o, torch.Tensor) and o.requires_grad for o in outs))


def saved_tensors(space: Space) -> Dict[int, Saved]:
    """Per op decision, what its backward keeps (module doc); parameters require grad."""
    grad: Dict[Tuple[int, int], bool] = {}
    out: Dict[int, Saved] = {}
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    for i, d in enumerate(space.decisions):
        if d.kind != 'op':
            grad[(i, 0)] = d.kind == 'param' and d.node.meta['val'].is_floating_point()
            continue
        slots = tensor_args(d.node)
        grads = [bool(s is not None and d.producers[k] is not None
                      and grad.get(tuple(d.producers[k]), False)
                      and s.meta['val'].is_floating_point()) for k, s in enumerate(slots)]
        key = _key(d.node, slots, grads)
        if key not in _CACHE:
            _CACHE[key] = _probe(d.node, slots, grads, mode)
        saved = out[i] = _CACHE[key]
        for j, g in enumerate(saved.grad):
            grad[(i, j)] = g
    return out


def _nbytes(t: torch.Tensor) -> float:
    return float(math.prod(t.shape)) * t.element_size()


def _dim(name: str) -> int:
    return int(name[1:].split(':')[0])


class Liveness:
    """The memory model of a space on a mesh (module doc); placements by name per axis."""

    def __init__(self, space: Space, states: int = 2, all_to_all: bool = True,
                 onednn: bool = False):
        self.space = space
        self.states = states
        self.all_to_all = all_to_all
        self.onednn = onednn and ONEDNN_LINEAR is not None
        self.mesh = space.mesh_shape
        self.saved = saved_tensors(space)
        self._storage_roots()
        self._node_cache: Dict[tuple, List[float]] = {}

    # ------------------------------------------------------------------ helpers
    def ways(self, placements) -> int:
        """Shard ways: what one rank holds of a tensor is ``bytes / ways``."""
        w = 1
        for p, k in zip(placements, self.mesh):
            if p[0] == 'S':
                w *= k
        return w

    def moved(self, meta: torch.Tensor, src, dst) -> Tuple[float, bool]:
        """(bytes of the storage a value moved from ``src`` to ``dst`` lives in, whether it
        is still the source's): a move makes a new storage of the moved size, but without
        ``all_to_all`` (CPU process groups) Shard(a) -> Shard(d) with ``d`` leading keeps the
        all_gather buffer (``k`` times the moved size) whose chunk it is. Measured on
        DTensor's redistribute (gloo, tests/test_auto_graph_memory.py)."""
        local = list(meta.shape)
        now = list(src)
        for p, k in zip(now, self.mesh):
            if p[0] == 'S':
                local[_dim(p)] //= k
        cur = _nbytes(meta) / self.ways(now)
        store = None
        for axis in reversed(range(len(now))):
            s, d, k = now[axis], dst[axis], self.mesh[axis]
            if s == d or k == 1 or ':' in s or ':' in d:
                now[axis] = d
                continue
            if s[0] == 'S':
                local[_dim(s)] *= k
                cur *= k
            if d[0] == 'S':
                dim = _dim(d)
                lead = all(n == 1 for n in local[:dim])
                local[dim] //= k
                cur /= k
                store = cur * k if s[0] == 'S' and lead and not self.all_to_all else cur
            else:
                store = cur
            now[axis] = d
        return (cur, True) if store is None else (store, False)

    def _storage_roots(self) -> None:
        """``_root[(i, j)]``: the storage output j of decision i lives in (its producer's,
        through views); ``_self_saved``: roots their producer saves itself; ``_read``:
        roots some op saves."""
        self._root: Dict[Tuple[int, int], Tuple[int, int]] = {}
        self._self_saved, self._read = set(), set()
        for i, d in enumerate(self.space.decisions):
            if d.kind != 'op':
                self._root[(i, 0)] = (i, 0)
                continue
            sv = self.saved[i]
            for j, slot in enumerate(sv.aliases):
                pr = d.producers[slot] if slot is not None else None
                self._root[(i, j)] = (i, j) if pr is None else \
                    self._root.get(tuple(pr), tuple(pr))
            for j in sv.outputs:
                self._self_saved.add(self._root[(i, j)])
                self._read.add(self._root[(i, j)])
            for slot in sv.inputs:
                pr = d.producers[slot]
                if pr is not None:
                    self._read.add(self._root.get(tuple(pr), tuple(pr)))

    # ------------------------------------------------------------------ per node (linear)
    def node_memory(self, i: int, codes, shared: bool = True) -> List[float]:
        """Per strategy of decision i (``codes``: (input names per slot, output names per
        output) per strategy): its part of the linear sum (module doc). ``shared=False``
        also counts a saved input whose producer saves it itself (the conservative sum: as
        if every such input were moved). Cached by what it depends on, so repeated blocks
        cost one evaluation."""
        d = self.space.decisions[i]
        codes = tuple(codes)
        if d.kind != 'op':    # a parameter read by an op that saves it is counted there
            factor = int((i, 0) not in self._read) + (self.states if d.kind == 'param' else 0)
            b = _nbytes(d.node.meta['val'])
            return [factor * b / self.ways(outs[0]) for _, outs in codes]
        sv = self.saved[i]
        outs_b = tuple(_nbytes(m) if m is not None and sv.aliases[j] is None else 0.0
                       for j, m in enumerate(outputs_of(d.node)))
        slots = tensor_args(d.node)
        ins_b = []
        for k in sv.inputs:
            pr = d.producers[k]
            if pr is None or shared and self._root.get(tuple(pr), tuple(pr)) in self._self_saved:
                continue
            ins_b.append((k, _nbytes(slots[k].meta['val'])))
        key = (sv, outs_b, tuple(ins_b), codes)
        hit = self._node_cache.get(key)
        if hit is None:
            hit = self._node_cache[key] = [self._node_bytes(sv, outs_b, ins_b, ins, outs)
                                           for ins, outs in codes]
        return hit

    def _node_bytes(self, sv: Saved, outs_b, ins_b, ins, outs) -> float:
        rep = ('R',) * len(self.mesh)
        out0 = outs[0] if outs and outs[0] is not None else rep
        total = sum(b / self.ways(out0) for b in sv.other)
        total += sum(outs_b[j] / self.ways(outs[j] or rep) for j in sv.outputs)
        return total + sum(b / self.ways(ins[k] or rep) for k, b in ins_b)

    # ------------------------------------------------------------------ per plan
    def peak(self, chosen) -> Dict[str, float]:
        """The step's peak of one plan (module doc). ``chosen[i]``: (input names per slot,
        output names per output) of decision i's strategy. Returns the peak and its parts:
        ``held``, ``params`` (P), ``joint`` (J), ``phase`` (which term is the largest)."""
        space, rep = self.space, ('R',) * len(self.mesh)
        size: List[float] = []
        refs: List[int] = []
        live = [0.0, 0.0]          # now, peak

        def new(b: float) -> int:
            size.append(b)
            refs.append(0)
            return len(size) - 1

        def hold(s: int) -> None:
            if refs[s] == 0:
                live[0] += size[s]
                live[1] = max(live[1], live[0])
            refs[s] += 1

        def drop(s: int) -> None:
            refs[s] -= 1
            if refs[s] == 0:
                live[0] -= size[s]

        held = params = largest = 0.0
        storage: Dict[Tuple[int, int], int] = {}
        last: Dict[Tuple[int, int], int] = {}
        for i, d in enumerate(space.decisions):
            if d.kind != 'op':
                b = _nbytes(d.node.meta['val']) / self.ways(chosen[i][1][0])
                storage[(i, 0)] = new(b)      # held: outside J, pinned (never counted there)
                refs[-1] = 1
                held += b
                if d.kind == 'param':
                    params += b
                    largest = max(largest, b)
                continue
            for pr in d.producers:
                if pr is not None:
                    last[tuple(pr)] = i
        ops = [i for i, d in enumerate(space.decisions) if d.kind == 'op']
        saved_by: Dict[int, List[int]] = {}
        moved_in: Dict[int, list] = {}
        for i in ops:                                             # forward
            d, sv = space.decisions[i], self.saved[i]
            ins, outs = chosen[i]
            args, temps = [], []
            for slot, pr in enumerate(d.producers):
                if pr is None:
                    args.append(None)
                    continue
                pr = tuple(pr)
                sid = storage[pr]
                src, dst = chosen[pr[0]][1][pr[1]], ins[slot]
                if dst is not None and src is not None and tuple(dst) != tuple(src):
                    b, same = self.moved(space.output_meta(*pr), src, dst)
                    if not same:
                        sid = new(b)
                        hold(sid)
                        temps.append(sid)
                args.append(sid)
            moved_in[i] = [a is not None and a in temps for a in args]
            metas = outputs_of(d.node)
            for j, m in enumerate(metas):
                if m is None:
                    continue
                slot = sv.aliases[j] if j < len(sv.aliases) else None
                if slot is not None and args[slot] is not None:
                    sid = args[slot]
                else:
                    sid = new(_nbytes(m) / self.ways(outs[j] if j < len(outs) and outs[j]
                                                      else rep))
                storage[(i, j)] = sid
                hold(sid)
            if self.onednn and d.node.target in MATMULS:
                scratch = new(self._scratch(d.node, ins))
                hold(scratch)
                drop(scratch)
            keep = [args[k] for k in sv.inputs if args[k] is not None]
            keep += [storage[(i, j)] for j in sv.outputs if (i, j) in storage]
            out0 = outs[0] if outs and outs[0] is not None else rep
            keep += [new(b / self.ways(out0)) for b in sv.other]
            saved_by[i] = keep
            for s in keep:
                hold(s)
            for s in temps:
                drop(s)
            for pr in {tuple(p) for p in d.producers if p is not None}:   # last uses
                if last.get(pr) == i and space.decisions[pr[0]].kind == 'op':
                    drop(storage[pr])
            for j in range(len(metas)):
                if (i, j) in storage and (i, j) not in last:
                    drop(storage[(i, j)])
        forward_end = live[0]
        grads: Dict[Tuple[int, int], int] = {}
        for i in reversed(ops):                                   # backward
            d, sv = space.decisions[i], self.saved[i]
            ins, _ = chosen[i]
            gout = [grads.pop((i, j)) for j in range(len(sv.grad)) if (i, j) in grads]
            made = []
            if any(sv.grad):
                for slot, pr in enumerate(d.producers):
                    if pr is None or not self._requires_grad(tuple(pr)):
                        continue
                    if slot in sv.aliases and gout:
                        g = gout[0]
                        refs[g] += 1          # a view of the output's gradient
                    else:
                        meta = space.output_meta(*pr)
                        g = new(_nbytes(meta) / self.ways(ins[slot] or rep))
                        hold(g)
                    made.append((tuple(pr), slot, g))
            for s in saved_by.pop(i, ()):
                drop(s)
            for g in gout:
                drop(g)
            for pr, slot, g in made:
                src = chosen[pr[0]][1][pr[1]]
                if moved_in[i][slot]:                   # back to the producer's placements
                    g2 = new(_nbytes(space.output_meta(*pr)) / self.ways(src))
                    hold(g2)
                    drop(g)
                    g = g2
                if pr in grads:                         # accumulated into the first
                    drop(g)
                else:
                    grads[pr] = g
        joint = live[1]
        s = self.states
        phases = {'forward/backward': s * params + joint, 'lowered backward': (s + 2) * params,
                  'optimizer': (s + 1) * params + ADAMW_TEMPORARIES * largest}
        phase = max(phases, key=phases.get)
        return {'peak': held + phases[phase], 'held': held, 'params': params, 'joint': joint,
                'forward_end': forward_end, 'phase': phase}

    def _scratch(self, node: torch.fx.Node, ins) -> float:
        """oneDNN's scratch for a matmul whose first operand (``mm``'s slot 0, ``addmm``'s
        slot 1) arrives at ``ins``: by its local contraction."""
        slot = 1 if node.target is MATMULS[1] else 0
        contraction = tensor_args(node)[slot].meta['val'].shape[-1]
        for name, k in zip(ins[slot] or (), self.mesh):
            if name[0] == 'S' and _dim(name) == 1:
                contraction //= k
        return float(scratch_bytes(contraction))

    def _requires_grad(self, pr: Tuple[int, int]) -> bool:
        d = self.space.decisions[pr[0]]
        if d.kind != 'op':
            return d.kind == 'param' and d.node.meta['val'].is_floating_point()
        g = self.saved[pr[0]].grad
        return pr[1] < len(g) and g[pr[1]]
