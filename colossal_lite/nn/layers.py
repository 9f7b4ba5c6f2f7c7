"""Mode-dispatching facades: model code writes ``col_nn.Linear(...)`` once for every layout.

Each facade returns the layer of the family of the launched tensor mode (see
``registry.py``). The signatures are mode-agnostic; the only structural hints
model code gives are:

* ``Linear(..., region='enter' | 'exit' | None)``: a linear that opens a
  parallel region (its output may stay sharded, e.g. attention QKV, MLP fc1),
  one that closes it (attention output projection, MLP fc2), or a standalone
  linear whose input and output both have the mode's standard layout.
* ``Dropout(p, inside_region=True)`` for activations between 'enter' and 'exit'.

Activation layouts are the family's business; inputs (ids, images, labels,
masks) are always the user's full tensors.
"""
from __future__ import annotations

from typing import Optional

from ..tensor.adjacent import place_adjacent
from .registry import current_mode, implementation


def Linear(in_features: int, out_features: int, bias: bool = True, region: Optional[str] = None,
           **kwargs):
    """A linear layer of the current mode; ``region`` as in the module docstring."""
    return implementation('linear')(in_features, out_features, bias=bias, region=region, **kwargs)


def LayerNorm(normalized_shape: int, eps: float = 1e-5, **kwargs):
    return implementation('layernorm')(normalized_shape, eps=eps, **kwargs)


def RMSNorm(normalized_shape: int, eps: float = 1e-6, **kwargs):
    """``x * rsqrt(mean(x^2) + eps) * weight`` (no centering, no bias; statistics in fp32):
    the family's LayerNorm with ``rms=True``, so it splits and communicates as LayerNorm."""
    return implementation('layernorm')(normalized_shape, eps=eps, rms=True, **kwargs)


def KeyValueLinear(in_features: int, kv_heads: int, head_dim: int, num_heads: int,
                   bias: bool = True, **kwargs):
    """The 'enter' projection to ``kv_heads`` key (or value) heads of grouped-query attention
    (query head i reads kv head ``i // (num_heads / kv_heads)``), whose output lines up
    with the local query heads of an 'enter' ``Linear(in, num_heads * head_dim)``.

    When the ranks that split the heads divide ``kv_heads`` it is that Linear; when
    ``kv_heads`` is smaller, families that can (1D) replicate the kv heads so each rank
    holds the ones its query heads read (Megatron's GQA); otherwise a ValueError names
    both counts."""
    if num_heads % kv_heads:
        raise ValueError(f'grouped-query attention needs num_heads ({num_heads}) divisible by '
                         f'kv_heads ({kv_heads})')
    return implementation('kv_linear')(in_features, kv_heads, head_dim, num_heads, bias=bias,
                                       **kwargs)


def local_positions(position_ids):
    """The position ids (``[s]``, or ``[b, s]`` for per-sample positions) of the tokens of
    the q, k, v that :func:`project_qkv` returns on this rank: all of them where the
    sequence is whole, this rank's part of the sequence under sequence parallelism, and
    the rank's batch part of ``[b, s]`` ids where the batch is split. Feeds rotary
    embeddings (``nn.rotary``). No communication."""
    return implementation('positions')(position_ids)


def Embedding(num_embeddings: int, embedding_dim: int, padding_idx: Optional[int] = None, **kwargs):
    """Embedding of full ids ``[b, s]`` -> activations in the mode's standard layout."""
    return implementation('embedding')(num_embeddings, embedding_dim, padding_idx=padding_idx, **kwargs)


def VocabParallelEmbedding(num_embeddings: int, embedding_dim: int,
                           padding_idx: Optional[int] = None, **kwargs):
    """Like Embedding, with the vocabulary split across ranks (large vocabularies)."""
    return implementation('vocab_parallel_embedding')(num_embeddings, embedding_dim,
                                                      padding_idx=padding_idx, **kwargs)


def Classifier(in_features: int, num_classes: int, bias: bool = True, weight=None, **kwargs):
    """Logits for every class (ViT head, NSP head)."""
    return implementation('classifier')(in_features, num_classes, bias=bias, weight=weight, **kwargs)


def VocabParallelClassifier(in_features: int, num_classes: int, bias: bool = False, weight=None,
                            **kwargs):
    """Logits split along the classes (LM heads); ``weight=`` ties it to a VocabParallelEmbedding."""
    return implementation('vocab_parallel_classifier')(in_features, num_classes, bias=bias,
                                                       weight=weight, **kwargs)


def PatchEmbedding(img_size: int, patch_size: int, in_chans: int, embed_size: int, **kwargs):
    """Full images ``[b, C, H, W]`` -> ``[b, 1 + patches, h]`` (class token + positions)."""
    return implementation('patch_embedding')(img_size, patch_size, in_chans, embed_size, **kwargs)


def Dropout(p: float = 0.5, inside_region: bool = False, **kwargs):
    return implementation('dropout')(p, inside_region=inside_region, **kwargs)


def AttentionCore(head_dim: int, causal: bool = False, dropout: float = 0.0,
                  num_heads: Optional[int] = None, **kwargs):
    """softmax(QK^T/sqrt(d) + mask)V on the q, k, v produced by 'enter' linears.

    ``forward(q, k, v, key_padding_mask=None, document_ids=None)``; the mask is the user's
    full ``[b, s]`` mask (1 = attend) and is split by the family as its layout needs.
    ``document_ids`` (packed rows: ``nn.functional.document_ids(position_ids)``) is the
    full ``[b, s_k]`` document index of every key, the queries being the last ones; a
    query attends only to keys of its own document (and, when causal, not later ones).
    Split by each family like the mask. k and v may hold
    fewer heads than q (grouped-query attention, from :func:`KeyValueLinear`): local
    query head i reads local kv head ``i // (local q heads / local kv heads)``. With
    ``num_heads`` the split of the heads over ranks is checked here, at construction.
    """
    core = implementation('attention_core')(head_dim, causal=causal, dropout=dropout, **kwargs)
    split = getattr(core, 'head_split', 1)
    if num_heads is not None and num_heads % split:
        raise ValueError(f'{num_heads} attention heads cannot be divided among the {split} '
                         f"ranks that split them (tensor mode {current_mode()!r})")
    return core


def project_qkv(x, query, key, value):
    """``(query(x), key(x), value(x))`` for three 'enter' Linears of this mode.

    Every family fuses them into one matmul over the blocked rows ``[q_r; k_r; v_r]``
    of each rank (1D: one backward all_reduce of dx instead of three; sequence: one GEMM;
    2D/2.5D: one SUMMA linear; 3D: one cube linear); the parameters stay the three
    layers' own, so state-dict keys and initial weights do not change.
    """
    return implementation('qkv')(x, query, key, value)


def place_qkv_adjacent(query, key, value):
    """Lay the three layers' local weights (and biases) back to back in one storage each,
    q then k then v, so :func:`project_qkv` joins them as a view instead of a copy
    (``colossal_lite.tensor.adjacent``). On layers built on meta this happens when they
    are materialized. Values, parameter objects and state-dict keys are unchanged."""
    layers = (query, key, value)
    place_adjacent([layer.weight for layer in layers])
    if all(layer.bias is not None for layer in layers):
        place_adjacent([layer.bias for layer in layers])


def CrossEntropyLoss(ignore_index: int = -100, reduction: str = 'mean',
                     vocab_parallel: Optional[bool] = None, **kwargs):
    """Cross entropy of a Classifier's or VocabParallelClassifier's logits against full labels.

    ``vocab_parallel=None`` reads the logits' own tag; True/False forces it.
    """
    return implementation('cross_entropy')(ignore_index=ignore_index, reduction=reduction,
                                           vocab_parallel=vocab_parallel, **kwargs)


def gather_logits(logits):
    """The full ``[b, s, C]`` logits a serial model would return, on every rank."""
    return implementation('gather_logits')(logits)


def first_token(x):
    """``x[:, 0]`` of an activation in the standard layout (the [CLS] / class token),
    returned in the standard layout of a ``[b, h]`` activation."""
    return implementation('first_token')(x)
