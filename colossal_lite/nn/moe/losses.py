"""The router's auxiliary losses, and how they reach the gradient without touching the loss.

With ``n`` local tokens, ``k`` slots each, ``experts`` = X:

* load balancing (Switch / Mixtral)::

      aux = coef * X * sum_i f_i * P_i
      f_i = c_i / (k * N)          c_i: slots routed to expert i (before capacity drops),
                                   summed over the stats axis; N = tokens over that axis
                                   (no gradient)
      P_i = mean over the n local tokens of probs[:, i]   (with gradient)

  Uniform routing gives ``aux = coef``. (transformers' Mixtral ``router_aux_loss`` counts
  ``f_i`` per token, not per slot: it is ``k`` times this one.)
* router z-loss (ST-MoE): ``z = coef * mean over the n local tokens of logsumexp(logits)^2``.

Each rank's ``aux`` uses the global ``f`` and its local ``P``, so the serial loss over
all tokens is the mean of the replicas' losses, and averaging gradients over replicas
(the data-parallel sync) gives the serial gradient.

:func:`attach_loss` (Megatron's MoEAuxLossAutoScaler): a tensor of the layer (the routing
weights, whose gradient the layer's output always reaches) passes through unchanged in
forward (a copy, so the output stays free for in-place use); in backward its gradient
passes through and the loss receives the gradient ``scale``. For a training loss that is
a mean over tokens, ``scale = 1`` adds exactly ``d(aux)/d(params)`` to
``d(loss)/d(params)``. A backward of ``loss * a`` (AMP loss scale S, ``1/M`` for M
accumulated micro-batches: ``a = S / M``) needs ``scale = a``; in the sequence modes (each
of the P sequence ranks holds a part of every sample, and the gradient sync adds their
gradients) it is divided by P.
"""
from __future__ import annotations

from typing import Callable

import torch


def load_balancing_loss(probs: torch.Tensor, global_counts: torch.Tensor,
                        top_k: int) -> torch.Tensor:
    """``X * sum_i f_i * P_i`` (module doc; without coef) from ``probs [n, X]`` and the
    counts of routed slots per expert over the stats axis, ``global_counts [X]``."""
    num_experts = probs.shape[-1]
    f = global_counts.to(probs.dtype) / global_counts.sum().clamp(min=1)   # sum = k * N
    return num_experts * (f * probs.mean(0)).sum()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """``mean over tokens of logsumexp(logits)^2`` (without coef)."""
    return torch.logsumexp(logits, dim=-1).square().mean()


class _AttachLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, carrier, loss, scale_of):
        ctx.scale_of = scale_of
        ctx.loss_meta = (loss.shape, loss.dtype, loss.device)
        return carrier.clone()

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.loss_meta
        return grad, torch.full(shape, float(ctx.scale_of()), dtype=dtype, device=device), None


def attach_loss(carrier: torch.Tensor, loss: torch.Tensor,
                scale_of: Callable[[], float]) -> torch.Tensor:
    """A copy of ``carrier`` whose backward also back-propagates ``loss`` with the gradient
    ``scale_of()`` (read at backward time; module doc)."""
    if not (torch.is_grad_enabled() and loss.requires_grad and carrier.requires_grad):
        return carrier
    return _AttachLoss.apply(carrier, loss, scale_of)
