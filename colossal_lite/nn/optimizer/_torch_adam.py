"""The torch implementation of the fused CPU Adam step: the kernel's semantics in torch ops.

Used where the C++ extension cannot be built (or is disabled), and for tensors that are not
on the CPU. Same operands and result as ``csrc/cpu_adam.cpp``'s ``adam_update``: the
parameter may be fp32/fp16/bf16 (computed in fp32), moments are fp32, ``out_lowp`` receives
the updated parameter rounded to its dtype, and a non-finite gradient writes nothing.
"""
from __future__ import annotations

import math
from typing import Optional

import torch


def step_scalars(step: int, lr: float, beta1: float, beta2: float) -> tuple:
    """(step_size, inv_bc2_sqrt): ``lr / (1 - beta1^t)`` and ``1 / sqrt(1 - beta2^t)``."""
    if step < 1:
        raise ValueError(f'Adam step must be >= 1 (bias correction), got {step}')
    return lr / (1.0 - beta1 ** step), 1.0 / math.sqrt(1.0 - beta2 ** step)


def torch_adam_update(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                      exp_avg_sq: torch.Tensor, out_lowp: Optional[torch.Tensor], step: int,
                      lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                      adamw: bool, loss_scale: float, check_finite: bool) -> bool:
    """One Adam/AdamW step in torch ops; returns found_inf (then nothing was written)."""
    if check_finite and not bool(torch.isfinite(grad).all()):
        return True
    step_size, inv_bc2_sqrt = step_scalars(step, lr, beta1, beta2)
    master = param if param.dtype == torch.float32 else param.float()
    g = grad.float() * (1.0 / loss_scale)
    if not adamw and weight_decay != 0:
        g.add_(master, alpha=weight_decay)
    exp_avg.lerp_(g, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    if adamw and weight_decay != 0:
        master.mul_(1.0 - lr * weight_decay)
    denom = exp_avg_sq.sqrt().mul_(inv_bc2_sqrt).add_(eps)
    master.addcdiv_(exp_avg, denom, value=-step_size)
    if master is not param:
        param.copy_(master)
    if out_lowp is not None:
        out_lowp.copy_(master)
    return False
