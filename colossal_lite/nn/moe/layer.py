"""``MoE``: a mixture-of-experts layer (router -> dispatch -> experts -> combine).

Input ``x [..., s, h]`` (any leading dims; a batch row is one sequence of the second-to-last
dim), output the same shape. Each rank holds its own tokens whole (hidden not split): the
serial model, data parallelism, 1D tensor parallelism (x replicated over the tensor group)
and the sequence modes (x split along s). Under 1D sequence parallelism x is the rank's
sequence block ``[b, s/t, h]``: the routed part runs on the whole sequences, gathered over
the 1D group (``gather_from``: all_gather forward, own block of the gradient backward) and
cut back to the block (``split_to``: backward all_gather), so it computes exactly what 1D
without sequence parallelism computes; the shared experts are the 1D MLP on the block.

Per forward, with ``N`` local tokens and E expert ranks:

1. route (``router.py``, fp32): ``experts [N, k]``, ``weights [N, k]``;
2. statistics (training only): ``tokens_per_expert`` = one all_reduce of ``[experts]``
   int64 over ``stats_axis`` (the ranks holding other tokens: DATA, or SEQUENCE_DP in the
   sequence modes); the losses of ``losses.py``;
3. capacity drops when ``capacity_factor`` (``dispatch.capacity_keep``), then the kept
   slots sorted by expert (``dispatch.sort_slots``);
4. with E > 1, counts then rows by all_to_all over EXPERT to the experts' ranks
   (``dispatch.ExpertExchange``), the local experts on their segments
   (``experts.GroupedExperts``), the reverse all_to_all;
5. ``combine``: the weighted sum of each token's slots; plus the shared experts
   (``experts.SharedExperts``, gated by ``sigmoid(x w_g)`` when ``shared_gate``).

Parameters: ``router.weight [experts, h]`` and the shared experts are dense (replicated,
gradient summed over DATA); ``experts.gate``, ``experts.up`` ``[experts, h, f]`` and
``experts.down [experts, f, h]`` are cut along dim 0 over EXPERT (gradient summed over
EXPERT_DATA) and, under 1D tensor parallelism (expert tensor parallelism, on by default
there as in Megatron), along f over TENSOR (``experts.py``). Buffer ``router.balance.bias [experts]`` (with ``bias_update_rate > 0``).
"""
from __future__ import annotations

import numbers
from typing import Optional

import torch
from torch import nn

from ...communication import collective as C
from ...communication import gather_from, partial_grad_param, split_to
from ...config.families import family
from ...config.layout import EXPERT_TENSOR_MODES
from ...context import ParallelMode, ProcessGroupAxis, current_context
from ...tensor import Init, new_parameter
from ..parallel_1d.layers import default_axis, sequence_dim
from .dispatch import ExpertExchange, capacity, capacity_keep, combine, sort_slots
from .experts import GroupedExperts, SharedExperts
from .losses import attach_loss, load_balancing_loss, z_loss
from .router import TopKRouter, uniform_init


def token_axis() -> ProcessGroupAxis:
    """The ranks holding other tokens of the step (the default ``stats_axis``): SEQUENCE_DP
    in the sequence modes, else DATA; a one-rank stand-in when serial."""
    ctx = current_context()
    if family(ctx.tensor_mode).splits_sequence:
        return ctx.axis(ParallelMode.SEQUENCE_DP)
    return ctx.axis(ParallelMode.DATA)


def _sequence_ranks() -> int:
    ctx = current_context()
    return ctx.axis(ParallelMode.SEQUENCE).size if family(ctx.tensor_mode).splits_sequence else 1


def expert_tensor_axis(enabled: Optional[bool]) -> Optional[ProcessGroupAxis]:
    """The TENSOR group the experts' width is cut over: the launched 1D group unless
    ``enabled`` is False (``None``: on under 1D, as Megatron's expert tensor parallel size
    defaults to the tensor-parallel size); None without 1D tensor parallelism."""
    if enabled is not None and not isinstance(enabled, bool):
        raise ValueError(f'MoE expert_tensor_parallel must be None, True or False, got '
                         f'{enabled!r}')
    ctx = current_context()
    layout = ctx.layout
    one_d = layout is not None and layout.mode == '1d' and ctx.axis(ParallelMode.TENSOR).size > 1
    if enabled and not one_d:
        mode = None if layout is None else layout.mode
        raise ValueError(f'MoE expert_tensor_parallel=True needs 1D tensor parallelism '
                         f"(tensor=dict(mode='1d', size>1)); the tensor mode is {mode!r}")
    return ctx.axis(ParallelMode.TENSOR) if one_d and enabled is not False else None


def sequence_parallel_axis() -> Optional[ProcessGroupAxis]:
    """The 1D group the tokens are split over along the sequence under 1D sequence
    parallelism (``tensor=dict(mode='1d', sequence_parallel=True)``), else None."""
    axis = default_axis()
    return axis if sequence_dim(axis) is not None else None


def _check_layout(capacity_factor):
    layout = current_context().layout
    if layout is None:
        return
    if layout.mode not in EXPERT_TENSOR_MODES:
        raise NotImplementedError(f"MoE needs each token's hidden vector whole; tensor mode "
                                  f"{layout.mode!r} splits it (supported: "
                                  f"{EXPERT_TENSOR_MODES})")
    if capacity_factor is not None and family(layout.mode).splits_sequence:
        raise NotImplementedError(f"MoE capacity_factor counts per whole sequence; tensor mode "
                                  f"{layout.mode!r} splits sequences over ranks")


class SharedGate(nn.Module):
    """Qwen2-MoE's shared-expert gate ``sigmoid(x w^T)``, ``weight [1, h]`` (replicated).
    ``sequence_axis``: x is this rank's sequence block (1D sequence parallelism), so the
    weight's gradient is partial and summed over that group (``partial_grad_param``), as a
    norm's."""

    def __init__(self, hidden: int, weight_init: Optional[Init] = None,
                 sequence_axis: Optional[ProcessGroupAxis] = None):
        super().__init__()
        self.weight = new_parameter((1, hidden), init=weight_init or uniform_init(hidden))
        self.sequence_axis = sequence_axis

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight if self.sequence_axis is None else partial_grad_param(
            self.weight, self.sequence_axis)
        return torch.sigmoid(x @ weight.t())


class MoE(nn.Module):
    """Mixture of ``experts`` SwiGLU experts of width ``ffn_hidden``, ``top_k`` per token.

    ``score``: 'softmax' | 'sigmoid'; ``renormalize``: top-k weights divided by their sum.
    ``capacity_factor``: None (dropless) or > 0: ``C = ceil(cf * s * k / experts)`` slots
    per expert and batch row, earlier tokens kept. ``aux_loss_coef``, ``z_loss_coef``: the
    losses of ``losses.py``, added to the gradient through the output (forward signature and
    training loss unchanged; ``aux_loss_scale`` for AMP / micro-batches). ``bias_update_rate``
    > 0: DeepSeek-V3 bias balancing, the bias moved by :meth:`update_balance_bias`.
    ``shared_experts`` n always-on experts of width ``shared_ffn_hidden`` (default
    ``ffn_hidden``), gated when ``shared_gate``. ``weight_init(tensor, generator)`` for every
    weight (default: U(+-1/sqrt(fan_in))). ``expert_axis`` (default EXPERT of the launched
    layout) and ``stats_axis`` (default :func:`token_axis`) are ProcessGroupAxis.
    ``expert_tensor_parallel`` (:func:`expert_tensor_axis`): each expert's width cut over
    the 1D TENSOR group.

    After each training forward: ``last_tokens_per_expert`` (int64 ``[experts]``: slots
    routed per expert, before drops, summed over ``stats_axis``; local counts in eval),
    ``last_aux_loss`` and ``last_z_loss`` (detached, coef included, this rank's value: the
    serial value is their mean over ``stats_axis``).
    """

    def __init__(self, hidden: int, ffn_hidden: int, experts: int, top_k: int, *,
                 score: str = 'softmax', renormalize: bool = True,
                 capacity_factor: Optional[float] = None, aux_loss_coef: float = 0.0,
                 z_loss_coef: float = 0.0, bias_update_rate: float = 0.0,
                 shared_experts: int = 0, shared_ffn_hidden: Optional[int] = None,
                 shared_gate: bool = False, weight_init: Optional[Init] = None,
                 expert_axis: Optional[ProcessGroupAxis] = None,
                 stats_axis: Optional[ProcessGroupAxis] = None,
                 expert_tensor_parallel: Optional[bool] = None):
        super().__init__()
        if capacity_factor is not None and (isinstance(capacity_factor, bool) or not isinstance(
                capacity_factor, numbers.Real) or not capacity_factor > 0):
            raise ValueError(f'MoE capacity_factor must be None (dropless) or a number > 0, '
                             f'got {capacity_factor!r}')
        for name, value in (('aux_loss_coef', aux_loss_coef), ('z_loss_coef', z_loss_coef),
                            ('bias_update_rate', bias_update_rate)):
            if not value >= 0:
                raise ValueError(f'MoE {name} must be >= 0, got {value!r}')
        if shared_experts < 0:
            raise ValueError(f'MoE shared_experts must be >= 0, got {shared_experts}')
        _check_layout(capacity_factor)
        self.num_experts, self.top_k, self.capacity_factor = experts, top_k, capacity_factor
        self.aux_loss_coef, self.z_loss_coef = aux_loss_coef, z_loss_coef
        self.bias_update_rate = bias_update_rate
        self.expert_axis = expert_axis or current_context().axis(ParallelMode.EXPERT)
        self.stats_axis = stats_axis or token_axis()
        self.aux_loss_scale = 1.0
        self._sequence_ranks = _sequence_ranks()
        self.sequence_axis = sequence_parallel_axis()
        self.router = TopKRouter(hidden, experts, top_k, score, renormalize,
                                 bias_balancing=bias_update_rate > 0, weight_init=weight_init)
        self.experts = GroupedExperts(hidden, ffn_hidden, experts, self.expert_axis, weight_init,
                                      expert_tensor_axis(expert_tensor_parallel))
        self.shared_expert = (SharedExperts(hidden, shared_experts * (shared_ffn_hidden or
                                                                      ffn_hidden), weight_init)
                              if shared_experts else None)
        self.shared_expert_gate = (SharedGate(hidden, weight_init, self.sequence_axis)
                                   if shared_experts and shared_gate else None)
        self.last_tokens_per_expert = torch.zeros(experts, dtype=torch.int64)
        self.last_aux_loss = torch.zeros(())
        self.last_z_loss = torch.zeros(())
        self.step_tokens_per_expert = torch.zeros(experts, dtype=torch.int64)
        self.step_aux_loss = torch.zeros(())
        self.step_z_loss = torch.zeros(())
        self._pending_counts: Optional[torch.Tensor] = None
        self._pending_losses: Optional[torch.Tensor] = None
        self._pending_forwards = 0

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 2:
            raise ValueError(f'MoE input must be [..., s, h], got shape {tuple(x.shape)}')
        if self.sequence_axis is None:
            out = self._routed(x)
        else:   # x: this rank's sequence block; route the whole sequences, keep own block
            seq = x.dim() - 2
            out = split_to(self._routed(gather_from(x, self.sequence_axis, seq)),
                           self.sequence_axis, seq)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = self.shared_expert_gate(x).to(shared.dtype) * shared
            out = out + shared
        return out

    def _routed(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted outputs for ``x [..., s, h]`` (whole sequences)."""
        tokens = x.reshape(-1, x.shape[-1])
        route = self.router(tokens)
        counts = self._count(route.experts)
        weights = self._attach_losses(route, counts) if self.training else route.weights
        keep = None
        if self.capacity_factor is not None:
            cap = capacity(self.capacity_factor, x.shape[-2], self.top_k, self.num_experts)
            keep = capacity_keep(route.experts, self.num_experts, x.shape[-2], cap)
        slots = sort_slots(route.experts, self.num_experts, keep)
        exchange = ExpertExchange(slots.counts, self.expert_axis)
        rows = exchange.dispatch(tokens[slots.token])
        rows = exchange.combine(self.experts(rows, exchange.local_counts))
        out = combine(rows, slots, weights)
        return out.view(x.shape[:-1] + out.shape[-1:])

    def _count(self, experts: torch.Tensor) -> torch.Tensor:
        """Routed slots per expert: summed over ``stats_axis`` in training, local in eval;
        accumulated for :meth:`update_balance_bias` (and the step's statistics) in training
        with grad."""
        counts = torch.bincount(experts.reshape(-1), minlength=self.num_experts)
        if self.training:
            counts = C.all_reduce(counts, self.stats_axis)
            if torch.is_grad_enabled():
                pending = self._pending_counts
                self._pending_counts = counts.clone() if pending is None else pending + counts
        self.last_tokens_per_expert = counts.detach()
        return counts

    def _attach_losses(self, route, counts) -> torch.Tensor:
        """The routing weights, carrying the aux and z losses' gradient (``losses.py``)."""
        total = None
        values = torch.zeros(2, device=route.logits.device)   # (aux, z) of this forward
        if self.aux_loss_coef:
            aux = self.aux_loss_coef * load_balancing_loss(route.probs, counts, self.top_k)
            self.last_aux_loss, total = aux.detach(), aux
            values[0] = aux.detach()
        if self.z_loss_coef:
            z = self.z_loss_coef * z_loss(route.logits)
            self.last_z_loss = z.detach()
            total = z if total is None else total + z
            values[1] = z.detach()
        if torch.is_grad_enabled():   # the step's mean losses (update_balance_bias records)
            pending = self._pending_losses
            self._pending_losses = values if pending is None else pending + values
            self._pending_forwards += 1
        if total is None:
            return route.weights
        return attach_loss(route.weights, total, self._loss_grad_scale)

    def _loss_grad_scale(self) -> float:
        """The gradient given to the auxiliary losses (``losses.py``): ``aux_loss_scale``
        over the sequence ranks (whose gradients the sync adds)."""
        return self.aux_loss_scale / self._sequence_ranks

    # ------------------------------------------------------------------ balancing
    @torch.no_grad()
    def update_balance_bias(self):
        """DeepSeek-V3 balancing step: ``bias += rate * sign(mean(c) - c)`` with ``c`` the
        global routed counts of the training forwards since the last call (every replica
        the same). Call once per optimizer step (the engine does, after ``engine.step()``);
        the bias is left alone without ``bias_update_rate``; nothing happens without training
        forwards since the last call.

        It also closes the step's statistics (read by the trainer's ``MoEStatsHook``):
        ``step_tokens_per_expert`` (int64 ``[experts]``, the global counts summed over the
        step's micro-batches), ``step_aux_loss`` and ``step_z_loss`` (this rank's losses,
        coefficient included, averaged over the step's training forwards)."""
        if self._pending_counts is None:
            return
        if self.router.balance is not None:
            self.router.balance.update(self._pending_counts, self.bias_update_rate)
        self.step_tokens_per_expert = self._pending_counts
        if self._pending_losses is not None:
            self.step_aux_loss, self.step_z_loss = (
                self._pending_losses / max(1, self._pending_forwards)).unbind()
        self.discard_balance_counts()

    def discard_balance_counts(self):
        """Forget the counts (and losses) gathered since the last :meth:`update_balance_bias`
        (a skipped or discarded optimizer step)."""
        self._pending_counts = None
        self._pending_losses, self._pending_forwards = None, 0

    def extra_repr(self) -> str:
        return (f'experts={self.num_experts}, top_k={self.top_k}, '
                f'score={self.router.score!r}, E={self.expert_axis.size}, '
                f'expert_tensor={getattr(self.experts.tensor_axis, "size", 1)}, '
                f'capacity_factor={self.capacity_factor}')


def moe_layers(model: nn.Module):
    """The :class:`MoE` layers of ``model``."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def update_balance_biases(model: nn.Module):
    """:meth:`MoE.update_balance_bias` on every MoE layer of ``model``."""
    for layer in moe_layers(model):
        layer.update_balance_bias()


def set_aux_loss_scale(model: nn.Module, scale: float):
    """``aux_loss_scale`` of every MoE layer of ``model`` (``losses.py``: the AMP loss scale
    over the number of accumulated micro-batches)."""
    for layer in moe_layers(model):
        layer.aux_loss_scale = float(scale)
