"""The memory tracer of the warm-up step: model vs non-model memory per module.

During the first training step the tracer records

* the chunk access order (every gather, forward then backward): the ``auto`` policy's
  Belady eviction reads the next use of a chunk from it;
* per module (by name), the model data it needs (bytes of its parameters' chunks, gathered)
  and the non-model bytes it adds: the activations autograd saves for backward during its
  forward (``torch.autograd.graph.saved_tensors_hooks``; parameters excluded). Their running
  sum peaks at the end of forward; ``non_model_peak`` is that peak, the headroom ``auto``
  keeps free of model data.

Local bookkeeping only: no communication.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch


class MemoryTracer:
    def __init__(self, param_ids: set):
        self._param_ids = param_ids
        self.saved_bytes = 0
        self.non_model_peak = 0
        self.non_model: Dict[str, int] = {}     # module name -> saved activation bytes
        self.model: Dict[str, int] = {}         # module name -> bytes of its chunks
        self.order: List[int] = []              # chunk access order of the step
        self._hooks: Optional[torch.autograd.graph.saved_tensors_hooks] = None
        self._starts: Dict[str, int] = {}
        self.done = False

    def _pack(self, t: torch.Tensor):
        if id(t) not in self._param_ids:
            self.saved_bytes += t.numel() * t.element_size()
            self.non_model_peak = max(self.non_model_peak, self.saved_bytes)
        return t

    def start_forward(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()

    def end_forward(self):
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks = None

    def module_start(self, name: str, chunk_bytes: int):
        self._starts[name] = self.saved_bytes
        self.model[name] = max(self.model.get(name, 0), chunk_bytes)

    def module_end(self, name: str):
        start = self._starts.pop(name, self.saved_bytes)
        self.non_model[name] = self.non_model.get(name, 0) + self.saved_bytes - start
