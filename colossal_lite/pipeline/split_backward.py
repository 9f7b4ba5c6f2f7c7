"""Backward split into an input-gradient pass (B) and a weight-gradient pass (W).

Zero-bubble schedules send the gradient of a stage's input as early as possible (B) and
compute the weight gradients later, in what would be bubbles (W). On the stage's autograd
graph of one micro-batch:

* the *input closure* is the set of graph nodes from which the input ``x`` is reachable:
  exactly what ``torch.autograd.grad(out, [x])`` executes;
* a parameter's *frontier* is the set of closure nodes from which its AccumulateGrad
  node is reachable through nodes outside the closure only (e.g. a linear layer's
  ``AddmmBackward``, whose weight hangs below a ``TBackward`` the input pass never runs).

B registers a pre-hook on every frontier node, runs ``autograd.grad(out, [x], grad,
retain_graph=True)`` and keeps the gradient each frontier node received (dL/d(op
output)). W then runs, per frontier node, ``autograd.grad`` from that node (a
``GradientEdge``) with the kept gradient to its parameters only -- the weight gradient
of that op and nothing upstream -- accumulated into ``.grad`` by autograd (``backward``
with ``inputs=``), so post-accumulate-grad hooks (data-parallel and ZeRO reducers) fire. A parameter with no
frontier (a stage with no input: stage 0) or several (a weight used by several ops in
one stage: a node-rooted pass would count the later use twice through the earlier one)
gets its gradient in W from the stage output directly.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Set

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge


def _nodes(root) -> List:
    """Every node reachable from ``root`` (depth-first, iterative)."""
    seen, order, stack = set(), [], [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        order.append(node)
        stack.extend(nxt for nxt, _ in node.next_functions)
    return order


def _parents(nodes: Sequence) -> Dict:
    """node -> the nodes with an edge to it."""
    parents: Dict = {}
    for node in nodes:
        for nxt, _ in node.next_functions:
            if nxt is not None:
                parents.setdefault(nxt, []).append(node)
    return parents


def _frontier(parents: Dict, closure: Set, accumulator) -> Set:
    """The closure nodes that reach ``accumulator`` through non-closure nodes only."""
    frontier, seen, stack = set(), {accumulator}, [accumulator]
    while stack:
        for parent in parents.get(stack.pop(), ()):
            if parent in seen:
                continue
            seen.add(parent)
            if parent in closure:
                frontier.add(parent)
            else:
                stack.append(parent)
    return frontier


def _reaching(parents: Dict, target) -> Set:
    """The nodes from which ``target`` is reachable (``parents``: see :func:`_parents`)."""
    found, stack = {target}, [target]
    while stack:
        for parent in parents.get(stack.pop(), ()):
            if parent not in found:
                found.add(parent)
                stack.append(parent)
    return found


class SplitBackward:
    """One (stage, micro-batch): :meth:`input_grad` now (B), :meth:`weight_grad` later (W)."""

    def __init__(self, output: torch.Tensor, grad: Optional[torch.Tensor],
                 stage_input: Optional[torch.Tensor], params: Sequence[torch.Tensor]):
        self.output, self.grad, self.x = output, grad, stage_input
        self.params = [p for p in params if p.requires_grad]
        self.by_consumer: Dict = {}       # consumer node -> its parameters
        self.captured: Dict = {}          # consumer node -> gradients it received in B
        self.direct: List[torch.Tensor] = self.params

    def input_grad(self) -> Optional[torch.Tensor]:
        """B: the gradient of the stage input (None when the stage has no input)."""
        x = self.x
        if self.output.grad_fn is None:
            self.direct = []
            return None
        nodes = _nodes(self.output.grad_fn)
        parents = _parents(nodes)
        in_graph = [p for p in self.params if get_gradient_edge(p).node in parents]
        if x is None or not x.requires_grad:
            self.direct = in_graph  # stage 0: everything in W
            return None
        closure = _reaching(parents, get_gradient_edge(x).node)
        direct = []
        for p in in_graph:
            frontier = _frontier(parents, closure, get_gradient_edge(p).node)
            if len(frontier) == 1:
                self.by_consumer.setdefault(frontier.pop(), []).append(p)
            else:
                direct.append(p)
        self.direct = direct
        handles = [node.register_prehook(self._capture(node)) for node in self.by_consumer]
        try:
            (gx,) = torch.autograd.grad(self.output, [x], self.grad, retain_graph=True)
        finally:
            for h in handles:
                h.remove()
        return gx

    def _capture(self, node):
        def hook(grad_outputs):
            self.captured[node] = grad_outputs
        return hook

    def weight_grad(self):
        """W: every parameter's gradient accumulated into ``.grad``; frees the graph."""
        for node, params in self.by_consumer.items():
            grads = self.captured.get(node)
            if grads is None:
                self.direct.extend(params)
                continue
            edges = [(GradientEdge(node, i), g) for i, g in enumerate(grads) if g is not None]
            if not edges:
                continue
            torch.autograd.backward([e for e, _ in edges], [g for _, g in edges],
                                    retain_graph=True, inputs=params)
        if self.direct:
            torch.autograd.backward(self.output, self.grad, inputs=self.direct)
        self.output = self.grad = self.x = None
        self.captured.clear()
        self.by_consumer.clear()
