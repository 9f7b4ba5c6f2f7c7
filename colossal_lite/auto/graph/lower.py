"""The plan's training step lowered to one per-rank program over local tensors.

Interpreting the graph over DTensors (``execute.GraphRunner``) pays DTensor's Python dispatch
on every op, forward and backward, every step. :class:`LoweredStep` pays it once: on the first
step for given input shapes it traces (``make_fx``, real tensors) the joint function

    (local shards of the parameters, buffers, inputs) -> (loss, local gradients)

through the runner and ``torch.autograd.grad`` (DTensor's identity views and copies and its
global-shape constants dropped: ``simplify.py``; the forward's matmuls on oneDNN on CPU:
``onednn.py``; the parameters' gradient all_reduces merged into one: ``buckets.py``; the
waits only the outputs read moved to the end: ``schedule.py``). The
trace holds the local aten ops DTensor ran and its functional collectives (all_gather / all_reduce / reduce_scatter / all_to_all on
the mesh's process groups), forward and backward, so later steps replay exactly the same
local computation and the same collectives with no DTensor in between.

:class:`LoweredLoss` hands the result to autograd: its forward returns the loss and keeps the
gradients; its backward returns them (times the incoming scalar, e.g. a loss scale or 1/k of
gradient accumulation) as DTensors with each parameter's placements, so ``param.grad``,
optimizers, clipping and checkpoints see what the interpreter gives.

Not lowered (the interpreter runs them, which gives the same numbers): a graph with random
ops (DTensor draws them through its own RNG tracker, which a trace would freeze; dropout with
p = 0 is not random), a step without autograd (``no_grad``), inputs that want gradients, and
a graph the trace cannot take (data-dependent Python control in a kernel's dispatch; the
reason is kept in ``LoweredStep.failure``).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch.distributed.tensor import DTensor
from torch.fx.experimental.proxy_tensor import make_fx

from ...communication import profile as comm_profile
from .buckets import bucket_gradient_all_reduces
from .onednn import matmuls_on_onednn
from .schedule import wait_at_end
from .simplify import forward_end, simplify


_DROPOUT_P = {torch.ops.aten.scaled_dot_product_attention.default: ('dropout_p', 4),
              torch.ops.aten.native_dropout.default: ('p', 1),
              torch.ops.aten.dropout.default: ('p', 1)}


def _draws(node: torch.fx.Node) -> bool:
    """Whether ``node`` draws random numbers (dropout with p = 0 does not)."""
    if torch.Tag.nondeterministic_seeded not in getattr(node.target, 'tags', ()):
        return False
    if node.target in _DROPOUT_P:
        key, pos = _DROPOUT_P[node.target]
        p = node.kwargs.get(key, node.args[pos] if len(node.args) > pos else 0.0)
        return p != 0
    return True


def has_random_ops(graph: torch.fx.Graph) -> bool:
    """Whether any op of ``graph`` draws random numbers (dropout, rand, bernoulli, ...)."""
    return any(node.op == 'call_function' and _draws(node) for node in graph.nodes)


class _Spec:
    """How to rebuild a DTensor from its local shard (and its gradient from a local one)."""

    __slots__ = ('mesh', 'placements', 'shape', 'stride')

    def __init__(self, value: DTensor):
        self.mesh, self.placements = value.device_mesh, tuple(value.placements)
        self.shape, self.stride = value.shape, value.stride()

    def wrap(self, local: torch.Tensor) -> DTensor:
        return DTensor.from_local(local, self.mesh, self.placements, run_check=False,
                                  shape=self.shape, stride=self.stride)


def _local(value):
    return value.to_local() if isinstance(value, DTensor) else value


class Program:
    """One lowered step: the traced graph, how to wrap each input's gradient, which
    parameters the loss reaches, and the collectives one run issues (read off the graph:
    ``(mode, op, buffer bytes, group size)``, recorded into ``communication.profile``);
    ``merged_all_reduces``: how many gradient all_reduces the bucket saved (``buckets.py``)."""

    def __init__(self, graph: torch.fx.GraphModule, specs: List[Optional[_Spec]],
                 used: List[bool], entry: Callable):
        self.graph, self.specs, self.used = graph, specs, used
        self.merged_all_reduces = 0
        self.collectives = [hit for node in graph.graph.nodes if node.op == 'call_function'
                            for hit in [entry(node.target, node.args, node.kwargs)]
                            if hit is not None]


class LoweredStep:
    """See the module doc. ``run(*values)`` runs the graph over the runner's inputs in the
    captured order (parameters as DTensors); ``trainable[i]``: whether input i is a parameter
    the loss is differentiated for; ``entry(func, args, kwargs)`` names a collective
    (``execute.CollectiveCounter.entry``)."""

    def __init__(self, run: Callable[..., torch.Tensor], trainable: Sequence[bool],
                 entry: Callable):
        self._run = run
        self._trainable = list(trainable)
        self._entry = entry
        self._programs: Dict[tuple, Program] = {}
        self.failure: Optional[str] = None

    @staticmethod
    def _key(values) -> tuple:
        return tuple((tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else repr(v)
                     for v in values)

    def program(self, values: Sequence):
        """The lowered program for these input shapes (traced on first use), or None (also
        when a non-parameter input wants a gradient: the program gives parameters' only)."""
        if any(isinstance(v, torch.Tensor) and v.requires_grad and not train
               for v, train in zip(values, self._trainable)):
            return None
        key = self._key(values)
        hit = self._programs.get(key)
        if hit is None and self.failure is None:
            try:
                hit = self._programs[key] = self._trace(values)
            except Exception as exc:   # noqa: BLE001 - the interpreter runs the step instead
                self.failure = f'{type(exc).__name__}: {exc}'.splitlines()[0][:300]
        return hit

    def _trace(self, values: Sequence):
        specs = [_Spec(v) if isinstance(v, DTensor) else None for v in values]
        trainable = self._trainable
        used: List[bool] = []

        def joint(locals_):
            wrapped = []
            for local, spec, train in zip(locals_, specs, trainable):
                value = spec.wrap(local) if spec is not None else local
                if train:
                    value = value.detach().requires_grad_()
                wrapped.append(value)
            loss = self._run(*wrapped)
            params = [w for w, train in zip(wrapped, trainable) if train]
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            used.clear()
            out = []
            for grad, param in zip(grads, params):
                used.append(grad is not None)
                if grad is None:
                    continue
                if isinstance(grad, DTensor):
                    if tuple(grad.placements) != tuple(param.placements):
                        grad = grad.redistribute(param.device_mesh, param.placements)
                    grad = grad.to_local()
                out.append(grad)
            return loss.detach(), out

        locals_ = [_local(v).detach() if isinstance(v, torch.Tensor) else v for v in values]
        graph = make_fx(joint)(locals_)
        # simplify ends by removing dead ops, which must not run: those traced through
        # DTensor's propagation (e.g. an index over freshly allocated, uninitialized tensors)
        # fault on CUDA with their garbage indices
        simplify(graph.graph, forward_end(graph.graph))
        matmuls_on_onednn(graph.graph, forward_end(graph.graph))
        merged = bucket_gradient_all_reduces(graph.graph)   # one all_reduce per group
        wait_at_end(graph.graph)      # the loss's collective is not waited for mid-step
        graph.recompile()
        trained = [s for s, train in zip(specs, trainable) if train]
        program = Program(graph, trained, list(used), self._entry)
        program.merged_all_reduces = merged
        return program

    def run(self, program: Program, values: Sequence) -> torch.Tensor:
        """The loss of one step through ``program``; its collectives are recorded."""
        params = [v for v, train in zip(values, self._trainable) if train]
        loss = LoweredLoss.apply(program, values, *params)
        for hit in program.collectives:
            comm_profile.record(*hit)
        return loss


class LoweredLoss(torch.autograd.Function):
    """Forward: run the lowered program, return the loss, keep the local gradients.
    Backward: the gradients times the incoming scalar, as DTensors with the parameters'
    placements (None for a parameter the loss does not reach)."""

    @staticmethod
    def forward(ctx, program, values, *params):
        locals_ = [_local(v).detach() if isinstance(v, torch.Tensor) else v for v in values]
        loss, grads = program.graph(locals_)
        ctx.specs, ctx.used, ctx.grads = program.specs, program.used, grads
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        # one foreach call, out of place: outputs may share storage with each other (the
        # gradients of a + b) or with the program's inputs, so none is scaled in place
        grads = iter(torch._foreach_mul(ctx.grads, grad_loss) if ctx.grads else ())
        out = []
        for spec, used in zip(ctx.specs, ctx.used):
            if not used:
                out.append(None)
                continue
            grad = next(grads)
            out.append(spec.wrap(grad) if spec is not None else grad)
        ctx.grads = None
        return (None, None, *out)
