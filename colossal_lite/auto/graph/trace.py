"""Capture a single-device model as one ATen graph: the forward and its loss.

``capture(model, example_inputs, loss_fn)`` exports ``loss_fn(model(*inputs), *inputs)`` (or
the model's own scalar output when ``loss_fn`` is None) with ``torch.export`` (non-strict, so
any Python the model runs is traced through) and decomposes the composite ops that the
sharding rules do not know (``linear`` -> ``t`` + ``addmm``, ``cross_entropy`` ->
``log_softmax`` + ``nll_loss``, ...); a formula spelled op by op (tanh-GELU) becomes the one
kernel that computes it (``kernels.py``). Attention stays one node (``aten.scaled_dot_product_
attention``) so the planner can give it a head or batch split.

The backward is not traced: every op's backward is taken by autograd at run time from the
same sharded inputs, and the planner prices it as the forward's dual (docs/auto_graph.md).

A model holding a list of >= 4 identical blocks is traced two blocks deep and the others are
stamped from the second (``stamp.py``: export time grows with depth; the stamped graph runs
the same ops as the full trace, and every check that could tell them apart falls back to it).

A model ``torch.export`` cannot trace (data-dependent Python control flow, unsupported
Python) raises :class:`GraphBreakError`, which names the cause and the model's source line.
"""
from __future__ import annotations

import re
import traceback
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch import nn

from .fused import mark_fused
from .kernels import fuse_tanh_gelu
from .stamp import capture_stamped

# ops kept whole through decomposition: the planner has its own rules for them
KEEP = (torch.ops.aten.scaled_dot_product_attention.default,)


class GraphBreakError(RuntimeError):
    """The model could not be captured as one graph; the message names why and where."""


class _WithLoss(nn.Module):
    """``model`` followed by ``loss_fn``: one module whose output is the scalar loss."""

    def __init__(self, model: nn.Module, loss_fn: Optional[Callable]):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *inputs):
        out = self.model(*inputs)
        if self.loss_fn is not None:
            return self.loss_fn(out, *inputs)
        loss = getattr(out, 'loss', out)
        if isinstance(loss, (tuple, list)):
            loss = loss[0]
        return loss


@dataclass
class Captured:
    """The decomposed graph and what its placeholders are.

    ``inputs[i]`` names placeholder i: ``('param', fqn)``, ``('buffer', fqn)``,
    ``('constant', fqn)`` or ``('input', k)`` (the k-th example input). ``stamped``: the
    lists of repeated blocks traced two blocks deep and stamped (``stamp.py``)."""

    graph_module: torch.fx.GraphModule
    inputs: List[tuple]
    constants: Dict[str, torch.Tensor]
    stamped: List[str] = field(default_factory=list)

    @property
    def graph(self) -> torch.fx.Graph:
        return self.graph_module.graph


def _user_frame(exc: BaseException) -> str:
    """The innermost traceback frame outside torch: the model's line that broke the graph."""
    frames = traceback.extract_tb(exc.__traceback__)
    user = [f for f in frames if '/torch/' not in f.filename and '/auto/graph/' not in f.filename]
    text = str(exc)
    if not user:  # non-strict export reports the user's line inside the message
        found = re.findall(r'File "([^"]+)", line (\d+)', text)
        found = [f for f in found if '/torch/' not in f[0]]
        return f'{found[-1][0]}:{found[-1][1]}' if found else 'unknown source line'
    f = user[-1]
    return f'{f.filename}:{f.lineno} ({(f.line or "").strip()})'


def _decompositions():
    table = torch.export.default_decompositions()
    for op in KEEP:
        table.pop(op, None)
    return table


def _export(wrapped: _WithLoss, example_inputs: Sequence[torch.Tensor]):
    """(graph module, placeholder table, constants) of the decomposed export of ``wrapped``."""
    try:
        exported = torch.export.export(wrapped, tuple(example_inputs), strict=False)
    except Exception as exc:  # every export failure is a graph break for the user
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise GraphBreakError(
            f'cannot capture {type(wrapped.model).__name__} as one graph: '
            f'{type(exc).__name__}: {first} (at {_user_frame(exc)}); rewrite the '
            f'data-dependent Python there (e.g. with torch.where or torch.cond) or pass a '
            f'traceable loss_fn') from exc
    exported = exported.run_decompositions(_decompositions())
    inputs: List[tuple] = []
    user = 0
    for spec in exported.graph_signature.input_specs:
        kind = spec.kind.name
        if kind == 'PARAMETER':
            inputs.append(('param', _strip(spec.target)))
        elif kind == 'BUFFER':
            inputs.append(('buffer', _strip(spec.target)))
        elif kind in ('CONSTANT_TENSOR', 'CUSTOM_OBJ'):
            inputs.append(('constant', spec.target))
        else:
            inputs.append(('input', user))
            user += 1
    constants = {k: v for k, v in exported.constants.items() if isinstance(v, torch.Tensor)}
    return exported.graph_module, inputs, constants


def capture(model: nn.Module, example_inputs: Sequence[torch.Tensor],
            loss_fn: Optional[Callable] = None, stamp_repeats: bool = True) -> Captured:
    """See the module doc. ``example_inputs`` are the full tensors every rank passes.
    ``stamp_repeats``: trace two blocks of a list of identical ones and stamp the rest
    (``stamp.py``; the full trace wherever its checks fail)."""
    wrapped = _WithLoss(model, loss_fn)
    stamped = capture_stamped(lambda: _export(wrapped, example_inputs), wrapped, model,
                              example_inputs) if stamp_repeats else None
    (gm, inputs, constants), lists = stamped or (_export(wrapped, example_inputs), [])
    out = [n for n in gm.graph.nodes if n.op == 'output'][0]
    result = out.args[0]
    if len(result) != 1 or not isinstance(result[0].meta.get('val'), torch.Tensor) \
            or result[0].meta['val'].numel() != 1:
        raise ValueError(f'{type(model).__name__} with loss_fn={loss_fn!r} must return one '
                         f'scalar loss to be planned; pass loss_fn(output, *inputs)')
    fuse_tanh_gelu(gm.graph)    # formulas spelled op by op -> their ATen kernel (kernels.py)
    gm.recompile()
    mark_fused(gm.graph)        # head-aligned splits of fused projections (fused.py)
    return Captured(gm, inputs, constants, lists)


def _strip(fqn: str) -> str:
    return fqn[len('model.'):] if fqn.startswith('model.') else fqn
