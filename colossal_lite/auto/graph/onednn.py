"""The lowered program's matmuls on oneDNN where the hand layouts run theirs (CPU, fp32).

``nn.functional.dense_linear`` runs a one-rank layer's forward and input gradient through
oneDNN's matmul (``mkldnn._linear_pointwise``), on AVX-512 CPUs about 2x MKL's fp32 rate,
which ``aten.mm`` / ``aten.addmm`` use. :func:`matmuls_on_onednn` rewrites a lowered program
the same way: ``mm(a, b)`` -> ``linear(a, b^T)`` and ``addmm(bias, a, b)`` (a 1-D bias, unit
``alpha`` and ``beta``) -> ``linear(a, b^T, bias)``, where ``a`` is contiguous (oneDNN's
source layout); ``b`` may be any strided 2-D view (its transpose, the weight argument, is read
in place).
Only the forward's calls (before the loss, ``simplify.forward_end``): the backward's stay on
``mm``. Results agree to fp32 rounding (oneDNN's blocking is not MKL's).

oneDNN takes a scratch buffer for the call (B-panel packing) from torch's allocator: at most
:func:`scratch_bytes` ``= threads (64 K 4 + 1024)`` for a contraction of ``K`` (measured in
tests/test_auto_graph.py), which the memory model adds at each forward matmul
(``liveness.py``).
"""
from __future__ import annotations

from typing import Optional

import torch

from ...nn.functional import _ONEDNN_LINEAR

aten = torch.ops.aten

ONEDNN_LINEAR = _ONEDNN_LINEAR       # None where this torch has no oneDNN

MATMULS = (aten.mm.default, aten.addmm.default)


def scratch_bytes(contraction: int, threads: Optional[int] = None) -> int:
    """Upper bound of oneDNN's scratch for one matmul contracting ``contraction`` elements
    (fp32): per thread (default: torch's intra-op threads now), B-panel packing of 64
    columns and 1 KiB."""
    threads = torch.get_num_threads() if threads is None else threads
    return threads * (64 * contraction * 4 + 1024)


def _plain(node, contiguous: bool) -> bool:
    value = node.meta.get('val') if isinstance(node, torch.fx.Node) else None
    return (isinstance(value, torch.Tensor) and value.dtype == torch.float32
            and value.device.type == 'cpu' and value.dim() == 2
            and (value.is_contiguous() or not contiguous))


def matmuls_on_onednn(graph: torch.fx.Graph, boundary: Optional[torch.fx.Node]) -> int:
    """Rewrite the forward's eligible matmuls, those up to ``boundary`` (module doc; none
    without a boundary); returns how many."""
    if ONEDNN_LINEAR is None or boundary is None:
        return 0
    done = 0
    for node in list(graph.nodes):
        if node is boundary:
            break
        if node.op != 'call_function':
            continue
        if node.target is aten.mm.default:
            bias, (a, b) = None, node.args
        elif node.target is aten.addmm.default:
            if node.kwargs.get('beta', 1) != 1 or node.kwargs.get('alpha', 1) != 1:
                continue
            bias, a, b = node.args
            value = bias.meta.get('val') if isinstance(bias, torch.fx.Node) else None
            if not (isinstance(value, torch.Tensor) and value.dim() == 1
                    and value.dtype == torch.float32):
                continue
        else:
            continue
        if not (_plain(a, True) and _plain(b, False)):
            continue
        with graph.inserting_before(node):
            weight = graph.call_function(aten.t.default, (b,))
            weight.meta['val'] = b.meta['val'].t()
            linear = graph.call_function(ONEDNN_LINEAR, (a, weight, bias, 'none', [], ''))
            linear.meta['val'] = node.meta.get('val')
        node.replace_all_uses_with(linear)
        graph.erase_node(node)
        done += 1
    return done
