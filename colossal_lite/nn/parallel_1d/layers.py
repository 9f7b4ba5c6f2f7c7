"""1D (Megatron) tensor parallelism over the PARALLEL_1D group of p ranks.

Activations outside a parallel region are replicated ``[b, s, h]`` on every
rank. A region opens with a column-parallel linear (output split along the
last dim) and closes with a row-parallel linear (input split, output summed).
Each layer's docstring gives the sharding of its weights (``full -> local``)
and the collectives it issues. With a one-rank group every layer is exactly
the serial torch layer; serial runs and pure data parallelism use them so.

Sequence parallelism (``tensor=dict(mode='1d', sequence_parallel=True)``, Megatron's):
outside the regions an activation is rank r's sequence block ``[b, s/p, h]``. A region
opens with an all_gather along the sequence (backward: reduce_scatter of dx) instead of
the identity (backward: all_reduce), and closes with a reduce_scatter along the sequence
instead of an all_reduce -- the same bytes, and the norms, dropout and residuals between
regions hold 1/p of the tokens. Their replicated weights see only the local tokens, so
their gradients are summed over the group (``partial_grad_param``: one bucketed all_reduce
at the end of the backward pass). On gloo each of these
all_gathers and reduce_scatters is one all_to_all (``collective.prefers_pairwise``).
"""
from __future__ import annotations

import contextlib
import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ...communication import (copy_to, gather_from, partial_grad_param, reduce_from,
                              reduce_scatter_to, split_to)
from ...communication.collective import check_divisible, prefers_pairwise
from ...context import ParallelMode, ProcessGroupAxis, current_context, seed
from ...tensor import Init, ShardedModule, new_parameter, tag, tied_or_new_parameter
from ...tensor.adjacent import join_rows
from ..functional import check_ids, dense_linear, vocab_range_lookup
from .overlap import column_matmul, column_matmul_rows, rank_major

def default_axis() -> ProcessGroupAxis:
    """PARALLEL_1D when the current context's mode is 1D, else a one-rank group (serial)."""
    ctx = current_context()
    if ctx.tensor_mode == '1d':
        return ctx.axis(ParallelMode.PARALLEL_1D)
    return ProcessGroupAxis.serial(ParallelMode.PARALLEL_1D)


def sequence_dim(axis: ProcessGroupAxis) -> Optional[int]:
    """1 (the sequence dim of ``[b, s, h]``) when the launched layout runs sequence
    parallelism inside 1D tensor parallelism over ``axis`` (more than one rank), else None."""
    ctx = current_context()
    on = ctx.tensor_mode == '1d' and ctx.layout.sequence_parallel and axis.size > 1
    return 1 if on else None


def tokens_dim(seq_dim: Optional[int], x: torch.Tensor) -> Optional[int]:
    """``seq_dim`` for token activations ``[b, s(/p), ..]``; None for per-sample ones
    ``[b, h]`` (a pooled first token), which stay replicated under sequence parallelism."""
    return seq_dim if x.dim() >= 3 else None


def to_sequence_block(x: torch.Tensor, axis: ProcessGroupAxis, seq_dim: Optional[int],
                      what: str = 'sequence length') -> torch.Tensor:
    """A replicated ``[b, s, ..]`` as this rank's block ``[b, s/p, ..]`` under sequence
    parallelism (gradient blocks all_gathered backward); ``x`` itself otherwise."""
    if seq_dim is None:
        return x
    check_sequence_block(x.shape[seq_dim], axis, what)
    return split_to(x, axis, seq_dim)


def check_sequence_block(length: int, axis: ProcessGroupAxis, what: str = 'sequence length'):
    if length % axis.size:
        raise ValueError(f'sequence parallelism inside 1D tensor parallelism needs the {what} '
                         f'divisible by the tensor size p={axis.size}, got {length}')


def linear_weight_init(fan_in: int) -> Init:
    """torch.nn.Linear's weight init (kaiming uniform, a=sqrt(5)), on the full weight."""
    return lambda w, g: nn.init.kaiming_uniform_(w, a=math.sqrt(5), generator=g)


def linear_bias_init(fan_in: int) -> Init:
    bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
    return lambda b, g: nn.init.uniform_(b, -bound, bound, generator=g)


def _check(size: int, parts: int, what: str):
    check_divisible(size, parts, what)


class ColumnLinear1D(ShardedModule):
    """y = x A^T + b with A split by output rows: weight [out, in] -> [out/p, in], bias [out/p].

    Input replicated [.., in]; output [.., out/p] (or gathered [.., out]).
    Forward: none (all_gather of y if ``gather_output``). Backward: all_reduce of dx,
    overlapped with the weight-gradient matmul (``overlap.py``). Sequence parallel: input
    ``[b, s/p, in]`` all_gathered along the sequence (backward reduce_scatter of dx); a
    gathered output is cut back to the rank's sequence block.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 gather_output: bool = False, axis: Optional[ProcessGroupAxis] = None,
                 weight_init: Optional[Init] = None, bias_init: Optional[Init] = None,
                 dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.axis = axis or default_axis()
        _check(out_features, self.axis.size, 'Linear out_features (1D column split)')
        self.in_features, self.out_features, self.gather_output = in_features, out_features, gather_output
        self.seq_dim = sequence_dim(self.axis)
        self.weight = new_parameter((out_features, in_features), (0, self.axis),
                                    init=weight_init or linear_weight_init(in_features), dtype=dtype)
        self.bias = new_parameter((out_features,), (0, self.axis), dtype=dtype,
                                  init=bias_init or linear_bias_init(in_features)) if bias else None

    @property
    def local_width(self) -> int:
        """Width of the local (ungathered) output: ``out / p``."""
        return self.out_features // self.axis.size

    def local_rows(self) -> tuple:
        """(weight, bias or None) as this rank multiplies them: its own shards."""
        return self.weight, self.bias

    def forward(self, x):
        if self.axis.size == 1:  # serial: F.linear on oneDNN (functional.dense_linear)
            return dense_linear(x, self.weight, self.bias)
        seq_dim = tokens_dim(self.seq_dim, x)
        y = column_matmul(x, self.weight, self.bias, self.axis, seq_dim)
        if not self.gather_output:
            return y
        return to_sequence_block(gather_from(y, self.axis, -1), self.axis, seq_dim)


class RowLinear1D(ShardedModule):
    """y = x A^T + b with A split by input columns: weight [out, in] -> [out, in/p], bias replicated.

    Input [.., in/p] (or replicated [.., in], split locally); output replicated [.., out].
    Forward: all_reduce of the partial products. Backward: none (all_gather of dx
    if the input was replicated). Sequence parallel: reduce_scatter along the sequence
    -> ``[b, s/p, out]``; the bias gradient summed over the group.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 input_is_parallel: bool = True, axis: Optional[ProcessGroupAxis] = None,
                 weight_init: Optional[Init] = None, bias_init: Optional[Init] = None,
                 dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.axis = axis or default_axis()
        _check(in_features, self.axis.size, 'Linear in_features (1D row split)')
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel = input_is_parallel
        self.seq_dim = sequence_dim(self.axis)
        self.weight = new_parameter((out_features, in_features), (1, self.axis),
                                    init=weight_init or linear_weight_init(in_features), dtype=dtype)
        self.bias = new_parameter((out_features,), dtype=dtype,
                                  init=bias_init or linear_bias_init(in_features)) if bias else None

    def forward(self, x):
        if not self.input_is_parallel:
            x = split_to(x, self.axis, -1)
        seq_dim = tokens_dim(self.seq_dim, x)
        if seq_dim is None:
            local = dense_linear if self.axis.size == 1 else F.linear
            y = reduce_from(local(x, self.weight), self.axis, inplace=True)
            return y + self.bias if self.bias is not None else y
        check_sequence_block(x.shape[seq_dim], self.axis)
        # rank-major rows (overlap.py): the scattered [p, b, s/p, out] comes out of the
        # matmul as it is, and its gradient arrives gathered in that order
        y = F.linear(rank_major(x, self.axis.size, seq_dim), self.weight)
        y = reduce_scatter_to(y, self.axis, 0, pairwise=prefers_pairwise(self.axis)).squeeze(0)
        return y + partial_grad_param(self.bias, self.axis) if self.bias is not None else y


def linear_1d(in_features: int, out_features: int, bias: bool = True,
              region: Optional[str] = None, **kwargs):
    """The facade's choice: 'enter' -> column (output stays split), 'exit' -> row,
    None -> column with the output gathered (replicated in, replicated out)."""
    if region == 'enter':
        return ColumnLinear1D(in_features, out_features, bias, gather_output=False, **kwargs)
    if region == 'exit':
        return RowLinear1D(in_features, out_features, bias, input_is_parallel=True, **kwargs)
    if region is None:
        return ColumnLinear1D(in_features, out_features, bias, gather_output=True, **kwargs)
    raise ValueError(f"Linear region must be 'enter', 'exit' or None, got {region!r}")


def qkv_1d(x, query: ColumnLinear1D, key, value):
    """Fused, head-aligned q/k/v projection of three 'enter' ColumnLinear1D over one axis
    (``key``/``value`` may be :class:`GroupedKVLinear1D`: replicated kv heads).

    Each layer holds its rows ``[h/p, h]`` (rank r: heads r*n/p .. (r+1)*n/p - 1), so
    ``cat(Wq_r, Wk_r, Wv_r)`` is rank r's block of the blocked fused weight
    ``W[3h, h]`` with ``W_r = [q_r; k_r; v_r]``. Input replicated ``[.., h]``; one matmul
    -> ``[.., 3h/p]``, returned as three ``[.., h/p]`` views. Forward: none. Backward:
    one all_reduce of dx (not three); the concatenation's gradient splits back into
    the three layers' own parameters. The layers' forward hooks (e.g. ZeRO's chunk
    gathering) fire as if each were called: every pre-hook before the matmul, every
    hook after it on the layer's own output view.
    """
    layers = (query, key, value)
    if query.axis.size == 1 and torch.compiler.is_compiling():
        # a traced serial model (auto/graph) sees the three projections the model names,
        # which a graph plan can split one by one; storage joins are not traceable
        return query(x), key(x), value(x)
    check_qkv_layers(layers, (ColumnLinear1D, GroupedKVLinear1D),
                     lambda layer: not layer.gather_output
                     and layer.axis.group is query.axis.group, "'enter' (gather_output=False) "
                     'over one axis')
    seq_dim = query.seq_dim
    if query.axis.size == 1:  # serial: one F.linear of the joined rows, on oneDNN
        return fused_projection(x, layers, lambda w, b: dense_linear(x, w, b))
    if not any(isinstance(layer, GroupedKVLinear1D) for layer in layers):
        return fused_projection(x, layers, lambda w, b: column_matmul_rows(
            x, w, b, query.axis, seq_dim), blocks=True)

    def project(weights, biases):  # the replicated kv layers contribute their own rows
        rows = [layer.local_rows() for layer in layers]
        return column_matmul_rows(x, [w for w, _ in rows],
                                  None if biases is None else [b for _, b in rows], query.axis,
                                  seq_dim)

    widths = [layer.local_width for layer in layers]
    return fused_projection(x, layers, project, split=lambda y: y.split(widths, dim=-1),
                            blocks=True)


class GroupedKVLinear1D(ShardedModule):
    """The k (or v) projection of grouped-query attention when the p ranks outnumber the
    ``kv_heads`` (p divisible by kv_heads): weight ``[kv*d, in]`` and bias ``[kv*d]``
    replicated; rank r uses the rows of kv head ``g = r * kv / p``, the one its query heads
    ``r*n/p .. (r+1)*n/p - 1`` read (Megatron's replicated kv heads).

    Input replicated ``[.., in]``; output ``[.., d]``. Forward: none. Backward: all_reduce of
    dx over the axis (each rank's dx covers its own query heads' share, as in a column
    linear) and all_reduce of the full dW, db over the axis (the replicas' partial
    gradients; rows of heads a rank does not use are zero there)."""

    def __init__(self, in_features: int, kv_heads: int, head_dim: int, num_heads: int,
                 bias: bool = True, axis: Optional[ProcessGroupAxis] = None,
                 weight_init: Optional[Init] = None, bias_init: Optional[Init] = None,
                 dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.axis = axis or default_axis()
        p = self.axis.size
        if p % kv_heads:
            raise ValueError(f'kv_heads {kv_heads} must divide, or be divisible by, the {p} '
                             f'ranks of the 1D tensor split')
        out_features = kv_heads * head_dim
        self.in_features, self.out_features, self.gather_output = in_features, out_features, False
        self.head_dim, self.kv_head = head_dim, self.axis.rank * kv_heads // p
        self.local_width, self.seq_dim = head_dim, sequence_dim(self.axis)
        self.weight = new_parameter((out_features, in_features), dtype=dtype,
                                    init=weight_init or linear_weight_init(in_features))
        self.bias = new_parameter((out_features,), dtype=dtype,
                                  init=bias_init or linear_bias_init(in_features)) if bias else None

    def local_rows(self) -> tuple:
        """(weight rows, bias rows or None) of this rank's kv head, whose gradients are summed
        over the axis."""
        start = self.kv_head * self.head_dim

        def rows(t):
            return None if t is None else copy_to(t, self.axis).narrow(0, start, self.head_dim)
        return rows(self.weight), rows(self.bias)

    def forward(self, x):
        return column_matmul(x, *self.local_rows(), self.axis, self.seq_dim)


def kv_linear_1d(in_features: int, kv_heads: int, head_dim: int, num_heads: int,
                 bias: bool = True, axis: Optional[ProcessGroupAxis] = None, **kwargs):
    """The facade's KeyValueLinear: a column split when the p ranks divide ``kv_heads``,
    :class:`GroupedKVLinear1D` when ``kv_heads`` divides p."""
    axis = axis or default_axis()
    if kv_heads % axis.size == 0:
        return ColumnLinear1D(in_features, kv_heads * head_dim, bias, gather_output=False,
                              axis=axis, **kwargs)
    return GroupedKVLinear1D(in_features, kv_heads, head_dim, num_heads, bias, axis=axis,
                             **kwargs)


def check_qkv_layers(layers, cls, same: Callable, what: str):
    """Raise ValueError unless every layer is a ``cls`` (a class or a tuple of them) with
    ``same(layer)`` and the query's in_features (checked before any hook or collective)."""
    names = cls.__name__ if isinstance(cls, type) else ' or '.join(c.__name__ for c in cls)
    for name, layer in zip(('query', 'key', 'value'), layers):
        if not isinstance(layer, cls) or not same(layer) \
                or layer.in_features != layers[0].in_features:
            raise ValueError(f'fused qkv needs three {names} layers, {what}, with '
                             f'in_features {layers[0].in_features}; {name} is '
                             f'{type(layer).__name__} (in_features '
                             f"{getattr(layer, 'in_features', None)})")


def fused_projection(x, layers, project: Callable, split: Optional[Callable] = None,
                     blocks: bool = False) -> tuple:
    """``layers``' outputs on ``x`` from one ``project(cat(weights), cat(biases) or None)``
    (the local weights concatenated along their output rows), cut back into one output per
    layer by ``split(y)`` (default: views of the local rows' widths); the layers' forward
    hooks fire around it (:func:`as_called`). The concatenation is a view, not a copy,
    when the weights (biases) lie back to back in one storage (``tensor.adjacent``;
    ``col_nn.place_qkv_adjacent`` lays them so). ``blocks=True``: ``project`` takes the
    lists of weights and biases (or None) and joins them itself."""
    if len({layer.bias is None for layer in layers}) > 1:
        raise ValueError('a fused projection needs a bias in every layer or in none: '
                         f'{[layer.bias is not None for layer in layers]}')

    def fused():
        weights = [layer.weight for layer in layers]
        biases = None if layers[0].bias is None else [layer.bias for layer in layers]
        y = project(weights, biases) if blocks else project(*join_rows(weights, biases))
        if split is not None:
            return split(y)
        return y.split([layer.weight.shape[0] for layer in layers], dim=-1)
    return as_called(layers, x, fused)


def as_called(layers, x, compute: Callable[[], tuple]) -> tuple:
    """``compute()`` (one output per layer) run as if each layer were called on ``x``:
    every layer's forward pre-hooks first, then ``compute``, then each layer's forward
    hooks on its own output. Hooks taking kwargs or returning replacements raise
    NotImplementedError."""
    if any(layer._forward_pre_hooks_with_kwargs or layer._forward_hooks_with_kwargs
           for layer in layers):
        raise NotImplementedError('a fused projection does not run forward hooks that take kwargs')
    for layer in layers:
        for hook in list(layer._forward_pre_hooks.values()):
            if hook(layer, (x,)) is not None:
                raise NotImplementedError('a fused projection does not run pre-hooks that '
                                          'replace inputs')
    outputs = tuple(compute())
    for layer, out in zip(layers, outputs):
        for hook in list(layer._forward_hooks.values()):
            if hook(layer, (x,), out) is not None:
                raise NotImplementedError('a fused projection does not run hooks that '
                                          'replace outputs')
    return outputs


class VocabParallelEmbedding1D(ShardedModule):
    """Lookup with the vocabulary split: weight [V, h] -> [V/p, h]; out replicated [b, s, h].

    Ids outside this rank's range give zeros; forward all_reduce sums the rows.
    Backward: none. Sequence parallel: reduce_scatter along the sequence instead ->
    ``[b, s/p, h]`` (backward all_gather).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: Optional[int] = None,
                 axis: Optional[ProcessGroupAxis] = None, weight_init: Optional[Init] = None,
                 dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.axis = axis or default_axis()
        _check(num_embeddings, self.axis.size, 'VocabParallelEmbedding num_embeddings')
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.vocab_start = self.axis.rank * (num_embeddings // self.axis.size)
        self.vocab_end = self.vocab_start + num_embeddings // self.axis.size
        self.padding_idx, self.seq_dim = padding_idx, sequence_dim(self.axis)
        self.weight = new_parameter((num_embeddings, embedding_dim), (0, self.axis), dtype=dtype,
                                    init=embedding_init(padding_idx, weight_init))

    def forward(self, ids):
        if self.axis.size == 1:
            return F.embedding(ids, self.weight, self.padding_idx)
        check_ids(ids, self.num_embeddings, 'VocabParallelEmbedding')
        if self.seq_dim is None:
            return reduce_from(self._lookup(ids), self.axis)
        check_sequence_block(ids.shape[self.seq_dim], self.axis)
        out = self._lookup(rank_major(ids, self.axis.size, self.seq_dim))  # overlap.py
        return reduce_scatter_to(out, self.axis, 0,
                                 pairwise=prefers_pairwise(self.axis)).squeeze(0)

    def _lookup(self, ids):
        return vocab_range_lookup(ids, self.weight, self.vocab_start, self.vocab_end,
                                  self.padding_idx)


def embedding_init(padding_idx: Optional[int], base: Optional[Init] = None) -> Init:
    """torch.nn.Embedding's init (standard normal), or ``base``; the padding row zeroed."""
    def init(w, g):
        if base is not None:
            base(w, g)
        else:
            nn.init.normal_(w, generator=g)
        if padding_idx is not None:
            w[padding_idx].zero_()
    return init


class Embedding1D(ShardedModule):
    """Lookup with the hidden dim split: weight [V, h] -> [V, h/p]; out replicated [b, s, h].

    Forward: all_gather along the hidden dim. Backward: none (keep own chunk).
    Sequence parallel: then the rank's sequence block (backward all_gather of its gradient).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: Optional[int] = None,
                 axis: Optional[ProcessGroupAxis] = None, weight_init: Optional[Init] = None,
                 dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.axis = axis or default_axis()
        _check(embedding_dim, self.axis.size, 'Embedding embedding_dim (1D hidden split)')
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        self.seq_dim = sequence_dim(self.axis)
        self.weight = new_parameter((num_embeddings, embedding_dim), (1, self.axis), dtype=dtype,
                                    init=embedding_init(padding_idx, weight_init))

    def forward(self, ids):
        out = gather_from(F.embedding(ids, self.weight, self.padding_idx), self.axis, -1)
        return to_sequence_block(out, self.axis, self.seq_dim)


class VocabParallelClassifier1D(ShardedModule):
    """Logits with the classes split: weight [C, h] -> [C/p, h], bias [C/p]; input replicated.

    Output [.., C/p], tagged vocab-parallel for the loss. Forward: none.
    Backward: all_reduce of dx. ``weight`` ties it to a VocabParallelEmbedding's weight.
    Sequence parallel: input ``[b, s/p, h]`` all_gathered along the sequence first
    (backward reduce_scatter of dx), so the logits are ``[b, s, C/p]`` as without it.
    """

    def __init__(self, in_features: int, num_classes: int, bias: bool = False,
                 weight: Optional[nn.Parameter] = None, axis: Optional[ProcessGroupAxis] = None,
                 weight_init: Optional[Init] = None, bias_init: Optional[Init] = None,
                 dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.axis = axis or default_axis()
        _check(num_classes, self.axis.size, 'VocabParallelClassifier num_classes')
        self.in_features, self.num_classes = in_features, num_classes
        self.seq_dim = sequence_dim(self.axis)
        self.weight = tied_or_new_parameter(weight, (num_classes, in_features), (0, self.axis),
                                            init=weight_init or linear_weight_init(in_features),
                                            dtype=dtype)
        self.bias = new_parameter((num_classes,), (0, self.axis), dtype=dtype,
                                  init=bias_init or linear_bias_init(in_features)) if bias else None

    def forward(self, x):
        if self.axis.size == 1:  # serial: F.linear on oneDNN (functional.dense_linear)
            logits = dense_linear(x, self.weight, self.bias)
        else:
            logits = column_matmul(x, self.weight, self.bias, self.axis,
                                   tokens_dim(self.seq_dim, x))
        return tag(logits, (-1, self.axis))


class Classifier1D(ShardedModule):
    """Logits for all classes: weight [C, h] -> [C, h/p] (row split), bias replicated.

    Input replicated [.., h] (split locally); output replicated [.., C].
    Forward: all_reduce of the partial logits. Backward: all_gather of dx.
    ``weight`` ties it to an Embedding1D weight (same split).
    """

    def __init__(self, in_features: int, num_classes: int, bias: bool = True,
                 weight: Optional[nn.Parameter] = None, axis: Optional[ProcessGroupAxis] = None,
                 weight_init: Optional[Init] = None, bias_init: Optional[Init] = None,
                 dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.axis = axis or default_axis()
        _check(in_features, self.axis.size, 'Classifier in_features (1D row split)')
        self.in_features, self.num_classes = in_features, num_classes
        self.weight = tied_or_new_parameter(weight, (num_classes, in_features), (1, self.axis),
                                            init=weight_init or linear_weight_init(in_features),
                                            dtype=dtype)
        self.bias = new_parameter((num_classes,), dtype=dtype,
                                  init=bias_init or linear_bias_init(in_features)) if bias else None

    def forward(self, x):
        y = reduce_from(F.linear(split_to(x, self.axis, -1), self.weight), self.axis, inplace=True)
        return tag(y + self.bias if self.bias is not None else y)


def ones_init(t, g):
    return nn.init.ones_(t)


def zeros_init(t, g):
    return nn.init.zeros_(t)


class LayerNorm1D(ShardedModule):
    """LayerNorm (``rms=True``: RMSNorm, weight only) on replicated activations; weight and
    bias ``[h]`` replicated. No communication; sequence parallel: the input is the rank's
    sequence block and the weight and bias gradients are summed over the group
    (``partial_grad_param``)."""

    def __init__(self, normalized_shape: int, eps: float = 1e-5, dtype=None, axis=None,
                 rms: bool = False):
        super().__init__()
        self.normalized_shape, self.eps, self.rms = (normalized_shape,), eps, rms
        self.axis = axis or default_axis()
        self.seq_dim = sequence_dim(self.axis)
        self.weight = new_parameter((normalized_shape,), init=ones_init, dtype=dtype)
        self.bias = None if rms else new_parameter((normalized_shape,), init=zeros_init,
                                                   dtype=dtype)

    def forward(self, x):
        weight, bias = self.weight, self.bias
        if tokens_dim(self.seq_dim, x) is not None:  # own tokens: the gradients are partial
            weight = partial_grad_param(weight, self.axis)
            bias = None if bias is None else partial_grad_param(bias, self.axis)
        if self.rms:
            return rms_norm(x, weight, self.eps)
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim, normalized in fp32 and cast
    back before the weight (as Hugging Face's LlamaRMSNorm). For fp32 outside autocast it is
    torch's ``F.rms_norm``: the same forward ops (bit-identical output) in one autograd node
    with an analytic backward, instead of six nodes."""
    if (x.dtype == weight.dtype == torch.float32
            and (x.is_meta or not torch.is_autocast_enabled(x.device.type))):  # meta: no autocast
        return F.rms_norm(x, weight.shape, weight, eps)
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


class Dropout1D(nn.Module):
    """Dropout; ``inside_region`` marks sharded activations, whose ranks draw independent
    masks from the TENSOR stream. Replicated activations use the default stream, which is
    the same on every rank, so their masks agree; under sequence parallelism every
    activation outside the regions is the rank's own tokens (TENSOR stream too)."""

    def __init__(self, p: float = 0.5, inside_region: bool = False,
                 axis: Optional[ProcessGroupAxis] = None):
        super().__init__()
        self.p, self.inside_region = p, inside_region
        self.axis = axis or default_axis()
        self.seq_dim = sequence_dim(self.axis)

    def rng(self, x: Optional[torch.Tensor] = None):
        split = self.inside_region or (x is not None and tokens_dim(self.seq_dim, x) is not None)
        if split and self.axis.size > 1:
            return seed(ParallelMode.TENSOR)
        return contextlib.nullcontext()

    def forward(self, x):
        if not self.training or self.p == 0:
            return x
        with self.rng(x):
            return F.dropout(x, self.p, True)


class PatchParameters(ShardedModule):
    """The parameters of a patch embedding, with the hidden (embedding) dim cut over
    ``hidden_axis`` (None: whole): ``proj.weight [h, C, P, P]``, ``proj.bias [h]``,
    ``cls_token [1, 1, h]``, ``pos_embed [1, 1 + n, h]``. Initial values as the serial
    model's: torch's Conv2d init for proj, truncated normal (std 0.02) for the tokens.
    Every family's PatchEmbedding holds one; the families differ in the cut only."""

    def __init__(self, img_size: int, patch_size: int, in_chans: int, embed_size: int,
                 hidden_axis: Optional[ProcessGroupAxis] = None, dtype=None):
        super().__init__()
        if img_size % patch_size:
            raise ValueError(f'img_size {img_size} must be divisible by patch_size {patch_size}')
        self.num_patches = (img_size // patch_size) ** 2
        self.patch_size = patch_size
        cut = () if hidden_axis is None else ((0, hidden_axis),)
        token_cut = () if hidden_axis is None else ((2, hidden_axis),)
        fan_in = in_chans * patch_size * patch_size
        self.proj = ShardedModule()
        self.proj.weight = new_parameter((embed_size, in_chans, patch_size, patch_size), *cut,
                                         init=linear_weight_init(fan_in), dtype=dtype)
        self.proj.bias = new_parameter((embed_size,), *cut, init=linear_bias_init(fan_in),
                                       dtype=dtype)
        self.cls_token = new_parameter((1, 1, embed_size), *token_cut, init=token_init, dtype=dtype)
        self.pos_embed = new_parameter((1, 1 + self.num_patches, embed_size), *token_cut,
                                       init=token_init, dtype=dtype)

    def embed(self, images, shared=lambda t: t):
        """Images ``[b, C, H, W]`` -> ``[b, 1 + n, h_local]``; ``shared`` wraps each parameter
        (e.g. to sum its gradient over the groups that see other images)."""
        x = F.conv2d(images, shared(self.proj.weight), shared(self.proj.bias),
                     stride=self.patch_size).flatten(2).transpose(1, 2)
        cls = shared(self.cls_token).expand(x.shape[0], -1, -1)
        return torch.cat([cls, x], dim=1) + shared(self.pos_embed)


def token_init(t, g):
    return nn.init.trunc_normal_(t, std=0.02, generator=g)


class PatchEmbedding1D(PatchParameters):
    """Image -> [b, 1 + n_patches, h]: conv patches, class token, learned positions.

    All weights replicated (activations are replicated in 1D). No communication.
    """

    def __init__(self, img_size: int, patch_size: int, in_chans: int, embed_size: int,
                 dtype=None, axis=None, weight_init: Optional[Init] = None):
        super().__init__(img_size, patch_size, in_chans, embed_size, None, dtype)

    def forward(self, images):
        axis = default_axis()
        return to_sequence_block(self.embed(images), axis, sequence_dim(axis),
                                 'number of tokens (1 class token + patches)')
