"""3D attention core and first token. The 3D classifiers tag their logits with the batch
cut of their layout (standard for :class:`Classifier3D`, swapped for
:class:`VocabParallelClassifier3D`) and the class cut (WEIGHT, or none); the loss and
``gather_logits`` read that placement (``nn/losses.py``)."""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import nn

from ...context import ParallelMode, seed
from ..functional import attention
from .cube import Cube3D, default_cube, split_batch


class AttentionCore3D(nn.Module):
    """softmax(QK^T/sqrt(d) + mask)V on q, k, v in the swapped layout (made by 'enter'
    linears): ``[b, s, n*d] -> [b/q^2, s, n/q*d]`` (batch chunk l*q+i, heads chunk j).

    The user's full ``key_padding_mask [b, s]`` and ``document_ids [b, s]`` are split by
    batch locally. No
    communication; attention dropout draws from the TENSOR stream.
    """

    def __init__(self, head_dim: int, causal: bool = False, dropout: float = 0.0,
                 cube: Optional[Cube3D] = None):
        super().__init__()
        self.head_dim, self.causal, self.dropout = head_dim, causal, dropout
        self.cube = default_cube(cube)

    @property
    def head_split(self) -> int:
        """Ranks the heads are divided among (the hidden split q)."""
        return self.cube.q

    def rng(self):
        return seed(ParallelMode.TENSOR) if self.cube.q > 1 else contextlib.nullcontext()

    def forward(self, q, k, v, key_padding_mask=None, document_ids=None):
        width, parts = q.shape[-1], self.cube.q
        if width % self.head_dim:
            heads = width * parts // self.head_dim
            raise ValueError(f'3D attention splits the heads over q={parts}: the number of heads '
                             f'{heads} (hidden {width * parts} / head_dim {self.head_dim}) must '
                             f'be divisible by {parts}')
        if key_padding_mask is not None:
            key_padding_mask = split_batch(key_padding_mask, self.cube.swapped, 'key_padding_mask')
        if document_ids is not None:
            document_ids = split_batch(document_ids, self.cube.swapped, 'document_ids')
        return attention(q, k, v, self.head_dim, causal=self.causal,
                         key_padding_mask=key_padding_mask,
                         dropout_p=self.dropout if self.training else 0.0, rng=self.rng,
                         document_ids=document_ids)


def first_token_3d(x: torch.Tensor) -> torch.Tensor:
    """``x[:, 0]``: the batch and hidden splits are kept (standard layout of ``[b, h]``);
    no communication."""
    return x[:, 0]
