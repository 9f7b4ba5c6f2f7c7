"""3D tensor-parallel layers (q^3 ranks, the cube algorithm of Agarwal et al.).

Notation: rank (i, j, l) on the INPUT, WEIGHT and OUTPUT axes (see ``cube.py``).
Activations use the *standard* layout ``[b, ..., h] -> [b/q^2, ..., h/q]``
(batch chunk j*q+i, hidden chunk l) between blocks, and the *swapped* layout
(batch chunk l*q+i, hidden chunk j) inside a parallel region. Every layer
docstring gives each tensor's split (full -> local) and its collectives.
Parameters replicated over groups whose members see different tokens get
their gradients summed over those groups (``shared_over`` = copy_to per group).
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ...communication import collective as C
from ...communication import reduce_from, reduce_scatter_to
from ...context import ParallelMode, seed
from ...tensor import Init, ShardedModule, new_parameter, tag, tied_or_new_parameter
from .._grid import shared_over
from ..functional import check_ids, matmul_dtype, vocab_range_lookup
from ..parallel_1d.layers import (PatchParameters, check_qkv_layers, embedding_init,
                                  fused_projection, linear_bias_init, linear_weight_init,
                                  ones_init, zeros_init)
from .cube import (ActLayout, Cube3D, Orientation, check_batch, default_cube, split_batch,
                   sum_partials, swap_layout)



def _check(size: int, parts: int, what: str, q: int):
    if size % parts:
        raise ValueError(f'3D tensor parallelism (q={q}) needs {what} = {size} divisible by '
                         f'{parts}')


def tag_logits(logits: torch.Tensor, batch: ActLayout, vocab=None) -> torch.Tensor:
    """Tag logits with their placement: the batch cut of ``batch``, the classes by ``vocab``."""
    return tag(logits, *batch.batch_cuts, *(((-1, vocab),) if vocab is not None else ()))


class _CubeLinear(torch.autograd.Function):
    """y = x A^T + b on the cube (see :class:`Orientation`).

    Forward: all_gather x (``x_gather``) and A, b (``w_gather``), all async together; matmul;
    reduce_scatter y (``y_scatter``). Backward: all_gather dy (``y_scatter``) -- and, unless
    ``keep_gathered``, x and A again, concurrently; dA = dy^T x and db = sum dy are
    reduce_scattered over ``w_gather`` asynchronously while dx = dy A is computed and
    reduce_scattered over ``x_gather``.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, orient: Orientation, keep_gathered: bool):
        b_pending = C.all_gather(bias, orient.w_gather, 0, async_op=True) if bias is not None else None
        x_full, w_full = _gather_operands(x, weight, orient)
        y = C.reduce_scatter(F.linear(x_full, w_full), orient.y_scatter, 0)
        if b_pending is not None:
            y = y + b_pending.wait()
        ctx.save_for_backward(*((x_full, w_full) if keep_gathered else (x, weight)))
        ctx.orient, ctx.has_bias, ctx.keep_gathered = orient, bias is not None, keep_gathered
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.compute_dtype = matmul_dtype(x, weight)
        return y

    @staticmethod
    def backward(ctx, dy):
        orient = ctx.orient
        dy_pending = C.all_gather(dy.contiguous(), orient.y_scatter, 0, async_op=True)
        if ctx.keep_gathered:
            x_full, w_full = ctx.saved_tensors
        else:
            x_full, w_full = _gather_operands(*ctx.saved_tensors, orient)
        compute = ctx.compute_dtype  # backward runs outside autocast: use forward's dtype
        x_full, w_full = x_full.to(compute), w_full.to(compute)
        dy_full = dy_pending.wait().to(compute)
        dy2 = dy_full.reshape(-1, dy_full.shape[-1])
        dw = dy2.t().mm(x_full.reshape(-1, x_full.shape[-1]))
        dw_pending = C.reduce_scatter(dw, orient.w_gather, 0, async_op=True)
        db_pending = C.reduce_scatter(dy2.sum(0), orient.w_gather, 0, async_op=True) \
            if ctx.has_bias else None
        dx = C.reduce_scatter(dy_full.matmul(w_full), orient.x_gather, 0)
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        db = db_pending.wait().to(b_dtype) if db_pending is not None else None
        return dx.to(x_dtype), dw_pending.wait().to(w_dtype), db, None, None


def _gather_operands(x, weight, orient: Orientation):
    """x all-gathered over ``x_gather`` and A over ``w_gather`` (both in flight at once)."""
    x_pending = C.all_gather(x, orient.x_gather, 0, async_op=True)
    w_pending = C.all_gather(weight, orient.w_gather, 0, async_op=True)
    return x_pending.wait(), w_pending.wait()


class Linear3D(ShardedModule):
    """y = x A^T + b on the cube. Weight ``[out, in] -> [out/q^2, in/q]``, bias ``[out] -> [out/q^2]``.

    ``region='enter'``: input standard ``[b/q^2, .., in/q]`` (batch j*q+i, hidden l),
    output swapped ``[b/q^2, .., out/q]`` (batch l*q+i, hidden j); A's rows cut by
    WEIGHT then INPUT (chunk j*q+i), its columns by OUTPUT (chunk l).
    ``region='exit'``: the same with WEIGHT and OUTPUT exchanged (swapped -> standard).
    ``region=None``: 'enter' followed by :func:`swap_layout` (standard in and out).
    ``keep_gathered``: save the gathered x and A for backward (+1/q^2 of x and of A kept per
    rank) instead of the local shards (default; costs one more all_gather of each backward).

    Collectives (enter; exit exchanges WEIGHT and OUTPUT): forward all_gather x over
    WEIGHT, A and b over INPUT, reduce_scatter y over OUTPUT; backward all_gather dy
    over OUTPUT, reduce_scatter dA and db over INPUT (async), reduce_scatter dx over
    WEIGHT, plus (default) the all_gathers of x and A again; region None adds one
    send+recv of y (and of dy) over OUTPUT_X_WEIGHT.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 region: Optional[str] = None, cube: Optional[Cube3D] = None,
                 weight: Optional[nn.Parameter] = None, weight_init: Optional[Init] = None,
                 bias_init: Optional[Init] = None, dtype: Optional[torch.dtype] = None,
                 keep_gathered: bool = False):
        super().__init__()
        if region not in ('enter', 'exit', None):
            raise ValueError(f"Linear region must be 'enter', 'exit' or None, got {region!r}")
        self.cube = default_cube(cube)
        q = self.cube.q
        _check(in_features, q, 'Linear in_features', q)
        _check(out_features, q * q, 'Linear out_features', q)
        self.in_features, self.out_features, self.region = in_features, out_features, region
        self.keep_gathered = keep_gathered
        self.orient = self.cube.exit if region == 'exit' else self.cube.enter
        self.weight = tied_or_new_parameter(weight, (out_features, in_features),
                                            *self.orient.weight_cuts, dtype=dtype,
                                            init=weight_init or linear_weight_init(in_features))
        self.bias = new_parameter((out_features,), *self.orient.bias_cuts, dtype=dtype,
                                  init=bias_init or linear_bias_init(in_features)) if bias else None

    def forward(self, x):
        if x.shape[-1] * self.cube.q != self.in_features:
            raise ValueError(f'3D Linear expects a local input of last dim in_features/q = '
                             f'{self.in_features}/{self.cube.q}, got {x.shape[-1]}')
        y = _CubeLinear.apply(x, self.weight, self.bias, self.orient, self.keep_gathered)
        return swap_layout(y, self.cube) if self.region is None else y


def qkv_3d(x, query: Linear3D, key: Linear3D, value: Linear3D):
    """Fused q/k/v projection: one 'enter' cube matmul over the three weights' shards.

    Rank (i, j, l) holds rows chunk ``j*q + i`` (``h/q^2`` rows) of each of W_q, W_k, W_v;
    ``cat`` gives ``[q_{jq+i}; k_{jq+i}; v_{jq+i}]``, and the all_gather over INPUT stacks
    these for i = 0..q-1, so the fused output ``[.., 3h/q]`` (hidden chunk j, swapped
    layout) is ordered (i, {q, k, v}, h/q^2); regrouping by {q, k, v} (a copy) gives each
    its ``[.., h/q]`` chunk j, heads j*n/q .. (j+1)*n/q - 1 as the three linears would.
    Communication: one 'enter' Linear3D on the fused shards (the bytes of three, a third
    of the calls).
    """
    layers = (query, key, value)
    check_qkv_layers(layers, Linear3D, lambda layer: layer.region == 'enter'
                     and layer.orient == query.orient
                     and layer.keep_gathered == query.keep_gathered,
                     "'enter', one cube")
    q = query.orient.w_gather.size
    rows = [layer.weight.shape[0] for layer in layers]  # k, v narrower under GQA

    def project(weight, bias):
        return _CubeLinear.apply(x, weight, bias, query.orient, query.keep_gathered)

    def split(y):
        parts = y.unflatten(-1, (q, sum(rows))).split(rows, dim=-1)
        return tuple(t.flatten(-2) for t in parts)
    return fused_projection(x, layers, project, split)


def kv_linear_3d(in_features: int, kv_heads: int, head_dim: int, num_heads: int,
                 bias: bool = True, **kwargs):
    """The facade's KeyValueLinear: the 'enter' Linear3D to ``kv_heads * head_dim`` (hidden
    chunk j holds the kv heads query heads chunk j read) when q divides ``kv_heads``; a
    ValueError otherwise (3D does not replicate kv heads)."""
    cube = default_cube(kwargs.pop('cube', None))
    if kv_heads % cube.q:
        raise ValueError(f'3D attention splits the heads over q={cube.q}: kv_heads {kv_heads} '
                         f'must be divisible by {cube.q} (only 1D replicates kv heads)')
    return Linear3D(in_features, kv_heads * head_dim, bias, region='enter', cube=cube, **kwargs)


def positions_3d(position_ids: torch.Tensor) -> torch.Tensor:
    """Positions of the q, k, v tokens (the swapped layout 'enter' linears produce): ``[s]``
    whole, ``[b, s]`` batch chunk ``l*q + i``."""
    if position_ids.dim() < 2:
        return position_ids
    return split_batch(position_ids, default_cube(None).swapped, 'position_ids')


class VocabParallelClassifier3D(Linear3D):
    """Logits with the classes split: an 'enter' :class:`Linear3D` (same weight split, so it
    ties to :class:`VocabParallelEmbedding3D`). Input standard; logits ``[b, .., C] ->
    [b/q^2, .., C/q]`` (batch l*q+i, classes chunk j over WEIGHT), tagged for the loss."""

    def __init__(self, in_features: int, num_classes: int, bias: bool = False, weight=None,
                 cube: Optional[Cube3D] = None, weight_init: Optional[Init] = None,
                 bias_init: Optional[Init] = None, dtype: Optional[torch.dtype] = None,
                 keep_gathered: bool = False):
        super().__init__(in_features, num_classes, bias=bias, region='enter', cube=cube,
                         weight=weight, weight_init=weight_init, bias_init=bias_init, dtype=dtype,
                         keep_gathered=keep_gathered)
        self.num_classes = num_classes

    def forward(self, x):
        logits = super().forward(x)
        return tag_logits(logits, self.cube.swapped, self.cube.weight)


class Classifier3D(ShardedModule):
    """Logits for all classes: weight ``[C, h] -> [C, h/q]`` (cut by OUTPUT), bias ``[C]`` whole.

    Input standard ``[b/q^2, .., h/q]``; logits ``[b/q^2, .., C]`` (batch j*q+i), the same
    on every OUTPUT rank. Forward: all_reduce of partial logits over OUTPUT. Backward:
    all_reduce of dW and db over INPUT_X_WEIGHT. ``weight`` ties to an :class:`Embedding3D`.
    """

    def __init__(self, in_features: int, num_classes: int, bias: bool = True, weight=None,
                 cube: Optional[Cube3D] = None, weight_init: Optional[Init] = None,
                 bias_init: Optional[Init] = None, dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.cube = default_cube(cube)
        _check(in_features, self.cube.q, 'Classifier in_features', self.cube.q)
        self.in_features, self.num_classes = in_features, num_classes
        self.weight = tied_or_new_parameter(weight, (num_classes, in_features),
                                            (1, self.cube.output), dtype=dtype,
                                            init=weight_init or linear_weight_init(in_features))
        self.bias = new_parameter((num_classes,), dtype=dtype,
                                  init=bias_init or linear_bias_init(in_features)) if bias else None

    def forward(self, x):
        tokens = (self.cube.input_x_weight,)
        logits = reduce_from(F.linear(x, shared_over(self.weight, tokens)), self.cube.output, inplace=True)
        if self.bias is not None:
            logits = logits + shared_over(self.bias, tokens)
        return tag_logits(logits, self.cube.standard)


class LayerNorm3D(ShardedModule):
    """LayerNorm (``rms=True``: RMSNorm, no centering, weight only) over a hidden dim split
    by OUTPUT: weight, bias ``[h] -> [h/q]``.

    Input/output standard ``[b/q^2, .., h/q]``. Forward: 2 all_reduces over OUTPUT of
    ``[b/q^2, ..]`` (sum, then sum of squared deviations; RMSNorm: the squares only);
    backward the same; dW, db all_reduced over INPUT_X_WEIGHT.
    """

    def __init__(self, normalized_shape: int, eps: float = 1e-5, cube: Optional[Cube3D] = None,
                 dtype: Optional[torch.dtype] = None, rms: bool = False):
        super().__init__()
        self.cube = default_cube(cube)
        _check(normalized_shape, self.cube.q, 'LayerNorm normalized_shape', self.cube.q)
        self.normalized_shape, self.eps, self.rms = normalized_shape, eps, rms
        cut = (0, self.cube.output)
        self.weight = new_parameter((normalized_shape,), cut, init=ones_init, dtype=dtype)
        self.bias = None if rms else new_parameter((normalized_shape,), cut, init=zeros_init,
                                                   dtype=dtype)

    def forward(self, x):
        axis, tokens = self.cube.output, (self.cube.input_x_weight,)
        x32 = x.float()  # statistics in fp32, as torch's LayerNorm: rsqrt'^3 overflows fp16
        centered = x32
        if not self.rms:
            centered = x32 - sum_partials(x32.sum(-1, keepdim=True), axis) / self.normalized_shape
        var = sum_partials((centered * centered).sum(-1, keepdim=True), axis) / self.normalized_shape
        normed = (centered * torch.rsqrt(var + self.eps)).to(x.dtype)
        y = normed * shared_over(self.weight, tokens)
        return y if self.bias is None else y + shared_over(self.bias, tokens)


class Embedding3D(ShardedModule):
    """Lookup with the hidden dim split: weight ``[V, h] -> [V, h/q]`` (cut by OUTPUT).

    Full ids ``[b, s]`` -> standard ``[b/q^2, s, h/q]``. Forward: none (ids split locally).
    Backward: all_reduce of dW over INPUT_X_WEIGHT.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: Optional[int] = None,
                 cube: Optional[Cube3D] = None, weight_init: Optional[Init] = None,
                 dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.cube = default_cube(cube)
        _check(embedding_dim, self.cube.q, 'Embedding embedding_dim', self.cube.q)
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        self.weight = new_parameter((num_embeddings, embedding_dim), (1, self.cube.output),
                                    init=embedding_init(padding_idx, weight_init), dtype=dtype)

    def forward(self, ids):
        check_ids(ids, self.num_embeddings, 'Embedding')
        ids = split_batch(ids, self.cube.standard, 'Embedding ids')
        weight = shared_over(self.weight, (self.cube.input_x_weight,))
        return F.embedding(ids, weight, self.padding_idx)


class VocabParallelEmbedding3D(ShardedModule):
    """Lookup with the vocabulary split: weight ``[V, h] -> [V/q^2, h/q]`` (rows cut by WEIGHT
    then INPUT, i.e. chunk j*q+i = the INPUT_X_WEIGHT rank; columns by OUTPUT), the split of
    :class:`VocabParallelClassifier3D`, so the two can be tied.

    Full ids ``[b, s]`` -> standard ``[b/q^2, s, h/q]``: each rank looks up the whole batch in
    its vocabulary rows (zeros elsewhere), then reduce_scatter over INPUT_X_WEIGHT (batch).
    Backward: all_gather of the output gradient over INPUT_X_WEIGHT; dW is then complete.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: Optional[int] = None,
                 cube: Optional[Cube3D] = None, weight_init: Optional[Init] = None,
                 dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.cube = default_cube(cube)
        q = self.cube.q
        _check(num_embeddings, q * q, 'VocabParallelEmbedding num_embeddings', q)
        _check(embedding_dim, q, 'VocabParallelEmbedding embedding_dim', q)
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        plane = self.cube.input_x_weight
        self.vocab_start = plane.rank * (num_embeddings // plane.size)
        self.vocab_end = self.vocab_start + num_embeddings // plane.size
        self.weight = new_parameter((num_embeddings, embedding_dim), *self.cube.enter.weight_cuts,
                                    init=embedding_init(padding_idx, weight_init), dtype=dtype)

    def forward(self, ids):
        check_batch(ids.shape[0], self.cube.standard, 'VocabParallelEmbedding ids')
        check_ids(ids, self.num_embeddings, 'VocabParallelEmbedding')
        out = vocab_range_lookup(ids, self.weight, self.vocab_start, self.vocab_end,
                                 self.padding_idx)
        return reduce_scatter_to(out, self.cube.input_x_weight, 0)


class PatchEmbedding3D(PatchParameters):
    """Images ``[b, C, H, W]`` -> standard ``[b/q^2, 1 + n, h/q]`` (class token + positions).

    proj.weight ``[h, C, P, P] -> [h/q, C, P, P]``, proj.bias, cls_token ``[1, 1, h]`` and
    pos_embed ``[1, 1 + n, h]`` cut along h by OUTPUT. Images are split by batch locally.
    Forward: none. Backward: all_reduce of every gradient over INPUT_X_WEIGHT.
    """

    def __init__(self, img_size: int, patch_size: int, in_chans: int, embed_size: int,
                 cube: Optional[Cube3D] = None, dtype: Optional[torch.dtype] = None,
                 weight_init: Optional[Init] = None):
        cube = default_cube(cube)
        _check(embed_size, cube.q, 'PatchEmbedding embed_size', cube.q)
        super().__init__(img_size, patch_size, in_chans, embed_size, cube.output, dtype)
        self.cube = cube

    def forward(self, images):
        images = split_batch(images, self.cube.standard, 'PatchEmbedding images')
        return self.embed(images, lambda p: shared_over(p, (self.cube.input_x_weight,)))


class Dropout3D(nn.Module):
    """Dropout on sharded activations: every element lives on one rank, so every rank draws
    its own mask from the TENSOR stream (``inside_region`` makes no difference). No
    communication."""

    def __init__(self, p: float = 0.5, inside_region: bool = False, cube: Optional[Cube3D] = None):
        super().__init__()
        self.p, self.inside_region = p, inside_region
        self.cube = default_cube(cube)

    def rng(self):
        return seed(ParallelMode.TENSOR) if self.cube.q > 1 else contextlib.nullcontext()

    def forward(self, x):
        if not self.training or self.p == 0:
            return x
        with self.rng():
            return F.dropout(x, self.p, True)
