"""Key/value cache for incremental decoding with the model zoo's causal attention.

Each attention layer keeps the keys and values of the tokens seen so far exactly as its
fused q/k/v projection produced them on this rank: ``[b_local, t, width_local]`` --
1D: ``[b, t, h/p]`` (this rank's heads); 2D/2.5D: ``[b/q(/d), t, h/q]``; 3D: ``[b/q^2, t,
h/q]``. No tensor mode splits the sequence, so appending a step is a local concatenation
along dim 1: no communication. The causal mask of a step of ``s`` queries against ``t + s``
keys is ``tril(t)`` (``nn.functional.attention``), and the model offsets the positions of
the new tokens by ``t`` (:attr:`KVCache.length`).
"""
from __future__ import annotations

from typing import Dict, Iterable, Optional, Tuple

import torch

from colossal_lite.config.families import family
from colossal_lite.nn.functional import document_ids
from colossal_lite.nn.registry import current_mode


def _splits_sequence() -> bool:
    """Whether the launched tensor mode splits the sequence ('sequence', 'ulysses')."""
    return family(current_mode()).splits_sequence


class LayerKV:
    """One attention layer's cached local keys and values (None before the first step)."""

    def __init__(self):
        self.keys: Optional[torch.Tensor] = None
        self.values: Optional[torch.Tensor] = None

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Append this step's ``k, v [b_local, s, width_local]``; the keys and values of
        every token so far ``[b_local, t + s, width_local]``."""
        if self.keys is not None:
            if k.shape[0] != self.keys.shape[0] or k.shape[2] != self.keys.shape[2]:
                raise ValueError(f'this step\'s keys {tuple(k.shape)} do not extend the cached '
                                 f'{tuple(self.keys.shape)} (same local batch and width needed)')
            k, v = torch.cat([self.keys, k], dim=1), torch.cat([self.values, v], dim=1)
        self.keys, self.values = k, v
        return k, v


class KVCache:
    """The caches of a model's attention layers (keyed by serial block index) and the number
    of positions already cached (:attr:`length`), which the model adds to the positions of
    the next step's tokens and advances after the step."""

    def __init__(self, layers: Iterable[int]):
        self.layers: Dict[int, LayerKV] = {int(i): LayerKV() for i in layers}
        self.length = 0
        # packed rows (CachedDecoding.packed_step): the full [b, t] document ids of the
        # cached tokens and the [b] position each row's last document continues at
        self.document_ids: Optional[torch.Tensor] = None
        self.next_positions: Optional[torch.Tensor] = None

    @property
    def packed(self) -> bool:
        """Filled by a packed step: later steps continue each row's last document."""
        return self.document_ids is not None

    def layer(self, index: int) -> LayerKV:
        return self.layers[int(index)]


class CachedDecoding:
    """Mixin of the causal LMs (GPT, Llama; staged models): :meth:`new_kv_cache` and the
    guard of ``forward(..., last_only=True)``, refused where no rank holds what they need."""

    def new_kv_cache(self) -> KVCache:
        """An empty cache for incremental decoding: ``model(ids, kv_cache=cache)`` appends the
        step's local keys/values to it (no communication) and offsets the step's positions
        by ``cache.length``. Serial and 1D/2D/2.5D/3D."""
        if self.is_pipelined:
            raise NotImplementedError('KV-cached decoding is not implemented under pipeline '
                                      'parallelism; load the weights into a tensor layout')
        if _splits_sequence():
            raise NotImplementedError('KV-cached decoding is not implemented under sequence '
                                      'parallelism (a decoding step of one token cannot be '
                                      'split along the sequence); use a tensor mode')
        return KVCache(self.stage_spec().layers)

    @staticmethod
    def packed_step(input_ids: torch.Tensor, position_ids: Optional[torch.Tensor], packed: bool,
                    kv_cache: Optional[KVCache]) -> Tuple[Optional[torch.Tensor],
                                                          Optional[torch.Tensor]]:
        """``(position_ids, document_ids)`` of a forward step. Packed rows (``packed=True``,
        or a cache a packed step filled): ``position_ids [b, s]`` restart at 0 where a
        document starts -- after a packed cache they default to continuing each row's last
        document -- and ``document_ids [b, t + s]`` number the documents of the cached and
        the step's tokens (``nn.functional.document_ids``, continuing the cache's count),
        which the cache records. Otherwise ``(position_ids, None)``: nothing else is done.
        No communication."""
        cached = kv_cache is not None and kv_cache.packed
        if not (packed or cached):
            return position_ids, None
        if kv_cache is not None and kv_cache.length and not cached:
            raise ValueError('packed=True after unpacked cached tokens: a cache continues '
                             'packed rows only when a packed step filled it')
        b, s = input_ids.shape
        if position_ids is None:
            if not cached:
                raise ValueError('packed=True needs position_ids [b, s] that restart at 0 '
                                 'where each document starts')
            position_ids = kv_cache.next_positions.unsqueeze(1) + torch.arange(
                s, device=input_ids.device)
        if position_ids.dim() == 1:
            position_ids = position_ids.expand(b, s)
        if tuple(position_ids.shape) != (b, s):
            raise ValueError(f'position_ids must be [b, s] = [{b}, {s}] like input_ids, got '
                             f'{tuple(position_ids.shape)}')
        docs = document_ids(position_ids)
        if cached:
            docs = torch.cat([kv_cache.document_ids, docs + kv_cache.document_ids[:, -1:]], 1)
        if kv_cache is not None:
            kv_cache.document_ids, kv_cache.next_positions = docs, position_ids[:, -1] + 1
        return position_ids, docs

    @staticmethod
    def check_last_only(last_only: bool):
        if last_only and _splits_sequence():
            raise NotImplementedError('last_only is not implemented under sequence parallelism '
                                      '(the last position lives on the last sequence rank)')
