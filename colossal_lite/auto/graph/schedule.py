"""The loss's collective is waited for at the end of the lowered step, not mid-step.

A traced step waits for each functional collective where the trace met its first use
(``wait_tensor`` right after the issue). A plan that splits the batch gathers the loss's
per-token terms (or all_reduces its partial sum) at the end of the forward; none of the
returned gradients reads the result (the loss's gradient needs only the token count), yet the
wait there makes every rank stop until the slowest arrives, once mid-step, on top of the
gradient bucket's wait at the end.

:func:`wait_at_end` moves the *loss-only* nodes (those no returned gradient depends on) that
hang off such a wait to just before the output, in program order, unless one of them issues
a collective (collectives stay in the traced order, the same on every rank): the collective
is issued where it was, its wait and what reads its result run after the backward (the
backward's seed ``ones_like(loss)`` is first made from the loss's sizes, so it does not read
the loss), and the step has one synchronisation (the gradient bucket) instead of two. What
is moved keeps its order, so the program computes the same values; what stays alive longer
is the collective's result and the moved nodes' inputs (the loss's per-token terms, a few
KiB).
"""
from __future__ import annotations

from typing import List, Set

import torch

aten = torch.ops.aten
_WAIT = torch.ops._c10d_functional.wait_tensor.default
_LIKES = {aten.ones_like.default: 1, aten.zeros_like.default: 0}


def _fill_from_sizes(graph: torch.fx.Graph) -> None:
    """``ones_like(x)`` / ``zeros_like(x)`` of a contiguous ``x`` made from its sizes alone
    (``full``): the backward's seed ``ones_like(loss)`` then no longer reads the loss."""
    for node in list(graph.nodes):
        fill = _LIKES.get(node.target)
        value = node.meta.get('val')
        if fill is None or not isinstance(value, torch.Tensor) or not value.is_contiguous():
            continue
        with graph.inserting_before(node):
            full = graph.call_function(aten.full.default, (list(value.shape), fill), {
                'dtype': value.dtype, 'layout': torch.strided, 'device': value.device,
                'pin_memory': False})
        full.meta['val'] = value
        node.replace_all_uses_with(full)
        graph.erase_node(node)


def _loss_only(output: torch.fx.Node) -> Set[torch.fx.Node]:
    """The nodes only the loss (the program's first output) reads: none of the returned
    gradients depends on them."""
    graph = output.graph
    loss, rest = output.args[0][0], output.args[0][1:]
    needed: Set[torch.fx.Node] = set()
    stack: List[torch.fx.Node] = []
    torch.fx.node.map_arg(rest, stack.append)
    while stack:
        node = stack.pop()
        if node not in needed:
            needed.add(node)
            stack.extend(node.all_input_nodes)
    if not isinstance(loss, torch.fx.Node) or loss in needed:
        return set()
    return {n for n in graph.nodes if n.op == 'call_function' and n not in needed}


def wait_at_end(graph: torch.fx.Graph) -> int:
    """Move the loss's waits and what reads their results (module doc) to just before the
    output; returns how many nodes moved (none if a collective would be issued later than
    traced: every rank issues its collectives in the traced order)."""
    _fill_from_sizes(graph)
    output = next(n for n in graph.nodes if n.op == 'output')
    only = _loss_only(output)
    late: Set[torch.fx.Node] = set()
    for node in graph.nodes:
        if node in only and (node.target is _WAIT or any(a in late for a in node.all_input_nodes)):
            late.add(node)
    if any(_issues(node) for node in late):
        return 0
    moved = [n for n in graph.nodes if n in late]
    for node in moved:
        output.prepend(node)
    return len(moved)


def _issues(node: torch.fx.Node) -> bool:
    """Whether ``node`` starts a collective (a functional collective other than the wait)."""
    return node.target is not _WAIT and getattr(node.target, 'namespace', None) == '_c10d_functional'
