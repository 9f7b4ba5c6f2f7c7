"""Per-layer choices the runtime executes: activation checkpointing of named blocks
(``checkpoint=[i, ...]`` in model_zoo) and an explicit pipeline cut
(``parallel.pipeline.partition=[n_0, ..., n_{S-1}]``)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from colossal_lite.config import ConfigError, load_config
from colossal_lite.engine.checkpoint import capture_rng_state, restore_rng_state
from colossal_lite.testing import plain_step, run_distributed, trace_diffs, training_trace
from tests.model_cases import FAMILIES, build, criterion, global_batch
from tests.test_pipeline import _check as check_pipeline_equals_serial

LAYERS = 3
CHECKPOINTED = [0, 2]


# ------------------------------------------------------------------ per-block checkpointing
def _counted_backward(model, family, batch):
    """(one backward's trace, forward calls per block): a hook on each block's MLP counts
    its runs, so a checkpointed block counts 2 (forward + recompute), a plain one 1."""
    calls = {}
    for i, block in _blocks(model).items():
        calls[i] = 0
        block.mlp.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    trace = training_trace(model, batch, steps=1, step_fn=plain_step(criterion(family)))
    return trace, calls


def _blocks(model):
    """Serial index -> TransformerLayer (BERT names its ModuleDict ``layers``)."""
    return {int(i): b for i, b in (model.layers if hasattr(model, 'layers')
                                   else model.blocks).items()}


@pytest.mark.parametrize('family', FAMILIES)
def test_named_blocks_recompute_and_gradients_equal_the_plain_model(family):
    """Dropout 0.2 (masks must repeat on recompute); same RNG start for both runs."""
    torch.manual_seed(5)
    plain = build(family, dropout=0.2, layers=LAYERS)
    ckpt = build(family, dropout=0.2, layers=LAYERS, checkpoint=CHECKPOINTED)
    ckpt.load_state_dict(plain.state_dict())
    batch = global_batch(family, batch=4)
    start = capture_rng_state()
    trace_p, calls_p = _counted_backward(plain, family, batch)
    restore_rng_state(start)
    trace_c, calls_c = _counted_backward(ckpt, family, batch)
    assert calls_p == {i: 1 for i in range(LAYERS)}
    assert calls_c == {i: 2 if i in CHECKPOINTED else 1 for i in range(LAYERS)}
    diffs = trace_diffs(trace_c, trace_p)
    assert any(key.startswith('grad:') for _, key in diffs)
    worst = max(d for d, _ in diffs.values())
    assert worst <= 1e-5, {k: v for k, v in diffs.items() if v[0] > 1e-5}


def test_checkpoint_accepts_bools_and_index_collections():
    assert [b.checkpoint for b in _blocks(build('gpt', layers=3, checkpoint=True)).values()] \
        == [True] * 3
    assert [b.checkpoint for b in _blocks(build('gpt', layers=3, checkpoint=range(2))).values()] \
        == [True, True, False]
    assert not any(b.checkpoint for b in _blocks(build('vit', layers=3)).values())


@pytest.mark.parametrize('value, message', [
    (2, 'got 2 (the first k blocks: range(k))'),
    ('all', "got 'all'"),
    ([0, 3], 'block index 3 is not in [0, 3) (the model has 3 layers)'),
    ([-1], 'block index -1 is not in [0, 3)'),
    ([True], 'block index True is not in [0, 3)'),
])
def test_bad_checkpoint_values_name_the_value_and_the_layer_count(value, message):
    with pytest.raises(ValueError) as err:
        build('bert', layers=3, checkpoint=value)
    assert message in str(err.value)


# ------------------------------------------------------------------ explicit pipeline cut
def test_gpt_under_an_explicit_cut_equals_serial():
    check_pipeline_equals_serial(2, 'gpt', dict(size=2, partition=[3, 1]))


def test_interleaved_explicit_cut_with_per_block_checkpointing_equals_serial():
    check_pipeline_equals_serial(2, 'gpt', dict(size=2, chunks=2, schedule='interleaved',
                                                partition=[1, 2, 1, 1]),
                                 model_kw=dict(layers=5, checkpoint=[1, 4]), steps=2)


def _stage_blocks(rank):
    from model_zoo import GPT
    model = GPT.from_preset('tiny', layers=5, dropout=0.0)
    return [list(s.layers) for s in model.stages], sorted(
        {int(k.split('.')[1]) for k in model.state_dict() if k.startswith('blocks.')})


def test_stages_hold_the_named_blocks():
    config = dict(parallel=dict(pipeline=dict(size=2, chunks=2, schedule='interleaved',
                                              partition=[2, 1, 1, 1])), num_microbatches=2)
    (r0, held0), (r1, held1) = run_distributed(_stage_blocks, 2, config)
    assert r0 == [[0, 1], [3]] and held0 == [0, 1, 3]
    assert r1 == [[2], [4]] and held1 == [2, 4]


@pytest.mark.parametrize('partition, message', [
    ([3], "'parallel.pipeline.partition' = [3] must list the blocks of each of the 2"),
    ([2, 0], "'parallel.pipeline.partition' = [2, 0]: every stage needs a positive integer"),
    ([2, 1.5], 'got 1.5'),
    ('even', "'parallel.pipeline.partition' must be one of"),
])
def test_bad_explicit_cuts_are_config_errors(partition, message):
    with pytest.raises(ConfigError) as err:
        load_config(dict(parallel=dict(pipeline=dict(size=2, partition=partition)),
                         num_microbatches=2)).settings
    assert message in str(err.value)


def test_parent_check_rejects_a_cut_that_misses_the_layer_count():
    """``job.check_layout`` (the CLI's parent check) names the key, the cut and the layers."""
    from colossal_lite.job import check_layout
    settings = load_config(dict(
        parallel=dict(pipeline=dict(size=2, partition=[2, 1])), num_microbatches=2,
        imports=['model_zoo'], model=dict(type='gpt', preset='tiny', layers=4),
        data=dict(type='shakespeare', seq_len=16), train=dict(global_batch_size=4))).settings
    layout = settings.layout.with_world_size(2)
    with pytest.raises(ConfigError) as err:
        check_layout(settings.job, layout, settings.pipeline)
    assert ("'parallel.pipeline.partition' = [2, 1] must sum to 'model.layers' = 4"
            in str(err.value))
    check_layout(settings.job, layout, replace(settings.pipeline, partition=(3, 1)))  # sums
