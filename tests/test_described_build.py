"""A described layout builds what the run builds: ``job.check_layout``'s meta build (the
CLI's parent, no process) cuts an interleaved pipeline with an explicit partition exactly
as the launched ranks cut it -- the same stage parameters, by name and local shape."""
from __future__ import annotations

from colossal_lite.config import PipelineSettings, load_config
from colossal_lite.job import build_model, describe_model
from colossal_lite.testing import run_distributed

CONFIG = dict(parallel=dict(pipeline=dict(size=2, chunks=2, schedule='interleaved',
                                          partition=[1, 2, 2, 1]),
                            tensor=dict(size=1)),
              num_microbatches=2, imports=['model_zoo'],
              model=dict(type='gpt', preset='tiny', hidden=16, heads=2, layers=6,
                         max_positions=16),
              data=dict(type='shakespeare', seq_len=16), train=dict(global_batch_size=4))


def _shapes(model):
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def _built_in_the_run(rank):
    from colossal_lite.context import global_context as gpc
    return _shapes(build_model(gpc.settings.job))


def test_described_build_equals_the_run_for_interleaved_explicit_cut():
    settings = load_config(CONFIG).settings
    layout = settings.layout.with_world_size(2)
    described = [_shapes(describe_model(settings.job, layout, rank, settings.pipeline))
                 for rank in range(2)]
    launched = run_distributed(_built_in_the_run, 2, CONFIG, timeout=120)
    assert described == launched
    # rank 0 holds stages 0 and 2 (blocks 0 and 3-4), rank 1 stages 1 and 3 (1-2 and 5)
    blocks = [sorted({int(n.split('.')[1]) for n in shapes if n.startswith('blocks.')})
              for shapes in launched]
    assert blocks == [[0, 3, 4], [1, 2, 5]]
    # what a description without the run's pipeline settings cuts (one uniform stage per
    # rank) differs: the settings are what makes the parent's build the run's
    default = [_shapes(describe_model(settings.job, layout, rank, PipelineSettings(size=2)))
               for rank in range(2)]
    assert default != launched
