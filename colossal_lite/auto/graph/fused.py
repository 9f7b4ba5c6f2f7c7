"""Rhino's head-aligned splits of fused projections.

A fused projection computes several tensors with one matmul and splits the result:
GPT-2's ``c_attn`` (``addmm(b, x, W)`` with ``W [h, 3h]``, a view, then
``split_with_sizes([h, h, h], -1)`` into q, k, v), or a fused SwiGLU ``gate_up``
(``[2f]`` split in two). A plain ``Shard`` of the fused dim over k ranks hands rank r a
contiguous block that straddles the pieces (rank 0 gets q and half of k for k = 2), so the
split has to gather first. The head-aligned split is ``_StridedShard(d, split_factor=m)``:
each of the m equal pieces is sharded over the k ranks, and rank r holds block r of every
piece, ``[q_r | k_r | v_r]``. The split then runs locally and each piece comes out as an
ordinary ``Shard(d)``: Megatron's column-parallel q/k/v (heads r*n/k .. (r+1)*n/k of each)
with no communication.

:func:`mark_fused` finds the chains ``parameter [-> t/permute] -> mm/addmm [-> views] ->
split into m equal pieces along the last dim`` (each link with one user) and records
``node.meta['fused'] = (dim, m)``, the fused dim of the node's output; the split itself
gets ``node.meta['fused_split'] = (dim, m)``. ``strategies.strided_rules`` gives those nodes
their strided strategies (run on local shards); other nodes never see a strided placement.
Pieces of unequal sizes (q/k/v fused under grouped-query attention) are not marked: their
head-aligned layout is not a ``_StridedShard``.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

aten = torch.ops.aten

SPLITS = {aten.split_with_sizes.default, aten.split.Tensor}
VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
TRANSPOSES = {aten.t.default, aten.transpose.int, aten.permute.default}
MATMULS = {aten.mm.default, aten.addmm.default}


def _val(node) -> Optional[torch.Tensor]:
    v = node.meta.get('val') if isinstance(node, torch.fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def split_pieces(node: torch.fx.Node) -> Optional[Tuple[int, int]]:
    """``(dim, m)`` when ``node`` splits its input's last dim into m >= 2 equal pieces."""
    if node.target not in SPLITS:
        return None
    x = _val(node.args[0])
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get('dim', 0)
    if x is None or x.dim() == 0 or dim % x.dim() != x.dim() - 1:
        return None
    size = x.shape[-1]
    sizes = node.args[1]
    if isinstance(sizes, int):
        if size % sizes:
            return None
        sizes = [sizes] * (size // sizes)
    if len(sizes) < 2 or len(set(sizes)) != 1:
        return None
    return x.dim() - 1, len(sizes)


def transposed_dim(node: torch.fx.Node, out_dim: int) -> int:
    """The input dim that ``node`` (t / transpose / permute) moves to ``out_dim``."""
    if node.target is aten.t.default:
        return 1 - out_dim
    if node.target is aten.transpose.int:
        a, b = (d % _val(node).dim() for d in node.args[1:3])
        return b if out_dim == a else a if out_dim == b else out_dim
    return node.args[1][out_dim] % _val(node).dim()


def _weight_chain(node, dim: int) -> Optional[List[Tuple[torch.fx.Node, int]]]:
    """``[(node, dim), ...]`` from a matmul's weight operand back to its parameter."""
    chain = []
    while isinstance(node, torch.fx.Node):
        if len(node.users) != 1:
            return None
        chain.append((node, dim))
        if node.op == 'placeholder':
            return chain
        if node.target not in TRANSPOSES:
            return None
        dim = transposed_dim(node, dim)
        node = node.args[0]
    return None


def _chain(split: torch.fx.Node, dim: int) -> Optional[List[Tuple[torch.fx.Node, int]]]:
    """The marked nodes with their fused dims, or None when the pattern does not hold."""
    chain = []
    node = split.args[0]
    while node.target in VIEWS:
        src = node.args[0]
        if len(node.users) != 1 or _val(src) is None or \
                _val(src).shape[-1] != _val(node).shape[-1]:
            return None
        chain.append((node, _val(node).dim() - 1))
        node = src
    if node.target not in MATMULS or len(node.users) != 1 or _val(node).dim() != 2:
        return None
    chain.append((node, 1))
    *bias, _, weight = node.args
    links = _weight_chain(weight, 1)
    if links is None:
        return None
    chain += links
    if bias:
        b = bias[0]
        if _val(b) is None or _val(b).dim() != 1 or b.op != 'placeholder' or len(b.users) != 1:
            return None
        chain.append((b, 0))
    return chain


def mark_fused(graph: torch.fx.Graph) -> int:
    """Mark every fused-projection chain of ``graph`` (see the module doc); the count."""
    found = 0
    for node in graph.nodes:
        pieces = split_pieces(node) if node.op == 'call_function' else None
        if pieces is None:
            continue
        dim, m = pieces
        chain = _chain(node, dim)
        if chain is None:
            continue
        for link, d in chain:
            link.meta['fused'] = (d, m)
        node.meta['fused_split'] = (dim, m)
        found += 1
    return found
