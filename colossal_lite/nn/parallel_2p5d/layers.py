"""2D / 2.5D layers on the ``d x q x q`` grid (2D: d = 1).

Standard layout (``grid.py``): activations ``[b, s, h] -> [b/(d q), s, h/q]``, batch
chunk ``k*q + i`` and hidden chunk ``j`` at rank (k, i, j). In the docstrings,
``b' = b/(d q)``; "shared" means replicated over ``col`` x ``dep`` with the gradient
summed there (two all_reduces of the parameter's local size backward, the ``dep``
one absent in 2D). Every layer keeps the standard layout in and out, so 'enter',
'exit' and plain linears are the same layer.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ...communication import copy_to, reduce_from, reduce_scatter_to
from ...context import ParallelMode, seed
from ...tensor import Init, ShardedModule, new_parameter, tag, tied_or_new_parameter
from ..functional import check_ids, vocab_range_lookup
from ..parallel_1d.layers import (PatchParameters, check_qkv_layers, embedding_init,
                                  fused_projection, linear_bias_init, linear_weight_init,
                                  ones_init, zeros_init)
from .grid import Grid2p5D, resolve_grid
from .summa import summa_linear


def block_cuts(grid: Grid2p5D) -> tuple:
    """``[out, in] -> [out/q, in/q]``: dim 0 over ``col`` (chunk i), dim 1 over ``row`` (chunk j)."""
    return (0, grid.col), (1, grid.row)


def hidden_cut(grid: Grid2p5D, dim: int) -> tuple:
    """Split ``dim`` over ``row`` (chunk j); replicated over ``col`` and ``dep``."""
    return (dim, grid.row)


def batch_cuts(grid: Grid2p5D) -> tuple:
    """The batch of the standard layout: chunk ``k*q + i`` (``dep`` outer, ``col`` inner)."""
    return (0, grid.dep), (0, grid.col)


class SummaAffine2p5D(ShardedModule):
    """``y = x W^T + b`` by SUMMA: weight ``[out, in] -> [out/q, in/q]`` (block (i, j),
    replicated over dep), bias ``[out] -> [out/q]`` (chunk j, shared).

    x ``[b', .., in/q]`` -> y ``[b', .., out/q]``. Communication: see ``summa.SummaLinear``;
    the bias adds all_reduces of ``out/q`` over col and dep backward.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 weight: Optional[nn.Parameter] = None, grid: Optional[Grid2p5D] = None,
                 weight_init: Optional[Init] = None, bias_init: Optional[Init] = None,
                 dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.grid = resolve_grid(grid)
        self.grid.check_hidden(in_features, 'in_features')
        self.grid.check_hidden(out_features, 'out_features')
        self.in_features, self.out_features = in_features, out_features
        self.weight = tied_or_new_parameter(weight, (out_features, in_features),
                                            *block_cuts(self.grid), dtype=dtype,
                                            init=weight_init or linear_weight_init(in_features))
        self.bias = new_parameter((out_features,), hidden_cut(self.grid, 0), dtype=dtype,
                                  init=bias_init or linear_bias_init(in_features)) if bias else None

    def forward(self, x):
        y = summa_linear(x, self.weight, self.grid)
        return y + self.grid.shared(self.bias) if self.bias is not None else y


class Linear2p5D(SummaAffine2p5D):
    """The facade's Linear: standard layout in and out for every ``region``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 region: Optional[str] = None, **kwargs):
        if region not in ('enter', 'exit', None):
            raise ValueError(f"Linear region must be 'enter', 'exit' or None, got {region!r}")
        super().__init__(in_features, out_features, bias, **kwargs)


def qkv_2p5d(x, query: SummaAffine2p5D, key: SummaAffine2p5D, value: SummaAffine2p5D):
    """Fused, head-aligned q/k/v projection: one SUMMA linear over the blocked weight.

    Rank (k, i, j) holds ``W_q``'s block (out-chunk i, in-chunk j) ``[h/q, h/q]``, and so
    for k and v; ``cat`` of the three is block (i, j) of the blocked fused weight
    ``W [3h, h]`` whose out-chunk i is ``[q_i; k_i; v_i]`` (heads i*n/q .. (i+1)*n/q - 1),
    so the SUMMA output chunk j ``[b', s, 3h/q]`` splits into q_j, k_j, v_j with the
    standard layout, and the bias ``[bq_j; bk_j; bv_j]`` is shared once. Communication:
    one SummaLinear on ``[3h/q, h/q]`` blocks (the bytes of three, a third of the calls).
    """
    layers = (query, key, value)
    check_qkv_layers(layers, SummaAffine2p5D, lambda layer: layer.grid == query.grid,
                     'on one grid')

    def project(weight, bias):
        y = summa_linear(x, weight, query.grid)
        return y + query.grid.shared(bias) if bias is not None else y
    return fused_projection(x, layers, project)


def kv_linear_2p5d(in_features: int, kv_heads: int, head_dim: int, num_heads: int,
                   bias: bool = True, **kwargs):
    """The facade's KeyValueLinear: the Linear to ``kv_heads * head_dim``, whose output chunk j
    holds kv heads j*kv/q .. -- the ones query heads chunk j read, when q divides
    ``kv_heads`` (a ValueError otherwise: 2D/2.5D do not replicate kv heads)."""
    grid = resolve_grid(kwargs.pop('grid', None))
    if kv_heads % grid.q:
        raise ValueError(f'{grid.describe()} splits the heads over q={grid.q}: kv_heads '
                         f'{kv_heads} must be divisible by {grid.q} (only 1D replicates kv '
                         f'heads)')
    return Linear2p5D(in_features, kv_heads * head_dim, bias, region='enter', grid=grid, **kwargs)


def positions_2p5d(position_ids: torch.Tensor) -> torch.Tensor:
    """Positions of the standard layout's tokens: ``[s]`` whole, ``[b, s]`` batch chunk
    ``k*q + i``."""
    return position_ids if position_ids.dim() < 2 else Grid2p5D.current().split_batch(position_ids)


class VocabParallelClassifier2p5D(SummaAffine2p5D):
    """Logits split along the classes: weight ``[C, h] -> [C/q, h/q]`` (as a Linear, so it ties
    to :class:`VocabParallelEmbedding2p5D`), bias ``[C] -> [C/q]``.

    x ``[b', s, h/q]`` -> logits ``[b', s, C/q]`` (class chunk j), tagged vocab-parallel
    over ``row`` for the loss. Communication as a Linear.
    """

    def __init__(self, in_features: int, num_classes: int, bias: bool = False,
                 weight: Optional[nn.Parameter] = None, **kwargs):
        super().__init__(in_features, num_classes, bias, weight=weight, **kwargs)

    def forward(self, x):
        logits = super().forward(x)
        return tag(logits, *batch_cuts(self.grid), (-1, self.grid.row))


class Classifier2p5D(ShardedModule):
    """Logits for all classes: weight ``[C, h] -> [C, h/q]`` (chunk j, shared), bias ``[C]``
    replicated (shared).

    x ``[b', .., h/q]`` -> logits ``[b', .., C]``, replicated over ``row``. Forward: all_reduce
    of ``b' C`` (per token) over row. Backward: the shared all_reduces of the weight and bias.
    ``weight`` ties it to an :class:`Embedding2p5D` weight (same split).
    """

    def __init__(self, in_features: int, num_classes: int, bias: bool = True,
                 weight: Optional[nn.Parameter] = None, grid: Optional[Grid2p5D] = None,
                 weight_init: Optional[Init] = None, bias_init: Optional[Init] = None,
                 dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.grid = resolve_grid(grid)
        self.grid.check_hidden(in_features, 'Classifier in_features')
        self.in_features, self.num_classes = in_features, num_classes
        self.weight = tied_or_new_parameter(weight, (num_classes, in_features),
                                            hidden_cut(self.grid, 1), dtype=dtype,
                                            init=weight_init or linear_weight_init(in_features))
        self.bias = new_parameter((num_classes,), dtype=dtype,
                                  init=bias_init or linear_bias_init(in_features)) if bias else None

    def forward(self, x):
        y = reduce_from(F.linear(x, self.grid.shared(self.weight)), self.grid.row, inplace=True)
        return tag(y + self.grid.shared(self.bias) if self.bias is not None else y,
                   *batch_cuts(self.grid))


class LayerNorm2p5D(ShardedModule):
    """LayerNorm (``rms=True``: RMSNorm, no centering, weight only) over a hidden dim split
    in q: weight, bias ``[h] -> [h/q]`` (chunk j, shared).

    x ``[b', s, h/q]`` -> same. The row sums of x and of (x - mean)^2 are all_reduced over
    ``row`` (``b' s`` elements each, forward and again backward; RMSNorm: x^2 only).
    """

    def __init__(self, normalized_shape: int, eps: float = 1e-5, dtype=None,
                 grid: Optional[Grid2p5D] = None, rms: bool = False):
        super().__init__()
        self.grid = resolve_grid(grid)
        self.grid.check_hidden(normalized_shape, 'LayerNorm normalized_shape')
        self.normalized_shape, self.eps, self.rms = normalized_shape, eps, rms
        cut = hidden_cut(self.grid, 0)
        self.weight = new_parameter((normalized_shape,), cut, init=ones_init, dtype=dtype)
        self.bias = None if rms else new_parameter((normalized_shape,), cut, init=zeros_init,
                                                   dtype=dtype)

    def _row_mean(self, t):
        total = reduce_from(t.sum(dim=-1, keepdim=True), self.grid.row)
        return copy_to(total, self.grid.row) / self.normalized_shape

    def forward(self, x):
        x32 = x.float()  # statistics in fp32, as torch's LayerNorm: rsqrt'^3 overflows fp16
        centered = x32 if self.rms else x32 - self._row_mean(x32)
        var = self._row_mean(centered * centered)
        y = (centered * torch.rsqrt(var + self.eps)).to(x.dtype)
        y = y * self.grid.shared(self.weight)
        return y if self.bias is None else y + self.grid.shared(self.bias)


class Embedding2p5D(ShardedModule):
    """Lookup with the hidden dim split: weight ``[V, h] -> [V, h/q]`` (chunk j, shared).

    ids: the user's full ``[b, s]`` (split locally) -> ``[b', s, h/q]``. Forward: none.
    Backward: the shared all_reduces of the weight (``V h/q`` over col and dep).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: Optional[int] = None,
                 grid: Optional[Grid2p5D] = None, weight_init: Optional[Init] = None,
                 dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.grid = resolve_grid(grid)
        self.grid.check_hidden(embedding_dim, 'Embedding embedding_dim')
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = padding_idx
        self.weight = new_parameter((num_embeddings, embedding_dim), hidden_cut(self.grid, 1),
                                    init=embedding_init(padding_idx, weight_init), dtype=dtype)

    def forward(self, ids):
        check_ids(ids, self.num_embeddings, 'Embedding')
        return F.embedding(self.grid.split_batch(ids), self.grid.shared(self.weight),
                           self.padding_idx)


class VocabParallelEmbedding2p5D(ShardedModule):
    """Lookup with the vocabulary split: weight ``[V, h] -> [V/q, h/q]`` (vocab chunk i, hidden
    chunk j, as a Linear weight, so a VocabParallelClassifier can tie to it).

    ids: full ``[b, s]``; each rank looks up its depth layer's ``b/d`` rows in its vocab chunk
    (zeros elsewhere) and a reduce_scatter over ``col`` along the batch sums the vocab chunks
    and leaves batch chunk i: ``[b', s, h/q]``. Forward: reduce_scatter of ``(b/d) s h/q``.
    Backward: all_gather of the same over col, all_reduce of ``V h/q^2`` over dep.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: Optional[int] = None,
                 grid: Optional[Grid2p5D] = None, weight_init: Optional[Init] = None,
                 dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.grid = resolve_grid(grid)
        self.grid.check_hidden(num_embeddings, 'VocabParallelEmbedding num_embeddings')
        self.grid.check_hidden(embedding_dim, 'VocabParallelEmbedding embedding_dim')
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        per_rank = num_embeddings // self.grid.q
        self.vocab_start = self.grid.i * per_rank
        self.vocab_end = self.vocab_start + per_rank
        self.padding_idx = padding_idx
        self.weight = new_parameter((num_embeddings, embedding_dim), *block_cuts(self.grid),
                                    init=embedding_init(padding_idx, weight_init), dtype=dtype)

    def forward(self, ids):
        check_ids(ids, self.num_embeddings, 'VocabParallelEmbedding')
        ids = self.grid.split_depth(ids)
        weight = _grid_dep_shared(self.weight, self.grid)
        out = vocab_range_lookup(ids, weight, self.vocab_start, self.vocab_end, self.padding_idx)
        return reduce_scatter_to(out, self.grid.col, 0)


def _grid_dep_shared(weight, grid: Grid2p5D):
    """Identity forward; weight gradient summed over the depth layers backward."""
    return copy_to(weight, grid.dep)


class PatchEmbedding2p5D(PatchParameters):
    """Images -> ``[b', 1 + n, h/q]``: conv patches, class token, positions, all split along the
    hidden (embedding) dim over ``row`` and shared: proj.weight ``[h, C, P, P] -> [h/q, C, P, P]``,
    proj.bias ``[h] -> [h/q]``, cls_token ``[1, 1, h] -> [1, 1, h/q]``,
    pos_embed ``[1, 1+n, h] -> [1, 1+n, h/q]``. Images: full ``[b, C, H, W]``, split locally.
    Forward: none. Backward: the shared all_reduces.
    """

    def __init__(self, img_size: int, patch_size: int, in_chans: int, embed_size: int,
                 dtype=None, grid: Optional[Grid2p5D] = None, weight_init: Optional[Init] = None):
        grid = resolve_grid(grid)
        grid.check_hidden(embed_size, 'PatchEmbedding embed_size')
        super().__init__(img_size, patch_size, in_chans, embed_size, grid.row, dtype)
        self.grid = grid

    def forward(self, images):
        return self.embed(self.grid.split_batch(images), self.grid.shared)


class Dropout2p5D(nn.Module):
    """Dropout; every activation is a distinct shard, so each rank draws from the TENSOR
    stream (when the grid has more than one rank). No communication."""

    def __init__(self, p: float = 0.5, inside_region: bool = False,
                 grid: Optional[Grid2p5D] = None):
        super().__init__()
        self.p, self.inside_region = p, inside_region
        self.grid = resolve_grid(grid)

    def rng(self):
        return seed(ParallelMode.TENSOR) if self.grid.size > 1 else contextlib.nullcontext()

    def forward(self, x):
        if not self.training or self.p == 0:
            return x
        with self.rng():
            return F.dropout(x, self.p, True)
