"""The experts: routed SwiGLU experts stored stacked, and the always-on shared experts.

Routed (:class:`GroupedExperts`), full shapes, no biases::

    gate [experts, h, f]   up [experts, h, f]   down [experts, f, h]
    expert e: y = (silu(x @ gate[e]) * (x @ up[e])) @ down[e]

each cut along dim 0 over the EXPERT group (E ranks; rank r holds experts
``r*L .. r*L + L - 1``, ``L = experts / E``): ``Placement.of(shape, (0, EXPERT),
replicated=(EXPERT_DATA,), grad_sum=(EXPERT_DATA,))``, which ``new_parameter`` fills in from
the launched layout.

Expert tensor parallelism (``tensor_axis``, 1D TENSOR of t ranks, which hold the same
tokens): the width f is cut as Megatron cuts an MLP, ``gate``/``up`` along dim 2 (columns)
and ``down`` along dim 1 (rows), so each rank holds ``[L, h, f/t]`` / ``[L, f/t, h]``. The
rows enter through ``copy_to`` (identity; their gradient all-reduced over TENSOR backward)
and the partial outputs leave through ``reduce_from`` (all-reduce over TENSOR forward):
one all-reduce of ``[rows, h]`` each way per layer, as a dense 1D MLP of ``rows`` tokens.
Rows come sorted by local expert with ``counts`` rows each, and each
expert multiplies its contiguous segment (a loop of matmuls over the L local experts: on
CPU as fast as ``torch.nn.functional.grouped_mm`` and ~5% faster than a padded ``bmm``,
``benchmarks/moe_grouped.py``). An expert given no rows still takes part, with empty
matmuls, so its gradient slice is zero -- never None -- on every rank alike.

Shared (:class:`SharedExperts`): ``n`` always-on SwiGLU experts of width ``f_s`` are one
SwiGLU of width ``n * f_s`` (the sum of the n outputs is that SwiGLU's output), built from
``colossal_lite.nn.Linear`` like the dense MLP (``gate_proj``/``up_proj`` 'enter',
``down_proj`` 'exit'), so it is split as the launched tensor mode splits an MLP. No
communication in either beyond what those Linears do.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ...communication import copy_to, reduce_from
from ...context import ParallelMode, ProcessGroupAxis, current_context
from ...tensor import (Init, Placement, ShardedModule, building_on_meta, new_parameter,
                       set_placement)
from ..layers import Linear
from .router import uniform_init


def expert_parameter(shape: Sequence[int], axis: ProcessGroupAxis, init: Init,
                     *tensor_cuts: Tuple[int, ParallelMode]) -> nn.Parameter:
    """A stacked expert weight of full ``shape`` holding this rank's experts of ``axis``
    (and its slice of ``tensor_cuts``, e.g. ``(2, TENSOR)`` under expert tensor parallelism).

    Over the launched EXPERT group (or one rank) it is a :func:`new_parameter` cut along dim
    0 over EXPERT (drawn by name under ``init_by_name``). Over a group outside the launched
    layout (a test's own group) the full tensor is drawn now from the default generator and
    cut here; its placement then records only the local shape."""
    launched = current_context().axis(ParallelMode.EXPERT)
    if axis.size == 1:
        return new_parameter(shape, *tensor_cuts, init=init)
    if axis.mode is ParallelMode.EXPERT and axis.ranks == launched.ranks:
        return new_parameter(shape, (0, ParallelMode.EXPERT), *tensor_cuts, init=init)
    if tensor_cuts:
        raise ValueError(f'expert tensor parallelism needs the launched expert group, got '
                         f'ranks {axis.ranks}')
    if building_on_meta():
        raise ValueError(f'an expert group outside the launched layout (ranks {axis.ranks}) '
                         f'cannot be built on the meta device; launch with '
                         f'parallel=dict(expert={axis.size})')
    full = torch.empty(tuple(shape))
    with torch.no_grad():
        init(full, None)
    param = nn.Parameter(full.chunk(axis.size, dim=0)[axis.rank].clone())
    return set_placement(param, Placement(tuple(param.shape)))


def grouped_swiglu(x: torch.Tensor, counts: List[int], gate: torch.Tensor, up: torch.Tensor,
                   down: torch.Tensor) -> torch.Tensor:
    """``x [S, h]`` sorted by expert (``counts[e]`` rows for expert e of the stacked
    ``gate``, ``up [L, h, f]``, ``down [L, f, h]``) -> ``[S, h]``, each segment through its
    expert's SwiGLU."""
    outs = [(F.silu(seg @ g) * (seg @ u)) @ d
            for seg, g, u, d in zip(x.split(counts), gate.unbind(0), up.unbind(0),
                                    down.unbind(0))]
    return torch.cat(outs) if outs else x.new_zeros(0, down.shape[-1])


class GroupedExperts(ShardedModule):
    """``experts`` routed SwiGLU experts (module doc), this rank's ``experts / E`` of them,
    with their width cut over ``tensor_axis`` (the launched 1D TENSOR group) when given.
    ``forward(x [S, h], counts)``: rows sorted by local expert. Communication in forward:
    none, or one all-reduce of ``[S, h]`` over ``tensor_axis`` (and one backward);
    ``state_dict()`` gathers the full stacked tensors over EXPERT and TENSOR (collective) and
    ``load_state_dict(full)`` keeps this rank's slice (``tensor.ShardedModule``)."""

    def __init__(self, hidden: int, ffn_hidden: int, experts: int, axis: ProcessGroupAxis,
                 weight_init: Optional[Init] = None,
                 tensor_axis: Optional[ProcessGroupAxis] = None):
        super().__init__()
        if experts % axis.size:
            raise ValueError(f'MoE experts = {experts} must be divisible by the expert-parallel '
                             f'size E = {axis.size}')
        self.num_experts, self.axis = experts, axis
        self.num_local = experts // axis.size
        self.tensor_axis = tensor_axis if tensor_axis is not None and tensor_axis.size > 1 \
            else None
        cols, rows = (), ()
        if self.tensor_axis is not None:
            if ffn_hidden % self.tensor_axis.size:
                raise ValueError(f'MoE expert width ffn_hidden = {ffn_hidden} must be divisible '
                                 f'by the tensor-parallel size {self.tensor_axis.size} (expert '
                                 f'tensor parallelism; expert_tensor_parallel=False keeps '
                                 f'experts whole)')
            cols, rows = ((2, ParallelMode.TENSOR),), ((1, ParallelMode.TENSOR),)
        self.gate = expert_parameter((experts, hidden, ffn_hidden), axis,
                                     weight_init or uniform_init(hidden), *cols)
        self.up = expert_parameter((experts, hidden, ffn_hidden), axis,
                                   weight_init or uniform_init(hidden), *cols)
        self.down = expert_parameter((experts, ffn_hidden, hidden), axis,
                                     weight_init or uniform_init(ffn_hidden), *rows)

    def forward(self, x: torch.Tensor, counts: List[int]) -> torch.Tensor:
        if self.tensor_axis is None:
            return grouped_swiglu(x, counts, self.gate, self.up, self.down)
        partial = grouped_swiglu(copy_to(x, self.tensor_axis), counts, self.gate, self.up,
                                 self.down)
        return reduce_from(partial, self.tensor_axis, inplace=True)


class SharedExperts(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))`` of width ``ffn_hidden`` (the shared
    experts' widths summed), split as the launched mode splits an MLP (module doc)."""

    def __init__(self, hidden: int, ffn_hidden: int, weight_init: Optional[Init] = None):
        super().__init__()
        kw = dict(bias=False, weight_init=weight_init)
        self.gate_proj = Linear(hidden, ffn_hidden, region='enter', **kw)
        self.up_proj = Linear(hidden, ffn_hidden, region='enter', **kw)
        self.down_proj = Linear(ffn_hidden, hidden, region='exit', **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
