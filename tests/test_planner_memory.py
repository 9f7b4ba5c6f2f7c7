"""The planner's peak memory (``auto/memory.py``) against the allocator's record of real steps.

Per rank of a real run (4 forked gloo ranks, a tiny GPT, AdamW through ``initialize``):
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
saved score statistics). Bounds: 0.5 % where every buffer is named, 6 % under for 1D and
10 % under for the pipeline (``CASES`` says why; measured 1.6 % and 6.8 % under); the test
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
BATCH = 8


def _live_bytes() -> int:
    """Live tensor bytes without 0-dim tensors (AdamW's step counters are not modelled)."""
    return live_tensor_bytes(scalars=False)


def _step_memory(rank, checkpoint):
    """(live bytes after zero_grad, the step's allocation peak above them) on this rank."""
    import colossal_lite as clt
    from colossal_lite.context import ParallelMode, global_context as gpc
    from colossal_lite.models import get_model
    from colossal_lite.testing import engine_step
    from colossal_lite.testing.memory import peak_allocated
    ids = torch.randint(0, 256, (BATCH // gpc.get_world_size(ParallelMode.DATA), 16),
                        generator=torch.Generator().manual_seed(0))
    before = _live_bytes()
    entry = get_model('gpt')
    model = entry.builder(**dict(OPTS, checkpoint=checkpoint))
    engine, *_ = clt.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                entry.loss())
    engine_step(engine, (ids, ids))
    engine.zero_grad()
    start = _live_bytes() - before
    # the first recorded step frees buffers made before the record (not seen): the later
    # ones are exact; their floor, as an async send or all-reduce whose peer is late keeps
    # its buffer past the peak (timing, not layout)
    step = lambda: engine_step(engine, (ids, ids))  # noqa: E731
    peaks = peak_allocated([step] + [engine.zero_grad, step] * 4)
    engine.zero_grad()
    # the same floor for the live bytes: a reduce-scatter that gloo's thread finished late
    # can still hold its buffer right after zero_grad (seen once: +gradients_b on a rank)
    return min(start, _live_bytes() - before), min(peaks[2::2])


def _l(p=1, t=1, mode=None, d=1):
    return ParallelLayout(p, t, mode, 1, d)


# (candidate, (low, high) bounds of predicted / measured): exact where every buffer is named;
# 1D's vocab-parallel loss keeps ~13 per-token index and mask values (int64 targets, masks,
# three all-reduced statistics) not modelled, and its overlapped all-reduces free their
# buffers when gloo's thread finishes them, up to 5 % later than program order even in the
# floor of four steps; the pipeline's peak comes inside a block's backward, where part of
# its activations are freed and its input gradients not yet; 1D with checkpointing also
# all-reduces in the recompute (measured 4 - 9 % under, varying between runs)
CASES = [(Candidate(_l(d=4), 1), (0.995, 1.005)),
         (Candidate(_l(d=4), 2, zero=2), (0.995, 1.005)),
         (Candidate(_l(d=4), 1, zero=3), (0.995, 1.005)),
         (Candidate(_l(d=4), 1, checkpoint=True), (0.995, 1.005)),
         (Candidate(_l(t=2, mode='sequence', d=2), 1), (0.995, 1.005)),
         (Candidate(_l(t=4, mode='1d'), 1), (0.94, 1.005)),
         (Candidate(_l(t=2, mode='1d', d=2), 1), (0.94, 1.005)),
         (Candidate(_l(t=4, mode='1d'), 1, checkpoint=True), (0.90, 1.005)),
         (Candidate(_l(p=2, d=2), 4, '1f1b'), (0.90, 1.02))]


@pytest.mark.parametrize('cand,bounds', CASES,
                         ids=[c.describe().replace(' ', '_') for c, _ in CASES])
def test_peak_memory_terms_equal_the_allocator_record(cand, bounds):
    from colossal_lite.auto.planner import plan_config
    from colossal_lite.testing import run_distributed
    shape = model_shape('gpt', None, seq=16, **OPTS)
    config = {k: v for k, v in plan_config(shape, cand, BATCH).items()
              if k in ('parallel', 'num_microbatches', 'zero')}
    measured = run_distributed(_step_memory, 4, config, cand.checkpoint)
    est = evaluate(shape, load_profile('nvlink8'), cand, BATCH)
    l = cand.layout
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
    from colossal_lite.pipeline.schedules import B, F, W, PipeShape
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
