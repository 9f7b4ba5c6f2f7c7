"""``Settings`` is the only reader of the user's config, and each section is parsed and
checked once per process.

* After ``load_config`` has built the settings, the ``Config`` class's every read accessor
  (and :func:`colossal_lite.config.snapshot`) is made to raise; a whole run -- launch on two
  ranks, a model built for a pipeline x ZeRO layout, ``initialize``, training steps through
  the job's builders and hooks, a checkpoint with the job's config -- still works.
* In a CLI parent (``cli.check_job``) and in a worker (``worker.worker_main`` under the
  environment ``torchrun`` sets), every registered section parser and every cross-section
  check (the ZeRO one included) runs exactly once.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from colossal_lite.testing import run_distributed
from colossal_lite.testing.distributed import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

JOB = textwrap.dedent("""\
    imports = ['model_zoo']
    parallel = dict(pipeline=dict(size=2, schedule='1f1b'))
    num_microbatches = 2
    zero = dict(stage=2)
    clip_grad_norm = 1.0
    fp16 = dict(mode='naive', dtype='bfloat16')
    model = dict(type='gpt', preset='tiny', hidden=16, layers=2, heads=2, max_positions=16)
    data = dict(type='shakespeare', seq_len=16, plays=['macbeth'])
    train = dict(global_batch_size=4, steps=2, log_every=1, run_dir={run_dir!r})
    optimizer = dict(type='adamw', lr=1e-3)
    checkpoint = dict(path={ckpt!r}, interval=1)
    """)

_READERS = ('__getitem__', 'get', 'items', 'keys', 'values', '__iter__', '__contains__',
            '__getattr__', '__len__', 'copy')


def _forbid_raw_reads(monkeypatch_like):
    """Make every read of a ``Config`` (and the snapshot) raise."""
    import colossal_lite.config.loader as loader

    def refuse(*args, **kwargs):
        raise AssertionError("the user's config was read after its Settings were built")
    for name in _READERS:
        monkeypatch_like(loader.Config, name, refuse)
    monkeypatch_like(loader, 'snapshot', refuse)


def _run_without_raw_reads(rank):
    """Launched by the harness with the job's config; forbid raw reads, then train two steps with a checkpoint through the CLI worker's ``train``."""
    from colossal_lite.context import global_context as gpc
    from colossal_lite.worker import train
    originals = []

    def patch(owner, name, value):
        originals.append((owner, name, owner.__dict__.get(name)))
        setattr(owner, name, value)
    _forbid_raw_reads(patch)
    try:
        result = train(gpc.settings)
    finally:
        for owner, name, value in reversed(originals):
            if value is None:
                delattr(owner, name)
            else:
                setattr(owner, name, value)
    return len(result['losses'])


def test_nothing_reads_the_users_dict_after_settings(tmp_path):
    path = tmp_path / 'job.py'
    path.write_text(JOB.format(run_dir=str(tmp_path / 'run'), ckpt=str(tmp_path / 'ckpt')))
    from colossal_lite.config import load_config
    config = load_config(str(path)).settings.to_dict()
    steps = run_distributed(_run_without_raw_reads, 2, config, timeout=240)
    assert steps == [2, 2]
    assert os.path.isfile(tmp_path / 'ckpt' / 'common.pt')


COUNTING = textwrap.dedent("""\
    import collections, json, sys
    from colossal_lite.config import registry
    calls = collections.Counter()

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper
    for section in registry.sections():
        registry.register_section(registry.Section(section.name, section.keys,
                                  counted(section.name, section.parse), section.lazy),
                                  replace=True)
    registry._CHECKS[:] = [counted('check:' + c.__name__, c) for c in registry._CHECKS]
    if sys.argv[1] == 'parent':
        from colossal_lite import cli
        cli.check_job(sys.argv[2], 2, None)
    else:
        from colossal_lite.worker import worker_main
        worker_main(sys.argv[2], steps=2)
    print('COUNTS ' + json.dumps(calls))
    """)


@pytest.mark.parametrize('side', ['parent', 'worker'])
def test_each_section_is_parsed_and_checked_once_per_process(tmp_path, side):
    from colossal_lite.config import registry
    path = tmp_path / 'job.py'
    path.write_text(JOB.format(run_dir=str(tmp_path / 'run'), ckpt=str(tmp_path / 'ckpt'))
                    .replace("parallel = dict(pipeline=dict(size=2, schedule='1f1b'))\n", ''))
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS='1', RANK='0', LOCAL_RANK='0',
               WORLD_SIZE='1', LOCAL_WORLD_SIZE='1', MASTER_ADDR='127.0.0.1',
               MASTER_PORT=str(free_port()))
    run = subprocess.run([sys.executable, '-c', COUNTING, side, str(path)], cwd=str(tmp_path),
                         env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    counts = json.loads(run.stdout.split('COUNTS ')[-1])
    expected = {s.name: 1 for s in registry.sections()}
    expected.update({'check:' + c.__name__: 1 for c in registry.checks()})
    assert counts == expected
