"""Functions shared by every layer family: vocab-parallel cross entropy, attention (with the
document mask of packed rows), id checks.

Vocab-parallel cross entropy (logits split along the vocabulary over ``axis``)::

    m      = all_reduce_max(max_j z_j)                 # 1 all_reduce of N floats
    S      = all_reduce_sum(sum_j exp(z_j - m))        # 1 all_reduce of N floats
    z_t    = all_reduce_sum(z_t if t is local else 0)  # 1 all_reduce of N floats
    loss   = log S - (z_t - m)
    dL/dz_j = softmax_j - [j == t]                     # local, no communication

Tokens whose label is ``ignore_index`` get loss 0 and gradient 0.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..communication import collective as C
from ..context import ParallelMode, ProcessGroupAxis, current_context

class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, axis, ignore_index):
        logits = logits.float()
        vocab_local = logits.shape[-1]
        start = axis.rank * vocab_local
        logits_max = C.all_reduce(logits.max(dim=-1).values, axis, op=dist.ReduceOp.MAX)
        shifted = logits - logits_max.unsqueeze(-1)
        valid = target != ignore_index
        local_target = target - start
        owned = valid & (local_target >= 0) & (local_target < vocab_local)
        safe_index = torch.where(owned, local_target, torch.zeros_like(local_target))
        picked = shifted.gather(-1, safe_index.unsqueeze(-1)).squeeze(-1) * owned
        exp = shifted.exp()
        sum_exp = C.all_reduce(exp.sum(dim=-1), axis)
        picked = C.all_reduce(picked, axis)
        loss = (sum_exp.log() - picked) * valid
        softmax = exp / sum_exp.unsqueeze(-1)
        ctx.save_for_backward(softmax, safe_index, owned, valid)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, safe_index, owned, valid = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, safe_index.unsqueeze(-1), -owned.to(grad.dtype).unsqueeze(-1))
        grad *= (grad_loss * valid).unsqueeze(-1)
        return grad, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor,
                                 axis: ProcessGroupAxis, ignore_index: int = -100) -> torch.Tensor:
    """Per-token loss for logits ``[N, V/p]`` split along the vocabulary over ``axis``."""
    if axis.size == 1:
        return F.cross_entropy(logits.float(), target, ignore_index=ignore_index,
                               reduction='none')
    return _VocabParallelCrossEntropy.apply(logits, target, axis, ignore_index)


_ONEDNN_LINEAR = (getattr(torch.ops.mkldnn, '_linear_pointwise', None)
                  if torch.backends.mkldnn.is_available() else None)


def _onednn_operand(t: Optional[torch.Tensor]) -> bool:
    """A plain (not a subclass: DTensor, fake) dense fp32 CPU tensor with data."""
    return t is None or (type(t) in (torch.Tensor, torch.nn.Parameter) and t.dtype == torch.float32
                         and t.device.type == 'cpu' and t.layout == torch.strided
                         and not t.is_meta)


def _onednn_matmul(x: torch.Tensor, weight: torch.Tensor,
                   bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x [.., in] @ weight^T + bias`` by oneDNN's matmul (``x`` contiguous; the weight may
    be any strided view, e.g. a transpose, read in place)."""
    return _ONEDNN_LINEAR(x, weight, bias, 'none', [], '')


def _forward_on_onednn() -> bool:
    """Whether a forward matmul may run on oneDNN here. Its kernel takes a scratch buffer
    (B-panel packing, up to ``threads * (64 * in * 4 + 1024)`` bytes, measured in
    tests/test_auto_graph.py) from torch's CPU allocator for the
    call, which the planner's memory model (``auto/memory.py``) has no term for. It cannot
    raise a step's peak in a plain forward: everything live during it is still live at the
    loss, where the log-softmax adds logits-sized buffers larger than the scratch. It can
    where a forward runs at the peak: a pipeline stage (a later micro-batch's forward beside
    earlier ones' activations) and the recompute of a checkpointed block (inside backward);
    there the forward stays on ``F.linear``. The input gradient's oneDNN call uses the
    weight in its stored layout and takes < 1 KiB."""
    task = getattr(torch._C, '_current_graph_task_id', None)   # -1: not inside backward
    return (task is not None and task() == -1
            and current_context().axis(ParallelMode.PIPELINE).size == 1)


class _DenseLinear(torch.autograd.Function):
    """``F.linear`` whose input gradient (``dy W``), and forward (``x W^T + b``) where
    :func:`_forward_on_onednn`, run on oneDNN; the weight gradient (``dy^T x``) runs on
    aten's ``mm`` as ``F.linear``'s does (on oneDNN it would need a transposed copy of x or
    dy). It saves what ``F.linear`` saves (``x`` and ``W``, no copy) and its backward makes
    the tensors ``F.linear``'s makes (``dx``, ``dW``, ``db``), so a step allocates the same
    tensors; only the kernels differ (fp32 rounding: oneDNN's blocking is not MKL's)."""

    @staticmethod
    def forward(ctx, x, weight, bias, onednn):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _onednn_matmul(x, weight, bias) if onednn else F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = dw = db = None
        dy2d = dy.reshape(-1, dy.shape[-1])
        if ctx.needs_input_grad[0]:
            if dy2d.is_contiguous():
                dx = _onednn_matmul(dy2d, weight.t())
            else:
                dx = dy2d.mm(weight)
            dx = dx.view(x.shape)
        if ctx.needs_input_grad[1]:
            dw = dy2d.t().mm(x.reshape(-1, x.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2d.sum(0)
        return dx, dw, db, None


def dense_linear(x: torch.Tensor, weight: torch.Tensor,
                 bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` of a one-rank (serial) layer. For contiguous fp32 CPU
    tensors outside autocast and tracing it runs the input gradient, and the forward where
    :func:`_forward_on_onednn`, on oneDNN: on AVX-512 CPUs about 2x MKL's fp32 rate (an AMD
    EPYC here, where MKL keeps to its AVX2 kernels), with ``F.linear``'s saved tensors and
    temporaries (:class:`_DenseLinear`). Otherwise it is ``F.linear``."""
    if (_ONEDNN_LINEAR is None or x.dim() < 2 or not x.is_contiguous()
            or not (_onednn_operand(x) and _onednn_operand(weight) and _onednn_operand(bias))
            or torch.is_autocast_enabled('cpu') or torch.compiler.is_compiling()):
        return F.linear(x, weight, bias)
    onednn = _forward_on_onednn()
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return _DenseLinear.apply(x, weight, bias, onednn)
    return _onednn_matmul(x, weight, bias) if onednn else F.linear(x, weight, bias)


def matmul_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The dtype a matmul of ``tensors`` runs in: autocast's when autocast is on for their
    device, else their promoted dtype. Custom autograd functions record it in forward and
    run backward in it (backward runs outside autocast), returning gradients in the
    inputs' own dtypes."""
    device_type = tensors[0].device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def per_token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor,
                            vocab_axis: Optional[ProcessGroupAxis],
                            ignore_index: int = -100) -> torch.Tensor:
    """Flat per-token losses ``[N]`` of logits ``[.., C]`` (split along the classes over
    ``vocab_axis``, or whole when it is None) against labels ``[..]`` of the same leading shape."""
    flat_logits, flat_labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
    if vocab_axis is None:
        return F.cross_entropy(flat_logits.float(), flat_labels, ignore_index=ignore_index,
                               reduction='none')
    return vocab_parallel_cross_entropy(flat_logits, flat_labels, vocab_axis, ignore_index)


def vocab_range_lookup(ids: torch.Tensor, weight: torch.Tensor, vocab_start: int,
                       vocab_end: int, padding_idx: Optional[int] = None) -> torch.Tensor:
    """Rows of a vocabulary shard ``weight`` (ids ``[vocab_start, vocab_end)``) for full ids;
    ids owned by other ranks give zero rows, so a sum over the shards is the full lookup.
    No communication."""
    outside = (ids < vocab_start) | (ids >= vocab_end)
    local_ids = torch.where(outside, torch.zeros_like(ids), ids - vocab_start)
    local_pad = None
    if padding_idx is not None and vocab_start <= padding_idx < vocab_end:
        local_pad = padding_idx - vocab_start
    return F.embedding(local_ids, weight, local_pad).masked_fill(outside.unsqueeze(-1), 0.0)


def check_ids(ids: torch.Tensor, num_embeddings: int, what: str = 'embedding'):
    """Every id in [0, num_embeddings). Run on the user's full ids, which every rank holds,
    so all ranks raise together before any collective."""
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_embeddings):
        bad = ids[(ids < 0) | (ids >= num_embeddings)][0].item()
        raise IndexError(f'{what}: index {bad} is out of range for {num_embeddings} embeddings')


def check_targets(labels: torch.Tensor, num_classes: int, ignore_index: int):
    """Every label in [0, num_classes) or ``ignore_index``; run on the full labels (see check_ids).
    Skipped while a graph is traced (``auto/graph``): a traced program cannot branch on values."""
    if torch.compiler.is_compiling():
        return
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= num_classes))
    if bad.any():
        raise IndexError(f'target {labels[bad][0].item()} is out of bounds for {num_classes} '
                         f'classes (ignore_index={ignore_index})')


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """The document of every token of packed rows ``[.., s]`` whose position ids restart at 0
    where a document starts (Megatron's ``reset_position_ids``, Hugging Face's packed
    sequences): ``cumsum(position_ids == 0, -1)``. Tokens before a row's first 0 (a document
    cut off by the row's start) are document 0. Non-decreasing along the row. Local."""
    return (position_ids == 0).cumsum(-1)


def document_mask(document_ids: torch.Tensor, s_q: int) -> torch.Tensor:
    """``[b, 1, s_q, s_k]`` booleans, True where query i and key j are in one document, for
    keys' ``document_ids [b, s_k]`` whose last ``s_q`` are the queries' (self-attention, or
    a decoding step against its KV cache)."""
    docs = document_ids
    return (docs[:, -s_q:, None] == docs[:, None, :]).unsqueeze(1)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int,
              causal: bool = False, key_padding_mask: Optional[torch.Tensor] = None,
              dropout_p: float = 0.0,
              rng: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
              document_ids: Optional[torch.Tensor] = None, sdpa_causal: bool = False):
    """softmax(Q K^T / sqrt(d) + mask) V on local tensors q ``[b, s, n*d]``, k and v
    ``[b, s_k, n_kv*d]``; with ``n_kv < n`` (grouped-query attention) query head i reads
    kv head ``i // (n / n_kv)``.

    ``key_padding_mask`` is ``[b, s_k]`` with 1/True for keys to attend to.
    ``document_ids`` (packed rows, :func:`document_ids`) is ``[b, s_k]``, the keys'
    documents (the queries are the last ``s`` keys): query i attends to key j only when
    both are in one document. ``rng`` gives the context in which attention dropout draws
    its mask. ``sdpa_causal``: plain causal attention (no padding mask, no documents, as many
    queries as keys) as SDPA's ``is_causal`` rather than an explicit ``s x s`` mask (the same
    numbers on CPU, without the mask SDPA would save for backward); always so when traced.
    """
    b, s_q, width = q.shape
    s_k = k.shape[1]
    heads, kv_heads = local_heads(q, k, head_dim)

    def split_heads(t, s, n):
        return t.view(b, s, n, head_dim).transpose(1, 2)

    mask = None
    if key_padding_mask is not None:
        mask = key_padding_mask.to(torch.bool).view(b, 1, 1, s_k)
    if document_ids is not None:
        if tuple(document_ids.shape) != (b, s_k):
            raise ValueError(f'document_ids must be [batch, keys] = [{b}, {s_k}] (this '
                             f'attention\'s local batch), got {tuple(document_ids.shape)}')
        same = document_mask(document_ids.to(q.device), s_q)
        mask = same if mask is None else mask & same
    # a traced graph (auto/graph) states plain causal attention as is_causal (the same
    # numbers), so the planner's attention rule sees no mask to place
    is_causal = causal and mask is None and s_q == s_k and (
        sdpa_causal or torch.compiler.is_compiling())
    if causal and not is_causal:
        tri = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).tril(s_k - s_q)
        mask = tri if mask is None else mask & tri
    with rng():
        out = F.scaled_dot_product_attention(split_heads(q, s_q, heads),
                                             split_heads(k, s_k, kv_heads),
                                             split_heads(v, s_k, kv_heads), attn_mask=mask,
                                             dropout_p=dropout_p, is_causal=is_causal,
                                             enable_gqa=kv_heads != heads)
    return out.transpose(1, 2).reshape(b, s_q, width)


def local_heads(q: torch.Tensor, k: torch.Tensor, head_dim: int) -> tuple:
    """(query heads, kv heads) of local ``q [.., n*d]`` and ``k [.., n_kv*d]``; a ValueError
    unless both are whole heads and the kv heads divide the query heads."""
    width, kv_width = q.shape[-1], k.shape[-1]
    if width % head_dim or kv_width % head_dim:
        raise ValueError(f'local attention widths q {width}, k {kv_width} are not multiples of '
                         f'head_dim {head_dim}')
    heads, kv_heads = width // head_dim, kv_width // head_dim
    if heads % kv_heads:
        raise ValueError(f'{heads} local query heads cannot share {kv_heads} local kv heads '
                         f'evenly (grouped-query attention)')
    return heads, kv_heads
