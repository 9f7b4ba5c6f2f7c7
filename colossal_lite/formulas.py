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
    """Activations one (memory-linear) ring attention saves for backward, multi-head, no
    mask, no dropout: q, k, v and the output ``[b, s/P, h]``, and the fp32 log-sum-exp
    ``[b, n, s/P]`` -- linear in s/P (``nn/sequence/ring.py``)."""
    return 4 * b * (s // p) * h * elem + b * n * (s // p) * 4


def ulysses_attention_bytes(p: int, u: int, b: int, s: int, heads: int, kv_heads: int,
                            head_dim: int, elem: int = 4) -> int:
    """One Ulysses attention forward + backward over P = R x U ranks, all_to_all buffer
    bytes per rank over ULYSSES (each moves (U-1)/U of it): q and the output ``[b, s/P, n d]``
    and the stacked k, v ``[2, b, s/P, n' d]`` (n' = max(n_kv, U): fewer kv heads are
    repeated to U), forward and again backward (``nn/sequence/ulysses.py``). A ring of
    R > 1 adds ``ring_attention_bytes(R, b, s, (n'/U) d)`` over SEQUENCE_RING."""
    if u == 1:
        return 0
    kv = kv_heads if kv_heads % u == 0 else u
    return 2 * b * (s // p) * (2 * heads + 2 * kv) * head_dim * elem


def block_bytes(mode: Optional[str], p: int, b: int, s: int, h: int, mlp_ratio: int = 4,
                d: int = 1, elem: int = 4) -> float:
    """One pre/post-LN transformer block (fused q/k/v h->3h, dense h->h; fc1 h->r h; fc2 r h->h; two
    LayerNorms; biases), forward + backward, buffer bytes per rank over the tensor group(s),
    input needing its gradient. The per-layer formulas above summed over the block's layers
    (``tests/test_planner.py`` measures 1D and 2D equal to the byte counter):

    * 1d: 4 all_reduces of ``b s h`` (the fused q/k/v projection's input gradient, dense
      and fc2 forward, fc1 input gradient) -- 2 :func:`mlp_1d_bytes` pairs;
    * 2d/2.5d (p = d q^2): :func:`linear_2p5d_bytes` per Linear generalized to (in, out):
      ``2 b s out/(d q) + 3 in out/q + [d>1] in out/q^2 + out/q (1 + [d>1])``, plus each
      LayerNorm's ``4 b s/(d q) + 2 h/q (1 + [d>1])``;
    * 3d (p = q^3): :func:`linear_3d_bytes` per Linear, plus each LayerNorm's
      ``4 b s/q^2 + 2 h/q``;
    * sequence: one :func:`ring_attention_bytes` (the weights are whole);
    * None (or p == 1): 0."""
    if mode is None or p == 1:
        return 0
    n, r = b * s, mlp_ratio
    # q, k, v run as one fused projection h -> 3h (``col_nn.project_qkv``): in 3D its input
    # is gathered once, not three times; in 2D/2.5D every term is linear in ``out``
    linears = [(h, 3 * h), (h, h), (h, r * h), (r * h, h)]
    if mode == '1d':
        return 2 * mlp_1d_bytes(p, b, s, h, elem)
    if mode == 'sequence':
        return ring_attention_bytes(p, b, s, h, elem)
    if mode in ('2d', '2.5d'):
        q = round((p // d) ** 0.5)
        deep = 1 if d > 1 else 0
        elems = sum(2 * n * o / (d * q) + 3 * i * o / q + deep * i * o / q ** 2
                    + o / q * (1 + deep) for i, o in linears)
        elems += 2 * (4 * n / (d * q) + 2 * h / q * (1 + deep))
        return elem * elems
    if mode == '3d':
        q = round(p ** (1 / 3))
        return (sum(linear_3d_bytes(b, s, i, o, q, elem=elem) for i, o in linears)
                + elem * 2 * (4 * n / q ** 2 + 2 * h / q))
    raise ValueError(f'unknown tensor mode {mode!r}')


def gradient_sync_bytes(zero_stage: int, grad_elems: int, microbatches: int = 1,
                        elem: int = 4) -> int:
    """Data-parallel gradient traffic per optimizer step, buffer bytes per rank, for
    ``grad_elems`` local gradient elements (docs/zero.md): plain data parallelism one
    all_reduce; ZeRO-1 one reduce_scatter + one all_gather; ZeRO-2 one reduce_scatter per
    micro-step + one all_gather; ZeRO-3 (chunks) one all_gather per forward and per backward
    re-gather plus one reduce_scatter per micro-step."""
    n = grad_elems * elem
    if zero_stage == 0:
        return n
    if zero_stage == 1:
        return 2 * n
    if zero_stage == 2:
        return (microbatches + 1) * n
    if zero_stage == 3:
        return 3 * microbatches * n
    raise ValueError(f'ZeRO stage must be 0 (none), 1, 2 or 3, got {zero_stage}')
