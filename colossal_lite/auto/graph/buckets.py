"""One all_reduce for the parameter gradients of a lowered program, as data parallelism does.

A plan that splits the batch (or any work a parameter's consumer splits) leaves that
parameter's gradient ``Partial`` on the axis, and the step reduces it at the edge
(``execute._GradToPlacement``): one all_reduce per parameter, each paying the collective's
latency (gloo, 4 CPU ranks: 4 ms a call, against 1.7 ns a byte). Our hand data parallelism
(``engine.GradientReducer``) and DDP bucket them.

:func:`bucket_gradient_all_reduces` rewrites a lowered program (``lower.py``) so that every
all_reduce whose result is only a returned gradient joins one bucket per (process group,
reduce op, dtype): the tensors are flattened into one buffer, reduced by one all_reduce where
the last of them was, and each gradient is returned as its slice of the result::

    g_i -> all_reduce(g_i) -> wait -> out_i      becomes
    cat([g_1.reshape(-1), ...]) -> all_reduce_ -> wait -> split(sizes) -> view(shape_i) -> out_i

The bucket is reduced in place (``all_reduce_``): the flat buffer is the program's own, read
by nothing else, so the functional all_reduce's copy of it is saved.

The bytes are the same; the calls drop from one per parameter to one per bucket. On gloo the
collectives are synchronous, so moving the earlier ones to the last one's place delays no
overlap. The cost model prices these reductions by bandwidth alone (``cost.py``).
"""
from __future__ import annotations

import operator
from collections import defaultdict
from typing import Dict, List, Tuple

import torch

aten = torch.ops.aten
_ALL_REDUCE = torch.ops._c10d_functional.all_reduce.default
_ALL_REDUCE_IN_PLACE = torch.ops._c10d_functional.all_reduce_.default
_WAIT = torch.ops._c10d_functional.wait_tensor.default


def _returned_reductions(graph: torch.fx.Graph) -> Dict[tuple, List[Tuple[torch.fx.Node, torch.fx.Node]]]:
    """``(group, op, dtype) -> [(all_reduce, wait), ...]`` in program order, for the
    all_reduces whose waited result the program only returns."""
    output = next(n for n in graph.nodes if n.op == 'output')
    found: Dict[tuple, list] = defaultdict(list)
    for node in graph.nodes:
        if node.op != 'call_function' or node.target is not _ALL_REDUCE:
            continue
        users = list(node.users)
        if len(users) != 1 or users[0].target is not _WAIT:
            continue
        wait = users[0]
        if set(wait.users) != {output}:
            continue
        value = node.args[0].meta.get('val') if isinstance(node.args[0], torch.fx.Node) else None
        if not isinstance(value, torch.Tensor):
            continue
        found[(node.args[2], node.args[1], value.dtype)].append((node, wait))
    return found


def bucket_gradient_all_reduces(graph: torch.fx.Graph) -> int:
    """Rewrite the returned gradients' all_reduces into one per bucket (module doc); returns
    how many all_reduces were merged away."""
    merged = 0
    for (group, op, dtype), items in _returned_reductions(graph).items():
        if len(items) < 2:
            continue
        values = [reduce.args[0] for reduce, _ in items]
        shapes = [list(v.meta['val'].shape) for v in values]
        sizes = [v.meta['val'].numel() for v in values]
        with graph.inserting_before(items[-1][1]):     # every input exists by the last wait
            flats = []
            for v, n in zip(values, sizes):
                flat = graph.call_function(aten.reshape.default, (v, [n]))
                flat.meta['val'] = torch.empty(n, dtype=dtype, device='meta')
                flats.append(flat)
            buffer = graph.call_function(aten.cat.default, (flats,))
            buffer.meta['val'] = torch.empty(sum(sizes), dtype=dtype, device='meta')
            reduced = graph.call_function(_ALL_REDUCE_IN_PLACE, (buffer, op, group))
            reduced.meta['val'] = buffer.meta['val']
            done = graph.call_function(_WAIT, (reduced,))
            done.meta['val'] = buffer.meta['val']
            pieces = graph.call_function(aten.split_with_sizes.default, (done, sizes))
            for k, ((reduce, wait), shape) in enumerate(zip(items, shapes)):
                piece = graph.call_function(operator.getitem, (pieces, k))
                grad = graph.call_function(aten.view.default, (piece, shape))
                grad.meta['val'] = torch.empty(shape, dtype=dtype, device='meta')
                wait.replace_all_uses_with(grad)
        for reduce, wait in items:
            graph.erase_node(wait)
            graph.erase_node(reduce)
        merged += len(items) - 1
    return merged
