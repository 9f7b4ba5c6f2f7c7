"""Activation checkpointing: ``checkpoint(fn, *args)`` keeps only the inputs of ``fn``.

Forward runs ``fn`` under ``no_grad`` and saves its tensor inputs plus every
random-number state ``fn`` may draw from:

* the default CPU generator (``torch.get_rng_state``),
* the current CUDA generator, when CUDA is in use,
* every per-mode stream of ``colossal_lite.context.seed_manager`` (the TENSOR
  stream draws attention and in-region dropout masks),
* the autocast state (enabled, dtype) of the CPU and CUDA devices.

Backward restores those states, recomputes ``fn`` with grad enabled,
back-propagates the incoming gradients through the recomputed graph, and puts
the states back as they were, so later random draws are unaffected. Dropout
masks, outputs and gradients therefore equal the non-checkpointed run exactly.
The recomputation repeats ``fn``'s forward collectives (e.g. the row-parallel
all_reduce of a 1D block) in backward, in the same order on every rank.

A placeholder tensor that requires grad is always passed to the autograd
function, so parameter gradients flow even when no input requires grad.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Tuple

import torch

from ..context.random import seed_manager


def _cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _autocast_state() -> Tuple[Tuple[str, bool, torch.dtype], ...]:
    devices = ('cpu', 'cuda') if torch.cuda.is_available() else ('cpu',)
    return tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in devices)


def capture_rng_state() -> dict:
    """Every RNG state a block may draw from (CPU, CUDA, the seed_manager streams)."""
    return {'cpu': torch.get_rng_state(),
            'cuda': torch.cuda.get_rng_state() if _cuda_in_use() else None,
            'modes': seed_manager.get_states()}


def restore_rng_state(state: dict):
    torch.set_rng_state(state['cpu'])
    if state['cuda'] is not None:
        torch.cuda.set_rng_state(state['cuda'])
    seed_manager.set_states(state['modes'])


@contextlib.contextmanager
def _replayed(rng_state: dict, autocast_state):
    """Run the block with the forward pass's RNG and autocast states; restore afterwards."""
    current = capture_rng_state()
    restore_rng_state(rng_state)
    try:
        with contextlib.ExitStack() as stack:
            for device, enabled, dtype in autocast_state:
                stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))
            yield
    finally:
        restore_rng_state(current)


class _CheckpointFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, placeholder, *args):
        ctx.fn = fn
        ctx.rng_state = capture_rng_state()
        ctx.autocast_state = _autocast_state()
        ctx.tensor_index = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.others = [None if torch.is_tensor(a) else a for a in args]
        ctx.save_for_backward(*(args[i] for i in ctx.tensor_index))
        with torch.no_grad():
            return fn(*args)

    @staticmethod
    def backward(ctx, *grads):
        args = list(ctx.others)
        for i, saved in zip(ctx.tensor_index, ctx.saved_tensors):
            args[i] = saved.detach().requires_grad_(saved.requires_grad)
        with _replayed(ctx.rng_state, ctx.autocast_state), torch.enable_grad():
            outputs = ctx.fn(*args)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads)
                 if torch.is_tensor(o) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        arg_grads = tuple(a.grad if torch.is_tensor(a) and a.requires_grad else None for a in args)
        return (None, None) + arg_grads


def checkpoint(fn: Callable[..., Any], *args):
    """``fn(*args)`` whose activations are recomputed in backward (see module docstring).

    ``args`` may mix tensors and other values (e.g. ``None`` masks); ``fn`` returns a
    tensor or a tuple of tensors. Outside grad mode this is just ``fn(*args)``.
    """
    if not torch.is_grad_enabled():
        return fn(*args)
    placeholder = torch.empty(0, requires_grad=True)
    return _CheckpointFunction.apply(fn, placeholder, *args)
