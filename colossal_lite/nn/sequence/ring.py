"""Ring attention: blockwise (online) softmax while key/value blocks travel the ring.

Sharding. The SEQUENCE group has P ranks; :class:`~.layout.SequenceLayout` says which
chunks of the sequence each holds (contiguous: chunk r; zigzag: chunks r and 2P-1-r).
Rank r holds ``q [b, s/P, n*d]`` and ``k, v [b, s/P, n_kv*d]`` of its own tokens (all
heads; grouped-query attention when ``n_kv < n``: query head i reads kv head
``i // (n/n_kv)``); the output ``[b, s/P, n*d]`` has q's layout. Every transfer is a
:func:`ring_exchange` (send to r+1, receive from r-1), so after t exchanges rank r holds
the block of owner ``j = (r - t) mod P``.

Forward (``_RingAttention.forward``): the own ``kv = [k; v]`` block (``[2, b, n_kv, s/P,
d]``, only the n_kv heads) goes round the ring, P-1 exchanges, the next one requested
(async) before the current one is used. For every local query chunk ``a`` and the key
chunks of owner j it may see, the scores ``S = q_a k^T / sqrt(d)`` (``[b, n, c, <= 2c]``,
c the chunk length) update a running row max ``m``, row sum ``l`` and output
``acc`` (flash attention's online softmax)::

    m' = max(m, rowmax S);  l = l e^(m-m') + rowsum e^(S-m');  acc = acc e^(m-m') + (e^(S-m') o D) v

(``D``: the dropout keep-mask / (1-p), 1 without dropout). At the end ``out = acc / l``
and ``lse = m + log l``. Saved for backward: q, k, v, out (``[b, s/P, .]``), lse
(``[b, n, s/P]`` fp32), the key padding mask as ``[b, C, c]`` booleans and the document
ids of packed rows as ``[b, C, c]`` (every rank holds the full ids, so the document mask
of a chunk pair is local; a pair sharing no document is skipped, :func:`live_pairs`).

Backward recomputes each block's probabilities from lse (``P = exp(S - lse)``) with
``Drow = rowsum(dO o out)``::

    dV_j += (P o D)^T dO     dP = (dO V_j^T) o D     dS = P o (dP - Drow)
    dq   += dS K_j / sqrt(d)                          dK_j += dS^T q / sqrt(d)

kv travels again (P-1 exchanges); dq accumulates locally; the fp32 accumulator
``[dk; dv]`` of block j is started by rank j+1 (the owner keeps its own term), passes
j+2, ..., j-1 and arrives at j: P-1 exchanges. Each rank adds its term into the arriving
sum itself (the exchange bringing it is waited for before the step's blocks), so the
kv-sized buffers live during a step are at most four for any P: the block in use, the one
arriving, the owner's term and the sum -- the peak per rank is a function of s/P alone,
and the longest sequence in a fixed budget doubles with P. Bytes per rank (``e`` the element size of
k and v)::

    forward   (P-1) * 2 b (s/P) n_kv d e
    backward  (P-1) * 2 b (s/P) n_kv d (e + 4)        = 6 (P-1) b (s/P) n_kv d * 4 in fp32

No ``[s/P, s]`` tensor exists: the keys of a chunk pair are taken ``KEY_TILE`` (512) at a
time, so the largest temporaries are one tile's scores and probabilities, ``[b, n, c,
<= 512]`` fp32 -- linear in s/P, like everything saved. Under a causal mask a chunk pair whose keys are all in
the future of its queries is skipped (not computed); its block still travels, so every
rank issues the same exchanges. Attention dropout draws one seed per forward from ``rng()``
(the per-rank stream) and the keep-mask of key tile i of chunk pair (a, b) from a generator
seeded with ``seed + a*C + b + C^2 i``, so backward regenerates exactly the forward's masks.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional, Tuple

import torch

from ...communication import ring_exchange
from ..functional import local_heads, matmul_dtype
from .layout import LayoutLike, SequenceLayout, as_layout

_RECORD: contextvars.ContextVar = contextvars.ContextVar('ring_blocks', default=None)

# keys per score tile: a chunk pair's keys are taken KEY_TILE at a time, so the largest
# temporaries, ``[b, n, c, <= KEY_TILE]`` scores and probabilities, grow linearly in s/P
KEY_TILE = 512


@contextlib.contextmanager
def record_blocks() -> Iterator[List[Tuple[str, int, int]]]:
    """Inside, every chunk pair the ring computes is appended to the yielded list as
    ``('forward' | 'backward', query chunk, key chunk)`` (global chunk indices)."""
    blocks: List[Tuple[str, int, int]] = []
    token = _RECORD.set(blocks)
    try:
        yield blocks
    finally:
        _RECORD.reset(token)


@dataclass(frozen=True)
class _Block:
    """Query chunk ``qi`` (local index) against rows ``[lo, hi)`` of a travelling key block
    (key chunks ``keys``, global indices); ``diagonal`` when causal masking is needed."""

    qi: int
    query: int
    lo: int
    hi: int
    keys: Tuple[int, ...]
    diagonal: bool


def plan(layout: SequenceLayout, owner: int, causal: bool) -> List[_Block]:
    """What this rank computes against the key block of ``owner``: for each local query
    chunk a, the owner's key chunks b that a may see (all; or ``b <= a`` when causal) --
    always contiguous rows of the owner's block. Pairs with ``b > a`` are skipped."""
    theirs, out = layout.chunks_of(owner), []
    for qi, a in enumerate(layout.chunks_of()):
        need = [bi for bi, b in enumerate(theirs) if not causal or b <= a]
        if need:
            keys = tuple(theirs[bi] for bi in need)
            out.append(_Block(qi, a, need[0], need[-1] + 1, keys, causal and a in keys))
    return out


def chunk_pairs(layout: SequenceLayout, causal: bool) -> List[Tuple[int, int]]:
    """Every (query chunk, key chunk) pair this rank computes in one forward."""
    return [(blk.query, b) for j in range(layout.size) for blk in plan(layout, j, causal)
            for b in blk.keys]


@dataclass(frozen=True)
class _Spec:
    layout: SequenceLayout
    head_dim: int
    heads: int
    kv_heads: int
    causal: bool
    dropout_p: float

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads


class _Local:
    """Per-call shapes and the helpers that move between ``[b, s/P, .]`` and head layouts."""

    def __init__(self, spec: _Spec, q: torch.Tensor, mask: Optional[torch.Tensor], seed: int,
                 docs: Optional[torch.Tensor] = None, live=None):
        self.spec = spec
        self.b, self.s_l = q.shape[0], q.shape[1]
        self.n_chunks = spec.layout.num_chunks
        self.c = self.s_l // len(spec.layout.chunks_of())
        self.mask, self.seed, self.device = mask, seed, q.device
        self.docs, self.live = docs, live      # [b, C, c] document ids; chunk pairs to compute
        self.scale = 1.0 / math.sqrt(spec.head_dim)
        # statistics and accumulators: fp32 (fp64 for fp64 inputs)
        self.acc = torch.promote_types(q.dtype, torch.float32)

    def zeros(self, shape) -> torch.Tensor:
        return torch.zeros(shape, device=self.device, dtype=self.acc)

    def query_chunks(self, t: torch.Tensor, dtype) -> List[torch.Tensor]:
        """``[b, s/P, n*d]`` -> per local chunk ``[b, n_kv, g*c, d]`` (query head order)."""
        sp = self.spec
        t5 = t.to(dtype).view(self.b, self.s_l, sp.kv_heads, sp.group, sp.head_dim)
        t5 = t5.permute(0, 2, 3, 1, 4)
        return [t5[:, :, :, i * self.c:(i + 1) * self.c].reshape(
            self.b, sp.kv_heads, sp.group * self.c, sp.head_dim)
            for i in range(len(sp.layout.chunks_of()))]

    def from_query_chunks(self, chunks: List[torch.Tensor], dtype) -> torch.Tensor:
        """Inverse of :meth:`query_chunks`: ``[b, s/P, n*d]``."""
        sp = self.spec
        parts = [x.view(self.b, sp.kv_heads, sp.group, self.c, sp.head_dim) for x in chunks]
        out = torch.cat(parts, dim=3) if len(parts) > 1 else parts[0]
        return out.permute(0, 3, 1, 2, 4).reshape(self.b, self.s_l, sp.heads * sp.head_dim) \
            .to(dtype)

    def kv_heads(self, t: torch.Tensor, dtype) -> torch.Tensor:
        """``[b, s/P, n_kv*d]`` -> ``[b, n_kv, s/P, d]``."""
        sp = self.spec
        return t.to(dtype).view(self.b, self.s_l, sp.kv_heads, sp.head_dim).permute(0, 2, 1, 3)

    def from_kv_heads(self, t: torch.Tensor, dtype) -> torch.Tensor:
        return t.permute(0, 2, 1, 3).reshape(self.b, self.s_l, -1).to(dtype)

    def blocks(self, owner: int) -> List[_Block]:
        """:func:`plan` against ``owner``'s block, less the key chunks that share no document
        with the query chunk (packed rows, :attr:`live`): their scores would be all masked."""
        blocks = plan(self.spec.layout, owner, self.spec.causal)
        if self.live is None:
            return blocks
        out = []
        for blk in blocks:
            kept = [i for i, b in enumerate(blk.keys) if (blk.query, b) in self.live]
            if kept:
                keys = blk.keys[kept[0]:kept[-1] + 1]
                out.append(_Block(blk.qi, blk.query, blk.lo + kept[0], blk.lo + kept[-1] + 1,
                                  keys, blk.diagonal and blk.query in keys))
        return out

    def tiles(self, blk: _Block) -> List[Tuple[int, int]]:
        """Rows ``[r0, r1)`` of the travelling block that ``blk`` reads, cut in tiles of at
        most :data:`KEY_TILE` keys: the scores of one tile are ``[b, n, c, <= KEY_TILE]``."""
        lo, hi = blk.lo * self.c, blk.hi * self.c
        return [(r0, min(r0 + KEY_TILE, hi)) for r0 in range(lo, hi, KEY_TILE)]

    def scores(self, blk: _Block, q_a: torch.Tensor, k: torch.Tensor, phase: str,
               rows: Tuple[int, int]) -> torch.Tensor:
        """Masked fp32 scores ``[b, n_kv, g*c, w]`` of query chunk ``q_a`` (pre-scaled) against
        rows ``rows = [r0, r1)`` of the travelling key block ``k [b, n_kv, s/P, d]`` (inside
        ``blk``'s key chunks; w = r1 - r0)."""
        c, sp = self.c, self.spec
        r0, r1 = rows
        record = _RECORD.get()
        if record is not None and r0 == blk.lo * c:   # a chunk pair is recorded once
            record.extend((phase, blk.query, b) for b in blk.keys)
        keys = k[:, :, r0:r1]
        s = torch.matmul(q_a, keys.transpose(-1, -2)).to(self.acc)
        shape5 = (self.b, sp.kv_heads, sp.group, c, keys.shape[2])
        cut = slice(r0 - blk.lo * c, r1 - blk.lo * c)   # the tile inside blk's key chunks
        allowed = None
        if blk.diagonal:
            qpos = blk.query * c + torch.arange(c, device=self.device)
            kpos = torch.cat([torch.arange(b * c, (b + 1) * c, device=self.device)
                              for b in blk.keys])[cut]
            allowed = kpos.view(1, -1) <= qpos.view(-1, 1)                     # [c, w]
        if self.mask is not None:
            pad = self.mask[:, list(blk.keys)].reshape(self.b, -1)[:, cut]
            pad = pad.reshape(self.b, 1, 1, 1, -1)                             # [b,1,1,1,w]
            allowed = pad if allowed is None else pad & allowed
        if self.docs is not None:
            qdoc = self.docs[:, blk.query]                                     # [b, c]
            kdoc = self.docs[:, list(blk.keys)].reshape(self.b, -1)[:, cut]    # [b, w]
            same = (qdoc.unsqueeze(-1) == kdoc.unsqueeze(-2)).view(self.b, 1, 1, c, -1)
            allowed = same if allowed is None else same & allowed
        if allowed is not None:
            s = s.view(shape5).masked_fill(~allowed, float('-inf')).view(s.shape)
        return s

    def keep(self, blk: _Block, rows: Tuple[int, int], shape) -> Optional[torch.Tensor]:
        """The dropout multiplier (keep-mask / (1-p)) of the key tile ``rows`` of block
        ``blk``: the same tensor in forward and backward (one generator seed per chunk pair
        and tile)."""
        p = self.spec.dropout_p
        if p <= 0:
            return None
        pair = blk.query * self.n_chunks + blk.keys[0]
        tile = (rows[0] - blk.lo * self.c) // KEY_TILE
        gen = torch.Generator(device=self.device)
        gen.manual_seed((self.seed + pair + self.n_chunks ** 2 * tile) % 2 ** 63)
        draw = torch.rand(shape, generator=gen, device=self.device)
        return (draw >= p).to(self.acc).div_(1.0 - p)


def _ring_forward(loc: _Local, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype):
    """(out ``[b, s/P, n*d]``, lse ``[b, n, s/P]`` fp32); P-1 exchanges of ``[k; v]``."""
    sp, axis = loc.spec, loc.spec.layout.axis
    qs = [x * loc.scale for x in loc.query_chunks(q, dtype)]
    rows = qs[0].shape[:3] + (1,)
    m = [torch.full(rows, float('-inf'), device=q.device, dtype=loc.acc) for _ in qs]
    lsum = [loc.zeros(rows) for _ in qs]
    acc = [loc.zeros(x.shape) for x in qs]
    kv = torch.stack([loc.kv_heads(k, dtype), loc.kv_heads(v, dtype)])
    for t in range(axis.size):
        pending = ring_exchange(kv, axis, async_op=True) if t < axis.size - 1 else None
        for blk in loc.blocks((axis.rank - t) % axis.size):
            a = blk.qi
            for rows in loc.tiles(blk):
                s = loc.scores(blk, qs[a], kv[0], 'forward', rows)
                m_new = torch.maximum(m[a], s.amax(-1, keepdim=True))
                m_safe = m_new.masked_fill(m_new == float('-inf'), 0.0)
                p = torch.exp(s - m_safe)
                corr = torch.exp(m[a] - m_safe)
                lsum[a] = lsum[a] * corr + p.sum(-1, keepdim=True)
                keep = loc.keep(blk, rows, p.shape)
                pv = p if keep is None else p * keep
                values = kv[1][:, :, rows[0]:rows[1]]
                acc[a] = acc[a] * corr + torch.matmul(pv.to(dtype), values).to(loc.acc)
                m[a] = m_new
        if pending is not None:
            kv, pending = pending.wait(), None   # drop the sent block with its work
    empty = [x == 0 for x in lsum]      # a query with no key to attend to gets zeros
    outs = [(x / l.masked_fill(e, 1.0)).masked_fill(e, 0.0) for x, l, e in zip(acc, lsum, empty)]
    lses = [(mx + l.log()).masked_fill(e, float('inf')) for mx, l, e in zip(m, lsum, empty)]
    out = loc.from_query_chunks(outs, q.dtype)
    lse = torch.cat([x.view(loc.b, sp.heads, loc.c) for x in lses], dim=-1)
    return out, lse


def _ring_backward(loc: _Local, q, k, v, out, lse, grad, dtype):
    """(dq, dk, dv) in the inputs' layouts; P-1 exchanges of ``[k; v]`` and of ``[dk; dv]``."""
    sp, axis = loc.spec, loc.spec.layout.axis
    qs = [x * loc.scale for x in loc.query_chunks(q, dtype)]
    dos = loc.query_chunks(grad, dtype)
    os_ = loc.query_chunks(out, dtype)
    drow = [(d.to(loc.acc) * o.to(loc.acc)).sum(-1, keepdim=True) for d, o in zip(dos, os_)]
    lse5 = lse.view(loc.b, sp.heads, len(qs), loc.c)
    lses = [lse5[:, :, i].reshape(loc.b, sp.kv_heads, sp.group * loc.c, 1) for i in range(len(qs))]
    dq = [loc.zeros(x.shape) for x in qs]
    kv = torch.stack([loc.kv_heads(k, dtype), loc.kv_heads(v, dtype)])
    own, arriving = None, None      # arriving: the exchange bringing block (r-t)'s sum
    for t in range(axis.size):
        pending = ring_exchange(kv, axis, async_op=True) if t < axis.size - 1 else None
        if arriving is None:
            term = loc.zeros(kv.shape)                     # [dk; dv] fp32: a sum starts here
        else:   # add into the arriving sum itself: no separate term next to it in flight
            term, arriving = arriving.wait(), None
        for blk in loc.blocks((axis.rank - t) % axis.size):
            a = blk.qi
            for tile in loc.tiles(blk):
                rows = slice(*tile)
                s = loc.scores(blk, qs[a], kv[0], 'backward', tile)
                p = torch.exp(s - lses[a])
                keep = loc.keep(blk, tile, p.shape)
                pv = p if keep is None else p * keep
                term[1][:, :, rows] += torch.matmul(pv.to(dtype).transpose(-1, -2), dos[a])
                dp = torch.matmul(dos[a], kv[1][:, :, rows].transpose(-1, -2)).to(loc.acc)
                if keep is not None:
                    dp = dp * keep
                ds = (p * (dp - drow[a])).to(dtype)
                dq[a] += torch.matmul(ds, kv[0][:, :, rows])
                term[0][:, :, rows] += torch.matmul(ds.transpose(-1, -2), qs[a])
        if t == 0:
            own = term                      # the owner's term waits for the travelling sum
        else:
            arriving = ring_exchange(term, axis, async_op=True)  # block (r-t)'s sum to r+1
        term = None
        if pending is not None:
            kv, pending = pending.wait(), None
    dkv = own if arriving is None else arriving.wait().add_(own)
    dq = loc.from_query_chunks([x * loc.scale for x in dq], q.dtype)
    return dq, loc.from_kv_heads(dkv[0], k.dtype), loc.from_kv_heads(dkv[1], v.dtype)


class _RingAttention(torch.autograd.Function):
    """q ``[b, s/P, n*d]``, k, v ``[b, s/P, n_kv*d]`` -> out ``[b, s/P, n*d]`` (module doc)."""

    @staticmethod
    def forward(ctx, q, k, v, spec: _Spec, mask: Optional[torch.Tensor], seed: int,
                docs: Optional[torch.Tensor], live):
        dtype = matmul_dtype(q, k, v)
        loc = _Local(spec, q, mask, seed, docs, live)
        with torch.autocast(q.device.type, enabled=False):
            out, lse = _ring_forward(loc, q, k, v, dtype)
        ctx.loc, ctx.dtype = loc, dtype
        loc.mask = loc.docs = None  # saved below, so autograd tracks them
        ctx.save_for_backward(q, k, v, out, lse, mask, docs)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, mask, docs = ctx.saved_tensors
        loc = ctx.loc
        loc.mask, loc.docs = mask, docs
        dq, dk, dv = _ring_backward(loc, q, k, v, out, lse, grad.contiguous(), ctx.dtype)
        loc.mask = loc.docs = None
        return dq, dk, dv, None, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int,
                   layout: LayoutLike = None, causal: bool = False,
                   key_padding_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                   rng: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                   document_ids: Optional[torch.Tensor] = None):
    """softmax(Q K^T / sqrt(d) + mask) V of local ``q [b, s/P, n*d]`` against the whole
    sequence's keys; k, v ``[b, s/P, n_kv*d]`` (grouped-query attention when n_kv < n).

    ``layout``: a :class:`SequenceLayout`, or a SEQUENCE axis (the launched zigzag setting)
    or None (the current context's). ``key_padding_mask``: the user's full ``[b, s]`` mask
    (1 = attend; a query with no key gets zeros). ``document_ids``: the full ``[b, s]``
    documents of packed rows (``nn.functional.document_ids``): a query attends only to keys
    of its own document; when they are non-decreasing along every row (as derived from
    position ids) a chunk pair sharing no document in any row is skipped
    (:func:`live_pairs`). Attention dropout draws its seed from ``rng()`` (the per-rank
    stream). Communication: module doc.
    """
    layout = as_layout(layout)
    b, s_l = q.shape[0], q.shape[1]
    heads, kv_heads = local_heads(q, k, head_dim)
    if tuple(k.shape[:2]) != (b, s_l) or k.shape != v.shape:
        raise ValueError(f'ring attention needs k and v of one shape [b, s/P, n_kv*d] with q '
                         f'{tuple(q.shape)}, got k {tuple(k.shape)}, v {tuple(v.shape)}')
    s = s_l * layout.size
    c = layout.check(s)
    mask = None
    if key_padding_mask is not None:
        if tuple(key_padding_mask.shape) != (b, s):
            raise ValueError(f'key_padding_mask must be the full [batch, seq] = [{b}, {s}] '
                             f'mask, got shape {tuple(key_padding_mask.shape)}')
        mask = key_padding_mask.to(device=q.device, dtype=torch.bool).reshape(
            b, layout.num_chunks, c)
    docs = live = None
    if document_ids is not None:
        if tuple(document_ids.shape) != (b, s):
            raise ValueError(f'document_ids must be the full [batch, seq] = [{b}, {s}] ids, '
                             f'got shape {tuple(document_ids.shape)}')
        docs = document_ids.to(q.device).reshape(b, layout.num_chunks, c)
        live = live_pairs(docs)
    seed = 0
    if dropout_p > 0:
        with rng():
            seed = int(torch.randint(0, 2 ** 62, (1,)).item())
    spec = _Spec(layout, head_dim, heads, kv_heads, causal, float(dropout_p))
    return _RingAttention.apply(q, k, v, spec, mask, seed, docs, live)


def live_pairs(docs: torch.Tensor) -> Optional[frozenset]:
    """The (query chunk, key chunk) pairs that share a document in some row, for document
    ids ``[b, C, c]`` (chunks in serial order); None (compute every pair) unless the ids
    are non-decreasing along every row -- then a chunk holds every document between its
    first and last token, and chunks a, b share one iff ``first_a <= last_b`` and
    ``first_b <= last_a``. One small host read per call."""
    b, n_chunks, c = docs.shape
    flat = docs.reshape(b, n_chunks * c)
    if flat.shape[1] > 1 and not bool((flat[:, 1:] >= flat[:, :-1]).all()):
        return None
    first, last = docs[..., 0], docs[..., -1]                                    # [b, C]
    share = (first.unsqueeze(2) <= last.unsqueeze(1)) & (first.unsqueeze(1) <= last.unsqueeze(2))
    pairs = share.any(0).nonzero().tolist()                                     # [C, C]
    return frozenset((int(a), int(k)) for a, k in pairs)
