"""Peak memory of one training step on one rank: the named buffers live at each phase.

The planner's memory is the peak of the bytes of live tensors during a step
(docs/planner.md). A rank's live bytes rise through the forward passes, peak either
when the last in-flight micro-batch starts its backward (**phase A**: every saved
activation, the loss head's buffers) or when the gradients are complete and being
reduced (**phase B**: gradients and the reduction's buffers); so

    peak = states + max(A, B)

with every term a buffer of the runtime (elem bytes per value; Ψ the rank's local
parameters, D data ranks, t tensor ranks, n tokens of a replica micro-batch on this
rank's sequence share, M micro-batches, L blocks on the rank, h hidden, s sequence,
V the head's outputs per token):

* ``states``: what a step starts from after ``zero_grad``: weights and AdamW moments,
  ``12Ψ`` (none), ``4Ψ + 12Ψ/D`` (ZeRO-1/2: full weights, sharded fp32 master and
  moments), ``12Ψ/D`` (ZeRO-3); with rotary positions the model's ``d/2`` frequencies;
* ``activations``: per block and in-flight micro-batch, what autograd saves
  (``n · ModelShape.block_values_per_token``) plus a saved causal mask ``s²``
  (``traits.causal_mask``) and, under ZeRO-3 or where 1D replicates the kv heads, the
  q/k/v weight and bias joined by a copy for the fused projection (``qkv_copy_bytes``;
  GPT ``3(h² + h)/t_w``); per micro-batch the rotary cos/sin tables ``2 s d``;
  checkpointed, the block input ``n h`` (/t unless 1D) and the CPU RNG state it saves;
  zero bubble: ``min(M, P) · kept + min(M, r + 1) · w_stash`` on rank r (its state before
  its first W in the ZB-H1 order), ``w_stash`` the output gradients W multiplies by,
  ``n ((3 + 2r) h / t + 2h)`` (GPT; ``w_stash_bytes``) (none on the first stage, whose
  backward waits whole for W);
* ``head``: the largest transient at the start of a backward: on the last stage three
  logits-sized buffers ``3 n V / t_v`` (the log-softmax -- vocab-parallel: the shifted
  logits, exp and softmax -- and the two backward gradients) and the final LayerNorm's
  input, output and statistics ``n (2h + 2)`` (a head transform, ``traits.head_transform``:
  ``+ n (3h + 2)``, its dense, GELU and LayerNorm outputs; /t outside none/1D/sequence; 2D/2.5D:
  the classifier's SUMMA backward blocks; 3D, when larger than the three logits buffers:
  the logits' gradient ``n V / t`` and the classifier's ``cube(n, h, V)``); in a block's
  backward, the gradients of its MLP hidden ``2 n r h`` (/t but for none; 2D/2.5D: fc1's
  SUMMA backward blocks; 3D, when larger: fc2's or fc1's ``cube(n, r h, h)``,
  ``cube(n, h, r h)``: a cube linear's backward with its gathered x, dy and A, dA and dx
  = dy A each with gloo's reduce-scatter copy and the shard, ``cube(n, i, o) =
  max(q (n i + n o + i o + max(n i, n o, i o)), (3q + 1)(n i + i o) + q n o) / t``, q the
  cube side);
  pipelined, the received activation or gradient ``n h``; checkpointed, when larger, a
  recomputed block in its backward: its activations, the gradient arriving at its output
  (``n h``, /t unless 1D) and the larger of its MLP gradient transient (the last block)
  and every later block's gradients (the first);
* ``outputs``: the logits of every micro-batch, kept by the schedule for its return
  value (not pipelined: a pipeline's last stage computes the loss in place);
* ``gradients``: ``4Ψ`` (ZeRO-2 with M > 1 reduces each micro-batch: its accumulated
  shard ``4Ψ/D`` instead), live in phase A when an earlier micro-batch's backward has
  run (M > 1 without ZeRO-2, or a pipeline rank with more micro-batches than in flight);
* ``gathered`` (ZeRO-3): the gathered chunks, ``4Ψ`` -- every chunk stays gathered
  between its forward and its backward when memory allows;
* phase B's reduction buffers: data parallelism flattens the gradients into one
  all-reduce bucket of ``min(4Ψ, bucket)``; ZeRO-1/2 flatten a bucket, and gloo's
  ``reduce_scatter_tensor`` reduces a full copy of it (two ``min(4Ψ, bucket)``), into a
  fresh ``4Ψ/D`` shard, next to the shard accumulated from earlier micro-batches.

Checked against the allocator's record of real steps: tests/test_planner_memory.py
(data, ZeRO-2/3, checkpointing, 1D, sequence, 1F1B; 8 ranks: 2.5D depth 2, 3D) and
``benchmarks/planner_accuracy.py --memory-only`` (all 54 layouts, 2D and zero bubble
included; ``--world 8``: tensor size 8 and every tensor family mixed with data or
pipeline parallelism).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Tuple

from ..config.schedules import SCHEDULES, w_waiting
from .model_spec import ModelShape, kv_replicated, splits_sequence

DP_BUCKET_BYTES = 25 * 2 ** 20       # engine.gradient_handler.DEFAULT_BUCKET_BYTES
ZERO_BUCKET_BYTES = 25 * 2 ** 20     # the ZeRO-1/2 reducer's default bucket
RNG_STATE_BYTES = 5056               # torch.get_rng_state().numel(): the CPU generator state


@dataclass(slots=True)
class RankMemory:
    """The named buffers of one rank at its two candidate peaks (bytes)."""

    states: float
    activations: float
    head: float
    outputs: float
    gradients_a: float
    gathered: float
    gradients_b: float
    reduction: float
    outputs_b: float
    rng_states: float = 0.0   # checkpointing's saved CPU RNG states, alive in both phases

    @property
    def phase_a(self) -> float:
        return (self.activations + self.head + self.outputs + self.gradients_a + self.gathered
                + self.rng_states)

    @property
    def phase_b(self) -> float:
        return (self.gradients_b + self.reduction + self.outputs_b + self.gathered
                + self.rng_states)

    @property
    def peak(self) -> float:
        return self.states + max(self.phase_a, self.phase_b)


def states_bytes(params: float, zero: int, data: int, elem: int = 4) -> float:
    """Weights and AdamW moments at a step's start (after ``zero_grad``)."""
    if zero == 0:
        return 3 * elem * params
    if zero in (1, 2):
        return elem * params + 3 * elem * params / data
    return 3 * elem * params / data


def causal_mask_bytes(shape: ModelShape, layout, elem: int = 4) -> float:
    """The causal mask ``s^2`` each block's attention builds and saves, where
    ``traits.causal_mask`` (batch-independent; sequence mode masks per ring step instead,
    Ulysses runs SDPA's ``is_causal`` on its whole sequence or the ring's steps)."""
    return (elem * shape.seq ** 2 if shape.traits.causal_mask
            and not splits_sequence(layout.mode) else 0.0)


def qkv_copy_bytes(shape: ModelShape, layout, elem: int = 4) -> float:
    """The q/k/v weights and biases joined for the fused projection, ``(h / t_w + 2 kv_r)
    (h + [bias])`` (t_w = t for the families that split weights, 1 for none and sequence;
    kv_r the local k/v width ``n_kv d / t_w``, or ``d`` where 1D replicates the kv heads;
    GPT: ``3 (h^2 + h) / t_w``), when ``join_rows`` must copy them (:func:`qkv_copied`)."""
    h = shape.hidden
    t_w = layout.tensor if layout.mode in ('1d', '2d', '2.5d', '3d') else 1
    kv = shape.local_kv_width(layout.mode, t_w)
    return elem * (h / t_w + 2 * kv) * (h + (1 if shape.qkv_bias else 0))


def qkv_copied(shape: ModelShape, layout, zero: int) -> bool:
    """Whether each block keeps a joined copy of its q/k/v weights per micro-batch: under
    ZeRO-3, whose chunks hold each weight apart (else ``place_qkv_adjacent`` makes the join
    a view), and wherever 1D replicates the kv heads (the rows a rank uses of a replicated
    k/v weight never lie next to its q rows: ``GroupedKVLinear1D``)."""
    return zero == 3 or kv_replicated(layout.mode, layout.tensor, shape.kv_heads)


def rotary_bytes(shape: ModelShape, layout, elem: int = 4) -> Tuple[float, float]:
    """(the model's rotary frequencies, ``d / 2`` fp32 values kept with its weights; the
    cos and sin tables ``2 s d`` one micro-batch's blocks share and save, ``s / t`` rows in
    sequence mode) where ``traits.rotary``, else zeros."""
    if not shape.traits.rotary:
        return 0.0, 0.0
    rows = shape.seq / (layout.tensor if splits_sequence(layout.mode) else 1)
    return 4 * shape.head_dim // 2, elem * 2 * rows * shape.head_dim


def block_kept(shape: ModelShape, layout, micro: float, elem: int = 4) -> float:
    """Bytes one block keeps per in-flight micro-batch of ``micro`` samples: the saved
    activations (``block_values_per_token``) and :func:`causal_mask_bytes`."""
    t = layout.tensor if layout.mode else 1
    grid = layout.tensor_grid if layout.mode in ('2d', '2.5d', '3d') else 1
    tokens = micro * shape.seq
    ring = layout.ring_size if layout.mode == 'ulysses' else 1
    return (tokens * shape.block_values_per_token(layout.mode, t, grid, ring) * elem
            + causal_mask_bytes(shape, layout, elem))


def head_bytes(shape: ModelShape, layout, micro: float, elem: int = 4) -> float:
    """The last stage's loss-head buffers at the start of backward: three logits-sized
    buffers (the fourth, the logits, is the schedule's kept output or freed when
    pipelined; 3D: or, when larger, the classifier's :func:`cube_backward_bytes` next to
    the logits' gradient), the final LayerNorm's input, output and statistics (an RMSNorm's
    input, normalized values, output and statistic, ``3h + 1``), the head
    transform, and under 2D/2.5D the classifier's SUMMA backward blocks (module doc)."""
    t = layout.tensor if layout.mode else 1
    seq = splits_sequence(layout.mode)
    t_v = t if layout.mode is not None and not seq else 1
    seq_split = t if seq else 1
    tokens = micro * shape.seq / seq_split
    head_tokens = micro * (shape.seq / seq_split if shape.traits.head_per_token else 1)
    ln_split = 1 if layout.mode in (None, '1d') or seq else t
    per_token = 3 * shape.hidden + 1 if shape.traits.rms_norm else 2 * shape.hidden + 2
    if shape.traits.head_transform:  # dense and GELU outputs, LayerNorm output and
        per_token += 3 * shape.hidden + 2   # statistics (its input is the GELU output)
    d_logits = head_tokens * shape.outputs / t_v
    logits = 3 * d_logits
    if layout.mode in ('2d', '2.5d'):  # the classifier's SUMMA backward: the broadcast dY
        q = layout.tensor_grid         # and W blocks of two steps in flight
        logits += min(q, 2) * (head_tokens * shape.outputs + shape.outputs * shape.hidden) / t
    if layout.mode == '3d':
        logits = max(logits, d_logits + cube_backward_bytes(
            head_tokens, shape.hidden, shape.outputs, layout.tensor_grid, t, 1))
    return elem * (logits + tokens * per_token / ln_split)


def cube_backward_bytes(tokens: float, fan_in: int, fan_out: int, q: int, t: int,
                        elem: int = 4) -> float:
    """3D's linear backward transient (``parallel_3d._CubeLinear``, ``n`` tokens, q the cube
    side), the larger of its two moments: gathering dy, x and A, the three outputs next to
    gloo's receive buffer of the largest, ``q (n in + n out + in out + max(n in, n out,
    in out)) / t`` (the three buffers coexist only when gloo's thread runs the gathers at
    once: timing; the floor of several steps holds about one); then computing, with the
    gathered x, dy and A live, dA and its reduce-scatter copy and shard, dx = dy A, its
    reduce-scatter copy and shard, ``((3q + 1)(n in + in out) + q n out) / t``."""
    sizes = (tokens * fan_in, tokens * fan_out, fan_in * fan_out)
    gather = q * (sum(sizes) + max(sizes))
    compute = (3 * q + 1) * (tokens * fan_in + fan_in * fan_out) + q * tokens * fan_out
    return elem * max(gather, compute) / t


def mlp_gradient_bytes(shape: ModelShape, layout, micro: float, elem: int = 4) -> float:
    """A block's backward transient: the gradients of its MLP hidden (i = r h wide), the
    GELU's output and the fc1 output, ``2 n i`` -- gated, the product's and the gate's and
    up's outputs', ``3 n i`` -- (/t where the MLP is split: every family but none); 2D and
    2.5D add fc1's SUMMA backward blocks of two steps in flight, ``min(q, 2) (n i + i h)
    / t`` (the broadcast dY and W blocks); 3D: the larger, fc2's or fc1's
    :func:`cube_backward_bytes`."""
    t = layout.tensor if layout.mode else 1
    tokens = micro * shape.seq
    hidden = shape.ffn
    grads = shape.mlp_inputs + 1
    moe = shape.moe
    if moe is not None:   # the k expert rows' SwiGLU (width / t_e) and the shared experts'
        rows = tokens * (1 if layout.mode == '1d' else 1 / t)   # whole tokens under 1D
        t_e = moe.expert_tensor(layout.mode, t)
        return elem * 3 * (rows * moe.top_k * moe.ffn / t_e + tokens * moe.shared / t)
    summa = 0.0
    if layout.mode in ('2d', '2.5d'):  # fc1's SUMMA backward: its broadcast dY and W blocks
        summa = min(layout.tensor_grid, 2) * (tokens * hidden + hidden * shape.hidden) / t
    if layout.mode == '3d':
        q, h = layout.tensor_grid, shape.hidden
        return max(elem * grads * tokens * hidden / t,
                   cube_backward_bytes(tokens, hidden, h, q, t, elem),
                   cube_backward_bytes(tokens, h, hidden, q, t, elem))
    return elem * (grads * tokens * hidden / t + summa)


def w_stash_bytes(shape: ModelShape, layout, micro: float, elem: int = 4) -> float:
    """Zero bubble's W stash, per block and micro-batch whose weight-gradient pass is
    pending: the gradients the B pass computed at the outputs of q/k/v (h + 2 n_kv d; the
    local kv width, ``ModelShape.local_kv_width``), of the attention projection (h), of
    the MLP's hidden (fc1 and the GELU, 2i; gated: gate, up and their product, 3i) and of
    fc2 (h), which W multiplies by the saved inputs (the column-split ones /t: 1D, 2D, ...;
    sequence mode: n is this rank's share)."""
    t = layout.tensor if layout.mode else 1
    seq = splits_sequence(layout.mode)
    split = t if layout.mode is not None and not seq else 1
    tokens = micro * shape.seq / (t if seq else 1)
    h, f = shape.hidden, shape.ffn
    kv = shape.local_kv_width(layout.mode, split) * split
    row_out = h / (split if layout.mode in ('2d', '2.5d', '3d') else 1)
    return elem * tokens * ((h + 2 * kv + (shape.mlp_inputs + 1) * f) / split + 2 * row_out)


def zero_bubble_peak_state(ranks: int, microbatches: int, rank: int) -> Tuple[int, int]:
    """(micro-batches held, of them waiting for their W) at a rank's peak in the runtime's
    ZB-H1 order (``pipeline.zero_bubble``; M >= P): a micro-batch is held from its F to its
    W and waits with its W stash from its B to its W; just before its first W a rank holds
    ``min(M, P)`` of which ``min(M, r + 1)`` wait, both maxima at once (tested against the
    generated orders; the schedule table's ``in_flight`` and ``w_waiting``)."""
    zb = SCHEDULES['zero_bubble']
    return (int(zb.in_flight(ranks, microbatches, 1, rank)),
            w_waiting(zb.name, ranks, microbatches, rank))


def boundary_bytes(shape: ModelShape, layout, micro: float, elem: int = 4) -> float:
    """A pipeline rank's received activation (or gradient) buffer, ``n h`` (/t unless 1D:
    split like the block input)."""
    t = layout.tensor if layout.mode and layout.mode != '1d' else 1
    return elem * micro * shape.seq * shape.hidden / t


def output_bytes(shape: ModelShape, layout, micro: float, elem: int = 4) -> float:
    """One micro-batch's logits, as the schedule keeps them for its return value."""
    t = layout.tensor if layout.mode else 1
    seq = splits_sequence(layout.mode)
    t_v = t if layout.mode is not None and not seq else 1
    seq_split = t if seq else 1
    head_tokens = micro * (shape.seq / seq_split if shape.traits.head_per_token else 1)
    return elem * head_tokens * shape.outputs / t_v


@lru_cache(maxsize=65536)
def _unit_terms(shape: ModelShape, layout, micro: float, elem: int) -> Tuple[float, ...]:
    """Per block or micro-batch: kept, q/k/v copy, checkpointed block input, MLP gradient
    transient, loss head, boundary buffer, one micro-batch's logits, W stash."""
    t = layout.tensor if layout.mode else 1
    block_input = micro * shape.seq * shape.hidden * elem / (1 if layout.mode == '1d' else t)
    return (block_kept(shape, layout, micro, elem), qkv_copy_bytes(shape, layout, elem),
            block_input, mlp_gradient_bytes(shape, layout, micro, elem),
            head_bytes(shape, layout, micro, elem), boundary_bytes(shape, layout, micro, elem),
            output_bytes(shape, layout, micro, elem), w_stash_bytes(shape, layout, micro, elem))


def rank_memory(shape: ModelShape, layout, *, params: float, blocks: int, held: float,
                last: bool, micro: float, microbatches: int, zero: int, checkpoint: bool,
                after_backward: bool, schedule: str = '1f1b', rank: int = 0,
                elem: int = 4, expert_params: float = 0.0) -> RankMemory:
    """The buffers of one rank holding ``params`` local elements and ``blocks`` blocks,
    with ``held`` micro-batches in flight at its peak; ``after_backward``: an earlier
    micro-batch's backward has run when the peak comes (its gradients are live).
    ``expert_params`` (of ``params``): an MoE model's expert parameters, whose ZeRO shards
    are over EXPERT_DATA (D / E ranks) instead of DATA."""
    d, m = layout.data, microbatches
    d_e = d // getattr(layout, 'expert', 1)
    grads = elem * params
    shard_of = elem * ((params - expert_params) / d + expert_params / d_e)  # a ZeRO shard
    kept, qkv, block_input, mlp, loss_head, boundary, logits, stash = _unit_terms(
        shape, layout, micro, elem)
    if qkv_copied(shape, layout, zero):
        kept += qkv
    frequencies, tables = rotary_bytes(shape, layout, elem)
    if checkpoint:  # each block keeps its input and the CPU RNG state for its recompute
        activations = held * blocks * block_input
    elif SCHEDULES[schedule].split_backward and layout.pipeline > 1:
        held_zb, waiting = zero_bubble_peak_state(layout.pipeline, m, rank)
        activations = blocks * (held_zb * kept + (waiting * stash if rank else 0.0))
    else:
        activations = held * blocks * kept
    if blocks:   # the rotary tables, shared by the blocks of a micro-batch
        activations += held * tables
    head = mlp if blocks else 0.0
    if last:
        head = max(head, loss_head)
    if layout.pipeline > 1:
        head += boundary
    # the schedule keeps each micro-batch's logits for its return value; a pipeline's last
    # stage computes the loss in place and keeps only the scalar
    out = logits if last and layout.pipeline == 1 else 0.0
    reducers = d * layout.tensor if splits_sequence(layout.mode) else d
    if zero == 2 and reducers > 1:
        shard = shard_of
        gradients_a = shard if m > 1 else 0.0
        bucket = min(grads, ZERO_BUCKET_BYTES)
        reduction = 2 * bucket + shard + (shard if m > 1 else 0.0)
    elif zero == 1 and reducers > 1:
        gradients_a = grads if after_backward else 0.0
        bucket = min(grads, ZERO_BUCKET_BYTES)
        reduction = 2 * bucket + shard_of
    else:
        gradients_a = grads if after_backward else 0.0
        reduction = min(grads, DP_BUCKET_BYTES) if (zero == 0 and reducers > 1) else 0.0
    if checkpoint and blocks:  # or later, a recomputed block in its backward: its activations,
        # the gradient arriving at its output (block-input sized) and either its MLP
        # gradient transient (the last block) or every later block's gradients (the first)
        head = max(head, kept + block_input + max(mlp, grads - gradients_a))
    gathered = grads if zero == 3 else 0.0
    states = (states_bytes(params - expert_params, zero, d, elem)
              + states_bytes(expert_params, zero, d_e, elem))
    return RankMemory(states=states + frequencies,
                      activations=activations, head=head,
                      outputs=m * out,
                      gradients_a=gradients_a, gathered=gathered,
                      gradients_b=grads, reduction=reduction, outputs_b=m * out,
                      rng_states=held * blocks * RNG_STATE_BYTES if checkpoint else 0.0)
