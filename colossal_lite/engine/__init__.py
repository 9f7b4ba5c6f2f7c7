"""Engine, gradient handling (bucketed data-parallel all-reduce, clipping), checkpointing,
and the non-pipeline schedule (which runs the M micro-batches of one optimizer step)."""
from .checkpoint import checkpoint
from .clip import clip_grad_norm, grad_norm
from .engine import Engine
from .gradient_handler import (GradientReducer, allreduce_gradients, broadcast_parameters,
                               data_parallel_axis, gradient_axis, is_expert_parameter)
from .schedule import NonPipelineSchedule

__all__ = ['Engine', 'GradientReducer', 'NonPipelineSchedule', 'allreduce_gradients',
           'broadcast_parameters', 'checkpoint', 'clip_grad_norm', 'data_parallel_axis',
           'grad_norm', 'gradient_axis', 'is_expert_parameter']
