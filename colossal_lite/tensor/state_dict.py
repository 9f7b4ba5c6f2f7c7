"""Full-tensor state dicts for modules holding sharded parameters.

:class:`ShardedModule` registers two hooks: ``state_dict()`` replaces every
sharded parameter by its gathered full tensor (all-gathers over the spec's
groups, so every rank must call it), and ``load_state_dict(full)`` cuts each
full tensor down to this rank's shard. Keys are the serial model's keys.
:func:`local_state_dict` gives the per-rank shards instead, for large models.
"""
from __future__ import annotations

from typing import Dict

import torch
from torch import nn

from .placement import param_placement


def _gather_hook(module, state_dict, prefix, local_metadata):
    for name, param in module._parameters.items():
        key = prefix + name
        if param is None or key not in state_dict:
            continue
        placement = param_placement(param)
        if not placement.is_replicated:
            state_dict[key] = placement.gather(param.detach())
    return state_dict


def _shard_hook(module, state_dict, prefix, local_metadata, strict, missing_keys,
                unexpected_keys, error_msgs):
    for name, param in module._parameters.items():
        key = prefix + name
        if param is None or key not in state_dict:
            continue
        placement = param_placement(param)
        if placement.is_replicated:
            continue
        full = state_dict[key]
        if tuple(full.shape) != placement.shape:
            error_msgs.append(f"'{key}': expected the full (serial) tensor of shape "
                              f"{placement.shape} (this rank's shard: {tuple(param.shape)}), "
                              f"got shape {tuple(full.shape)}")
            continue
        state_dict[key] = placement.shard(full)


class ShardedModule(nn.Module):
    """Base of every parallel layer: full-tensor ``state_dict`` / ``load_state_dict``."""

    def __init__(self):
        super().__init__()
        self._register_state_dict_hook(_gather_hook)
        self._register_load_state_dict_pre_hook(_shard_hook, with_module=True)


def gather_full(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Gather ``tensor`` (a local shard, e.g. a gradient) with the placement of ``like``."""
    return param_placement(like).gather(tensor)


def local_state_dict(model: nn.Module) -> Dict[str, torch.Tensor]:
    """This rank's shards, keyed like ``model.state_dict()`` (no communication)."""
    out = {name: p.detach() for name, p in model.named_parameters(remove_duplicate=False)}
    out.update({name: b.detach() for name, b in model.named_buffers()})
    return out
