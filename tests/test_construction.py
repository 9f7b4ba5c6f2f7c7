"""Constructors only construct: building a model_zoo model issues no collective.

One launched run of 4 ranks (and one of 8 for 2.5D, 3D and pipeline x 2D) builds GPT, BERT and ViT ('tiny', 4 blocks) for a set of
layouts -- data 4 (the serial model on every rank), data 2 x 1D t=2, 2D q=2, data 2 x
sequence 2, pipeline 2 under every schedule (interleaved with chunks 2), pipeline 2 x 1D 2
and pipeline 2 with ``partition='cost'`` after the explicit step
(``colossal_lite.pipeline.resolve_partition``) -- each layout's groups made over the one
default group, outside the count. During construction both
``colossal_lite.communication.comm_profile()`` and a counter on torch.distributed's
collectives themselves (so nothing bypasses the library's counter) must read zero.
"""
import torch

from colossal_lite.testing import run_distributed

LAYOUTS = {
    'data 4': dict(),
    'data 2 x 1d 2': dict(tensor=dict(size=2, mode='1d')),
    '2d q=2': dict(tensor=dict(size=4, mode='2d')),
    'data 2 x sequence 2': dict(tensor=dict(size=2, mode='sequence')),
    'pipeline 2 gpipe': dict(pipeline=dict(size=2, schedule='gpipe')),
    'pipeline 2 1f1b': dict(pipeline=dict(size=2, schedule='1f1b')),
    'pipeline 2 zero_bubble': dict(pipeline=dict(size=2, schedule='zero_bubble')),
    'pipeline 2 interleaved x2': dict(pipeline=dict(size=2, chunks=2, schedule='interleaved')),
    'pipeline 2 x 1d 2': dict(pipeline=2, tensor=dict(size=2, mode='1d')),
    'pipeline 2 parameters': dict(pipeline=dict(size=2, partition='parameters')),
    'pipeline 2 cost': dict(pipeline=dict(size=2, partition='cost')),
}
LAYOUTS_8 = {  # the cube and the layered grid need 8 ranks
    '2.5d q=2 depth 2': dict(tensor=dict(size=8, mode='2.5d', depth=2)),
    '3d q=2': dict(tensor=dict(size=8, mode='3d')),
    'pipeline 2 x 2d q=2': dict(pipeline=dict(size=2, schedule='1f1b'),
                                tensor=dict(size=4, mode='2d')),
}
_COLLECTIVES = ('all_reduce', 'all_gather', 'all_gather_into_tensor', 'all_gather_object',
                'broadcast', 'broadcast_object_list', 'reduce', 'reduce_scatter',
                'reduce_scatter_tensor', 'all_to_all', 'all_to_all_single', 'send', 'recv',
                'isend', 'irecv', 'batch_isend_irecv', 'barrier', 'monitored_barrier', 'gather',
                'scatter')


def _count_torch_collectives(calls: list):
    """Wrap torch.distributed's collectives (both namespaces) to append their names to
    ``calls``; returns the undo."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    saved = []
    for module in (dist, c10d):
        for name in _COLLECTIVES:
            original = getattr(module, name, None)
            if original is None:
                continue

            def counted(*args, _name=name, _original=original, **kwargs):
                calls.append(_name)
                return _original(*args, **kwargs)
            saved.append((module, name, original))
            setattr(module, name, counted)

    def undo():
        for module, name, original in saved:
            setattr(module, name, original)
    return undo


def _build_everything(rank, layouts=LAYOUTS):
    from colossal_lite.communication import comm_profile
    from colossal_lite.config import load_config
    from colossal_lite.context import ParallelContext, global_context as gpc, use_context
    from colossal_lite.pipeline import resolve_partition
    from model_zoo import BERT, BERT_PRESETS, GPT, GPT_PRESETS, VIT_PRESETS, ViT
    from model_zoo.blocks import preset_config
    models = [(GPT, preset_config(GPT_PRESETS, 'tiny', dict(layers=4), 'GPT')),
              (BERT, preset_config(BERT_PRESETS, 'tiny', dict(layers=4), 'BERT')),
              (ViT, preset_config(VIT_PRESETS, 'tiny', dict(layers=4), 'ViT'))]
    report = {}
    for name, parallel in layouts.items():
        ctx = ParallelContext()
        ctx.device = gpc.device
        ctx.init_parallel_groups(load_config(dict(parallel=parallel, num_microbatches=4))
                                 .settings)
        with use_context(ctx):
            cuts = {cls.__name__: resolve_partition(cls, **options) for cls, options in models}
            calls, built = [], {}
            undo = _count_torch_collectives(calls)
            try:
                with comm_profile() as stats:
                    for cls, options in models:
                        if cls is ViT and ctx.tensor_mode == 'sequence':
                            continue  # 1 + (8 / 2)^2 = 17 tokens do not split in 2
                        model = cls(**options)
                        built[cls.__name__] = [list(s.layers) for s in model.stages]
            finally:
                undo()
        report[name] = dict(library_calls=stats.calls(), torch_calls=calls, built=built,
                            cuts=cuts)
    return report


def _check_no_collective(reports, layouts):
    for rank, report in enumerate(reports):
        assert list(report) == list(layouts)
        for name, got in report.items():
            assert got['library_calls'] == 0 and got['torch_calls'] == [], (rank, name, got)
            expected = {'GPT', 'BERT'} | ({'ViT'} if 'sequence' not in name else set())
            assert set(got['built']) == expected, (rank, name)


def test_building_models_for_8_rank_layouts_issues_no_collective():
    reports = run_distributed(_build_everything, 8, dict(), LAYOUTS_8, timeout=600)
    _check_no_collective(reports, LAYOUTS_8)
    held = [r['pipeline 2 x 2d q=2']['built']['GPT'] for r in reports]
    assert sorted({i for stages in held for s in stages for i in s}) == [0, 1, 2, 3]


def test_building_models_issues_no_collective():
    reports = run_distributed(_build_everything, 4, dict(), timeout=600)
    _check_no_collective(reports, LAYOUTS)
    # the pipeline layouts built only their stages; 'cost' cut alike on every rank
    for name in LAYOUTS:
        if not name.startswith('pipeline'):
            assert all(r[name]['built']['GPT'] == [[0, 1, 2, 3]] for r in reports), name
            continue
        chunks = 2 if 'interleaved' in name else 1
        gpt = [r[name]['built']['GPT'] for r in reports]
        assert all(len(stages) == chunks for stages in gpt), (name, gpt)
        held = [sorted(i for s in stages for i in s) for stages in gpt]
        assert sorted({i for h in held for i in h}) == [0, 1, 2, 3], (name, gpt)
        assert all(0 < len(h) < 4 for h in held), (name, gpt)
    cost = {tuple(sorted(r['pipeline 2 cost']['cuts'].items())) for r in reports}
    assert len(cost) == 1 and all(sum(c) == 4 for _, c in next(iter(cost))), cost
    assert reports[0]['pipeline 2 1f1b']['cuts'] == {'GPT': None, 'BERT': None, 'ViT': None}
