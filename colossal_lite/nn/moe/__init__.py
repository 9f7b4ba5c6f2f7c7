"""Mixture of experts: :class:`MoE` (router, dispatch, experts, losses) with expert
parallelism over the EXPERT group. One job per module: ``router.py`` (top-k scores, the
balancing bias), ``dispatch.py`` (capacity, sorting, the all_to_all exchange, combine),
``experts.py`` (stacked routed experts, shared experts), ``losses.py`` (aux and z losses and
how they reach the gradient), ``layer.py`` (the layer). Formulas: docs/moe.md."""
from .dispatch import (ExpertExchange, SortedSlots, capacity, capacity_keep, combine,
                       exchange_rows, sort_slots)
from .experts import GroupedExperts, SharedExperts, expert_parameter, grouped_swiglu
from .layer import (MoE, SharedGate, moe_layers, set_aux_loss_scale, token_axis,
                    update_balance_biases)
from .losses import attach_loss, load_balancing_loss, z_loss
from .router import BalanceBias, Routing, TopKRouter, uniform_init

__all__ = ['MoE', 'TopKRouter', 'Routing', 'BalanceBias', 'GroupedExperts', 'SharedExperts',
           'SharedGate', 'ExpertExchange', 'SortedSlots', 'capacity', 'capacity_keep',
           'combine', 'exchange_rows', 'sort_slots', 'expert_parameter', 'grouped_swiglu',
           'attach_loss', 'load_balancing_loss', 'z_loss', 'moe_layers', 'set_aux_loss_scale',
           'token_axis', 'update_balance_biases', 'uniform_init']
