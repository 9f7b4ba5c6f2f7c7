"""Tensors laid back to back in one storage, and the zero-copy join of their rows.

A fused projection multiplies by ``cat(W_1, ..., W_n)`` (the local weights joined along
their rows, dim 0). When the tensors already lie back to back and fill one storage --
each contiguous, same dtype and trailing shape, ``W_{i+1}`` starting where ``W_i`` ends
(:func:`rows_adjacent`) -- that concatenation *is* a view of the storage: :func:`join_rows`
returns it without a copy, through one small autograd Function whose backward hands each
tensor its row block of the joined gradient (views, no copy, as ``torch.cat``'s backward
does), and :func:`joined_rows` does the same inside another Function's forward (the 1D
column matmul joins its row blocks so, with no node of its own). Otherwise both fall
back to ``torch.cat``: the same numbers either way.

:func:`place_adjacent` makes parameters adjacent: materialized ones at once (one new
buffer, each parameter's ``.data`` its row block, so parameter objects, placements and
state-dict keys stay), meta ones when :func:`colossal_lite.tensor.materialize` draws
them (it calls :func:`place_tagged`). Anything that later gives a parameter storage of
its own (``model.to(dtype)``, ZeRO chunks, ``load_state_dict(assign=True)``) just makes
the join fall back to ``torch.cat``; in-place writes (``copy_``, optimizer steps) keep
the layout. The joined view shares the first tensor's version counter only; it is kept
per first tensor (:func:`adjacent_view`) until a data pointer changes, so a buffer left
behind by such a replacement is freed at the next join or when the parameter dies.
"""
from __future__ import annotations

import itertools
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

ADJACENT_ATTR = 'adjacent_group'   # (group number, index, group size)
_GROUPS = itertools.count()


def rows_adjacent(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether ``tensors`` lie back to back, in order, and fill one storage exactly: each
    contiguous, one dtype and trailing shape, the first at offset 0, each next one where
    the last ends, the storage no longer than they are (as :func:`place_adjacent` lays
    them). A view into a storage someone else manages (a ZeRO chunk, a flat buffer) may be
    rewritten while autograd still holds the joined view, so it does not count."""
    first = tensors[0]
    if first.storage_offset() or not first.is_contiguous() or first.is_meta:
        return False
    storage = first.untyped_storage()
    ptr, size = storage.data_ptr(), first.element_size()
    end = ptr
    for t in tensors:
        if (t.data_ptr() != end or t.dtype != first.dtype or t.shape[1:] != first.shape[1:]
                or not t.is_contiguous() or t.untyped_storage().data_ptr() != ptr):
            return False
        end += t.numel() * size
    return ptr != 0 and end - ptr == storage.nbytes()


_VIEWS: Dict[int, tuple] = {}   # id(first) -> (weak first, data pointers, view or None)


def adjacent_view(tensors: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """The view ``[sum rows, ...]`` of the storage that ``tensors`` fill when they are
    :func:`rows_adjacent`, else None; no autograd. The answer is kept per first tensor while
    the data pointers stay: a kept view holds its storage alive, so no other tensor can take
    those addresses meanwhile."""
    first = tensors[0]
    ptrs = [t.data_ptr() for t in tensors]
    key = id(first)
    entry = _VIEWS.get(key)
    if entry is None or entry[0]() is not first or entry[1] != ptrs:
        view = None
        if rows_adjacent(tensors):
            rows = sum(t.shape[0] for t in tensors)
            view = first.detach().as_strided((rows,) + tuple(first.shape[1:]), first.stride(), 0)
        entry = (weakref.ref(first, lambda _, key=key: _VIEWS.pop(key, None)), ptrs, view)
        _VIEWS[key] = entry
    return entry[2]


def joined_rows(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(tensors)`` without autograd (inside an autograd Function's forward): the
    :func:`adjacent_view` when there is one, else a copy."""
    view = adjacent_view(tensors)
    return torch.cat(list(tensors)) if view is None else view


class _JoinRows(torch.autograd.Function):
    """Forward: the given views, one per group of adjacent tensors (``lengths`` tensors
    each), as new tensors. Backward: each tensor's row block of its group's gradient."""

    @staticmethod
    def forward(ctx, views: Tuple[torch.Tensor, ...], lengths: Tuple[int, ...], *tensors):
        rows = [t.shape[0] for t in tensors]
        ends = list(itertools.accumulate(lengths))
        ctx.rows = [rows[end - n:end] for n, end in zip(lengths, ends)]
        return tuple(view.detach() for view in views)

    @staticmethod
    def backward(ctx, *grads):
        return (None, None) + tuple(itertools.chain.from_iterable(
            (None,) * len(rows) if g is None else g.split(rows)
            for g, rows in zip(grads, ctx.rows)))


def join_rows(*groups: Optional[Sequence[torch.Tensor]]) -> Tuple[Optional[torch.Tensor], ...]:
    """``tuple(torch.cat(group) for group in groups)`` (None for a None group), as a view
    of the storage for every group whose tensors are :func:`rows_adjacent`, through one
    autograd node for all of them."""
    views = [None if group is None else adjacent_view(group) for group in groups]
    chosen = [(v, g) for v, g in zip(views, groups) if v is not None]
    joined = iter(_JoinRows.apply(tuple(v for v, _ in chosen), tuple(len(g) for _, g in chosen),
                                  *itertools.chain.from_iterable(g for _, g in chosen))
                  if chosen else ())
    return tuple(None if group is None else torch.cat(list(group)) if view is None
                 else next(joined) for view, group in zip(views, groups))


def place_adjacent(params: Sequence[nn.Parameter]) -> None:
    """Lay ``params`` back to back, in order, in one storage (see module doc): at once when
    every one is materialized, else tag them for :func:`place_tagged`. Raises ValueError
    when their dtypes, devices or trailing shapes differ."""
    first = params[0]
    for p in params[1:]:
        if p.dtype != first.dtype or p.device != first.device or p.shape[1:] != first.shape[1:]:
            raise ValueError('adjacent parameters need one dtype, device and trailing shape, '
                             f'got {[(p.dtype, p.device.type, tuple(p.shape)) for p in params]}')
    token = next(_GROUPS)
    for index, p in enumerate(params):
        setattr(p, ADJACENT_ATTR, (token, index, len(params)))
    if not any(p.is_meta for p in params):
        _pack(params)


@torch.no_grad()
def _pack(params: Sequence[nn.Parameter]) -> None:
    if rows_adjacent(params):
        return
    first = params[0]
    rows = [p.shape[0] for p in params]
    buffer = torch.empty((sum(rows),) + tuple(first.shape[1:]), dtype=first.dtype,
                         device=first.device)
    for p, block in zip(params, buffer.split(rows)):
        block.copy_(p.detach())
        p.data = block


def place_tagged(module: nn.Module) -> None:
    """Pack every tagged group of ``module``'s parameters whose members are all present
    and materialized (called by ``materialize`` after drawing)."""
    groups: Dict[int, List[Tuple[int, nn.Parameter]]] = {}
    for p in module.parameters():
        tag = getattr(p, ADJACENT_ATTR, None)
        if tag is not None and not p.is_meta:
            groups.setdefault(tag[0], []).append((tag[1], p))
    for members in groups.values():
        members.sort(key=lambda m: m[0])
        if [i for i, _ in members] == list(range(getattr(members[0][1], ADJACENT_ATTR)[2])):
            _pack([p for _, p in members])
