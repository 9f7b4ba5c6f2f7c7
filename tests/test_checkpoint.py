"""Checkpoints (colossal_lite.checkpoint): any layout loads any other, resume equals an
uninterrupted run, a save killed mid-write leaves the previous checkpoint loadable.

Every test trains the tiny GPT of ``tests/model_cases.py`` (4 layers, no dropout) and
compares full tensors keyed by serial name: ``'model.<key>'`` (the model's full state
dict) and ``'optim.<name>.<slot>'`` (Adam's ``exp_avg``, ``exp_avg_sq``, ``step`` at the
parameter's full shape), merged over the ranks (replicas and pipeline stages must agree).
"""
import glob
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

import colossal_lite as clt
from colossal_lite import checkpoint
from colossal_lite.checkpoint import state as S
from colossal_lite.testing import (engine_step, make_optimizer, max_rel_diff, replica_batch,
                                   run_distributed)
from tests.model_cases import make_case

SERIAL = {}
TP2 = dict(parallel=dict(tensor=dict(size=2, mode='1d')))          # 2 ranks; x dp=2 on 4
TWO_D = dict(parallel=dict(tensor=dict(size=4, mode='2d')))        # 4 ranks
PP2 = dict(parallel=dict(pipeline=2), num_microbatches=2)          # 2 ranks
ZERO2 = dict(zero=dict(stage=2))                                   # dp = world
TWO_P5_D = dict(parallel=dict(tensor=dict(size=8, mode='2.5d', depth=2)))  # 8 ranks
THREE_D = dict(parallel=dict(tensor=dict(size=8, mode='3d')))      # 8 ranks
PP2_3D = dict(parallel=dict(pipeline=2, tensor=dict(size=8, mode='3d')), num_microbatches=2)  # 16
PP2_TP2 = dict(parallel=dict(pipeline=2, tensor=dict(size=2, mode='1d')), num_microbatches=2)  # 4
TP4 = dict(parallel=dict(tensor=dict(size=4, mode='1d')))          # 4 ranks


def _case():
    return make_case('gpt', batch=8, seq=16)


def _engine(with_scheduler=False):
    case = _case()
    model = case.build(layers=4, dropout=0.0)
    optimizer = make_optimizer(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    engine, *_ = clt.initialize(model, optimizer, case.criterion())
    return (engine, scheduler) if with_scheduler else engine


def _steps(engine, n, scheduler=None):
    """``n`` engine steps on the case's batch (the scheduler, when given, stepped after
    each: LR = lr0 / (1 + step), which a lost scheduler state would get wrong); the
    losses (None on non-last stages)."""
    batch = replica_batch(_case().batch)
    losses = []
    for _ in range(n):
        loss = engine_step(engine, batch)['loss']
        losses.append(None if loss is None else float(loss))
        if scheduler is not None:
            scheduler.step()
    return losses


def _full(engine):
    return {k: v.detach().cpu().clone() for k, v in S.tensor_state(engine).items()}


def _merge(rank_states):
    """One dict from the ranks' dicts; a key held by several ranks must agree bitwise."""
    out = {}
    for state in rank_states:
        for key, value in state.items():
            if key in out:
                assert torch.equal(out[key], value), f'ranks disagree on {key}'
            else:
                out[key] = value
    return out


def _train_and_save(rank, path, steps):
    engine = _engine()
    losses = _steps(engine, steps)
    checkpoint.save(path, engine, extra={'note': 'hi'})
    return losses, _full(engine)


def _load_fresh(rank, path, steps=0):
    engine = _engine()
    extra = checkpoint.load(path, engine)
    loaded = _full(engine)
    losses = _steps(engine, steps)
    return extra, engine.global_step, loaded, losses, _full(engine)


def _assert_equal_states(expected, actual):
    assert set(actual) == set(expected), sorted(set(actual) ^ set(expected))
    assert any(k.endswith('.exp_avg_sq') for k in expected)  # optimizer state is in it
    for key, value in expected.items():
        assert torch.equal(actual[key].to(value.dtype), value), key


@pytest.mark.parametrize('src, src_world, dst, dst_world', [
    (SERIAL, 1, TP2, 2),
    (dict(TP2), 4, TWO_D, 4),           # 1D tp=2 x dp=2 -> 2D
    (PP2, 2, SERIAL, 1),
    (dict(ZERO2), 2, TP2, 2),           # ZeRO-2 dp=2 -> 1D tp=2
    (TP2, 2, dict(ZERO2), 2),           # 1D tp=2 -> ZeRO-2 dp=2
    (TWO_D, 4, PP2, 2),
    (THREE_D, 8, dict(TP2), 4),         # 3D q=2 -> 1D tp=2 x dp=2
    (PP2_3D, 16, TP4, 4),               # pp=2 x 3D q=2 -> 1D tp=4
    (TWO_D, 8, PP2_TP2, 4),             # 2D q=2 x dp=2 -> pp=2 x 1D tp=2
], ids=['serial-to-tp2', 'tp2dp2-to-2d', 'pp2-to-serial', 'zero2-to-tp2', 'tp2-to-zero2',
        '2d-to-pp2', '3d-to-tp2dp2', 'pp2x3d-to-tp4', '2ddp2-to-pp2tp2'])
def test_round_trip_between_layouts_is_bit_exact(tmp_path, src, src_world, dst, dst_world):
    path = str(tmp_path / 'ckpt')
    saved = _merge(s for _, s in run_distributed(_train_and_save, src_world, src, path, 2))
    results = run_distributed(_load_fresh, dst_world, dst, path)
    for extra, step, _, _, _ in results:
        assert extra == {'note': 'hi'} and step == 2
    _assert_equal_states(saved, _merge(r[2] for r in results))


def test_shards_are_written_in_place_and_each_chunk_once(tmp_path):
    """1D tp=2 x dp=2: a cut weight is stored as its 2 DTensor chunks (no gather), and the
    data files hold each distinct chunk once (DATA replicas deduplicated)."""
    written = {}
    for world in (2, 4):  # tp=2 alone, then with dp=2: the same chunks, written once
        path = str(tmp_path / f'ckpt{world}')
        run_distributed(_train_and_save, world, dict(TP2), path, 1)
        meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        assert len(meta['model.blocks.0.mlp.fc1.weight'].chunks) == 2
        assert len(meta['optim.blocks.0.mlp.fc1.weight.exp_avg'].chunks) == 2
        files = glob.glob(os.path.join(path, '*.distcp'))
        assert len(files) == world  # every rank writes a share
        written[world] = sum(os.path.getsize(f) for f in files)
        unique = sum(c.sizes.numel() * v.properties.dtype.itemsize
                     for v in meta.values() for c in v.chunks)
        assert written[world] >= unique
    assert abs(written[4] - written[2]) <= 0.05 * written[2], written


def test_serial_to_2p5d_depth_2_round_trip(tmp_path):
    path = str(tmp_path / 'ckpt')
    saved = _merge(s for _, s in run_distributed(_train_and_save, 1, SERIAL, path, 2))
    results = run_distributed(_load_fresh, 8, TWO_P5_D, path, timeout=300)
    _assert_equal_states(saved, _merge(r[2] for r in results))


def _straight(rank, steps):
    engine = _engine()
    return _steps(engine, steps), _full(engine)


def _straight_scheduled(rank, steps):
    engine, scheduler = _engine(with_scheduler=True)
    return _steps(engine, steps, scheduler), _full(engine)


def _resume_same_run(rank, path):
    first, scheduler = _engine(with_scheduler=True)
    losses = _steps(first, 2, scheduler)
    checkpoint.save(path, first, lr_scheduler=scheduler)
    del first
    second, scheduler = _engine(with_scheduler=True)
    checkpoint.load(path, second, lr_scheduler=scheduler)
    return losses + _steps(second, 2, scheduler), _full(second)


@pytest.mark.parametrize('cfg, world', [
    (TP2, 4),                                        # dp=2 x tp=2
    (dict(TP2, fp16=dict(mode='naive')), 4),         # + naive fp16: scaler and fp32 masters
    (ZERO2, 2),
    (dict(PP2, parallel=dict(pipeline=2, tensor=dict(size=2, mode='1d'))), 4),
], ids=['dp2-tp2', 'dp2-tp2-fp16', 'zero2-dp2', 'pp2-tp2'])
def test_resume_equals_uninterrupted(tmp_path, cfg, world):
    straight = run_distributed(_straight_scheduled, world, cfg, 4)
    resumed = run_distributed(_resume_same_run, world, cfg, str(tmp_path / 'ckpt'))
    for (loss_a, state_a), (loss_b, state_b) in zip(straight, resumed):
        assert loss_a == loss_b  # bit-identical losses
        _assert_equal_states(state_a, state_b)


def test_resume_under_another_layout_matches_within_fp32_tolerance(tmp_path):
    path = str(tmp_path / 'ckpt')
    straight_losses, straight = run_distributed(_straight, 1, SERIAL, 4)[0]
    first = run_distributed(_train_and_save, 4, dict(TP2), path, 2)   # dp=2 x tp=2
    results = run_distributed(_load_fresh, 2, PP2, path, 2)           # resume on pp=2
    # dp=2 x tp=2: each rank's loss is its replica's; the serial loss is their mean
    losses = [sum(r[0][i] for r in first) / 4 for i in range(2)]
    losses += next(r[3] for r in results if r[3][0] is not None)
    for a, b in zip(straight_losses, losses):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (straight_losses, losses)
    resumed = _merge(r[4] for r in results)
    assert set(resumed) == set(straight)
    for key, value in straight.items():
        assert max_rel_diff(resumed[key].float(), value.float()) <= 1e-5, key


# ---------------------------------------------------------------------- atomicity
def _killed_save(rank, path):
    """Load, step once more, then die after DCP wrote this rank's shards into the tmp
    directory but before the side files and the rename."""
    engine = _engine()
    checkpoint.load(path, engine)
    _steps(engine, 1)

    def die():
        os._exit(17)

    S.rng_state = die
    checkpoint.save(path, engine)


def test_save_killed_mid_write_leaves_previous_checkpoint_loadable(tmp_path):
    path = str(tmp_path / 'ckpt')
    saved = _merge(s for _, s in run_distributed(_train_and_save, 2, TP2, path, 2))
    with pytest.raises(Exception, match='exited with code 17'):
        run_distributed(_killed_save, 2, TP2, path)
    partial = glob.glob(path + '.tmp-*')
    assert len(partial) == 1 and glob.glob(os.path.join(partial[0], '*.distcp'))
    assert not os.path.exists(os.path.join(partial[0], 'common.pt'))
    extra, step, loaded, _, _ = run_distributed(_load_fresh, 1, SERIAL, path)[0]
    assert step == 2
    _assert_equal_states(saved, loaded)
    run_distributed(_train_and_save, 1, SERIAL, path, 1)   # the next save to the same path
    assert glob.glob(path + '.tmp-*') == []                 # removes what the crash left
    assert run_distributed(_load_fresh, 1, SERIAL, path)[0][1] == 1


def _failing_save(rank, path, where, async_save):
    """One more step, then a save whose rank 1 raises: in its side files, or in DCP's write
    of its shards. Every rank's error as text."""
    engine = _engine()
    _steps(engine, 1)
    if rank == 1 and where == 'side files':
        def broken():
            raise OSError(28, 'no space left on device (test)')
        S.rng_state = broken
    elif rank == 1:
        def broken(self, plan, planner):
            raise OSError(28, 'no space left on device (test)')
        dcp.FileSystemWriter.write_data = broken
    try:
        handle = checkpoint.save(path, engine, async_save=async_save)
        if handle is not None:
            handle.wait()
    except (Exception, dcp.CheckpointException) as err:   # DCP's is a BaseException
        return f'{type(err).__name__}: {err}'
    return 'saved'


@pytest.mark.parametrize('where, async_save', [
    ('side files', False), ('shards', False), ('side files', True), ('shards', True)])
def test_a_failed_save_raises_on_every_rank_and_removes_its_tmp_dir(tmp_path, where, async_save):
    path = str(tmp_path / 'ckpt')
    run_distributed(_train_and_save, 2, TP2, path, 2)
    before = sorted(os.listdir(path))
    errors = run_distributed(_failing_save, 2, TP2, path, where, async_save, timeout=120)
    assert all(e != 'saved' for e in errors), errors
    assert 'no space left on device (test)' in errors[1], errors
    if where == 'side files':   # rank 0 did its part: it names the rank that failed
        assert errors[0].startswith('RuntimeError: checkpoint save failed while writing ') \
            and 'on rank(s) [1]' in errors[0], errors
    assert glob.glob(path + '.tmp-*') == [] and sorted(os.listdir(tmp_path)) == ['ckpt']
    assert sorted(os.listdir(path)) == before
    from colossal_lite import run_state
    assert run_state.saved_step(path) == 2


def test_load_of_a_missing_or_incomplete_directory_names_it(tmp_path):
    engine_error = run_distributed(_load_error, 1, SERIAL, str(tmp_path / 'nope'))[0]
    assert 'is not a complete checkpoint' in engine_error and 'nope' in engine_error


def _load_error(rank, path):
    try:
        checkpoint.load(path, _engine())
    except FileNotFoundError as e:
        return str(e)
    return 'no error'
