"""Gradient-norm clipping whose norm is the serial model's norm in every layout.

For gradients g_p of the (deduplicated) parameters, the serial norm is
``||g|| = sqrt(sum_p ||G_p||^2)`` with G_p the full (unsharded) gradient. Each
parameter carries a :class:`~colossal_lite.tensor.ShardSpec`; its full squared
norm is the sum of the local squared norms over the groups its placement cuts it
over. So, per rank:

* replicated parameters (no cut): ``s_rep = sum ||g_p||^2`` locally -- every
  replica holds the same value, so it is counted once, never summed over a group;
* sharded parameters, grouped by the tuple of their placement's cut modes ``(A_1..A_k)``:
  ``s_A = all_reduce_{A_k}( ... all_reduce_{A_1}(sum ||g_p||^2))``, one scalar
  all_reduce per group of the tuple.

``norm = sqrt(s_rep + sum_A s_A)`` is then identical on every rank of a pipeline stage;
under pipeline parallelism each stage's share is summed over PIPELINE (a weight held by the
first and the last stage -- EMBEDDING in its ``grad_sum`` -- counted on the first only; a
graph plan's parameter held by h pipeline ranks counts ``||g||^2 / h`` on each). Clipping
multiplies every gradient by ``min(1, max_norm / (norm + 1e-6))`` (torch's rule).
Call after the data-parallel gradient synchronization.
"""
from __future__ import annotations

import math
from typing import Dict, Iterable, List, Tuple

import torch
from torch.distributed.tensor import DTensor

from ..communication import collective as C
from ..context import ParallelMode, global_context as gpc
from ..tensor import param_placement


# attribute of a graph plan's parameter held by h > 1 pipeline ranks (a tied embedding):
# each holder counts ||g||^2 / h, so the sum over PIPELINE counts it once
PIPELINE_HOLDERS = 'pipeline_holders'


def unique_parameters(parameters: Iterable[torch.Tensor]) -> List[torch.Tensor]:
    """Parameters in order with duplicates (tied weights) removed."""
    seen, out = set(), []
    for p in parameters:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def grad_norm(parameters: Iterable[torch.Tensor]) -> float:
    """The 2-norm of the full gradient of the serial model (see module docstring)."""
    replicated = torch.zeros((), dtype=torch.float32)
    sharded: Dict[Tuple[str, ...], Tuple[list, List[torch.Tensor]]] = {}
    for p in unique_parameters(parameters):
        if isinstance(p.grad, DTensor):   # a graph plan's parameter: DTensor sums its shards
            sq = p.grad.detach().float().pow(2).sum().full_tensor().cpu()
            # held by several pipeline ranks (PipelinedAutoModel): each counts its share
            replicated = replicated + sq / getattr(p, PIPELINE_HOLDERS, 1)
            continue
        if p.grad is None or _counted_on_another_stage(p):
            continue
        sq = p.grad.detach().float().pow(2).sum().cpu()
        modes = [mode for _, mode in param_placement(p).cuts]
        if not modes:
            replicated = replicated + sq
            continue
        key = tuple(m.value for m in modes)
        sharded.setdefault(key, (modes, []))[1].append(sq)
    total = replicated
    for key in sorted(sharded):  # the same order of collectives on every rank
        axes, squares = sharded[key]
        partial = torch.stack(squares).sum().to(gpc.device)
        for axis in axes:
            partial = C.all_reduce(partial, axis)
        total = total + partial.cpu()
    if gpc.get_world_size(ParallelMode.PIPELINE) > 1:  # every stage's share
        total = C.all_reduce(total.reshape(1).to(gpc.device), ParallelMode.PIPELINE).cpu()
    return math.sqrt(total.item())


def _counted_on_another_stage(p: torch.Tensor) -> bool:
    """A weight held by the first and the last pipeline stage counts on the first only."""
    return (ParallelMode.EMBEDDING in param_placement(p).grad_sum
            and gpc.get_local_rank(ParallelMode.EMBEDDING) != 0)


def clip_grad_norm(parameters: Iterable[torch.Tensor], max_norm: float) -> float:
    """Scale gradients so their serial-model 2-norm is at most ``max_norm``; returns the norm
    before clipping."""
    params = [p for p in unique_parameters(parameters) if p.grad is not None]
    norm = grad_norm(params)
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for p in params:
            p.grad.detach().mul_(coef)
    return norm
