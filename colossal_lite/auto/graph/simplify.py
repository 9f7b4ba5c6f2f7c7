"""Simplifications of a lowered per-rank program (``lower.py``): calls DTensor's wrapping
leaves in the trace that compute nothing the program needs.

The program is a functional graph run without autograd (no op writes into a tensor: checked,
the passes do nothing otherwise), so a value is only ever read and two values with the same
shape, dtype and strides are interchangeable:

* :func:`drop_identity_views`: ``view`` / ``_unsafe_view`` / ``detach`` / ``alias`` /
  ``clone`` whose output has its input's shape, dtype and strides reads as its input (about
  half the calls of a traced program are such views; the clones come from redistributions).
  Except a copy of a part of a larger tensor (DTensor's chunk of a replicated or gathered
  value) that the backward reads: the copy lets the larger buffer go while the value waits
  for the backward, as the memory model (liveness.py) counts it; without the copy a rank
  holds ``k`` times the bytes of each such saved value.
* :func:`localize_constant_chunks`: ``split(full(global shape, c))[k]`` (DTensor allocating a
  sharded constant, e.g. the zeros the gather's backward scatters into, at its global shape
  and keeping this rank's chunk) becomes ``full(chunk shape, c)``: 1/t of the fill.

:func:`simplify` runs both and removes the dead calls.
"""
from __future__ import annotations

import operator
from typing import Optional

import torch

aten = torch.ops.aten

_ALIASES = (aten.view.default, aten._unsafe_view.default, aten.detach.default,
            aten.alias.default, aten.clone.default)

# constant factories: (op, position of the fill value in args, or the value itself)
_FACTORIES = {aten.new_zeros.default: 0.0, aten.zeros.default: 0.0,
              aten.new_ones.default: 1.0, aten.ones.default: 1.0,
              aten.full.default: ('arg', 1), aten.new_full.default: ('arg', 2)}
_CHUNKS = (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default)
_PARTS = (aten.slice.Tensor, aten.narrow.default, aten.select.int, aten.as_strided.default)
# views that keep every element of their input
_WHOLE_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.detach.default,
                aten.alias.default, aten.unsqueeze.default, aten.squeeze.dim,
                aten.squeeze.dims, aten.permute.default, aten.transpose.int, aten.t.default,
                aten.expand.default)


def _writes(graph: torch.fx.Graph) -> bool:
    """Whether any call of ``graph`` writes into one of its arguments."""
    return any(node.op == 'call_function' and isinstance(node.target, torch._ops.OpOverload)
               and node.target._schema.is_mutable for node in graph.nodes)


def _val(node):
    value = getattr(node, 'meta', {}).get('val')
    return value if isinstance(value, torch.Tensor) else None


def _part_of_larger(node) -> bool:
    """Whether ``node``'s value is a view of a part of a larger tensor (a chunk, a slice),
    seen through views that keep every element."""
    while isinstance(node, torch.fx.Node) and node.op == 'call_function':
        if node.target is operator.getitem:
            return getattr(node.args[0], 'target', None) in _CHUNKS
        if node.target in _PARTS:
            return True
        if node.target not in _WHOLE_VIEWS:
            return False
        node = node.args[0]
    return False


def _last_read(node: torch.fx.Node, position) -> int:
    """Position of the last call reading ``node``'s value, through views of it."""
    last = position[node]
    for user in node.users:
        last = max(last, _last_read(user, position) if user.target in _WHOLE_VIEWS
                   else position[user])
    return last


def _outlives(copy: torch.fx.Node, boundary, position, end: int) -> bool:
    """Whether a copy is read across the forward's end, or returned (the program's
    gradients live on after it); without a boundary, always."""
    last = _last_read(copy, position)
    return boundary is None or last >= end or \
        position[copy] <= position[boundary] < last


def forward_end(graph: torch.fx.Graph) -> Optional[torch.fx.Node]:
    """The call that makes a joint program's loss, its first output (seen through
    ``detach`` and views): every call after it belongs to the backward."""
    output = next((n for n in graph.nodes if n.op == 'output'), None)
    leaves = torch.utils._pytree.tree_leaves(output.args) if output is not None else []
    node = leaves[0] if leaves else None
    while isinstance(node, torch.fx.Node) and node.target in _WHOLE_VIEWS:
        node = node.args[0]
    return node if isinstance(node, torch.fx.Node) and node.op == 'call_function' else None


def drop_identity_views(graph: torch.fx.Graph,
                        boundary: Optional[torch.fx.Node] = None) -> int:
    """Replace each identity view / detach / clone by its input (module doc); returns how
    many. ``boundary``: the call ending the forward (:func:`forward_end`); a copy of a part
    of a larger tensor is dropped only when the backward does not read it (if made in the
    forward) and the program does not return it (without a boundary such copies are all
    kept). Nothing is dropped from a graph that writes in
    place."""
    if _writes(graph):
        return 0
    position = {n: k for k, n in enumerate(graph.nodes)}
    end = len(position) - 1             # the output
    dropped = 0
    for node in list(graph.nodes):
        if node.op != 'call_function' or node.target not in _ALIASES:
            continue
        out, given = _val(node), _val(node.args[0])
        if out is None or given is None:
            continue
        if (out.shape, out.dtype, out.stride()) != (given.shape, given.dtype, given.stride()):
            continue
        if node.target is aten.clone.default and _part_of_larger(node.args[0]) and \
                _outlives(node, boundary, position, end):
            continue
        node.replace_all_uses_with(node.args[0])
        graph.erase_node(node)
        dropped += 1
    return dropped


def _fill_value(node):
    kind = _FACTORIES[node.target]
    if isinstance(kind, tuple):
        return node.args[kind[1]]
    return kind


def localize_constant_chunks(graph: torch.fx.Graph) -> int:
    """Allocate each chunk of a constant factory at the chunk's own shape (module doc);
    returns how many chunks. A chunk that is not contiguous is left alone."""
    if _writes(graph):
        return 0
    done = 0
    for node in list(graph.nodes):
        if node.op != 'call_function' or node.target is not operator.getitem or not node.users:
            continue
        parts = node.args[0]
        if getattr(parts, 'target', None) not in _CHUNKS:
            continue
        source = parts.args[0]
        if getattr(source, 'target', None) not in _FACTORIES:
            continue
        chunk = _val(node)
        if chunk is None or not chunk.is_contiguous():
            continue
        with graph.inserting_before(node):
            local = graph.call_function(
                aten.full.default, (list(chunk.shape), _fill_value(source)),
                {'dtype': chunk.dtype, 'layout': torch.strided, 'device': chunk.device,
                 'pin_memory': False})
        local.meta['val'] = chunk
        node.replace_all_uses_with(local)
        graph.erase_node(node)
        done += 1
    return done


def simplify(graph: torch.fx.Graph, boundary: Optional[torch.fx.Node] = None) -> dict:
    """Both passes, then dead-code elimination; returns what each did. ``boundary``: see
    :func:`drop_identity_views`."""
    counts = {'constant_chunks': localize_constant_chunks(graph),
              'identity_views': drop_identity_views(graph, boundary)}
    graph.eliminate_dead_code()
    return counts
