"""Formulas a model spells out op by op, rewritten in the captured graph into the one ATen
kernel that computes them.

A model that writes its activation as arithmetic (``transformers``' ``NewGELUActivation``,
GPT-2's ``gelu_new``) exports as one pointwise op per term, forward, and autograd adds one or
more per term backward: eight calls forward and about ten backward where ``F.gelu`` runs one
each way. The rewrite happens before planning, so the planner, the interpreter and the lowered
program all see the fused op; every split of a pointwise op stays valid.

* tanh-GELU: ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`` ->
  ``aten.gelu(x, approximate='tanh')`` (the same formula inside the kernel; results agree to
  float rounding).
"""
from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch

aten = torch.ops.aten

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_CUBIC = 0.044715


def _near(value, target: float) -> bool:
    return isinstance(value, (int, float)) and abs(value - target) <= 1e-6 * abs(target)


def _with_constant(node, target, value: float) -> Optional[torch.fx.Node]:
    """``t`` when ``node`` is ``target(t, value)`` in either order (an add with alpha 1),
    else None."""
    if getattr(node, 'target', None) is not target or node.kwargs.get('alpha', 1) != 1:
        return None
    a, b = node.args
    if isinstance(a, torch.fx.Node) and _near(b, value):
        return a
    if isinstance(b, torch.fx.Node) and _near(a, value):
        return b
    return None


def _scaled(node, factor: float) -> Optional[torch.fx.Node]:
    """``t`` when ``node`` is ``t * factor`` (either order), else None."""
    return _with_constant(node, aten.mul.Tensor, factor)


def _plus_one(node) -> Optional[torch.fx.Node]:
    """``t`` when ``node`` is ``t + 1`` (either order), else None."""
    return _with_constant(node, aten.add.Tensor, 1.0)


def _cube(node) -> Optional[torch.fx.Node]:
    if getattr(node, 'target', None) is aten.pow.Tensor_Scalar and _near(node.args[1], 3.0):
        return node.args[0]
    return None


def _tanh_gelu_input(node: torch.fx.Node) -> Optional[Tuple[torch.fx.Node, List]]:
    """``(x, the formula's other terms, last first)`` when ``node`` computes tanh-GELU of
    ``x`` (module doc), else None."""
    if node.target is not aten.mul.Tensor or len(node.args) != 2:
        return None
    for half, rest in (node.args, node.args[::-1]):
        x = _scaled(half, 0.5)
        tanh = _plus_one(rest)
        if x is None or getattr(tanh, 'target', None) is not aten.tanh.default:
            continue
        inner = _scaled(tanh.args[0], _SQRT_2_OVER_PI)
        if getattr(inner, 'target', None) is not aten.add.Tensor \
                or inner.kwargs.get('alpha', 1) != 1:
            continue
        for lin, cub in (inner.args, inner.args[::-1]):
            if lin is x and _cube(_scaled(cub, _CUBIC)) is x:
                return x, [rest, tanh, tanh.args[0], inner, cub, cub.args[0], half]
    return None


def fuse_tanh_gelu(graph: torch.fx.Graph) -> int:
    """Rewrite each tanh-GELU formula into ``aten.gelu(x, approximate='tanh')``; the terms
    nothing else reads are removed. Returns how many."""
    fused = 0
    for node in list(graph.nodes):
        if node.op != 'call_function':
            continue
        found = _tanh_gelu_input(node)
        if found is None:
            continue
        x, terms = found
        with graph.inserting_before(node):
            gelu = graph.call_function(aten.gelu.default, (x,), {'approximate': 'tanh'})
        gelu.meta = dict(node.meta)
        node.replace_all_uses_with(gelu)
        graph.erase_node(node)
        for term in terms:                  # each after every term that reads it
            if not term.users:
                graph.erase_node(term)
        fused += 1
    return fused
