"""Helpers of the sequence-parallel benchmarks: BERT-shaped layers in sequence and 1D mode,
built side by side in one launched run.

The run is launched with ``tensor=dict(mode='sequence', size=P)``. :func:`built_as` lets
the facades build a 1D tensor-parallel model over the *same* P ranks (the SEQUENCE group
presented as PARALLEL_1D while the modules are constructed; layers keep their group
objects afterwards), so the two layouts can be timed alternately in one process set.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from colossal_lite.context import ParallelMode, ProcessGroupAxis, global_context as gpc


@contextlib.contextmanager
def built_as(mode: str):
    """Construct modules for tensor mode ``mode`` ('sequence' or '1d') over the SEQUENCE ranks."""
    if mode == 'sequence':
        yield
        return
    seq = gpc.axis(ParallelMode.SEQUENCE)
    layout = gpc.layout
    gpc.layout = dataclasses.replace(layout, mode='1d')
    gpc._axes[ParallelMode.PARALLEL_1D] = ProcessGroupAxis(ParallelMode.PARALLEL_1D, seq.group,
                                                           seq.ranks, seq.rank, seq.size)
    try:
        yield
    finally:
        gpc.layout = layout
        del gpc._axes[ParallelMode.PARALLEL_1D]


def bert_layers(mode: str, hidden: int, heads: int, layers: int, dropout: float = 0.1):
    """``layers`` BERT encoder layers (post-LN, GELU, 4h MLP) for ``mode``."""
    from model_zoo.blocks import TransformerLayer
    torch.manual_seed(0)
    with built_as(mode):
        return torch.nn.ModuleList(
            TransformerLayer(hidden, heads, 4, dropout, causal=False, pre_ln=False, eps=1e-12)
            for _ in range(layers))


def layer_input(mode: str, batch: int, seq: int, hidden: int) -> torch.Tensor:
    """The activation entering layer 1: replicated ``[b, s, h]`` in 1D, own block in sequence."""
    x = torch.randn(batch, seq, hidden)
    if mode == 'sequence':
        from colossal_lite.nn.sequence import local_block
        x = local_block(x, gpc.axis(ParallelMode.SEQUENCE)).contiguous()
    return x.requires_grad_()


def run_layers(model, x):
    for layer in model:
        x = layer(x)
    return x


def saved_activation_bytes(model, x) -> int:
    """Bytes of the distinct storages autograd saves in one forward (parameters excluded),
    plus the output: what the layers keep alive until backward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            saved[ptr] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = run_layers(model, x)
    saved.setdefault(y.untyped_storage().data_ptr(), y.untyped_storage().nbytes())
    return sum(saved.values())
