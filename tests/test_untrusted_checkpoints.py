"""A checkpoint is data: loading one never runs code from it (colossal_lite/checkpoint/files.py).

A pickle that would run a command (``__reduce__`` -> ``os.system('touch MARKER')``) planted in
``common.pt``, ``rng_0.pt`` or DCP's ``.metadata`` of a real job checkpoint is refused, with
an error naming the file, by every path that reads it -- ``colossal-lite eval``,
``generate``, ``train --resume`` (the parent), the worker's resume and ``load_model`` -- and
the marker never appears. The side files are written in the form
``torch.load(weights_only=True)`` reads; a checkpoint of the earlier format (RNG streams keyed
by ``ParallelMode``) is refused until ``checkpoint.upgrade`` rewrites it. A crash between the
two renames of a save's commit leaves the previous checkpoint at ``dir.old-<uuid>``, which
``load`` and the resume checks find.
"""
import collections
import glob
import os
import pickle
import re
import shutil

import pytest
import torch

import colossal_lite as clt
from colossal_lite import checkpoint
from colossal_lite.checkpoint import UnsafeCheckpointError
from colossal_lite.checkpoint import files as F
from colossal_lite.checkpoint import state as S
from colossal_lite.testing import engine_step, make_optimizer, replica_batch, run_distributed
from tests.model_cases import make_case

JOB = """
model = dict(type='gpt', preset='tiny', hidden=16, layers=1, heads=2, max_positions=16, dropout=0.0)
data = dict(type='shakespeare', seq_len=16, val_fraction=0.05, plays=['macbeth'])
train = dict(global_batch_size=8, steps=2, log_every=1, eval_batches=1)
optimizer = dict(type='adamw', lr=1e-2)
checkpoint = dict(path={ckpt!r}, interval=2)
"""


class _Boom:
    """Runs ``touch marker`` when unpickled by a loader that runs code."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f'touch {self.marker}',)


def _train_job(rank, config_path, steps, resume=None):
    from colossal_lite.context import global_context as gpc
    from colossal_lite.worker import train
    spec = gpc.settings.job.with_steps(steps)
    return train(gpc.settings, spec, resume=resume, config_path=config_path)['losses']


@pytest.fixture(scope='module')
def job(tmp_path_factory):
    """(config path, config dict, a complete checkpoint of the job after 2 steps)."""
    from colossal_lite import cli
    folder = tmp_path_factory.mktemp('job')
    ckpt = str(folder / 'ckpt')
    path = folder / 'job.py'
    path.write_text(JOB.format(ckpt=ckpt))
    settings, _, _ = cli.check_job(str(path), 1, None)
    run_distributed(_train_job, 1, settings.to_dict(), str(path), 2, timeout=300)
    return str(path), settings.to_dict(), ckpt


def _copy(job, tmp_path):
    """A fresh copy of the job's checkpoint and a config that resumes 1 step past it."""
    path, cfg, ckpt = job
    copy = str(tmp_path / 'ckpt')
    shutil.copytree(ckpt, copy)
    return path, cfg, copy


def _plant(file, marker, key):
    """Rewrite ``file`` (a side file) with a live ``_Boom`` under ``key``; check it is live."""
    state = torch.load(file, weights_only=True)
    state[key] = _Boom(marker)
    torch.save(state, file)
    torch.load(file, weights_only=False)  # the old reading ran it
    assert os.path.exists(marker)
    os.remove(marker)


def _cli(argv, capfd):
    from colossal_lite import cli
    capfd.readouterr()
    code = cli.main(argv)
    return code, capfd.readouterr().err


def test_side_files_are_plain_data(job):
    _, _, ckpt = job
    common = torch.load(os.path.join(ckpt, 'common.pt'), weights_only=True)
    rng = torch.load(os.path.join(ckpt, 'rng_0.pt'), weights_only=True)
    assert common['global_step'] == 2 and isinstance(common['extra']['config'], dict)
    assert set(rng) == {'cpu', 'cuda', 'modes'} and 'data' in rng['modes']
    assert F.SafeReader(ckpt).read_metadata().state_dict_metadata  # the index, as data


def test_a_planted_pickle_in_common_pt_is_refused_by_eval_generate_and_resume(
        job, tmp_path, capfd):
    path, cfg, ckpt = _copy(job, tmp_path)
    marker = str(tmp_path / 'ran')
    _plant(os.path.join(ckpt, 'common.pt'), marker, 'evil')
    refused = re.escape(os.path.join(ckpt, 'common.pt')) + r': refused: reading it needs the ' \
        r'Python object (posix|os)\.system'
    for argv in (['eval', ckpt], ['generate', ckpt, '--prompt', 'a', '--tokens', '1'],
                 ['export', ckpt, '--hf', str(tmp_path / 'hf')],
                 ['train', path, '--steps', '3', '--resume', ckpt]):
        code, err = _cli(argv, capfd)
        assert code == 2 and re.search(refused, err), (argv, err)
    with pytest.raises(Exception, match=refused):  # the worker's resume (checkpoint.load)
        run_distributed(_train_job, 1, cfg, path, 3, ckpt, timeout=300)
    assert not os.path.exists(marker)


def _must_not_run(*args):
    raise AssertionError('a worker started for a checkpoint the parent refused')


def test_train_resume_blames_the_checkpoint_not_the_config(job, tmp_path, capfd, monkeypatch):
    """``train --resume`` on a refused or unreadable ``common.pt``: exit 2 naming the
    checkpoint file (not "bad config"), nothing run -- no worker, no data prepared."""
    from colossal_lite import cli
    path, _, ckpt = _copy(job, tmp_path)
    common = os.path.join(ckpt, 'common.pt')
    good = open(common, 'rb').read()
    marker = str(tmp_path / 'ran')
    _plant(common, marker, 'evil')
    started = []
    monkeypatch.setattr(cli, 'run_workers', lambda *a, **k: started.append(a))
    monkeypatch.setattr(cli, 'prepare_data', lambda *a, **k: started.append(a))

    def train():
        capfd.readouterr()
        args = cli._parser().parse_args(['train', path, '--steps', '3', '--resume', ckpt])
        code = cli.train_command(args, entrypoint=_must_not_run)
        return code, capfd.readouterr().err

    code, err = train()
    assert code == 2 and 'bad config' not in err and path not in err, err
    assert re.search(r'refused the checkpoint of --resume .* as untrusted, nothing was run: '
                     + re.escape(common) + r': refused: reading it needs the Python object '
                     r'(posix|os)\.system', err), err
    for broken in (b'', good[:len(good) // 2]):     # empty, truncated
        with open(common, 'wb') as f:
            f.write(broken)
        code, err = train()
        assert code == 2 and 'bad config' not in err and path not in err, err
        assert re.search(r'cannot resume from --resume .*, nothing was run: '
                         + re.escape(common) + r': unreadable \((EOFError|RuntimeError)', err), err
    shutil.rmtree(ckpt)
    code, err = train()
    assert code == 2 and 'bad config' not in err and 'is not a complete checkpoint' in err, err
    assert started == [] and not os.path.exists(marker)


def test_a_planted_pickle_in_an_rng_file_is_refused_on_resume(job, tmp_path):
    path, cfg, ckpt = _copy(job, tmp_path)
    marker = str(tmp_path / 'ran')
    _plant(os.path.join(ckpt, 'rng_0.pt'), marker, 'evil')
    refused = re.escape(os.path.join(ckpt, 'rng_0.pt')) + r': refused: reading it needs the ' \
        r'Python object (posix|os)\.system'
    with pytest.raises(Exception, match=refused):  # same layout: the RNG states are read
        run_distributed(_train_job, 1, cfg, path, 3, ckpt, timeout=300)
    assert not os.path.exists(marker)


def test_a_planted_index_is_refused_by_load_model(job, tmp_path):
    from colossal_lite.checkpoint.job import job_settings
    from colossal_lite.job import build_model
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    _, _, ckpt = _copy(job, tmp_path)
    index, marker = os.path.join(ckpt, '.metadata'), str(tmp_path / 'ran')
    good = open(index, 'rb').read()
    model = build_model(job_settings(ckpt).job)
    with open(index, 'wb') as f:
        pickle.dump(_Boom(marker), f)
    with pytest.raises(UnsafeCheckpointError, match=re.escape(index) + r': refused: reading it '
                       r'needs the Python object (posix|os)\.system'):
        checkpoint.load_model(ckpt, model)
    assert not os.path.exists(marker)
    meta = pickle.loads(good)       # a valid index whose entry DCP would torch.load unsafely
    meta.state_dict_metadata['model.wte.weight'] = BytesStorageMetadata()
    with open(index, 'wb') as f:
        pickle.dump(meta, f)
    with pytest.raises(UnsafeCheckpointError, match="entry 'model.wte.weight' is a "
                                                    "BytesStorageMetadata"):
        checkpoint.load_model(ckpt, model)


def _old_format(file):
    """The earlier writer's RNG file: streams keyed by ParallelMode objects."""
    from colossal_lite.context import ParallelMode
    state = torch.load(file, weights_only=True)
    state['modes'] = {ParallelMode(k): tuple(v) for k, v in state['modes'].items()}
    torch.save(state, file)


def test_an_old_format_checkpoint_is_refused_until_upgraded(job, tmp_path):
    path, cfg, ckpt = _copy(job, tmp_path)
    rng = os.path.join(ckpt, 'rng_0.pt')
    _old_format(rng)
    with pytest.raises(Exception, match=re.escape(rng) + r': refused: reading it needs the '
                       r'Python object colossal_lite\.config\.modes\.ParallelMode.*'
                       r'checkpoint\.upgrade\(DIR\)'):
        run_distributed(_train_job, 1, cfg, path, 3, ckpt, timeout=300)
    assert checkpoint.upgrade(ckpt) == [rng] and checkpoint.upgrade(ckpt) == []
    assert len(run_distributed(_train_job, 1, cfg, path, 3, ckpt, timeout=300)[0]) == 1


def test_a_checkpoint_holds_plain_data_only():
    Point = collections.namedtuple('Point', 'x y')
    value = dict(a=Point(1, 2.0), b=collections.OrderedDict(c=[None, 'x', torch.ones(2)]))
    out = F.plain(value, 'extra')
    assert type(out['a']) is tuple and out['a'] == (1, 2.0) and type(out['b']) is dict
    assert out['b']['c'][:2] == [None, 'x'] and torch.equal(out['b']['c'][2], torch.ones(2))
    with pytest.raises(TypeError, match=r"extra\['b'\]\[1\] is a builtins.function: a "
                                        r'checkpoint holds data only'):
        F.plain(dict(b=[1, lambda: 0]), 'extra')


# ------------------------------------------------------------ a crash inside the commit
def _engine():
    case = make_case('gpt', batch=8, seq=16)
    model = case.build(layers=1, dropout=0.0)
    engine, *_ = clt.initialize(model, make_optimizer(model.parameters()), case.criterion())
    return engine, replica_batch(case.batch)


def _state(engine):
    return {k: v.detach().clone() for k, v in S.tensor_state(engine).items()}


def _crash_between_renames(rank, path, expected):
    """Save at step 2 (its state also to ``expected``); step again; a save whose commit dies
    after its first rename."""
    from colossal_lite.checkpoint import io
    engine, batch = _engine()
    for _ in range(2):
        engine_step(engine, batch)
    checkpoint.save(path, engine)
    torch.save(_state(engine), expected)
    engine_step(engine, batch)

    def first_rename_only(tmp, target):
        os.rename(target, f'{target}.old-crashed')
        os._exit(17)
    io._commit = first_rename_only
    checkpoint.save(path, engine)


def _load_and_save(rank, path):
    engine, batch = _engine()
    extra = checkpoint.load(path, engine)
    step, loaded = engine.global_step, _state(engine)
    other, _ = _engine()
    checkpoint.load_model(path, other.model)
    model = {k: v for k, v in _state(other).items() if k.startswith('model.')}
    engine_step(engine, batch)
    checkpoint.save(path, engine)        # a complete commit: the left-over old-* goes
    return extra, step, loaded, model


def test_a_crash_between_the_commits_renames_leaves_a_checkpoint_load_finds(tmp_path):
    from colossal_lite import run_state
    path, expected = str(tmp_path / 'ckpt'), str(tmp_path / 'expected.pt')
    with pytest.raises(Exception, match='exited with code 17'):
        run_distributed(_crash_between_renames, 1, {}, path, expected)
    assert not os.path.exists(path) and glob.glob(path + '.old-*') == [path + '.old-crashed']
    assert glob.glob(path + '.tmp-*')                 # the new one, never put in place
    assert run_state.is_complete(path) and run_state.saved_step(path) == 2
    extra, step, loaded, model = run_distributed(_load_and_save, 1, {}, path)[0]
    saved = torch.load(expected, weights_only=True)
    assert extra is None and step == 2 and any(k.endswith('exp_avg_sq') for k in saved)
    assert set(loaded) == set(saved) and all(torch.equal(loaded[k], saved[k]) for k in saved)
    assert model and all(torch.equal(v, saved[k]) for k, v in model.items())
    assert glob.glob(path + '.old-*') == [] and run_state.saved_step(path) == 3
    assert glob.glob(path + '.tmp-*') == []           # the crashed save's too
