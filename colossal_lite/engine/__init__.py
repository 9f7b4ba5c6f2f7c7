"""Engine, gradient handling and schedules."""
from .gradient_handler import allreduce_gradients, data_parallel_axis

__all__ = ['allreduce_gradients', 'data_parallel_axis']
