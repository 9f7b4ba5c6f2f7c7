"""The planner's peak memory (``auto/memory.py``) against the allocator's record of real steps.

Per rank of a real run (4 or 8 forked gloo ranks, a tiny GPT, AdamW through ``initialize``):
the live tensor bytes after ``zero_grad`` equal the ``states`` term, and the peak of the
bytes the step allocates (``testing.memory.peak_allocated``: the allocator's own record,
deterministic) equals ``max(phase A, phase B)``. The layouts pin the terms: data
parallelism (activations, causal masks, the loss head's four logits buffers, the kept
logits), ZeRO-2 with 2 micro-batches (the flat bucket, gloo's reduce-scatter copy, the
fresh and the accumulated shards), ZeRO-3 (gathered chunks, the q/k/v copy), 1D (split
activations, replicated LayerNorm parts), checkpointing (block inputs, one recomputed
block with its output, the gradient arriving there and the later gradients or its MLP's
gradient transient; with data parallelism and with 1D), a 1F1B pipeline (in-flight micro-batches, earlier gradients, the
MLP's gradient transient, the boundary buffer) and sequence parallelism (the ring's
saved score statistics); on 8 ranks 2.5D with depth 2 (SUMMA blocks, the loss head) and
3D (the cube linear's backward, ``memory.cube_backward_bytes``). Bounds: 0.5 % where every
buffer is named, 6 % under for 1D, 10 % under for the pipeline, 7 % over for 2.5D, 1 % over
for 3D (``CASES`` says why; measured 1.6 %, 6.8 % under, 6.2 %, 0.6 % over); the test
also checks that every term of the winning phase (a ``RankMemory`` field) is larger than
the band, so dropping one fails.
Smaller parts folded into a field (the pipeline's boundary buffer, the checkpoint RNG
states) are pinned only where the band is 0.5 %.
"""
import pytest
import torch

import model_zoo  # noqa: F401  (registers gpt/bert/vit)
from colossal_lite.auto import load_profile
from colossal_lite.auto.cost import Candidate, evaluate
from colossal_lite.auto.model_spec import model_shape
from colossal_lite.config import ParallelLayout
from colossal_lite.testing.memory import live_tensor_bytes

OPTS = dict(vocab_size=256, max_positions=16, hidden=32, layers=2, heads=4, dropout=0.0)
# 3D: hidden 64, so that the peak is fc2's backward computation (``cube_backward_bytes``,
# deterministic) rather than the classifier's three async gathers, whose gloo receive
# buffers overlap or not by timing (hidden 32: measured 3.5 % over to 3.7 % under)
OPTS_3D = dict(OPTS, hidden=64)
BATCH = 8


def _live_bytes() -> int:
    """Live tensor bytes without 0-dim tensors (AdamW's step counters are not modelled)."""
    return live_tensor_bytes(scalars=False)


def _step_memory(rank, checkpoint, opts=OPTS, kind='gpt'):
    """(live bytes after zero_grad, the step's allocation peak above them) on this rank of a
    registered model ``kind`` (a causal LM trained on its own ids) built with ``opts``."""
    import colossal_lite as clt
    from colossal_lite.context import ParallelMode, global_context as gpc
    from colossal_lite.models import get_model
    from colossal_lite.testing import engine_step
    from colossal_lite.testing.memory import peak_allocated
    ids = torch.randint(0, 256, (BATCH // gpc.get_world_size(ParallelMode.DATA), 16),
                        generator=torch.Generator().manual_seed(0))
    before = _live_bytes()
    entry = get_model(kind)
    model = entry.builder(**dict(opts, checkpoint=checkpoint))
    engine, *_ = clt.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                entry.loss())
    engine_step(engine, (ids, ids))
    engine.zero_grad()
    start = _live_bytes() - before
    # the first recorded step frees buffers made before the record (not seen): the later
    # ones are exact; their floor, as an async send or all-reduce whose peer is late keeps
    # its buffer past the peak (timing, not layout). On 8 ranks sharing 2 cores 40 - 60 %
    # of a rank's steps peak 2 - 15 % above the floor (3D), so 4 steps left a rank with no
    # clean step in about one run of three (CI failed on it); 16 make that ~1e-5
    step = lambda: engine_step(engine, (ids, ids))  # noqa: E731
    peaks = peak_allocated([step] + [engine.zero_grad, step] * 16)
    engine.zero_grad()
    # the same floor for the live bytes: a reduce-scatter that gloo's thread finished late
    # can still hold its buffer right after zero_grad (seen once: +gradients_b on a rank)
    return min(start, _live_bytes() - before), min(peaks[2::2])


def _l(p=1, t=1, mode=None, d=1, dep=1):
    return ParallelLayout(p, t, mode, dep, d)


# (candidate, (low, high) bounds of predicted / measured): exact where every buffer is named;
# 1D's vocab-parallel loss keeps ~13 per-token index and mask values (int64 targets, masks,
# three all-reduced statistics) not modelled, and its overlapped all-reduces free their
# buffers when gloo's thread finishes them, up to 5 % later than program order even in the
# floor of the recorded steps; the pipeline's peak comes inside a block's backward, where part of
# its activations are freed and its input gradients not yet; 1D with checkpointing also
# all-reduces in the recompute (measured 4 - 9 % under, varying between runs); 8 ranks:
# 2.5D (depth 2) counts the log-softmax's three logits buffers next to the classifier's
# SUMMA blocks, which the runtime frees before (measured 6.2 % over; not dropped: BERT's
# 4-rank 2D layouts then fall to 11 % under), 3D's peak is the last fc2's cube backward,
# counted next to every block's activations and the kept logits though part of the loss
# head's saved values is freed by then (measured 0.6 % over)
CASES = [(Candidate(_l(d=4), 1), (0.995, 1.005)),
         (Candidate(_l(d=4), 2, zero=2), (0.995, 1.005)),
         (Candidate(_l(d=4), 1, zero=3), (0.995, 1.005)),
         (Candidate(_l(d=4), 1, checkpoint=True), (0.995, 1.005)),
         (Candidate(_l(t=2, mode='sequence', d=2), 1), (0.995, 1.005)),
         (Candidate(_l(t=4, mode='1d'), 1), (0.94, 1.005)),
         (Candidate(_l(t=2, mode='1d', d=2), 1), (0.94, 1.005)),
         (Candidate(_l(t=4, mode='1d'), 1, checkpoint=True), (0.90, 1.005)),
         (Candidate(_l(p=2, d=2), 4, '1f1b'), (0.90, 1.02)),
         (Candidate(_l(t=8, mode='2.5d', dep=2), 1), (0.99, 1.07)),
         (Candidate(_l(t=8, mode='3d'), 1), (0.995, 1.01))]


@pytest.mark.parametrize('cand,bounds', CASES,
                         ids=[c.describe().replace(' ', '_') for c, _ in CASES])
def test_peak_memory_terms_equal_the_allocator_record(cand, bounds):
    check_peak_memory('gpt', OPTS_3D if cand.layout.mode == '3d' else OPTS, cand, bounds)


def check_peak_memory(kind, opts, cand, bounds):
    """Every rank's states equal the ``states`` term and its peak is within ``bounds`` of
    ``max(phase A, phase B)``, each term of the winning phase larger than the band."""
    from colossal_lite.auto.planner import plan_config
    from colossal_lite.testing import run_distributed
    shape = model_shape(kind, None, seq=16, **opts)
    config = {k: v for k, v in plan_config(shape, cand, BATCH).items()
              if k in ('parallel', 'num_microbatches', 'zero')}
    l = cand.layout
    measured = run_distributed(_step_memory, l.pipeline * l.tensor * l.data, config,
                               cand.checkpoint, opts, kind)
    est = evaluate(shape, load_profile('nvlink8'), cand, BATCH)
    for rank, (start, peak) in enumerate(measured):
        terms = est.terms['memory_buffers'][rank // (l.data * l.tensor)]
        assert start == terms.states, (rank, start, terms)
        predicted = max(terms.phase_a, terms.phase_b)
        low, high = bounds
        assert low * peak <= predicted <= high * peak, (rank, peak, predicted, terms)
        phase = ('activations', 'head', 'outputs', 'gradients_a', 'gathered', 'rng_states') \
            if terms.phase_a >= terms.phase_b else ('gradients_b', 'reduction', 'outputs_b',
                                                    'gathered', 'rng_states')
        band = max(predicted - low * peak, high * peak - predicted)
        for name in phase:
            if name == 'rng_states' and low < 0.995:
                continue  # a small part: pinned only where the band is 0.5 % (module doc)
            value = getattr(terms, name)
            assert value == 0 or value > band, (name, value, band)  # the case can fail


def test_zero_bubble_peak_state_is_reached_in_the_generated_order():
    """``zero_bubble_peak_state``'s closed form -- min(M, P) micro-batches held, min(M, r + 1)
    of them waiting for W -- is a state of the runtime's ZB-H1 order on every rank, and no
    state holds or waits for more (P = 2..8, M = P..3P)."""
    from colossal_lite.auto.memory import zero_bubble_peak_state
    from colossal_lite.pipeline.actions import B, F, W, PipeShape
    from colossal_lite.pipeline.zero_bubble import zero_bubble_h1
    for p in range(2, 9):
        for m in range(p, 3 * p + 1):
            orders = zero_bubble_h1(PipeShape(p, 1, m))
            for rank in range(p):
                held = waiting = 0
                states = set()
                for action in orders[rank]:
                    held += (action.kind == F) - (action.kind == W)
                    waiting += (action.kind == B) - (action.kind == W)
                    states.add((held, waiting))
                peak = zero_bubble_peak_state(p, m, rank)
                assert peak in states, (p, m, rank, peak)
                assert peak == (max(f for f, _ in states), max(w for _, w in states))
