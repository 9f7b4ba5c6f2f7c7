"""`colossal-lite train` with a Hugging Face causal LM under ``parallel.auto``
(configs/llama_hf_auto.py): the ``parallel.auto`` section's checks, the mesh checked
against the launched world before any worker starts, and a 4-process run (mesh data=2 x
tensor=2, a budget that shards weights) whose losses equal the serial model's."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from colossal_lite import cli
from colossal_lite.config import ConfigError, load_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, 'configs', 'llama_hf_auto.py')
LLAMA = ("dict(type='hf', config=dict(model_type='llama', vocab_size=256, hidden_size=32, "
         "intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, "
         "num_key_value_heads=2, max_position_embeddings=64))")


def _job(tmp_path, parallel, model=LLAMA, extra=''):
    path = tmp_path / 'job.py'
    path.write_text(f"model = {model}\nparallel = {parallel}\n"
                    "data = dict(type='shakespeare', seq_len=16, plays=['macbeth'])\n"
                    f"train = dict(global_batch_size=8, steps=2, run_dir={str(tmp_path)!r})\n"
                    + extra)
    return str(path)


def _parsed(parallel):
    return load_config(dict(parallel=parallel)).settings.auto


# ---------------------------------------------------------------------------- the section
def test_the_auto_section_parses_and_keeps_the_mesh_axis_names():
    auto = _parsed(dict(auto=dict(level='optimal', mesh=dict(data=2, tensor=4), memory_gb=2)))
    assert (auto.level, auto.mesh, auto.axes, auto.memory_gb) == \
        ('optimal', (2, 4), ('data', 'tensor'), 2.0)
    assert auto.mesh_spec == {'data': 2, 'tensor': 4} and auto.devices == 8
    listed = _parsed(dict(auto=dict(mesh=[2, 2])))
    assert (listed.level, listed.mesh_spec, listed.memory_gb) == ('fast', (2, 2), None)
    assert _parsed(dict(auto=dict())).mesh is None and _parsed(dict()) is None


@pytest.mark.parametrize('parallel, message', [
    (dict(auto=dict(level='best')), "'parallel.auto.level' must be one of ['fast', 'optimal'], "
                                    "got 'best'"),
    (dict(auto=dict(levle='fast')), "unknown config key 'parallel.auto.levle'; did you mean "
                                    "'level'?"),
    (dict(auto=dict(mesh=[2, 2, 2, 2])), "'parallel.auto.mesh' must be a dict of axis sizes or "
                                         "a list of 1 to 3 of them"),
    (dict(auto=dict(mesh=dict(data=2, tensor=0))), "'parallel.auto.mesh.tensor' must be a "
                                                   "positive integer, got 0"),
    (dict(auto=dict(mesh=[2, 1.5])), "'parallel.auto.mesh[1]' must be a positive integer"),
    (dict(auto=dict(mesh=4)), "'parallel.auto.mesh' must be a dict of axis sizes"),
    (dict(auto=dict(memory_gb=-1)), "'parallel.auto.memory_gb' must be a positive finite "
                                    "number or None, got -1"),
    (dict(auto='fast'), "'parallel.auto' must be a dict like"),
    (dict(auto=dict(), tensor=dict(size=2, mode='1d')),
     "'parallel.tensor' = {'size': 2, 'mode': '1d'} cannot be combined with 'parallel.auto'"),
])
def test_bad_auto_sections_name_the_key(parallel, message):
    with pytest.raises(ConfigError) as info:
        _parsed(parallel)
    assert message in str(info.value)


def test_zero_beside_auto_is_not_built_yet():
    with pytest.raises(NotImplementedError, match="'zero' \\(stage 2\\) with 'parallel.auto'"):
        load_config(dict(parallel=dict(auto=dict()), zero=dict(stage=2))).settings


# ---------------------------------------------------------------------------- before the start
def test_a_mesh_that_does_not_span_the_world_fails_before_any_worker(tmp_path, monkeypatch,
                                                                     capsys):
    import torch.distributed.launcher.api as launcher
    starts = []
    monkeypatch.setattr(launcher, 'elastic_launch', lambda *a, **k: starts.append(a))
    path = _job(tmp_path, "dict(auto=dict(mesh=dict(data=2, tensor=2)))")
    with pytest.raises(ConfigError, match=r"'parallel.auto.mesh' = dict\(data=2, tensor=2\) "
                                          r"spans 4 processes but the job launches 8"):
        cli.check_job(path, 8, None)
    assert cli.main(['train', path, '--nproc', '8']) == 2
    assert 'spans 4 processes but the job launches 8' in capsys.readouterr().err
    assert starts == []
    settings, layout, spec = cli.check_job(path, 4, None)        # the fitting world passes
    assert (settings.auto.devices, layout.world_size, spec.kind) == (4, 4, 'hf')


@pytest.mark.parametrize('parallel, model, message', [
    ("dict(tensor=dict(size=2, mode='1d'))", LLAMA, "model type 'hf' runs a transformers model "
                                                     "as it is: it takes no hand layout"),
    ("dict(auto=dict())", LLAMA.replace('vocab_size=256', 'vocab_size=100'),
     "the 'hf' model's vocab_size = 100 must be at least 256"),
    ("dict(auto=dict())", LLAMA.replace('max_position_embeddings=64',
                                        'max_position_embeddings=8'),
     "'data.seq_len' = 16 exceeds the 'hf' model's 8 positions"),
    ("dict(auto=dict())", "dict(type='hf')", "needs exactly one of 'model.config'"),
    ("dict(auto=dict())", "dict(type='hf', config=dict(hidden_size=8))",
     "'model.config' must be a dict with a 'model_type'"),
    ("dict(auto=dict())", "dict(type='hf', path='/nowhere')",
     "'model.path' = '/nowhere' is not a directory holding a Hugging Face config.json"),
    ("dict(auto=dict())", "dict(type='gpt', hidden=32, layers=1, heads=4, max_positions=16)",
     "'parallel.auto' plans a model whose forward returns its own loss"),
])
def test_hf_and_auto_jobs_that_cannot_run_fail_in_the_parent(tmp_path, parallel, model, message):
    path = _job(tmp_path, parallel, model, "imports = ['model_zoo']\n")
    with pytest.raises(ConfigError) as info:
        cli.check_job(path, 2, None)
    assert message in str(info.value)


def test_a_local_hf_directory_is_read_by_its_config_before_the_start(tmp_path):
    from transformers import LlamaConfig
    LlamaConfig(vocab_size=128, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1).save_pretrained(tmp_path / 'hf')
    path = _job(tmp_path, 'dict(auto=dict(mesh=[2]))',
                f"dict(type='hf', path={str(tmp_path / 'hf')!r})")
    with pytest.raises(ConfigError, match="vocab_size = 128 must be at least 256"):
        cli.check_job(path, 2, None)


# ---------------------------------------------------------------------------- the run
STEPS = 3


def _serial_losses(spec, steps):
    """The config's model, optimizer, scheduler and clipping in this process, on the whole
    global batches the loader gives a serial run (seed 1024: launch's default)."""
    from colossal_lite.data import DataParallelLoader, text_datasets
    from colossal_lite.job import build_model, build_optimizer, build_scheduler
    torch.manual_seed(1024)
    model = build_model(spec)
    opt = build_optimizer(spec, model)
    sched = build_scheduler(spec, opt, steps)
    train, _ = text_datasets(spec.data.seq_len, spec.data.val_fraction, spec.data.plays)
    batches = iter(DataParallelLoader(train, spec.train.global_batch_size, seed=0, data_rank=0,
                                      data_size=1))
    losses = []
    for _ in range(steps):
        ids, _ = next(batches)
        opt.zero_grad()
        loss = model(ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)        # the config's clip
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


def test_the_config_trains_on_4_processes_like_the_serial_model(tmp_path):
    """``colossal-lite train configs/llama_hf_auto.py --nproc 4 --steps 3`` in a fresh
    process: rank 0 prints a plan that shards weights, every step's loss (metrics.jsonl,
    full precision) equals the serial model's within 1e-5, and the loss falls."""
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS='1')
    cmd = [sys.executable, '-m', 'colossal_lite.cli', 'train', CONFIG, '--nproc', '4',
           '--steps', str(STEPS)]
    run = subprocess.run(cmd, cwd=str(tmp_path), env=env, capture_output=True, text=True,
                         timeout=240)
    out = run.stdout
    assert run.returncode == 0, out + run.stderr
    assert 'auto plan (fast) on mesh dict(data=2, tensor=2)' in out
    assert 'graph plan (fast' in out and 'on mesh data=2 x tensor=2' in out
    placements = re.findall(r'^  model\.\S+\.weight\s+(\S+)$', out, re.M)
    assert placements and any('S' in p for p in placements), out   # the budget shards weights
    records = [json.loads(line) for line in
               (tmp_path / 'runs' / 'llama_hf_auto' / 'metrics.jsonl').read_text().splitlines()]
    losses = [r['loss'] for r in records if 'loss' in r]
    spec = load_config(CONFIG).settings.job
    serial = _serial_losses(spec, STEPS)
    assert losses == pytest.approx(serial, abs=1e-5)
    assert losses[-1] < losses[0]
    first, last = map(float, re.search(r'first_loss=([\d.]+) last_loss=([\d.]+)', out).groups())
    assert (first, last) == pytest.approx((serial[0], serial[-1]), abs=1e-4)
    assert re.search(r'bytes communicated per ParallelMode \(all ranks\): DATA: [\d.]+ MiB, '
                     r'TENSOR: [\d.]+ MiB', out)
    assert 'evaluation: test_loss=' in out


def test_pipeline_stages_of_the_graph_train_like_the_serial_model(tmp_path):
    """``parallel=dict(pipeline=2, auto=dict(mesh=dict(tensor=2)))`` on 4 processes: the mesh
    spans one stage's 2 ranks, the plan's graph is cut into 2 stages (printed), and every
    step's loss (2 micro-batches, clipping at 1.0) equals the serial model's."""
    with open(CONFIG) as f:
        text = f.read()
    text = re.sub(r"parallel = dict\(auto=dict\(.*\)\)\n",
                  "parallel = dict(pipeline=2, auto=dict(level='fast', mesh=dict(tensor=2), "
                  "memory_gb=0.003))\nnum_microbatches = 2\n", text)
    assert 'pipeline=2' in text
    path = tmp_path / 'pipelined.py'
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"spans 2 processes but the job launches 8 / "
                                          r"pipeline 2 = 4 per stage"):
        cli.check_job(str(path), 8, None)
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS='1')
    cmd = [sys.executable, '-m', 'colossal_lite.cli', 'train', str(path), '--nproc', '4',
           '--steps', str(STEPS)]
    run = subprocess.run(cmd, cwd=str(tmp_path), env=env, capture_output=True, text=True,
                         timeout=240)
    out = run.stdout
    assert run.returncode == 0, out + run.stderr
    assert re.search(r'pipeline: 2 stages starting at embedding, \S+;', out), out
    placements = re.findall(r'^  model\.\S+\.weight\s+(\S+)$', out, re.M)
    assert any('S' in p for p in placements), out
    records = [json.loads(line) for line in
               (tmp_path / 'runs' / 'llama_hf_auto' / 'metrics.jsonl').read_text().splitlines()]
    losses = [r['loss'] for r in records if 'loss' in r]
    serial = _serial_losses(load_config(str(path)).settings.job, STEPS)
    assert losses == pytest.approx(serial, abs=1e-5)
    assert 'PIPELINE:' in out and 'evaluation: test_loss=' in out
