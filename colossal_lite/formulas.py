"""Per-rank parameter sizes and communication bytes of each layer kind, per tensor family.

Pure arithmetic on a ``ParallelLayout`` (``l``) and layer dimensions, so the planner
and the tests read the same numbers the layers produce (the tests assert that the
layers' placements and the byte counter of ``colossal_lite.communication`` equal
them; docs/tensor_parallel.md and docs/sequence_parallel.md derive them).

``PARAMS[mode][kind](l, **dims)`` is the number of elements one rank holds of a
layer of that kind. Kinds and their dims:

* ``linear(fin, fout, bias, region)`` -- ``region`` in 'enter' | 'exit' | None;
* ``layernorm(h)``; ``embedding(v, h)``; ``vocab_embedding(v, h)``;
* ``vocab_classifier(h, c, bias, tied)`` (a tied weight counts 0: it is the
  embedding's); ``classifier(h, c, bias)``;
* ``patch_embedding(h, chans, patch, tokens)`` (tokens = 1 + patches).

``COMM`` holds the communication formulas in bytes per rank (``elem`` bytes each).
"""
from __future__ import annotations

from typing import Callable, Dict, Optional


def _patch_full(h, chans, patch, tokens):
    return h * chans * patch * patch + h + h + tokens * h


def _params_1d(p: int) -> Dict[str, Callable[..., int]]:
    def linear(fin, fout, bias=True, region=None):
        if region == 'exit':  # row-parallel: weight cut by columns, bias whole
            return fout * fin // p + (fout if bias else 0)
        return fout // p * fin + (fout // p if bias else 0)
    return dict(
        linear=linear, layernorm=lambda h: 2 * h,
        embedding=lambda v, h: v * h // p, vocab_embedding=lambda v, h: v // p * h,
        vocab_classifier=lambda h, c, bias=False, tied=False:
            (0 if tied else c // p * h) + (c // p if bias else 0),
        classifier=lambda h, c, bias=True: c * h // p + (c if bias else 0),
        patch_embedding=_patch_full)


def _params_2p5d(q: int) -> Dict[str, Callable[..., int]]:
    return dict(
        linear=lambda fin, fout, bias=True, region=None:
            fout // q * (fin // q) + (fout // q if bias else 0),
        layernorm=lambda h: 2 * h // q,
        embedding=lambda v, h: v * h // q, vocab_embedding=lambda v, h: v // q * (h // q),
        vocab_classifier=lambda h, c, bias=False, tied=False:
            (0 if tied else c // q * (h // q)) + (c // q if bias else 0),
        classifier=lambda h, c, bias=True: c * h // q + (c if bias else 0),
        patch_embedding=lambda h, chans, patch, tokens: _patch_full(h, chans, patch, tokens) // q)


def _params_3d(q: int) -> Dict[str, Callable[..., int]]:
    linear = (lambda fin, fout, bias=True, region=None:
              fout // (q * q) * (fin // q) + (fout // (q * q) if bias else 0))
    return dict(
        linear=linear, layernorm=lambda h: 2 * h // q,
        embedding=lambda v, h: v * h // q, vocab_embedding=lambda v, h: v // (q * q) * (h // q),
        vocab_classifier=lambda h, c, bias=False, tied=False:
            (0 if tied else c // (q * q) * (h // q)) + (c // (q * q) if bias else 0),
        classifier=lambda h, c, bias=True: c * h // q + (c if bias else 0),
        patch_embedding=lambda h, chans, patch, tokens: _patch_full(h, chans, patch, tokens) // q)


def params(mode: Optional[str], layout) -> Dict[str, Callable[..., int]]:
    """The parameter formulas of ``mode`` for ``layout``."""
    if mode == '1d':
        return _params_1d(layout.tensor)
    if mode in ('2d', '2.5d'):
        return _params_2p5d(layout.tensor_grid)
    if mode == '3d':
        return _params_3d(layout.tensor_grid)
    return _params_1d(1)  # serial and sequence: every weight whole


# ---------------------------------------------------------------------------- communication
def mlp_1d_bytes(p: int, b: int, s: int, h: int, elem: int = 4) -> int:
    """A 1D MLP block (column fc1 + row fc2), forward + backward: 2 all_reduces of the
    ``[b, s, h]`` activation (fc2's output forward, fc1's input gradient backward)."""
    return 0 if p == 1 else 2 * b * s * h * elem


def linear_2p5d_bytes(b: int, s: int, h: int, q: int, d: int, elem: int = 4) -> int:
    """One 2D/2.5D ``Linear(h, h)`` with bias, forward + backward, buffer bytes per rank:
    SUMMA broadcasts/reduces of x, y, dy blocks and W blocks, the bias gradient over col,
    and (d > 1) the dep all_reduces of dW and db."""
    deep = 1 if d > 1 else 0
    elems = (2 * b * s * h // (d * q) + 3 * h * h // q + h // q
             + deep * (h * h // (q * q) + h // q))
    return elems * elem


def linear_2p5d_wire_bytes(b: int, s: int, h: int, q: int, d: int, elem: int = 4) -> float:
    """Ring/chain bytes moved per rank for :func:`linear_2p5d_bytes`: (q-1)/q of every
    broadcast and reduce, 2(q-1)/q of the col all_reduce, 2(d-1)/d of the dep ones."""
    summa = (q - 1) / q * (2 * b * s * h / (d * q) + 3 * h * h / q)
    return elem * (summa + 2 * (q - 1) / q * h / q + 2 * (d - 1) / d * (h * h / q ** 2 + h / q))


def linear_3d_bytes(b: int, s: int, h_in: int, h_out: int, q: int, bias: bool = True,
                    keep_gathered: bool = False, elem: int = 4) -> int:
    """One 3D ``Linear`` forward + backward, buffer bytes per rank: gathers/scatters of x, y,
    dy, dx, the weight's all_gather and gradient reduce_scatter, the bias's, and (unless
    ``keep_gathered``) the backward re-gather of x and A."""
    acts = 2 * b * s * (h_in + h_out) / q ** 2
    weights = 2 * h_in * h_out / q ** 2
    biases = 2 * h_out / q if bias else 0
    regather = 0 if keep_gathered else (b * s * h_in + h_in * h_out) / q ** 2
    return int(elem * (acts + weights + biases + regather))


def ring_attention_bytes(p: int, b: int, s: int, h: int, elem: int = 4) -> int:
    """One ring self-attention forward + backward, bytes sent (= received) per rank:
    6(P-1) exchanges of a ``[b, s/P, h]`` block (k, v forward; k, dk, v, dv backward)."""
    return 6 * (p - 1) * b * (s // p) * h * elem


def ring_attention_saved_bytes(p: int, b: int, s: int, h: int, n: int, elem: int = 4) -> int:
    """Activations one ring attention saves for backward (no mask, no dropout):
    q, k, v in head layout (3 b s/P h) and the probabilities b n s/P s."""
    return (3 * b * (s // p) * h + b * n * (s // p) * s) * elem
