"""Packing documents into rows of a fixed length: several documents per row, told apart by
position ids that restart at 0 where each document starts (Megatron's ``reset_position_ids``,
Hugging Face's packed sequences). docs/llama.md, "Packed documents"::

    document_ids = cumsum(position_ids == 0)            (colossal_lite.nn.document_ids)
    labels[t]    = ignore_index  where position_ids[t] == 0, else input_ids[t]

The labels are unshifted, as ``model_zoo.GPTLMLoss`` takes them (logits[t] predicts
labels[t+1]), so the last token of a document is never trained to predict the first token
of the next one. Padding is a run of one-token documents (id ``pad_id``, position 0): each
attends only to itself and none is trained on, so no other mask is needed.
"""
from __future__ import annotations

from typing import Iterable, List, Sequence, Tuple

import torch


def packed_labels(input_ids: torch.Tensor, position_ids: torch.Tensor,
                  ignore_index: int = -100) -> torch.Tensor:
    """``input_ids`` with ``ignore_index`` at every document start (``position_ids == 0``):
    the labels of packed rows for a next-token loss that shifts them (GPTLMLoss)."""
    return input_ids.masked_fill(position_ids == 0, ignore_index)


def pack_documents(documents: Iterable[Sequence[int]], seq_len: int, pad_id: int = 0,
                   ignore_index: int = -100, truncate: bool = False
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, position_ids, labels)``, each ``[rows, seq_len]`` long tensors, of
    ``documents`` (token-id sequences) packed in order: a document goes into the current row
    when it fits, else it starts the next row; a row's tail is padding (module doc). Empty
    documents are dropped; one longer than ``seq_len`` is a ValueError, or cut to its first
    ``seq_len`` tokens with ``truncate=True``. No communication."""
    if seq_len < 1:
        raise ValueError(f'seq_len must be a positive integer, got {seq_len!r}')
    rows: List[List[int]] = [[]]
    positions: List[List[int]] = [[]]
    for i, doc in enumerate(documents):
        doc = [int(t) for t in doc]
        if len(doc) > seq_len:
            if not truncate:
                raise ValueError(f'document {i} has {len(doc)} tokens, more than seq_len '
                                 f'{seq_len}; pass truncate=True to cut it')
            doc = doc[:seq_len]
        if not doc:
            continue
        if len(rows[-1]) + len(doc) > seq_len:
            rows.append([])
            positions.append([])
        rows[-1].extend(doc)
        positions[-1].extend(range(len(doc)))
    if not rows[-1]:
        rows.pop()
        positions.pop()
    if not rows:
        raise ValueError('pack_documents got no non-empty document')
    pad = [seq_len - len(row) for row in rows]
    input_ids = torch.tensor([row + [pad_id] * p for row, p in zip(rows, pad)], dtype=torch.long)
    position_ids = torch.tensor([pos + [0] * p for pos, p in zip(positions, pad)],
                                dtype=torch.long)
    return input_ids, position_ids, packed_labels(input_ids, position_ids, ignore_index)
