"""The `colossal-lite train` command: config checks before any process starts, a dp=2 x tp=2
run whose printed losses equal the serial model's, and a failing rank that ends the job."""
import os
import re
import subprocess
import sys

import pytest
import torch

from colossal_lite import cli
from colossal_lite.config import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = """
parallel = dict(tensor=dict(size=2, mode='1d'))
model = dict(type='gpt', preset='tiny', hidden=32, layers=1, heads=4, max_positions=16, dropout=0.0)
data = dict(type='shakespeare', seq_len=16, val_fraction=0.05, plays=['macbeth'])
train = dict(global_batch_size=8, steps=4, log_every=2, eval_batches=2)
optimizer = dict(type='adamw', lr=1e-2)
"""


def _write(tmp_path, text, name='job.py'):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize('edit, nproc, message', [
    (("type='shakespeare'", "type='digits'"), 4, "model type 'gpt' trains on data type 'shakespeare'"),
    (('hidden=32', 'hiden=32'), 4, "unknown GPT options \\['hiden'\\]"),
    (('steps=4', 'steps=0'), 4, "'train.steps' must be an integer in \\[1, .*got 0"),
    (('global_batch_size=8', 'global_batch_size=6'), 8, 'divisible by the data-parallel size 4'),
    (('', ''), 3, 'divisible by pipeline\\*tensor = 1\\*2 = 2, got world size 3'),
    (("type='adamw'", "type='lamb'"), 4, "'optimizer.type' must be one of"),
])
def test_bad_jobs_fail_before_any_process_starts(tmp_path, edit, nproc, message):
    path = _write(tmp_path, TINY.replace(*edit))
    with pytest.raises(ConfigError, match=message):
        cli.check_job(path, nproc, None)
    assert cli.main(['train', path, '--nproc', str(nproc)]) == 2


def _serial_losses(steps):
    """The same job without any launch: one process, the whole global batch."""
    from colossal_lite.data import DataParallelLoader, text_datasets
    from colossal_lite.job import build_model, parse_job
    from colossal_lite.config import load_config
    from model_zoo import GPTLMLoss
    spec = parse_job(load_config({k: v for k, v in _tiny_namespace().items()}))
    torch.manual_seed(1024)                      # launch()'s default seed
    model = build_model(spec.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train, _ = text_datasets(16, 0.05, ['macbeth'])
    losses, batches = [], iter(DataParallelLoader(train, 8, seed=0, data_rank=0, data_size=1))
    for _ in range(steps):
        ids, labels = next(batches)
        opt.zero_grad()
        loss = GPTLMLoss()(model(ids), labels)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _tiny_namespace():
    names = {}
    exec(TINY, names)
    return {k: v for k, v in names.items() if not k.startswith('_')}


def test_dp2_tp2_run_prints_the_serial_losses_and_the_report(tmp_path):
    path = _write(tmp_path, TINY)
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS='1')
    run = subprocess.run([sys.executable, '-m', 'colossal_lite.cli', 'train', path, '--nproc', '4'],
                         cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=280)
    out = run.stdout
    assert run.returncode == 0, run.stdout + run.stderr
    serial = _serial_losses(4)
    printed = [float(x) for x in re.findall(r'^step=\d+ epoch=0 loss=([\d.]+)', out, re.M)]
    assert printed == pytest.approx([serial[1], serial[3]], abs=1e-3)
    first, last = map(float, re.search(r'first_loss=([\d.]+) last_loss=([\d.]+)', out).groups())
    assert (first, last) == pytest.approx((serial[0], serial[3]), abs=1e-4)
    assert re.search(r'peak memory per rank \(MiB\): rank 0: \d+, rank 1: \d+, rank 2: \d+, '
                     r'rank 3: \d+', out)
    comm = dict((k, float(v)) for k, v in re.findall(r'(\w+): ([\d.]+) MiB', out))
    assert comm == pytest.approx(_expected_mib(), abs=0.006)
    assert re.search(r'throughput: [\d.]+ tokens/s', out) and 'evaluation: test_loss=' in out


def _expected_mib(ranks=4, steps=4, eval_batches=2, b=4, s=16, h=32, layers=1, vocab=256,
                  positions=16, p=2):
    """docs/cli_and_data.md's byte formulas for TINY (dp=2 x 1D tp=2), summed over ranks."""
    act, ce = 4 * b * s * h, 3 * 4 * b * s
    tp = steps * (act * (3 + 6 * layers) + ce) + eval_batches * (act * (2 + 2 * layers) + ce)
    block = 4 * h + 3 * (h * h + h) // p + h * h // p + h + 2 * (4 * h * h // p) + 4 * h // p + h
    local_params = (vocab + positions) * h // p + layers * block + 2 * h
    data = steps * (4 * local_params + 8) + 16
    return {'DATA': ranks * data / 2 ** 20, 'PARALLEL_1D': ranks * tp / 2 ** 20}


def failing_worker(config_path, steps):
    from colossal_lite.communication import all_reduce
    from colossal_lite.context import ParallelMode
    from colossal_lite.launch import launch_from_torch
    launch_from_torch(config_path, backend='gloo')
    if int(os.environ['RANK']) == 1:
        raise RuntimeError('rank one fails on purpose')
    all_reduce(torch.ones(1), ParallelMode.GLOBAL)    # the others would wait here forever


def test_a_failing_rank_ends_every_process_and_is_named(tmp_path, capsys):
    args = cli._parser().parse_args(['train', _write(tmp_path, TINY), '--nproc', '4'])
    assert cli.train_command(args, entrypoint=failing_worker) == 1
    err = capsys.readouterr().err
    assert 'rank 1 failed first: RuntimeError: rank one fails on purpose' in err
    assert 'every process was ended' in err


BASE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'configs',
                    '_gpt_shakespeare.py')


@pytest.mark.parametrize('body, nproc, message', [
    ("parallel = dict(tensor=dict(size=8, mode='3d'))\ntrain = dict(global_batch_size=6)", 8,
     "splits each replica's batch of 6 (global batch / data size) 4 ways"),
    ("parallel = dict(tensor=dict(size=4, mode='sequence'))\n"
     "data = dict(type='shakespeare', seq_len=66)", 4, "needs 'data.seq_len' divisible by 4, got 66"),
    ("zero = dict()", 1, "'zero' and 'parallel.pipeline' > 1 are not implemented yet"),
    ("optimizer = dict(type='adamw', betas=(0.9,))", 1, "'optimizer.betas' must be two numbers"),
    ("data = dict(type='shakespeare', plays=['nope'])", 1, "'data.plays': unknown plays ['nope']"),
    ("checkpoint = dict(interval=5)", 1, "'checkpoint.path' must be a file name"),
    ("gradient_handler = dict(bucket_mb=-1)", 1, "'gradient_handler.bucket_mb' must be a positive"),
])
def test_layout_and_job_mismatches_fail_before_any_process(tmp_path, body, nproc, message):
    path = tmp_path / 'job.py'
    path.write_text(f"_base_ = {BASE!r}\n{body}\n")
    with pytest.raises(ConfigError) as info:
        cli.check_job(str(path), nproc, None)
    assert message in str(info.value)
