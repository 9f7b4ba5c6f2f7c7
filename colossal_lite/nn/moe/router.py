"""The top-k router: which experts each token goes to and with what weight, in fp32.

``logits = x W^T`` (``W`` = ``weight [experts, h]``, replicated like any dense weight), then

* ``score='softmax'`` (Mixtral, Qwen2-MoE): ``s = softmax(logits)``;
* ``score='sigmoid'`` (DeepSeek-V3): ``s = sigmoid(logits)``.

The k experts of largest ``s + b`` are selected (``b``: the balancing bias of
:class:`BalanceBias`, zero without it; by ``torch.topk``, slot j holding the j-th
largest); their weights are the unbiased ``s`` of the selected experts, divided by their
sum when ``renormalize`` (softmax: Mixtral's top-k renormalization; sigmoid: DeepSeek's, with
``+1e-20`` in the denominator). Routing ignores autocast and runs in fp32 whatever the
input's dtype. No communication.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ...tensor import Init, new_parameter

SCORES = ('softmax', 'sigmoid')


def uniform_init(fan_in: int) -> Init:
    """``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``: torch.nn.Linear's weight init, for any shape."""
    bound = 1.0 / math.sqrt(fan_in)
    return lambda w, g: nn.init.uniform_(w, -bound, bound, generator=g)


@dataclass
class Routing:
    """One forward's routing of ``N`` tokens: ``experts [N, k]`` (int64) and ``weights
    [N, k]`` (fp32, differentiable), the ``logits [N, experts]`` (fp32) and the scores the
    load-balancing loss averages, ``probs [N, experts]`` (softmax: ``s``; sigmoid: ``s``
    normalized to sum 1 per token, as DeepSeek-V3's sequence-wise balance loss)."""

    experts: torch.Tensor
    weights: torch.Tensor
    logits: torch.Tensor
    probs: torch.Tensor


class BalanceBias(nn.Module):
    """DeepSeek-V3's auxiliary-loss-free balancing: a bias ``b [experts]`` (a buffer, no
    gradient) added to the scores for the top-k selection only. :meth:`update` moves it by
    ``rate * sign(mean(c) - c_i)`` for the counts ``c`` of routed slots per expert."""

    def __init__(self, experts: int):
        super().__init__()
        self.register_buffer('bias', torch.zeros(experts, dtype=torch.float32))

    def reset_parameters(self):
        with torch.no_grad():
            self.bias.zero_()

    @torch.no_grad()
    def update(self, counts: torch.Tensor, rate: float):
        counts = counts.to(self.bias.device, torch.float32)
        self.bias.add_(torch.sign(counts.mean() - counts), alpha=rate)


class TopKRouter(nn.Module):
    """``weight [experts, h]`` (replicated). ``forward(tokens [N, h]) -> Routing``; see the
    module doc. ``balance``: a :class:`BalanceBias` when ``bias_balancing``."""

    def __init__(self, hidden: int, experts: int, top_k: int, score: str = 'softmax',
                 renormalize: bool = True, bias_balancing: bool = False,
                 weight_init: Optional[Init] = None):
        super().__init__()
        if score not in SCORES:
            raise ValueError(f"MoE score must be one of {SCORES}, got {score!r}")
        if not 1 <= top_k <= experts:
            raise ValueError(f'MoE top_k = {top_k} must be between 1 and experts = {experts}')
        self.experts, self.top_k, self.score, self.renormalize = experts, top_k, score, renormalize
        self.weight = new_parameter((experts, hidden), init=weight_init or uniform_init(hidden))
        self.balance = BalanceBias(experts) if bias_balancing else None

    def forward(self, tokens: torch.Tensor) -> Routing:
        with torch.autocast(tokens.device.type, enabled=False):
            logits = F.linear(tokens.float(), self.weight.float())
            if self.score == 'softmax':
                scores = probs = torch.softmax(logits, dim=-1)
            else:
                scores = torch.sigmoid(logits)
                probs = scores / scores.sum(-1, keepdim=True)
            chooser = scores.detach()
            if self.balance is not None:
                chooser = chooser + self.balance.bias
            experts = torch.topk(chooser, self.top_k, dim=-1).indices
            weights = scores.gather(1, experts)
            if self.renormalize:
                eps = 1e-20 if self.score == 'sigmoid' else 0.0
                weights = weights / (weights.sum(-1, keepdim=True) + eps)
        return Routing(experts, weights, logits, probs)
