"""A model built straight into chunks: no rank ever holds the whole model.

Under ``zero=dict(stage=3)`` a model can be built on the meta device
(:func:`building_into_chunks`, or ``with torch.device('meta')``): its layers only record
each parameter's shape, placement and init recipe (``colossal_lite.tensor.init``).
``initialize()`` then skips the move to the device and the parameter broadcast
(:func:`has_meta_parameters`), packs the parameters into chunks as usual and gives each
chunk's fp32 master its values with :func:`init_shard`: for every parameter that overlaps
this rank's shard, the full tensor is drawn on the CPU from the generator seeded by
``(seed, serial name)`` -- exactly as ``init_by_name`` draws it for a model built whole --,
cut to this rank's tensor-parallel piece, and only the overlapping elements are kept.
So the shards equal those of a model built whole (bit for bit) and the peak of the build
is the rank's shards plus the largest single full parameter. No communication.
"""
from __future__ import annotations

import contextlib
from typing import Dict, Optional, Sequence

import torch

from ...config.zero import ZeroSettings
from ...tensor.init import INIT_ATTR, _replace_parameter, materialize, name_seed
from ...tensor.placement import placement_of, set_placement


def has_meta_parameters(model: torch.nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def building_into_chunks(zero: Optional[ZeroSettings]):
    """A context to build a model in: the meta device under ``zero=dict(stage=3)`` (the
    settings' ``zero`` section; the model is then materialized into its chunk shards by
    ``initialize()``), else nothing."""
    if zero is not None and zero.stage == 3:
        return torch.device('meta')
    return contextlib.nullcontext()


def check_meta_model(zero: Optional[ZeroSettings], model: torch.nn.Module) -> bool:
    """Whether ``model`` is to be built into chunks: it has meta parameters, each with an
    init recipe, and no meta buffer. A meta model with plain torch layers (no recipe) or
    meta buffers is materialized whole (``materialize``: by name, as ``init_by_name``
    does) and False returned. Raises for a meta model outside ZeRO stage 3. No
    communication."""
    meta = [n for n, p in model.named_parameters() if p.is_meta]
    if not meta:
        return False
    if zero is None or zero.stage != 3:
        raise ValueError(f'a model built on the meta device ({len(meta)} meta parameter(s), e.g. '
                         f'{meta[0]!r}) is materialized only by zero=dict(stage=3), got '
                         f'zero = {zero!r}; build it outside the meta device')
    if any(p.is_meta and getattr(p, INIT_ATTR, None) is None for p in model.parameters()) or \
            any(b.is_meta for b in model.buffers()):
        materialize(model)
        return False
    return True


def swap_meta_parameters(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                         device: torch.device) -> int:
    """Replace every meta parameter the optimizer trains by a parameter on ``device`` with
    its shape, dtype, placement and init recipe that holds one element (a stride-0 view;
    the chunks read its shape, then swap its storage), in the model and in the optimizer's
    param groups. The others stay on meta (``materialize`` draws them whole). Returns how
    many were swapped."""
    trained = {id(p) for g in optimizer.param_groups for p in g['params'] if p.requires_grad}
    swapped = 0
    for _, old in list(model.named_parameters()):
        if not old.is_meta or id(old) not in trained:
            continue
        one = torch.empty(1, dtype=old.dtype, device=device).expand(old.shape)
        new = torch.nn.Parameter(one, requires_grad=old.requires_grad)
        setattr(new, INIT_ATTR, getattr(old, INIT_ATTR))
        set_placement(new, placement_of(old))
        _replace_parameter(model, old, new)
        for group in optimizer.param_groups:
            group['params'] = [new if p is old else p for p in group['params']]
        swapped += 1
    return swapped


def draw_full(param: torch.Tensor, name: str, seed: int) -> torch.Tensor:
    """The full (serial) value of a meta parameter, drawn by name on the CPU."""
    full = torch.empty(placement_of(param).shape, dtype=param.dtype)
    with torch.no_grad():
        getattr(param, INIT_ATTR)(full, torch.Generator().manual_seed(name_seed(seed, name)))
    return full


@torch.no_grad()
def init_shard(params: Sequence[torch.Tensor], numels: Sequence[int], size: int, rank: int,
               dp_size: int, names: Dict[int, str], seed: int) -> torch.Tensor:
    """This rank's fp32 shard (``size / dp_size`` elements) of a chunk of ``size`` elements
    holding ``params`` (meta, flattened in order, ``numels`` each, zero padding after): each
    overlapping parameter drawn in full (:func:`draw_full`), cut to this rank's
    tensor-parallel piece, and sliced."""
    s = size // dp_size
    start, offset = rank * s, 0
    shard = torch.zeros(s, dtype=torch.float32)
    for p, n in zip(params, numels):
        lo, hi = max(offset, start), min(offset + n, start + s)
        if lo < hi:
            full = draw_full(p, names[id(p)], seed)
            local = placement_of(p).shard(full).reshape(-1)
            shard[lo - start:hi - start].copy_(local[lo - offset:hi - offset])
            del full, local
        offset += n
    return shard
