"""The `colossal-lite train` command: config checks before any process starts, a dp=2 x tp=2
run whose printed losses equal the serial model's, and a failing rank that ends the job."""
import contextlib
import os
import re
import subprocess
import sys

import pytest
import torch

from colossal_lite import cli
from colossal_lite.config import ConfigError
from colossal_lite.testing import run_distributed

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = """
parallel = dict(tensor=dict(size=2, mode='1d'))
model = dict(type='gpt', preset='tiny', hidden=32, layers=1, heads=4, max_positions=16, dropout=0.0)
data = dict(type='shakespeare', seq_len=16, val_fraction=0.05, plays=['macbeth'])
train = dict(global_batch_size=8, steps=4, log_every=2, eval_batches=2)
optimizer = dict(type='adamw', lr=1e-2)
"""


def _serial_job_losses(spec, train, steps, clip=None):
    """The job's model trained in this process on ``train`` (batches of 8, seed 0): losses."""
    from colossal_lite.data import DataParallelLoader
    from colossal_lite.job import build_criterion, build_model
    torch.manual_seed(1024)                       # launch()'s default seed
    model, loss_fn = build_model(spec), build_criterion(spec)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, batches = [], iter(DataParallelLoader(train, 8, seed=0, data_rank=0, data_size=1))
    for _ in range(steps):
        ids, labels = next(batches)
        opt.zero_grad()
        loss = loss_fn(model(ids), labels)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return losses


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
    spec = parse_job(load_config({k: v for k, v in _tiny_namespace().items()}).settings.to_dict())
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
    _check_dp2_tp2_run(tmp_path)


def _check_dp2_tp2_run(tmp_path, serial=None):
    """``colossal-lite train TINY --nproc 4`` in a fresh process: exit 0, the serial model's
    losses, the report. A hang fails at once with every process's stacks."""
    path = _write(tmp_path, TINY)
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS='1')
    cmd = [sys.executable, '-m', 'colossal_lite.cli', 'train', path, '--nproc', '4']
    run = _run_dumping_stacks_on_timeout(cmd, tmp_path, env, 140)
    out = run.stdout
    assert run.returncode == 0, run.stdout + run.stderr
    serial = serial or _serial_losses(4)
    printed = [float(x) for x in re.findall(r'^step=\d+ epoch=0 loss=([\d.]+)', out, re.M)]
    assert printed == pytest.approx([serial[1], serial[3]], abs=1e-3)
    first, last = map(float, re.search(r'first_loss=([\d.]+) last_loss=([\d.]+)', out).groups())
    assert (first, last) == pytest.approx((serial[0], serial[3]), abs=1e-4)
    assert re.search(r'peak memory per rank \(MiB\): rank 0: \d+, rank 1: \d+, rank 2: \d+, '
                     r'rank 3: \d+', out)
    comm = dict((k, float(v)) for k, v in re.findall(r'(\w+): ([\d.]+) MiB', out))
    assert comm == pytest.approx(_expected_mib(), abs=0.006)
    assert re.search(r'throughput: [\d.]+ tokens/s', out) and 'evaluation: test_loss=' in out


def _process_tree(pid):
    """``pid`` and all its descendants (from /proc), parents first."""
    children = {}
    for entry in filter(str.isdigit, os.listdir('/proc')):
        try:
            with open(f'/proc/{entry}/stat') as f:
                ppid = int(f.read().rsplit(')', 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    tree = [pid]
    for p in tree:
        tree += children.get(p, [])
    return tree


def _run_dumping_stacks_on_timeout(cmd, cwd, env, timeout):
    """``subprocess.run(cmd, capture_output=True, text=True)``; after ``timeout`` seconds the
    test fails: the command and every process under it print their Python stacks (SIGUSR1,
    see ``launcher.failures.stacks_on_sigusr1``), all are killed, and the failure shows
    what they printed (also kept in ``cwd/hang.txt``)."""
    import signal
    import time
    proc = subprocess.Popen(cmd, cwd=str(cwd), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    except subprocess.TimeoutExpired:
        tree = _process_tree(proc.pid)
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR1)
        time.sleep(3)
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        out, err = proc.communicate()
        report = f'hung after {timeout} s; processes {tree}\nstdout:\n{out}\nstderr:\n{err}'
        (cwd / 'hang.txt').write_text(report)
        pytest.fail(f'{" ".join(cmd)}: {report}', pytrace=False)


def _expected_mib(ranks=4, steps=4, eval_batches=2, b=4, s=16, h=32, layers=1, vocab=256,
                  positions=16, p=2):
    """docs/cli_and_data.md's byte formulas for TINY (dp=2 x 1D tp=2), summed over ranks."""
    act, ce = 4 * b * s * h, 3 * 4 * b * s
    tp = steps * (act * (3 + 4 * layers) + ce) + eval_batches * (act * (2 + 2 * layers) + ce)
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
     "splits each replica's micro-batch of 6 (global batch / data size / num_microbatches) 4 ways"),
    ("parallel = dict(tensor=dict(size=4, mode='sequence'))\n"
     "data = dict(type='shakespeare', seq_len=68)", 4, "needs 'data.seq_len' divisible by 8, got 68"),
    ("zero = dict()", 1, "'zero' needs 'zero.stage'"),
    ("optimizer = dict(type='adamw', betas=(0.9,))", 1, "'optimizer.betas' must be two numbers"),
    ("data = dict(type='shakespeare', plays=['nope'])", 1, "'data.plays': unknown plays ['nope']"),
    ("checkpoint = dict(interval=5)", 1, "'checkpoint.path' must be a directory name"),
    ("gradient_handler = dict(bucket_mb=-1)", 1, "'gradient_handler.bucket_mb' must be a positive"),
])
def test_layout_and_job_mismatches_fail_before_any_process(tmp_path, body, nproc, message):
    path = tmp_path / 'job.py'
    path.write_text(f"_base_ = {BASE!r}\n{body}\n")
    with pytest.raises(ConfigError) as info:
        cli.check_job(str(path), nproc, None)
    assert message in str(info.value)


def test_what_is_not_built_yet_stops_in_the_parent(tmp_path, capsys):
    path = tmp_path / 'job.py'
    path.write_text(f"_base_ = {BASE!r}\nzero = dict(stage=3)\nfp16 = dict(mode='apex')\n")
    with pytest.raises(NotImplementedError, match="'apex' is not supported with ZeRO"):
        cli.check_job(str(path), 1, None)
    assert cli.train_command(cli._parser().parse_args(['train', str(path)]),
                             entrypoint=_must_not_run) == 2
    assert 'not supported yet' in capsys.readouterr().err


# ---------------------------------------------------------------------------- the parent's meta build
VIT = """
parallel = dict(tensor=dict(size=2, mode='1d'))
model = dict(type='vit', preset='tiny', hidden=32, layers=1, heads=4, dropout=0.0)
data = dict(type='digits')
train = dict(global_batch_size=8, steps=2)
"""
_1D4 = ("tensor=dict(size=2, mode='1d')", "tensor=dict(size=4, mode='1d')")
_3D8 = ("tensor=dict(size=2, mode='1d')", "tensor=dict(size=8, mode='3d')")


def _edit(text, *edits):
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new)
    return text


UNSPLITTABLE = {  # name: (config text, nproc, the key the message names, a fragment of it)
    'heads': (_edit(TINY, ('heads=4', 'heads=3'), ('hidden=32', 'hidden=48')), 2, 'model.heads',
              "needs 'model.heads' (attention heads) divisible by 2, got 3"),
    'hidden': (_edit(TINY, _3D8, ('hidden=32', 'hidden=34'), ('heads=4', 'heads=2')), 8,
               'model.hidden', "needs 'model.hidden' (hidden size) divisible by 4, got 34"),
    'vocab': (_edit(TINY, _1D4, ("preset='tiny'", "preset='tiny', vocab_size=258")), 4,
              'model.vocab_size', "needs 'model.vocab_size' (vocabulary) divisible by 4, got 258"),
    'image/patch': (_edit(VIT, ("heads=4", "heads=4, patch_size=3")), 2, 'model.img_size',
                    "'model.img_size' = 8 must be divisible by 'model.patch_size' = 3"),
    'sequence length': (_edit(TINY, ("tensor=dict(size=2, mode='1d')",
                                     "tensor=dict(size=4, mode='sequence')"),
                              ('seq_len=16', 'seq_len=14')), 4, 'data.seq_len',
                        "splits the sequence 8 ways"),   # zigzag: 2P chunks
    'vit tokens': (_edit(VIT, ("mode='1d'", "mode='sequence'")), 2, 'model.img_size',
                   'divisible by 4, got 17'),   # zigzag: 2P chunks
    'batch': (_edit(TINY, _3D8, ('global_batch_size=8', 'global_batch_size=6')), 8,
              'train.global_batch_size', "replica's micro-batch of 6 (global batch / data size / num_microbatches) 4 ways"),
    'pipeline layers': ("num_microbatches = 2\n" + _edit(TINY, ("parallel = dict(",
                                                               "parallel = dict(pipeline=2, ")),
                        4, 'model.layers', 'fewer than the 2 pipeline stages'),
}


def _must_not_run(config_path, steps):
    raise AssertionError('a worker started for a config that cannot be split')


@pytest.mark.parametrize('case', list(UNSPLITTABLE))
def test_an_unsplittable_model_fails_in_the_parent_naming_the_key(tmp_path, monkeypatch, capsys,
                                                                  case):
    import torch.distributed.launcher.api as launcher
    text, nproc, key, fragment = UNSPLITTABLE[case]
    starts = []
    monkeypatch.setattr(launcher, 'elastic_launch', lambda *a, **k: starts.append(a))
    path = _write(tmp_path, text)
    args = cli._parser().parse_args(['train', path, '--nproc', str(nproc)])
    assert cli.train_command(args, entrypoint=_must_not_run) == 2
    err = capsys.readouterr().err
    assert f"'{key}'" in err and fragment in err, err
    assert cli.main(['train', path, '--nproc', str(nproc)]) == 2
    assert starts == []


def test_the_meta_build_catches_what_no_rule_names(tmp_path):
    """A registered model without size rules: its build on the meta device for the described
    2D layout (no process group) raises the layer's error, reported under 'model'."""
    from colossal_lite.context import current_context, global_context as gpc
    from colossal_lite.models import register_model, unregister_model
    import colossal_lite.nn as col_nn
    seen = []

    def odd_linear(hidden=16, out=15):
        seen.append((current_context().is_described, torch.empty(0).is_meta,
                     gpc.is_initialized()))
        return col_nn.Linear(hidden, out)

    register_model('odd_linear', odd_linear, data='shakespeare')
    try:
        ok = _write(tmp_path, "model = dict(type='odd_linear', out=16)\n"
                    "data = dict(type='shakespeare', plays=['macbeth'])\n"
                    "parallel = dict(tensor=dict(size=4, mode='2d'))\n", 'ok.py')
        cli.check_job(ok, 4, None)
        assert seen == [(True, True, False)] * 2          # rank 0 and rank 3, on meta
        bad = _write(tmp_path, open(ok).read().replace('out=16', 'out=15'), 'bad.py')
        with pytest.raises(ConfigError, match=r"'model' \(odd_linear, preset None\) cannot be "
                                              r"built for data=1 pipeline=1 tensor=4 \(2d\)"
                                              r" \(rank 0\): .*divisible by 2"):
            cli.check_job(bad, 4, None)
    finally:
        unregister_model('odd_linear')


# ---------------------------------------------------------------------------- models from a registry
USER_MODELS = '''
import torch
import torch.nn.functional as F
from torch import nn
import colossal_lite.nn as col_nn
from colossal_lite.models import SizeRule, register_model
from colossal_lite.tensor import init_by_name


class TinyLM(nn.Module):
    """Token + position embeddings and a linear head: a user model of colossal_lite facades."""

    def __init__(self, vocab_size, hidden, max_positions):
        super().__init__()
        with init_by_name(self):
            self.tok = col_nn.Embedding(vocab_size, hidden)
            self.pos = col_nn.Embedding(max_positions, hidden)
            self.head = col_nn.Linear(hidden, vocab_size)

    def forward(self, ids):
        positions = torch.arange(ids.shape[1]).expand_as(ids)
        return self.head(torch.tanh(self.tok(ids) + self.pos(positions)))


class NextTokenLoss(nn.Module):
    def forward(self, logits, labels):
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                               labels[:, 1:].reshape(-1))


register_model('tiny_lm', TinyLM, presets=dict(tiny=dict(vocab_size=256, hidden=8, max_positions=16)),
               loss=NextTokenLoss, data='shakespeare',
               rules=lambda o: [SizeRule('model.hidden', o['hidden'], 'hidden')])
'''
USER_JOB = """
imports = ['user_models_for_cli_test']
model = dict(type='tiny_lm', hidden=12)
data = dict(type='shakespeare', seq_len=16, plays=['macbeth'])
train = dict(global_batch_size=8, steps=3, log_every=1, eval_batches=1)
optimizer = dict(type='adamw', lr=1e-2)
"""


def _train_the_launched_job(rank):
    from colossal_lite.context import global_context as gpc
    from colossal_lite.worker import train
    return train(gpc.settings)['losses']


def test_a_user_model_registered_by_an_import_trains_through_the_job_path(tmp_path):
    """The config's 'imports' (found next to the config file) registers the model; the parent
    checks and meta-builds it; two data-parallel ranks train it like the serial model."""
    (tmp_path / 'user_models_for_cli_test.py').write_text(USER_MODELS)
    cfg, layout, spec = cli.check_job(_write(tmp_path, USER_JOB), 2, None)
    assert (spec.kind, spec.options['hidden'], layout.data) == ('tiny_lm', 12, 2)
    losses = run_distributed(_train_the_launched_job, 2, cfg.to_dict(), timeout=240)
    assert losses[0] == losses[1]

    from colossal_lite.data import DataParallelLoader, text_datasets
    from colossal_lite.job import build_criterion, build_model
    train, _ = text_datasets(16, 0.05, ['macbeth'])
    serial = _serial_job_losses(spec, train, 3)
    assert losses[0] == pytest.approx(serial, rel=1e-5)
    assert serial[-1] < serial[0]


def test_the_library_never_imports_the_model_zoo():
    """colossal_lite neither imports model_zoo nor holds its module path as a string (what
    import_module, __import__ or a default 'imports' list would take); prose may name it."""
    import ast
    import pathlib
    offenders = []
    for path in pathlib.Path(REPO, 'colossal_lite').rglob('*.py'):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or '']
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names = [node.value.strip()]
            else:
                continue
            if any(re.fullmatch(r'model_zoo(\.\w+)*', n) for n in names):
                offenders.append(f'{path.relative_to(REPO)}:{node.lineno}')
    assert offenders == []


# ---------------------------------------------------------------------------- your own data (hf)
BPE_CONFIG = os.path.join(REPO, 'configs', 'gpt_bpe_plays.py')


def _bpe_job(tmp_path, **data):
    """configs/gpt_bpe_plays.py made small: one play, seq_len 16, a 512-token BPE, 3 steps."""
    play = os.path.join(REPO, 'colossal_lite', 'data', 'shakespeare', 'macbeth.txt')
    fields = dict(type='hf', path='text', data_files=[play], seq_len=16, val_fraction=0.05,
                  tokenizer=dict(type='bpe', vocab_size=500), cache_dir=str(tmp_path / 'cache'))
    fields.update(data)
    return (f"_base_ = {BPE_CONFIG!r}\n"
            "model = dict(type='gpt', preset='tiny', hidden=32, layers=1, heads=4, "
            "max_positions=16, dropout=0.0)\n"
            f"data = {fields!r}\n"
            f"train = dict(global_batch_size=8, steps=3, log_every=1, eval_batches=1, "
            f"run_dir={str(tmp_path / 'run')!r})\n"
            "optimizer = dict(type='adamw', lr=1e-2)\nlr_scheduler = dict(type='constant')\n")


def test_the_bpe_config_trains_on_your_text_like_the_serial_model(tmp_path):
    """Two data-parallel workers on a BPE-tokenized play print the serial model's losses; the
    tokenizer, metrics.jsonl and loss.png land in train.run_dir."""
    import json
    path = _write(tmp_path, _bpe_job(tmp_path))
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS='1')
    run = subprocess.run([sys.executable, '-m', 'colossal_lite.cli', 'train', path, '--nproc', '2'],
                         cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout

    from colossal_lite.config import load_config
    from colossal_lite.data import DataParallelLoader
    from colossal_lite.data.hf import hf_datasets
    from colossal_lite.job import build_criterion, build_model
    spec = load_config(path).settings.job
    train, _, vocab = hf_datasets(spec.data, str(tmp_path / 'run'))    # the saved tokenizer
    assert vocab <= 500 and spec.options['vocab_size'] == 512             # rounded up to 128s
    serial = _serial_job_losses(spec, train, 3, clip=1.0)              # the config's clip
    printed = [float(x) for x in re.findall(r'^step=\d+ epoch=0 loss=([\d.]+)', out, re.M)]
    assert printed == pytest.approx(serial, abs=1e-3)
    records = [json.loads(line) for line in (tmp_path / 'run' / 'metrics.jsonl').read_text().splitlines()]
    assert [r['loss'] for r in records[:3]] == pytest.approx(serial, abs=1e-5)
    assert records[3]['step'] == 3 and 'test_loss' in records[3]
    assert (tmp_path / 'run' / 'tokenizer.json').is_file()
    try:
        import matplotlib  # noqa: F401
        assert (tmp_path / 'run' / 'loss.png').stat().st_size > 1000
    except ImportError:
        pass
    assert f"wrote {tmp_path / 'run' / 'metrics.jsonl'}" in out


@pytest.mark.parametrize('data, model, message', [
    (dict(data_files=['missing/*.txt']), '', "'data.data_files': no file matches 'missing/*.txt'"),
    (dict(text_column='content'), '', "'data.text_column' = 'content' is not a column"),
    (dict(data_files=['empty.txt']), '', "'data.data_files': 'empty.txt' is empty"),
    (dict(path='saved_nowhere', data_files=None), '', "'data.path' = 'saved_nowhere' is neither"),
    (dict(tokenizer=dict(type='file', path='nope.json')), '', "'data.tokenizer.path' = 'nope.json'"),
    (dict(tokenizer=dict(type='wordpiece')), '', "'data.tokenizer' must be dict(type='bpe'"),
    ({}, ', vocab_size=256', "'model.vocab_size' = 256 is smaller than the tokenizer's vocabulary of 500"),
])
def test_bad_data_fails_in_the_parent_naming_the_key(tmp_path, monkeypatch, capsys, data, model,
                                                     message):
    import torch.distributed.launcher.api as launcher
    starts = []
    monkeypatch.setattr(launcher, 'elastic_launch', lambda *a, **k: starts.append(a))
    monkeypatch.chdir(tmp_path)
    (tmp_path / 'empty.txt').write_text('')
    text = _bpe_job(tmp_path, **data).replace("dropout=0.0)", f"dropout=0.0{model})")
    path = _write(tmp_path, text)
    assert cli.main(['train', path, '--nproc', '2']) == 2
    assert message in capsys.readouterr().err
    assert starts == []


# ---------------------------------------------------------------------------- as a new user meets it
# A fresh process that first leaves an exited, unreaped child of its own, then runs the CLI.
_WITH_ZOMBIE = ('import os, sys\n'
                'if os.fork() == 0:\n'
                '    os._exit(0)      # a zombie until the end: FirstExit must ignore it\n'
                'from colossal_lite.cli import main\n'
                'sys.exit(main(sys.argv[1:]))\n')


def test_a_killed_rank_is_named_first_with_its_signal(tmp_path):
    """Rank 3 ends itself with SIGKILL after step 2 (``COLOSSAL_LITE_TEST_KILL``, what the
    out-of-memory killer does); the others then lose their connections. Also when the
    launching process has another exited, unreaped child: FirstExit watches only the
    workers' pids."""
    path = _write(tmp_path, TINY)
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS='1', COLOSSAL_LITE_TEST_KILL='3:2')
    run = subprocess.run([sys.executable, '-c', _WITH_ZOMBIE, 'train', path, '--nproc', '4'],
                         cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=280)
    err = run.stderr
    assert run.returncode == 1, run.stdout + err
    want = 'rank 3 failed first: killed by SIGKILL (the out-of-memory killer, or kill -9)'
    first = next(line for line in err.splitlines() if 'failed first' in line)
    assert first == want, err
    assert 'Traceback' not in err.split('traceback of rank')[0]   # no launcher noise before it
    assert err.count('traceback of rank') <= 1


def test_forgetting_nproc_suggests_it(tmp_path):
    with pytest.raises(ConfigError, match='got world size 1: run with --nproc 2$'):
        cli.check_job(_write(tmp_path, TINY), 1, None)
    pp = _write(tmp_path, 'num_microbatches = 2\n' + TINY.replace('parallel = dict(',
                                                                 'parallel = dict(pipeline=2, data=2, '))
    with pytest.raises(ConfigError, match='run with --nproc 8$'):
        cli.check_job(pp, 4, None)


def test_a_copied_config_names_its_missing_base(tmp_path):
    copied = tmp_path / 'gpt_dp.py'
    copied.write_text(open(os.path.join(REPO, 'configs', 'gpt_dp.py')).read())
    with pytest.raises(ConfigError, match=r"_gpt_shakespeare.py', the _base_ of '.*gpt_dp.py'"):
        cli.check_job(str(copied), 2, None)


def test_help_reads_plainly_and_version_is_printed(capsys):
    from colossal_lite import __version__
    with pytest.raises(SystemExit):
        cli.main(['--help'])
    text = capsys.readouterr().out
    assert '``' not in text and 'train' in text and '--version' in text
    with pytest.raises(SystemExit):
        cli.main(['--version'])
    assert capsys.readouterr().out.strip() == f'colossal-lite {__version__}'


def test_an_unwritable_checkpoint_directory_fails_before_the_start(tmp_path):
    (tmp_path / 'a_file').write_text('')
    body = TINY + f"checkpoint = dict(path={str(tmp_path / 'a_file' / 'ckpt')!r})\n"
    with pytest.raises(ConfigError, match="'checkpoint.path': '.*a_file' is a file, not a directory"):
        cli.check_job(_write(tmp_path, body), 4, None)
    body = TINY + f"checkpoint = dict(path={str(tmp_path / 'new' / 'ckpt')!r})\n"
    cli.check_job(_write(tmp_path, body), 4, None)
    assert (tmp_path / 'new').is_dir()


class _Trainer:
    def __init__(self, **metrics):
        self.metrics, self.cur_step, self.cur_epoch, self.history = metrics, 4, 1, []
        self.step_samples, self.step_tokens = 8, 8


def test_image_logs_show_step_metrics_on_step_lines_and_test_metrics_on_test_lines():
    from colossal_lite.trainer import hooks as H
    lines = []
    trainer = _Trainer(loss=0.5, lr=1e-3, test_loss=0.9, test_accuracy=0.7, epoch_loss=0.6)
    H.LogMetricByStepHook(1, printer=lines.append).after_train_iter(trainer, None, None, None)
    H.LogMetricByEpochHook(printer=lines.append).after_test(trainer)
    assert lines == ['step=4 epoch=1 loss=0.5 lr=0.001', 'test (epoch 1) test_loss=0.9 test_accuracy=0.7']
    trainer.engine = type('E', (), {'model': torch.nn.Linear(2, 2)})()
    images = H.ThroughputHook(warmup=0, tokens=False)
    images.before_train(trainer)
    images.before_train_iter(trainer)
    images.after_train_iter(trainer, None, None, None)
    assert 'samples_per_s' in trainer.metrics and 'tokens_per_s' not in trainer.metrics
    assert 'tflops' not in trainer.metrics


def test_progress_bar_on_a_terminal_and_plain_lines_otherwise():
    import io
    from colossal_lite.trainer import hooks as H
    plain = H.ProgressBarHook(3, stream=io.StringIO())          # not a terminal
    assert not plain.enabled
    plain.printer('step=1 loss=2')
    assert plain.stream.getvalue() == 'step=1 loss=2\n'
    pytest.importorskip('tqdm')
    bar = H.ProgressBarHook(3, stream=io.StringIO(), force=True)
    trainer = _Trainer(loss=2.5, tokens_per_s=1234.0)
    bar.before_train(trainer)
    for _ in range(3):
        bar.after_train_iter(trainer, None, None, None)
    bar.printer('a log line')
    bar.after_train(trainer)
    shown = bar.stream.getvalue()
    assert '3/3' in shown and 'loss=2.5000' in shown and 'tokens/s=1234' in shown
    assert 'a log line\n' in shown


INSTALL = os.path.join(REPO, 'scripts', 'install.sh')
FAKE_PY = """#!/usr/bin/env bash
echo "$*" >> "$LOG"
if [ "$1" = -c ]; then exit 1; fi                     # no torch yet
case "$*" in *download.pytorch.org*) exit "${CPU_INDEX_FAILS:-0}";; esac
exit 0
"""


@pytest.mark.parametrize('cpu_index_fails', [0, 1])
def test_install_prefers_the_cpu_wheel_without_a_gpu_and_falls_back_to_the_default_index(
        tmp_path, cpu_index_fails):
    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir()
    (bin_dir / 'python').write_text(FAKE_PY)
    (bin_dir / 'nvidia-smi').write_text('#!/bin/sh\nexit 9\n')    # no working GPU
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    log = tmp_path / 'log'
    env = dict(os.environ, PYTHON=str(bin_dir / 'python'), LOG=str(log),
               CPU_INDEX_FAILS=str(cpu_index_fails), PATH=f"{bin_dir}:{os.environ['PATH']}")
    run = subprocess.run(['bash', INSTALL, 'test'], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    calls = [line for line in log.read_text().splitlines() if 'pip install' in line]
    assert 'download.pytorch.org/whl/cpu' in calls[0] and 'torch==2.13.0' in calls[0]
    if cpu_index_fails:
        assert calls[1] == '-m pip install -q torch==2.13.0'           # the default index
    assert calls[-1] == '-m pip install -q -e .[test]' and len(calls) == 2 + cpu_index_fails


_PARALLEL_FIRST = '''
import sys
import torch
from colossal_lite.launcher import free_port, run_workers


def parallel_op_first():
    """A worker whose first act is an intra-op parallel op (exp over 4M values, a matmul)."""
    x = torch.randn(1 << 22)
    m = torch.randn(1000, 1000)
    return float(x.exp_().sum() + (m @ m).sum())


if __name__ == '__main__':
    torch.set_num_threads(2)
    a = torch.randn(1500, 1500)
    (a @ a).sum()
    torch.randn(1 << 22).exp_()   # this process has run OpenMP with 2 threads: a team exists
    sys.exit(run_workers(2, free_port(), parallel_op_first))
'''


def test_workers_started_after_a_parallel_op_do_not_hang(tmp_path):
    """GNU libgomp after fork: a child whose parent ran an OpenMP region with 2 threads hangs
    in its own first parallel region with 2 threads (it has no team threads). Workers are
    spawned, not forked (``launcher.start_method``), and take ``OMP_NUM_THREADS`` first, so
    workers started from a process that already computed (a pytest process, a notebook)
    finish (with fork and neither measure this test hung)."""
    script = tmp_path / 'parallel_first.py'
    script.write_text(_PARALLEL_FIRST)
    env = dict(os.environ, PYTHONPATH=REPO)
    run = _run_dumping_stacks_on_timeout([sys.executable, str(script)], tmp_path, env, 90)
    assert run.returncode == 0, run.stdout + run.stderr
