"""Capture a deep model by tracing two of its repeated blocks and stamping the others.

``torch.export`` and its decomposition cost time per traced op: about 0.3 s per layer at
Llama-3-8B shapes, so 32 layers take ~8 s before any search. A model that holds a list
(``nn.ModuleList`` / ``nn.Sequential``) whose blocks from ``s`` on (s = 0, or 1 where block 0
differs: T5's holds the relative-position bias) are N - s >= ``MIN_BLOCKS`` modules of one
class with the same parameter and buffer names, shapes and dtypes is captured instead as
follows ("block 0" and "block 1" are blocks s and s + 1; what earlier blocks make or hold is
read like a value from before the blocks):

1. **proof of sameness** -- one forward on fake tensors (``functional_call`` with fake
   stand-ins of every parameter and buffer under ``FakeTensorMode``: the model's own tensors
   are not touched, nothing is computed, no RNG is drawn) logs every ATen op with, per
   tensor argument, its shape, dtype and origin: an op of the same block, of the block d
   before, a parameter of block j - d, or one tensor shared by all. Blocks 1..N-1 must give
   the same log, nothing may run between two of them, and the ops after the blocks may read
   no block but the last;
2. **trace** -- ``torch.export`` of the model with each such list cut after block 1;
3. **stamp** -- block 1's nodes are copied N-2 times after it. In copy j a read of a block-0
   node (the value carried into block 1, e.g. the residual stream) becomes a read of copy
   j-1's counterpart of that node's block-1 twin; block 1's parameters and buffers become new
   placeholders for block j's; reads of anything before the blocks (rotary tables, masks)
   stay; the nodes after the blocks read the last copy.

The stamped graph runs the ops a full trace runs, in the same order, on the same shapes (the
tests compare both, and the loss they compute, bit for bit). Node names differ from a full
trace's, so a :class:`~colossal_lite.auto.graph.plan.Plan` applies to the capture mode that
made it (its fingerprint says which). Any check that fails -- blocks that read other values
though they run the same ops (Qwen2's sliding window from block 2 on), ops that differ per
block, shared parameters, data-dependent ops fake tensors cannot run, a block-0 value read
after the blocks -- gives the full trace, unchanged.
"""
from __future__ import annotations

import re
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

MIN_BLOCKS = 4          # fewer blocks save at most one block's trace: not worth a check


@dataclass
class Repeated:
    """A list of ``count`` blocks at ``fqn`` (relative to the model), identical from block
    ``start`` on (T5's block 0 alone holds the relative-position bias)."""

    fqn: str
    module: nn.Module
    count: int
    start: int = 0


def _signature(block: nn.Module) -> tuple:
    return (type(block),
            tuple((n, tuple(p.shape), p.dtype) for n, p in block.named_parameters()),
            tuple((n, tuple(b.shape), b.dtype) for n, b in block.named_buffers()))


def repeated_lists(model: nn.Module) -> List[Repeated]:
    """The outermost lists whose blocks from ``start`` (0 or 1) on are >= MIN_BLOCKS of one
    signature, no parameter shared among them."""
    found: List[Repeated] = []
    for fqn, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) \
                or any(fqn.startswith(r.fqn + '.') for r in found):
            continue
        for start in (0, 1):
            blocks = list(module)[start:]
            if len(blocks) < MIN_BLOCKS or len({_signature(b) for b in blocks}) != 1 \
                    or not list(blocks[0].parameters()):
                continue
            ids = [id(p) for b in blocks for p in b.parameters()]
            if len(ids) == len(set(ids)):
                found.append(Repeated(fqn, module, len(module), start))
                break
    return found


class _T(NamedTuple):
    """A tensor argument in the op log."""
    producer: tuple
    shape: tuple
    dtype: torch.dtype


class _OpLog(TorchDispatchMode):
    """Every ATen op as ``(func, args)``: a tensor argument is ``(producer, shape, dtype)``
    with ``producer`` the ``(op index, output index)`` that made it, or ``('leaf', id)`` for a
    tensor no logged op made (an input, a parameter); any other argument as it is. Every
    tensor is kept alive, so no id is reused."""

    def __init__(self):
        super().__init__()
        self.ops: List[tuple] = []
        self._producer: Dict[int, tuple] = {}
        self._alive: List[torch.Tensor] = []

    def _arg(self, a):
        if not isinstance(a, torch.Tensor):
            return a
        return _T(self._producer.get(id(a), ('leaf', id(a))), tuple(a.shape), a.dtype)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        self.ops.append((func, tuple(self._arg(a) for a in flat)))
        out = func(*args, **kwargs)
        for k, t in enumerate(tree_flatten(out)[0]):
            if isinstance(t, torch.Tensor):
                self._producer[id(t)] = (len(self.ops) - 1, k)
                self._alive.append(t)
        return out


def _block_view(log: _OpLog, spans: List[Tuple[int, int]], j: int, leaves: Dict[int, tuple],
                first: int = 0):
    """Block j's ops with each tensor argument named relative to the block: made inside it
    (``('in', op, k)``), by the block ``d`` before (``('back', d, op, k)``, op relative to that
    block), a parameter of block ``j - d`` (``('param', d, name)``) or the same tensor for all
    blocks (``('shared', producer)``): anything from before the blocks or from, or of, a block
    before ``first`` (T5's block 0 makes the position bias every later block reads)."""
    def where(producer):
        if producer[0] == 'leaf':
            owner = leaves.get(producer[1])
            return ('param', j - owner[0], owner[1]) if owner and owner[0] >= first \
                else ('shared', producer)
        op, k = producer
        for b, (start, stop) in enumerate(spans):
            if start <= op < stop and b >= first:
                return ('in', op - start, k) if b == j else ('back', j - b, op - start, k)
        return ('shared', producer)

    start, stop = spans[j]
    return [(func, tuple(a._replace(producer=where(a.producer)) if isinstance(a, _T) else a
                         for a in args))
            for func, args in log.ops[start:stop]]


def blocks_run_alike(root: nn.Module, inputs: Sequence[torch.Tensor],
                     lists: List[Repeated]) -> bool:
    """Step 1 of the module doc: blocks s+1..N-1 of every list (s its ``start``) compute
    one function -- the
    same ops on the same shapes, reading their own op's outputs, the block before's, their
    own parameters and the same shared tensors -- with no op between two blocks, and the ops
    after the blocks read no block but the last. False when the fake forward cannot run."""
    spans: Dict[int, List[List[int]]] = {id(r.module): [] for r in lists}
    log = _OpLog()
    handles = []
    for r in lists:
        for block in r.module:
            handles.append(block.register_forward_pre_hook(
                lambda *_, s=spans[id(r.module)]: s.append([len(log.ops), None])))
            handles.append(block.register_forward_hook(
                lambda *_, s=spans[id(r.module)]: s[-1].__setitem__(1, len(log.ops))))
    fake = FakeTensorMode(allow_non_fake_inputs=False)
    to_fake = lambda t: fake.from_tensor(t) if isinstance(t, torch.Tensor) else t  # noqa: E731
    state = {k: to_fake(v) for k, v in list(root.named_parameters(remove_duplicate=False))
             + list(root.named_buffers(remove_duplicate=False))}
    try:
        with fake, torch.no_grad(), log:
            torch.func.functional_call(root, state, tree_map(to_fake, tuple(inputs)),
                                       tie_weights=False)
    except Exception:  # noqa: BLE001 - a model fake tensors cannot run is traced whole
        return False
    finally:
        for h in handles:
            h.remove()
    names = {id(v): k for k, v in state.items()}
    for r in lists:
        s = [tuple(span) for span in spans[id(r.module)]]
        if len(s) != r.count or any(b is None for _, b in s):
            return False                       # a block ran twice, or not at all
        first = r.start
        if any(b != c for (_, b), (c, _) in zip(s[first:], s[first + 1:])):
            return False                       # something ran between two blocks
        prefix = re.compile(r'(?:.*\.)?' + re.escape(r.fqn) + r'\.(\d+)\.(.+)$')
        leaves = {}
        for tid, name in names.items():
            m = prefix.match(name)
            if m:
                leaves[tid] = (int(m.group(1)), m.group(2))
        template = _block_view(log, s, first + 1, leaves, first)
        if any(_block_view(log, s, j, leaves, first) != template
               for j in range(first + 2, r.count)):
            return False
        last_start, last_stop = s[-1]
        for func, args in log.ops[last_stop:]:
            for a in args:
                if isinstance(a, _T) and a.producer[0] != 'leaf' \
                        and s[0][0] <= a.producer[0] < last_start:
                    return False               # read after the blocks from an earlier block
    return True


@contextmanager
def cut_after_template(lists: List[Repeated]):
    """Each list holds only its blocks up to ``start + 1`` inside the ``with``."""
    saved = [r.module._modules for r in lists]
    try:
        for r in lists:
            r.module._modules = OrderedDict(list(r.module._modules.items())[:r.start + 2])
        yield
    finally:
        for r, modules in zip(lists, saved):
            r.module._modules = modules


class NotStampable(Exception):
    """The two-block graph does not have the shape stamping needs (the module doc)."""


def _block_of(node: torch.fx.Node, prefix: str) -> Optional[int]:
    """The index of the block of list ``prefix`` (an export-root path) running ``node``."""
    for path, _ in (node.meta.get('nn_module_stack') or {}).values():
        if path == prefix or not path.startswith(prefix + '.'):
            continue
        head = path[len(prefix) + 1:].split('.')[0]
        if head.isdigit():
            return int(head)
    return None


def _renumber(meta: dict, prefix: str, i: int, j: int) -> dict:
    """A copy of ``meta`` whose module paths under ``prefix.i`` name ``prefix.j``."""
    meta = dict(meta)
    old = re.compile(re.escape(prefix) + rf'\.{i}(?=\.|$)')
    stack = meta.get('nn_module_stack')
    if stack:
        meta['nn_module_stack'] = {old.sub(f'{prefix}.{j}', k): (old.sub(f'{prefix}.{j}', p), t)
                                   for k, (p, t) in stack.items()}
    return meta


def stamp(gm: torch.fx.GraphModule, inputs: List[tuple], fqn: str, count: int, start: int = 0,
          root_prefix: str = 'model') -> List[tuple]:
    """Step 3 of the module doc on the graph of the list at ``fqn`` (a model fqn) cut after
    block ``start + 1``: "block 0" and "block 1" there are blocks ``start`` and ``start + 1``,
    and anything of earlier blocks is read like a value from before the blocks.
    ``root_prefix`` is the export root's name for the model. Returns the new placeholder
    table (``Captured.inputs``); raises :class:`NotStampable`."""
    first, second = start, start + 1
    graph = gm.graph
    prefix = f'{root_prefix}.{fqn}' if fqn else root_prefix
    placeholders = [n for n in graph.nodes if n.op == 'placeholder']
    spec = dict(zip(placeholders, inputs))
    param_of = {}                                    # placeholder -> (block, rest of fqn)
    pattern = re.compile(re.escape(fqn) + r'\.(\d+)\.(.+)$')
    for node, (kind, source) in spec.items():
        m = pattern.match(source) if kind in ('param', 'buffer') else None
        if m:
            param_of[node] = (int(m.group(1)), m.group(2))
    ops = [n for n in graph.nodes if n.op not in ('placeholder', 'output')]
    where = [_block_of(n, prefix) for n in ops]
    b0 = [n for n, w in zip(ops, where) if w == first]
    b1 = [n for n, w in zip(ops, where) if w == second]
    if not b0 or len(b0) != len(b1):
        raise NotStampable(f'blocks {first} and {second} of {fqn} have {len(b0)} and '
                           f'{len(b1)} nodes')
    start = ops.index(b0[0])
    if ops[start:start + 2 * len(b0)] != b0 + b1:
        raise NotStampable(f'the nodes of blocks {first} and {second} of {fqn} are not '
                           f'contiguous')
    twin = dict(zip(b0, b1))                         # block-0 node -> its block-1 twin
    in_b0, in_b1 = set(b0), set(b1)
    param_twin = {}
    by_rest = {(blk, rest): node for node, (blk, rest) in param_of.items()}
    for node, (blk, rest) in param_of.items():
        if blk == first:
            if (second, rest) not in by_rest:
                raise NotStampable(f'{fqn}.{second} has no twin of {fqn}.{first}.{rest}')
            param_twin[node] = by_rest[(second, rest)]
    for a, b in zip(b0, b1):
        if a.target != b.target or a.op != b.op:
            raise NotStampable(f'{a.name} and {b.name} differ ({a.target} / {b.target})')
        fa, _ = tree_flatten((a.args, a.kwargs))
        fb, _ = tree_flatten((b.args, b.kwargs))
        if len(fa) != len(fb):
            raise NotStampable(f'{a.name} and {b.name} take different arguments')
        for x, y in zip(fa, fb):
            if y in in_b1 and twin.get(x) is y:
                continue                             # inside the block
            if y in in_b0 and isinstance(x, torch.fx.Node) and x not in in_b0 \
                    and x not in in_b1:
                continue                             # carried in: block 0's input, 0's output
            if isinstance(x, torch.fx.Node) and param_twin.get(x) is y:
                continue                             # the block's own parameter
            if x is y or (not isinstance(x, torch.fx.Node) and not isinstance(y, torch.fx.Node)
                          and type(x) is type(y) and x == y):
                continue                             # shared: from before the blocks
            raise NotStampable(f'{b.name} reads {y} where {a.name} reads {x}')
    after = ops[start + 2 * len(b0):]
    for n in after:
        if any(isinstance(x, torch.fx.Node) and x in in_b0 for x in n.all_input_nodes):
            raise NotStampable(f'{n.name} after the blocks reads block {first} of {fqn}')
    # the copies
    b1_params = [n for n, (blk, _) in param_of.items() if blk == second]
    insert_after = max(b1_params, key=placeholders.index) if b1_params else None
    new_spec = dict(spec)
    previous = {n: n for n in b1}                    # copy j-1's node for each block-1 node
    anchor = b1[-1]
    post_users = {n: [u for u in n.users if u not in in_b1] for n in b1}
    for j in range(second + 1, count):
        params = {}
        for p in b1_params:
            kind, _ = spec[p]
            source = f'{fqn}.{j}.{param_of[p][1]}'
            with graph.inserting_after(insert_after):
                new = graph.placeholder(re.sub(r'\W', '_', f'{kind[0]}_{root_prefix}_{source}'))
            new.meta = dict(p.meta)
            new_spec[new] = (kind, source)
            insert_after = params[p] = new
        current: Dict[torch.fx.Node, torch.fx.Node] = {}

        def arg(x, current=current, params=params, previous=previous):
            if x in current:
                return current[x]
            if x in params:
                return params[x]
            if x in twin:                            # carried from the block before
                return previous[twin[x]]
            return x

        for n in b1:
            with graph.inserting_after(anchor):
                new = graph.node_copy(n, arg)
            new.meta = _renumber(n.meta, prefix, second, j)
            current[n] = anchor = new
        previous = current
    for n, users in post_users.items():
        for u in users:
            if u not in in_b1:
                u.replace_input_with(n, previous[n])
    graph.lint()
    gm.recompile()
    return [new_spec[n] for n in graph.nodes if n.op == 'placeholder']


def capture_stamped(export: Callable[[], tuple], root: nn.Module, model: nn.Module,
                    inputs: Sequence[torch.Tensor]) -> Optional[Tuple[tuple, List[str]]]:
    """``(export() result, the stamped lists' fqns)``: ``export`` -- which returns
    ``(graph_module, placeholder table, *rest)`` of ``root``, whose submodule ``model`` is
    the user's -- run under :func:`cut_after_template`, its graph stamped. None where the module doc
    says the full trace is taken."""
    lists = repeated_lists(model)
    if not lists or not blocks_run_alike(root, inputs, lists):
        return None
    with cut_after_template(lists):
        gm, table, *rest = export()
    try:
        for r in lists:
            table = stamp(gm, table, r.fqn, r.count, r.start)
    except NotStampable:
        return None
    return (gm, table, *rest), [r.fqn for r in lists]
