"""Optimizers: CPUAdam / HybridAdam over the fused C++ CPU Adam kernel (csrc/cpu_adam.cpp),
and ``adam_step``, the functional step on one flat tensor (used by the ZeRO engine)."""
from ._kernel import active_backend, any_nonfinite, load_extension, supported_backends
from .cpu_adam import CPUAdam, HybridAdam, adam_step

__all__ = ['CPUAdam', 'HybridAdam', 'adam_step', 'any_nonfinite', 'active_backend',
           'load_extension', 'supported_backends']
