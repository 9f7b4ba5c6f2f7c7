"""Pipeline parallelism equals the serial model: every schedule, with every tensor mode.

Each case trains a tiny model_zoo model for 3 AdamW steps through ``engine.execute_schedule``
+ ``engine.step()`` on every rank and compares, with the suite's harness, the loss, every
gradient (gathered to full shape, by serial name; a tied weight on both stages that hold
it) and every parameter after each step against the same engine run in one process.
"""
import pytest
import torch

import colossal_lite as clt
from colossal_lite.communication import comm_profile
from colossal_lite.context import ParallelMode
from colossal_lite.testing import (ChildFailed, assert_matches_serial, make_optimizer,
                                   run_distributed, training_trace)
from tests.model_cases import make_case

M = 4  # micro-batches


def _trace(rank, name, case_kw, model_kw, steps):
    """One engine's training trace; ``case_kw['seq']`` may list a length per step."""
    lengths = case_kw['seq'] if isinstance(case_kw['seq'], list) else [case_kw['seq']]
    cases = [make_case(name, **dict(case_kw, seq=s)) for s in lengths]
    model = cases[0].build(**model_kw)
    engine, *_ = clt.initialize(model, make_optimizer(model.parameters()), cases[0].criterion())
    return training_trace(engine, [c.batch for c in cases], steps=steps)


def _config(pipeline, tensor=None, clip=0.0, **extra):
    parallel = dict(pipeline=pipeline)
    if tensor:
        parallel['tensor'] = tensor
    cfg = dict(parallel=parallel, num_microbatches=M, **extra)
    if clip:
        cfg['clip_grad_norm'] = clip
    return cfg


def _check(world, name, pipeline, tensor=None, model_kw=None, case_kw=None, steps=3,
           clip=0.0):
    """The layout's traces on ``world`` ranks equal one process's, step by step."""
    model_kw = dict(dict(layers=4, dropout=0.0), **(model_kw or {}))
    case_kw = dict(dict(batch=8, seq=16), **(case_kw or {}))
    args = (name, case_kw, model_kw, steps)
    serial = run_distributed(_trace, 1, _config(1, clip=clip), *args)[0]
    traces = run_distributed(_trace, world, _config(pipeline, tensor, clip=clip), *args)
    assert_matches_serial(traces, serial)


@pytest.mark.parametrize('size, schedule', [
    (2, 'gpipe'), (2, '1f1b'), (2, 'zero_bubble'),
    (4, 'gpipe'), (4, '1f1b'), (4, 'zero_bubble'),
])
def test_gpt_pipeline_equals_serial(size, schedule):
    _check(size, 'gpt', dict(size=size, schedule=schedule))


@pytest.mark.parametrize('size', [2, 4])
def test_interleaved_two_chunks_per_rank_equals_serial(size):
    _check(size, 'gpt', dict(size=size, chunks=2, schedule='interleaved'),
           model_kw=dict(layers=2 * size))


def test_pipeline_with_1d_tensor_parallel_and_clipping():
    _check(4, 'gpt', dict(size=2), tensor=dict(size=2, mode='1d'), clip=0.05)


def test_pipeline_with_2d_tensor_parallel():
    _check(8, 'gpt', dict(size=2, schedule='interleaved', chunks=2), tensor=dict(size=4, mode='2d'))


def test_pipeline_with_2p5d_tensor_parallel():
    _check(8, 'gpt', dict(size=2), tensor=dict(size=4, mode='2.5d', depth=1))


def test_pipeline_with_3d_tensor_parallel():
    """16 ranks: 2 stages of a 2 x 2 x 2 cube (each micro-batch of 4 rows cut 4 ways)."""
    _check(16, 'gpt', dict(size=2), tensor=dict(size=8, mode='3d'), case_kw=dict(batch=16))


def test_pipeline_data_and_1d_tensor_parallel():
    _check(8, 'gpt', dict(size=2, schedule='zero_bubble'), tensor=dict(size=2, mode='1d'))


def test_bert_pipeline_with_sequence_parallel():
    _check(4, 'bert', dict(size=2), tensor=dict(size=2, mode='sequence'))


def test_vit_pipeline_by_parameter_count():
    _check(2, 'vit', dict(size=2, partition='parameters'), model_kw=dict(layers=3))


def test_sequence_length_changes_between_steps():
    _check(2, 'gpt', dict(size=2), case_kw=dict(seq=[16, 8, 12]))


# ------------------------------------------------------------------ stage contents
def _stage_state(rank):
    case = make_case('gpt')
    model = case.build(layers=4, dropout=0.0)
    return sorted(model.state_dict()), {k: v.clone() for k, v in model.state_dict().items()}


def test_stages_hold_serial_weights_and_tied_embedding_on_both_ends():
    _, serial = run_distributed(_stage_state, 1, {})[0]
    ranks = run_distributed(_stage_state, 2, _config(dict(size=2)))
    first, last = ranks[0][1], ranks[1][1]
    assert 'wpe.weight' in first and 'wpe.weight' not in last
    assert 'lm_head.weight' in last and 'lm_head.weight' not in first
    assert {k for k in first if k.startswith('blocks.')} == {
        k for k in serial if k.startswith(('blocks.0.', 'blocks.1.'))}
    for part in (first, last):  # bit-equal to the serial model, tied weight included
        for key, value in part.items():
            assert torch.equal(value, serial[key]), key
    assert set(first) | set(last) == set(serial)


def _load_full(rank, full):
    model = make_case('gpt').build(layers=4, dropout=0.0)
    model.load_state_dict({k: v * 0 + 0.5 for k, v in full.items()})
    return {k: bool((v == 0.5).all()) for k, v in model.state_dict().items()}


def test_load_state_dict_takes_own_keys_of_a_full_dict():
    _, serial = run_distributed(_stage_state, 1, {})[0]
    for loaded in run_distributed(_load_full, 2, _config(dict(size=2)), serial):
        assert loaded and all(loaded.values())


# ------------------------------------------------------------------ communication
def _pipeline_bytes(rank):
    case = make_case('gpt', batch=8, seq=16)
    model = case.build(layers=2, dropout=0.0, hidden=32)
    engine, *_ = clt.initialize(model, make_optimizer(model.parameters()), case.criterion())
    counts = []
    for _ in range(2):
        engine.zero_grad()
        with comm_profile() as stats:
            engine.execute_schedule(case.batch)
        engine.step()
        counts.append((stats.bytes(mode=ParallelMode.PIPELINE, op='send'),
                       stats.bytes(mode=ParallelMode.PARALLEL_1D, op='all_gather')))
    return counts


def test_1d_stages_send_a_slice_and_all_gather():
    """Per micro-batch [2, 16, 32] fp32 activation and gradient: each of t=2 ranks sends
    half, the receiving stage all-gathers the halves. A 64-byte shape header goes with the
    first message of a shape only (the first step)."""
    act = 2 * 16 * 32 * 4
    result = run_distributed(_pipeline_bytes, 4, _config(dict(size=2),
                                                         tensor=dict(size=2, mode='1d')))
    for (first_sent, first_gathered), (sent, gathered) in result:
        # stage 0 sends activations, stage 1 sends gradients: M messages each way
        assert first_sent == M * act // 2 + 64 and sent == M * act // 2
        assert gathered == first_gathered and gathered >= M * act // 2


# ------------------------------------------------------------------ errors
def _failing(rank):
    case = make_case('gpt')
    model = case.build(layers=2, dropout=0.0)

    def criterion(out, labels):
        raise RuntimeError('boom on the last stage')
    engine, *_ = clt.initialize(model, make_optimizer(model.parameters()), criterion)
    engine.execute_schedule(case.batch)


def test_a_failing_stage_ends_the_run_with_its_rank():
    import time
    start = time.time()
    with pytest.raises(ChildFailed, match='(?s)rank 1 of 2 raised.*boom on the last stage'):
        run_distributed(_failing, 2, _config(dict(size=2)), timeout=60)
    assert time.time() - start < 30


def _too_few_layers(rank):
    make_case('gpt').build(layers=3)


def test_fewer_layers_than_stages_is_a_named_error():
    with pytest.raises(ChildFailed, match='model.layers = 3 is fewer than the pipeline stages'):
        run_distributed(_too_few_layers, 2, _config(dict(size=2, chunks=2,
                                                          schedule='interleaved')))


# ------------------------------------------------------------------ mixed precision
def _fp16_steps(rank):
    case = make_case('gpt', batch=8, seq=16)
    model = case.build(layers=4, dropout=0.0)
    engine, *_ = clt.initialize(model, make_optimizer(model.parameters()), case.criterion())
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    steps = []
    for _ in range(3):
        engine.zero_grad()
        _, _, loss = engine.execute_schedule(case.batch)
        engine.step()
        steps.append((engine.overflow, engine.loss_scale, float(loss)))
        if len(steps) == 1:
            unchanged = all(torch.equal(v, engine.model.state_dict()[k]) for k, v in before.items())
    return steps, unchanged


def test_naive_fp16_overflow_is_agreed_by_every_stage():
    """A loss scale of 2^40 overflows fp16 on the first step: every stage skips it and backs
    off alike; the next steps train as the one-process fp16 run does."""
    fp16 = dict(mode='naive', initial_scale=2.0 ** 40, max_scale=2.0 ** 40,
                backoff_factor=2.0 ** -20, hysteresis=1)
    (serial_steps, _), = run_distributed(_fp16_steps, 1, _config(1, fp16=fp16))
    ranks = run_distributed(_fp16_steps, 2, _config(dict(size=2), fp16=fp16))
    assert serial_steps[0][:2] == (True, 2.0 ** 20)
    for steps, unchanged in ranks:
        assert unchanged
        assert [s[:2] for s in steps] == [s[:2] for s in serial_steps]
        for (_, _, loss), (_, _, expected) in zip(steps[1:], serial_steps[1:]):
            assert abs(loss - expected) < 2e-3 * abs(expected)


def test_activation_checkpointing_in_stages_equals_serial():
    _check(2, 'gpt', dict(size=2), model_kw=dict(checkpoint=True))


# ------------------------------------------------------------------ trainer
def _fit(rank):
    from colossal_lite.trainer import hooks as H
    import colossal_lite.nn as col_nn
    case = make_case('vit', batch=16)
    images, labels = case.inputs[0], torch.arange(16) % 2
    batches = [((images[i:i + 2],), labels[i:i + 2]) for i in range(0, 16, 2)]
    model = case.build(layers=2, dropout=0.0, num_classes=2)
    engine, *_ = clt.initialize(model, make_optimizer(model.parameters()),
                                col_nn.CrossEntropyLoss())
    trainer = clt.trainer.Trainer(engine)
    losses = []

    class Record(H.BaseHook):
        uses_train_output = False
        priority = H.METRIC_PRIORITY + 1

        def after_train_iter(self, trainer, output, label, loss):
            losses.append(trainer.metrics['loss'])
    trainer.fit(batches, epochs=1, test_dataloader=batches,
                hooks=[H.LossHook(), H.AccuracyHook(), Record()])
    return losses, trainer.metrics['test_loss'], trainer.metrics['test_accuracy']


@pytest.mark.parametrize('world, pipeline, tensor', [
    (2, dict(size=2), None), (2, 1, dict(size=2, mode='1d')), (4, 1, dict(size=4, mode='2d'))])
def test_trainer_metrics_equal_serial_on_every_rank(world, pipeline, tensor):
    """Loss, test loss and test accuracy equal the serial run's on every rank: from the last
    stage under pipelining (rank 0 holds the first stage and prints them), from the
    vocab/batch-split logits the engine returns under tensor parallelism."""
    (losses, test_loss, accuracy), = run_distributed(_fit, 1, _config(1))
    assert len(losses) == 2 and 0 < accuracy < 1
    for got in run_distributed(_fit, world, _config(pipeline, tensor)):
        assert got[0] == pytest.approx(losses, rel=1e-5)
        assert got[1] == pytest.approx(test_loss, rel=1e-5)
        assert got[2] == accuracy


# ------------------------------------------------------------------ partitioning
def _stage_sizes(cls, partition, size=4, name='tiny', **overrides):
    """Each described rank's block counts, building ``cls`` preset ``name`` on meta; under
    ``partition='cost'`` after the explicit step (``resolve_partition``, once per rank)."""
    from colossal_lite.config import PipelineSettings, parse_parallel
    from colossal_lite.context import ParallelContext, use_context
    from colossal_lite.pipeline import resolve_partition
    from model_zoo import BERT_PRESETS, GPT_PRESETS, VIT_PRESETS
    from model_zoo.blocks import preset_config
    presets = {'GPT': GPT_PRESETS, 'BERT': BERT_PRESETS, 'ViT': VIT_PRESETS}[cls.__name__]
    options = preset_config(presets, name, overrides, cls.__name__)
    layout = parse_parallel(dict(pipeline=size)).with_world_size(size)
    pipeline = PipelineSettings(size=size, partition=partition, num_microbatches=size)
    sizes, cuts = [], set()
    for rank in range(size):
        with use_context(ParallelContext.describe(layout, rank, pipeline)):
            cuts.add(resolve_partition(cls, **options))
            with torch.device('meta'):
                sizes.append([len(s.layers) for s in cls(**options).stages])
    assert len(cuts) == 1       # every rank cuts alike (None: nothing to resolve)
    if partition == 'cost':
        assert cuts == {tuple(s[0] for s in sizes)}
    return sizes


def test_balanced_cut_minimizes_the_heaviest_stage():
    from itertools import combinations
    from colossal_lite.pipeline.partition import balanced_cut
    weights, head, tail = [3, 1, 4, 1, 5, 9, 2, 6], 7.0, 2.0
    ranges = balanced_cut(weights, 3, head, tail)
    assert [i for r in ranges for i in r] == list(range(8)) and all(len(r) for r in ranges)

    def heaviest(bounds):
        loads = [sum(weights[a:b]) for a, b in zip((0,) + bounds, bounds + (8,))]
        return max(loads[0] + head, loads[1], loads[-1] + tail)
    best = min(heaviest(c) for c in combinations(range(1, 8), 2))  # every cut in 3 parts
    assert heaviest((ranges[1].start, ranges[2].start)) == best


def test_parameter_partition_gives_the_embedding_stage_fewer_blocks():
    """gpt2-small: the 50304 x 768 embedding (38.6 M) weighs about 5 blocks (7.1 M each);
    uniform gives 3 blocks per stage, by parameters the first and last stages hold fewer."""
    from model_zoo import GPT
    assert _stage_sizes(GPT, 'uniform', name='gpt2-small') == [[3], [3], [3], [3]]
    by_params = [s[0] for s in _stage_sizes(GPT, 'parameters', name='gpt2-small')]
    assert sum(by_params) == 12 and by_params[0] < 3 and by_params[-1] < 3


def test_cost_partition_covers_every_layer_once():
    from model_zoo import ViT
    sizes = [s[0] for s in _stage_sizes(ViT, 'cost', name='tiny', layers=8)]
    assert sum(sizes) == 8 and min(sizes) >= 1


def test_cost_partition_is_resolved_before_the_build_never_inside_it(monkeypatch):
    """partition='cost': building without the explicit step raises, naming it; the step
    times the parts once per process and arguments (model_zoo.blocks._MEASURED); the
    constructor afterwards neither times nor recomputes the cut."""
    from colossal_lite.config import PipelineSettings, parse_parallel
    from colossal_lite.context import ParallelContext, use_context
    from colossal_lite.pipeline import resolve_partition, stages
    from model_zoo import GPT, GPT_PRESETS
    from model_zoo.blocks import preset_config
    options = preset_config(GPT_PRESETS, 'tiny', dict(layers=6), 'GPT')
    layout = parse_parallel(dict(pipeline=2)).with_world_size(2)
    ctx = ParallelContext.describe(layout, 1, PipelineSettings(size=2, partition='cost',
                                                               num_microbatches=2))
    with use_context(ctx), torch.device('meta'):
        with pytest.raises(ValueError, match=r'call colossal_lite\.pipeline\.resolve_partition'):
            GPT(**options)
    with use_context(ctx):
        cut = resolve_partition(GPT, **options)
        assert sum(cut) == 6 and len(cut) == 2
        timed = []
        import model_zoo.blocks
        for module in (stages, model_zoo.blocks):
            monkeypatch.setattr(module, 'measure_part_costs', lambda *a, **k: timed.append(a))
        monkeypatch.setattr(stages, 'balanced_cut', lambda *a, **k: timed.append(a))
        assert resolve_partition(GPT, **dict(options, dropout=0.3)) == cut   # untimed option
        with torch.device('meta'):
            model = GPT(**options)
        assert [len(s.layers) for s in model.stages] == [cut[1]] and not timed
        # a model of other sizes is another cut: not resolved yet
        with pytest.raises(ValueError, match='resolve_partition'), torch.device('meta'):
            GPT(**dict(options, hidden=64))


# ------------------------------------------------------------------ user models
def _sequential_trace(rank):
    from torch import nn
    from colossal_lite.pipeline import StagedSequential
    sizes = [8, 16, 16, 16, 4]
    builders = []
    for i in range(4):
        builders.append(lambda a=sizes[i], b=sizes[i + 1]: nn.Linear(a, b))
        if i < 3:
            builders.append(nn.Tanh)
    model = StagedSequential(builders)
    g = torch.Generator().manual_seed(5)
    batch = (torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g))
    engine, *_ = clt.initialize(model, make_optimizer(model.parameters()), torch.nn.MSELoss())
    return training_trace(engine, batch, steps=3)


def test_a_user_layer_list_is_partitioned_and_equals_serial():
    cfg = _config(dict(size=2, partition='parameters'))
    serial = run_distributed(_sequential_trace, 1, _config(1))[0]
    traces = run_distributed(_sequential_trace, 2, cfg)
    assert_matches_serial(traces, serial)
    assert {k for k in traces[0][0] if k.startswith('param:')} == {  # 3 Linear layers first
        'param:layers.0.weight', 'param:layers.0.bias', 'param:layers.2.weight',
        'param:layers.2.bias'}


# ------------------------------------------------------------------ config
@pytest.mark.parametrize('pipeline, micro, message', [
    (dict(size=2, schedule='pipedream'), 4, "'parallel.pipeline.schedule' must be one of"),
    (dict(size=2, partition='random'), 4, "'parallel.pipeline.partition' must be one of"),
    (dict(size=2, chunks=2, schedule='1f1b'), 4, "chunks' = 2 needs schedule 'interleaved'"),
    (dict(size=4, schedule='1f1b'), 2, 'needs num_microbatches >= pipeline size 4, got '
                                       'num_microbatches = 2'),
    (dict(size=2, chunks=2, schedule='interleaved'), 3, 'divisible by the pipeline size 2, '
                                                        'got num_microbatches = 3'),
    (dict(size=0), 4, "'parallel.pipeline.size' must be a positive integer, got 0"),
    (dict(size=2, stages=3), 4, "unknown config key 'parallel.pipeline.stages'"),
])
def test_impossible_pipeline_configs_are_config_errors(pipeline, micro, message):
    from colossal_lite.config import ConfigError, load_config
    from colossal_lite.pipeline import parse_pipeline
    cfg = dict(parallel=dict(pipeline=pipeline), num_microbatches=micro)
    with pytest.raises(ConfigError, match=message.replace('(', r'\(').replace(')', r'\)')):
        parse_pipeline(cfg)
    with pytest.raises(ConfigError):
        load_config(cfg)


def test_gpipe_runs_fewer_microbatches_than_stages():
    from colossal_lite.pipeline import parse_pipeline
    settings = parse_pipeline(dict(parallel=dict(pipeline=dict(size=4, schedule='gpipe')),
                                   num_microbatches=2))
    assert (settings.size, settings.stages, settings.num_microbatches) == (4, 4, 2)


# ------------------------------------------------------------------ the CLI
CLI_JOB = """
model = dict(type='gpt', preset='tiny', hidden=32, layers=2, heads=4, max_positions=16, dropout=0.0)
data = dict(type='shakespeare', seq_len=16, val_fraction=0.05, plays=['macbeth'])
train = dict(global_batch_size=8, steps=3, log_every=1, eval_batches=2)
optimizer = dict(type='adamw', lr=1e-2)
"""


def _cli_summary(tmp_path, layout: str, nproc: int):
    import os
    import re
    import subprocess
    import sys
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = tmp_path / f'job_{nproc}.py'
    path.write_text(CLI_JOB + layout)
    env = dict(os.environ, PYTHONPATH=repo, OMP_NUM_THREADS='1')
    run = subprocess.run([sys.executable, '-m', 'colossal_lite.cli', 'train', str(path),
                          '--nproc', str(nproc)], cwd=str(tmp_path), env=env,
                         capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, run.stdout + run.stderr
    losses = [float(x) for x in re.findall(r'^step=\d+ epoch=0 loss=([\d.]+)', run.stdout, re.M)]
    return losses, run.stdout


def test_cli_pipeline_job_prints_the_serial_losses(tmp_path):
    """`colossal-lite train` with pp=2 x 1D tp=2 (4 micro-batches of the global batch 8)
    prints the one-process run's losses; the stages exchange messages on PIPELINE."""
    serial, _ = _cli_summary(tmp_path, '', 1)
    losses, out = _cli_summary(tmp_path, "parallel = dict(pipeline=2, tensor=dict(size=2, "
                                         "mode='1d'))\nnum_microbatches = 4\n", 4)
    assert len(serial) == 3 and losses == pytest.approx(serial, abs=1e-4)
    assert 'PIPELINE:' in out and 'EMBEDDING:' in out


@pytest.mark.parametrize('schedule, chunks', [('gpipe', 1), ('1f1b', 1), ('interleaved', 2),
                                              ('zero_bubble', 1)])
def test_sent_buffers_are_released_once_received(schedule, chunks):
    """A send is released after the first receive from the same peer that the peer sent after
    taking ours in: with M = 32 micro-batches, 1F1B-like schedules keep O(P) sends alive per
    rank, not O(M) (GPipe's forward sends wait for their gradients, as its memory does)."""
    from colossal_lite.pipeline import PipeShape, build_schedule
    from colossal_lite.pipeline.p2p import message_key, release_points
    P, Mb = 4, 32
    shape = PipeShape(P, chunks, Mb)
    lists = build_schedule(schedule, P, Mb, chunks)
    recv_at = {q: {message_key(a): i for i, a in enumerate(acts) if a.kind.startswith('RECV')}
               for q, acts in lists.items()}
    send_at = {q: {message_key(a): i for i, a in enumerate(acts) if a.kind.startswith('SEND')}
               for q, acts in lists.items()}
    for rank, acts in lists.items():
        releases = release_points(shape, lists, rank)
        alive, peak = set(), 0
        for i, a in enumerate(acts):
            if a.kind.startswith('SEND'):
                alive.add(message_key(a))
            for key in releases.get(i, ()):
                # proof of receipt: the receive at i carries a message its sender sent after
                # taking in ours
                peer = shape.rank_of(key[1])
                got = message_key(acts[i])
                assert send_at[peer][got] > recv_at[peer][key]
                alive.remove(key)
            peak = max(peak, len(alive))
        limit = 2 * Mb if schedule == 'gpipe' else 4 * P * chunks
        assert peak <= limit, (rank, peak)
