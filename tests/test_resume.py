"""Resuming a run: the data loader's position, the job's checkpoints (`colossal-lite train`
with a `checkpoint` section, `--resume DIR`, `--max-restarts N`) and async saves.

A resumed run must read exactly the batches the uninterrupted run reads and end with
bit-identical losses and parameters (same layout) or within fp32 tolerance (another
layout).
"""
import pytest
import torch
from torch.utils.data import TensorDataset

import colossal_lite as clt
from colossal_lite import checkpoint
from colossal_lite.data import DataParallelLoader
from colossal_lite.testing import make_optimizer, run_distributed
from tests.model_cases import make_case

N = 50                                   # samples; 6 global batches of 8 per epoch, 2 left over


def _dataset():
    return TensorDataset(torch.arange(N), torch.arange(N) * 10)


def _global_batches(loader_of_rank, data_size, passes, skip=0, state=None):
    """The global batches (data ranks' slices joined in rank order) of ``passes`` passes;
    ``state``: a position loaded first; ``skip``: batches drawn and dropped first."""
    loaders = [loader_of_rank(r) for r in range(data_size)]
    if state is not None:
        for loader in loaders:
            loader.load_state_dict(state)
    out = []
    for _ in range(passes):
        for slices in zip(*loaders):
            out.append(torch.cat([s[0] for s in slices]).tolist())
    return out[skip:]


def _loader(batch, data_size, seed=3):
    return lambda rank: DataParallelLoader(_dataset(), batch, seed=seed, data_rank=rank,
                                           data_size=data_size)


@pytest.mark.parametrize('taken', [0, 4, 6, 9])   # start, mid-epoch, epoch end, epoch 2
def test_a_loaded_position_continues_the_same_batches(taken):
    straight = _global_batches(_loader(8, 1), 1, 3)
    first = _loader(8, 1)(0)
    it, drawn = iter(first), 0
    while drawn < taken:
        try:
            next(it)
            drawn += 1
        except StopIteration:
            it = iter(first)
    state = first.state_dict()
    assert state['seed'] == 3 and state['samples'] % 8 == 0
    resumed = _global_batches(_loader(8, 1, seed=0), 1, 2, state=state)  # the seed is restored
    assert resumed == straight[taken:taken + len(resumed)]
    assert len(resumed) >= 6


@pytest.mark.parametrize('batch, data_size', [(8, 2), (8, 4), (4, 4)])
def test_the_position_carries_over_to_another_data_parallel_size(batch, data_size):
    """Saved on dp=2 (global batch 8) after 4 batches = 32 samples: dp=4 (or a global batch
    of 4 that divides 32) reads the same samples in the same order from there on."""
    first = [_loader(8, 2)(r) for r in range(2)]
    for loader in first:
        it = iter(loader)
        for _ in range(4):
            next(it)
    state = first[0].state_dict()
    assert state == first[1].state_dict() and state['samples'] == 32
    straight = sum(_global_batches(_loader(8, 1), 1, 2), [])
    resumed = sum(_global_batches(_loader(batch, data_size), data_size, 1, state=state), [])
    assert resumed == straight[32:48]


def test_a_position_that_cannot_carry_over_names_both_sizes():
    first = _loader(8, 2)(0)
    it = iter(first)
    for _ in range(3):
        next(it)                                            # 24 samples
    with pytest.raises(ValueError, match=r'24 samples into epoch 0, saved with global batch 8 '
                                         r'on data-parallel size 2\) .* global batches of 16 '
                                         r'\(data-parallel size 4\)'):
        _loader(16, 4)(0).load_state_dict(first.state_dict())
    with pytest.raises(ValueError, match='over 50 samples, .* has 40'):
        DataParallelLoader(TensorDataset(torch.arange(40)), 8, data_rank=0,
                           data_size=1).load_state_dict(first.state_dict())


# ------------------------------------------------------------ through checkpoint.save / load
def _engine():
    case = make_case('gpt', batch=8, seq=16)
    model = case.build(layers=1, dropout=0.0)
    engine, *_ = clt.initialize(model, make_optimizer(model.parameters()), case.criterion())
    return engine


def _save_position(rank, path, batches):
    loader = DataParallelLoader(_dataset(), 8, seed=3)
    it = iter(loader)
    for _ in range(batches):
        next(it)
    checkpoint.save(path, _engine(), dataloader=loader)


def _load_position(rank, path, batch):
    loader = DataParallelLoader(_dataset(), batch)
    try:
        checkpoint.load(path, _engine(), dataloader=loader)
    except ValueError as err:
        return str(err)
    return [next(iter(loader))[0].tolist()]


def test_checkpoints_carry_the_position_to_another_data_size_or_name_why_not(tmp_path):
    path = str(tmp_path / 'ckpt')
    run_distributed(_save_position, 2, {}, path, 2)              # dp=2, 16 samples read
    straight = sum(_global_batches(_loader(8, 1), 1, 1), [])
    slices = run_distributed(_load_position, 4, {}, path, 8)     # dp=4
    assert sum((s[0] for s in slices), []) == straight[16:24]
    errors = run_distributed(_load_position, 2, {}, path, 12)    # 16 % 12: on every rank, no hang
    assert all('not a whole number of this loader\'s global batches of 12' in e for e in errors)


# ------------------------------------------------------------ the job: save, --resume
JOB = """
imports = ['model_zoo']
model = dict(type='gpt', preset='tiny', hidden=32, layers=2, heads=4, max_positions=16, dropout=0.0)
data = dict(type='shakespeare', seq_len=16, val_fraction=0.05, plays=['macbeth'])
train = dict(global_batch_size=8, steps=8, log_every=4, eval_batches=1)
optimizer = dict(type='adamw', lr=1e-2)
lr_scheduler = dict(type='constant', warmup_steps=6)    # a lost scheduler state shows
checkpoint = dict(path={ckpt!r}, interval=4)
"""
DP_TP_PP_AMP = ("parallel = dict(pipeline=2, tensor=dict(size=2, mode='1d'))\n"
                "num_microbatches = 2\nfp16 = dict(mode='naive')\n", 8)   # dp=2 x pp=2 x tp=2
DP_TP = ("parallel = dict(tensor=dict(size=2, mode='1d'))\n", 4)        # dp=2 x tp=2
PP2 = ('parallel = dict(pipeline=2)\nnum_microbatches = 2\n', 2)
ZERO = ('zero = dict(stage={stage})\n', 2)                              # dp=2


def _job(tmp_path, name, layout, ckpt):
    """(config path, config dict, world size) of JOB under ``layout``, saving to ``ckpt``."""
    from colossal_lite import cli
    text, world = layout
    path = tmp_path / f'{name}.py'
    path.write_text(JOB.format(ckpt=str(ckpt)) + text)
    settings, _, _ = cli.check_job(str(path), world, None)
    return str(path), settings.to_dict(), world


def _train_job(rank, config_path, steps, resume=None):
    from colossal_lite.context import global_context as gpc
    from colossal_lite.worker import train
    spec = gpc.settings.job.with_steps(steps)
    return train(gpc.settings, spec, resume=resume, config_path=config_path)['losses']


def _run(job, steps, resume=None):
    path, cfg, world = job
    return run_distributed(_train_job, world, cfg, path, steps, resume, timeout=400)


def _saved(path):
    """Every tensor of a checkpoint directory at its full shape (read here, serially)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    reader = dcp.FileSystemReader(str(path))
    meta = reader.read_metadata().state_dict_metadata
    flat = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
            if isinstance(m, TensorStorageMetadata)}
    dcp.load(flat, storage_reader=reader)
    assert any(k.endswith('exp_avg_sq') for k in flat) and any(k.startswith('model.') for k in flat)
    return flat


def _resumed_equals_straight(tmp_path, layout, resume_layout=None):
    """8 straight steps vs 4 steps + save + --resume for 4 more (under ``resume_layout``):
    (straight losses, resumed losses per rank, straight final state, resumed final state)."""
    straight = _run(_job(tmp_path, 'straight', layout, tmp_path / 'a'), 8)
    first = _run(_job(tmp_path, 'first', layout, tmp_path / 'b'), 4)
    assert torch.load(tmp_path / 'b' / 'common.pt', weights_only=True)['extra']['config_path'] \
        == str(tmp_path / 'first.py')                    # job_extra: the job rebuilds from it
    second = _job(tmp_path, 'second', resume_layout or layout, tmp_path / 'c')
    resumed = _run(second, 8, str(tmp_path / 'b'))
    return straight, first, resumed, _saved(tmp_path / 'a'), _saved(tmp_path / 'c')


@pytest.mark.parametrize('layout', [DP_TP_PP_AMP, (ZERO[0].format(stage=1), 2),
                                    (ZERO[0].format(stage=2), 2)],
                         ids=['dp2-pp2-tp2-fp16', 'zero1-dp2', 'zero2-dp2'])
def test_save_and_resume_equals_the_uninterrupted_job_bit_for_bit(tmp_path, layout):
    straight, first, resumed, a, c = _resumed_equals_straight(tmp_path, layout)
    for s, f, r in zip(straight, first, resumed):
        assert s == f + r, (s, f, r)                    # every rank's losses, bitwise
    assert set(a) == set(c)
    for key in a:
        assert torch.equal(a[key], c[key]), key


def test_resume_under_another_layout_matches_within_fp32_tolerance(tmp_path):
    """Saved on dp=2 x tp=2 after 4 steps, resumed on pp=2 (data position: dp=2 -> dp=1)."""
    from colossal_lite.testing import max_rel_diff
    straight, first, resumed, a, c = _resumed_equals_straight(tmp_path, DP_TP, PP2)
    losses = first[0] + resumed[-1]                      # the last stage holds the loss
    assert losses == pytest.approx(straight[0], rel=1e-5, abs=1e-6)
    assert set(a) == set(c)
    for key in a:
        assert max_rel_diff(c[key].float(), a[key].float()) <= 1e-5, key


# ------------------------------------------------------------ --max-restarts
def test_a_killed_worker_is_restarted_and_resumes_to_the_uninterrupted_loss(tmp_path):
    """`colossal-lite train --max-restarts 1` on dp=2; rank 1 SIGKILLs itself after step 6 of
    the first attempt (COLOSSAL_LITE_TEST_KILL, run_state.py); the agent restarts the group,
    which resumes from the step-4 checkpoint (an async save, completed after step 5) and
    ends where the uninterrupted run (synchronous saves) ends."""
    import json
    import os
    import subprocess
    import sys
    async_ckpt = (f"checkpoint = dict(path={str(tmp_path / 'ckpt')!r}, interval=4, "
                  f"async_save=True)\n")
    job = _job(tmp_path, 'job', (async_ckpt, 2), tmp_path / 'ckpt')   # written during step 5
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=repo, OMP_NUM_THREADS='1', COLOSSAL_LITE_TEST_KILL='1:6')
    run = subprocess.run([sys.executable, '-m', 'colossal_lite.cli', 'train', job[0], '--nproc',
                          '2', '--max-restarts', '1'], cwd=str(tmp_path), env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count('model: gpt') == 2                  # two attempts
    records = [json.loads(line) for line in open(tmp_path / 'metrics.jsonl')]
    steps = [r['step'] for r in records if 'loss' in r]
    assert steps == [5, 6, 7, 8]                                # the restart resumed at step 4
    straight = _run(_job(tmp_path, 'straight', ('', 2), tmp_path / 'a'), 8)[0]
    assert [r['loss'] for r in records if 'loss' in r] == straight[4:]
    final = _saved(tmp_path / 'ckpt')
    for key, value in _saved(tmp_path / 'a').items():
        assert torch.equal(final[key], value), key


def test_resume_and_restart_arguments_are_checked_before_the_start(tmp_path):
    from colossal_lite import cli
    from colossal_lite.config import ConfigError
    path, _, _ = _job(tmp_path, 'job', ('', 1), tmp_path / 'ckpt')
    with pytest.raises(FileNotFoundError, match='is not a complete checkpoint'):
        cli.check_job(path, 1, None, resume=str(tmp_path / 'nothing'))
    (tmp_path / 'bad.py').write_text(open(path).read() + "checkpoint = dict(path='x', "
                                                          "async_save='yes')\n")
    with pytest.raises(ConfigError, match="'checkpoint.async_save' must be True or False"):
        cli.check_job(str(tmp_path / 'bad.py'), 1, None)
    with pytest.raises(ConfigError, match='--max-restarts must be >= 0, got -1'):
        cli.check_job(path, 1, None, max_restarts=-1)
    _run(_job(tmp_path, 'job', ('', 1), tmp_path / 'ckpt'), 2)
    with pytest.raises(ConfigError, match='saved at step 2: nothing is left of the 2 steps'):
        cli.check_job(path, 1, 2, resume=str(tmp_path / 'ckpt'))
    assert cli.main(['train', path, '--steps', '2', '--resume', str(tmp_path / 'ckpt')]) == 2


# ------------------------------------------------------------ async save
def _async_saves(rank, path):
    """Async save after 1 step; a second step before the wait (the staged copy must not see
    it); the directory appears only at wait(). A second async save completes the first."""
    import os
    from colossal_lite.checkpoint import state as S
    from colossal_lite.testing import engine_step, replica_batch
    engine = _engine()
    batch = replica_batch(make_case('gpt', batch=8, seq=16).batch)
    engine_step(engine, batch)
    at_save = {k: v.detach().clone() for k, v in S.tensor_state(engine).items()}
    handle = checkpoint.save(path, engine, async_save=True)
    engine_step(engine, batch)                          # training goes on meanwhile
    seen_before = os.path.exists(path)
    handle.wait()
    seen_after = os.path.exists(os.path.join(path, 'common.pt'))
    first = _engine()
    checkpoint.load(path, first)
    first_loaded = S.tensor_state(first)
    after_two = {k: v.detach().clone() for k, v in S.tensor_state(engine).items()}
    second = checkpoint.save(path, engine, async_save=True)
    engine_step(engine, batch)
    fresh = _engine()
    checkpoint.load(path, fresh)                        # completes the second save first
    loaded = S.tensor_state(fresh)
    return seen_before, seen_after, second.done, at_save, after_two, loaded, first_loaded


def _reload(rank, path):
    from colossal_lite.checkpoint import state as S
    fresh = _engine()
    checkpoint.load(path, fresh)
    return S.tensor_state(fresh)


def test_an_async_save_appears_complete_only_after_wait_and_holds_the_state_at_save(tmp_path):
    path = str(tmp_path / 'ckpt')
    results = run_distributed(_async_saves, 2, dict(parallel=dict(tensor=dict(size=2, mode='1d'))),
                              path, timeout=300)
    for seen_before, seen_after, second_done, at_save, after_two, loaded, first in results:
        assert not seen_before and seen_after and second_done
        for key, value in at_save.items():              # not the step taken during the write
            assert torch.equal(first[key], value), key
        assert set(loaded) == set(after_two)
        for key, value in after_two.items():
            assert torch.equal(loaded[key], value), key
    assert any(not torch.equal(a, b) for a, b in zip(results[0][3].values(),
                                                      results[0][4].values()))
    first = run_distributed(_reload, 1, {}, path)[0]
    for key, value in results[0][4].items():
        assert torch.equal(first[key], value), key


def test_the_cli_resumes_on_another_process_count(tmp_path):
    """`colossal-lite train job.py --nproc 2 --steps 4`, then `--nproc 1 --steps 8 --resume`
    (dp=2 -> dp=1, the data position carried over): steps 5-8 match the uninterrupted dp=2
    run within fp32 tolerance."""
    import json
    from colossal_lite import cli
    from colossal_lite.testing import max_rel_diff
    first, _, _ = _job(tmp_path, 'first', ('', 2), tmp_path / 'b')
    assert cli.main(['train', first, '--nproc', '2', '--steps', '4']) == 0
    second, _, _ = _job(tmp_path, 'second', ('', 1), tmp_path / 'c')
    assert cli.main(['train', second, '--steps', '8', '--resume', str(tmp_path / 'b')]) == 0
    records = [json.loads(line) for line in open(tmp_path / 'metrics.jsonl')]
    losses = [r['loss'] for r in records if 'loss' in r]
    assert [r['step'] for r in records if 'loss' in r] == [5, 6, 7, 8]
    straight = _run(_job(tmp_path, 'straight', ('', 2), tmp_path / 'a'), 8)[0]
    assert losses == pytest.approx(straight[4:], rel=1e-5)
    a, c = _saved(tmp_path / 'a'), _saved(tmp_path / 'c')
    for key in a:
        assert max_rel_diff(c[key].float(), a[key].float()) <= 1e-5, key
