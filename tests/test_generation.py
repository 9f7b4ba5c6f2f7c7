"""Generation from a trained GPT (docs/generation.md): model-only checkpoint loading into any
layout, KV-cached decoding equal to the full forward in serial and every tensor mode (also
for Llama's rotated, grouped-query cache: kv heads split or replicated),
``generate`` giving the same tokens in every layout, and the ``generate`` / ``eval`` /
``export`` commands on a checkpoint of a tiny ``colossal-lite train`` job.

References are computed serially in the test process from the same full weights.
"""
import os
import re

import pytest
import torch

import colossal_lite as clt
import colossal_lite.nn as col_nn
from colossal_lite import checkpoint
from colossal_lite.generation import generate
from colossal_lite.testing import engine_step, make_optimizer, replica_batch, run_distributed
from model_zoo import GPT, GPTLMLoss, Llama

TP2 = dict(parallel=dict(tensor=dict(size=2, mode='1d')))
TENSOR_LAYOUTS = [  # (config, world size)
    (TP2, 2),
    (dict(parallel=dict(tensor=dict(size=4, mode='2d'))), 4),
    (dict(parallel=dict(tensor=dict(size=8, mode='2.5d', depth=2))), 8),
    (dict(parallel=dict(tensor=dict(size=8, mode='3d'))), 8),
]
LAYOUT_IDS = ['1d', '2d', '2.5d', '3d']
PREFILL = 5


MODELS = {'gpt': GPT, 'llama': Llama}


def _gpt(state=None, name='gpt'):
    model = MODELS[name].from_preset('tiny', dropout=0.0)
    if state is not None:
        model.load_state_dict(state)
    return model.eval()


def _serial_state(seed=0, name='gpt'):
    torch.manual_seed(seed)
    return {k: v.clone() for k, v in _gpt(name=name).state_dict().items()}


def _ids(batch=4, seq=12, seed=1):
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _full_and_incremental(model, ids):
    """(full-sequence logits, logits of a PREFILL-token prefill then one token per step
    through the KV cache), both gathered to ``[b, s, V]``."""
    full = col_nn.gather_logits(model(ids))
    cache = model.new_kv_cache()
    steps = [col_nn.gather_logits(model(ids[:, :PREFILL], kv_cache=cache))]
    for t in range(PREFILL, ids.shape[1]):
        steps.append(col_nn.gather_logits(model(ids[:, t:t + 1], kv_cache=cache)))
    return full, torch.cat(steps, dim=1)


def _scale(t):
    return max(1.0, float(t.abs().max()))


def test_kv_cache_decoding_equals_the_full_forward_serially():
    model, ids = _gpt(_serial_state()), _ids()
    full, incremental = _full_and_incremental(model, ids)
    assert (incremental - full).abs().max() <= 1e-5 * _scale(full)


def test_the_cache_is_bounded_by_max_positions():
    model = _gpt(_serial_state())
    ids = _ids(batch=1, seq=64)
    cache = model.new_kv_cache()
    model(ids[:, :60], kv_cache=cache)
    with pytest.raises(ValueError, match='60 cached \\+ 5 new tokens exceed max_positions 64'):
        model(ids[:, :5], kv_cache=cache)


def _rank_cache(rank, state, ids, name='gpt'):
    model = _gpt(state, name)
    with torch.no_grad():
        last = col_nn.gather_logits(model(ids, last_only=True))
    return tuple(t.cpu() for t in _full_and_incremental(model, ids) + (last,))


LLAMA_LAYOUTS = TENSOR_LAYOUTS + [(dict(parallel=dict(tensor=dict(size=4, mode='1d'))), 4)]


@pytest.mark.parametrize('name,config,world',
                         [('gpt',) + c for c in TENSOR_LAYOUTS]
                         + [('llama',) + c for c in LLAMA_LAYOUTS],
                         ids=[f'gpt-{i}' for i in LAYOUT_IDS]
                         + [f'llama-{i}' for i in LAYOUT_IDS + ['1d-kv-replicated']])
def test_kv_cache_decoding_equals_the_serial_forward_in_every_tensor_mode(name, config, world):
    """Also ``last_only=True`` (the last position's logits) equals the serial last position."""
    state, ids = _serial_state(name=name), _ids()
    expected = _gpt(state, name)(ids).detach()
    tol = 1e-5 * _scale(expected)
    for full, incremental, last in run_distributed(_rank_cache, world, config, state, ids, name,
                                                   timeout=300):
        assert (full - expected).abs().max() <= tol
        assert (incremental - expected).abs().max() <= tol
        assert last.shape == (4, 1, 256) and (last - expected[:, -1:]).abs().max() <= tol


def _not_implemented(call):
    try:
        call()
    except NotImplementedError as err:
        return str(err)
    return None


def _rank_new_cache_error(rank, last_only=False):
    model = GPT.from_preset('tiny', dropout=0.0)
    messages = [_not_implemented(model.new_kv_cache)]
    if last_only:
        messages.append(_not_implemented(
            lambda: model(torch.zeros(2, 4, dtype=torch.long), last_only=True)))
    return messages


def test_pipeline_and_sequence_parallel_decoding_are_named_as_not_implemented():
    pipe = run_distributed(_rank_new_cache_error, 2,
                           dict(parallel=dict(pipeline=2), num_microbatches=2), timeout=120)
    assert all('under pipeline parallelism' in messages[0] for messages in pipe)
    for mode in ('sequence', 'ulysses'):
        seq = run_distributed(_rank_new_cache_error, 2,
                              dict(parallel=dict(tensor=dict(size=2, mode=mode))), True,
                              timeout=120)
        assert all('under sequence parallelism' in m for messages in seq for m in messages)


# ---------------------------------------------------------------------------- generate()
@torch.no_grad()
def _greedy_without_cache(model, prompt, n):
    """Reference: argmax of the full forward of the last ``max_positions`` tokens,
    recomputed for every new token."""
    ids = prompt
    for _ in range(n):
        logits = model(ids[:, -model.max_positions:])
        ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


SAMPLING = dict(top_k=8, temperature=0.9, seed=5)


def _rank_generate(rank, state, prompts):
    model = _gpt(state)
    return {name: (generate(model, prompt, 10), generate(model, prompt, 10, **SAMPLING))
            for name, prompt in prompts.items()}


def _prompts():
    ids = _ids(batch=3, seq=6, seed=2)
    return {'one': ids[0], 'batch3': ids}  # 3 rows: padded to 4 under 2D/2.5D/3D


def test_greedy_generation_equals_recomputing_the_full_forward():
    model, prompts = _gpt(_serial_state()), _prompts()
    assert torch.equal(generate(model, prompts['batch3'], 10),
                       _greedy_without_cache(model, prompts['batch3'], 10))
    one = generate(model, prompts['one'], 10)
    assert one.shape == (16,) and torch.equal(one, generate(model, prompts['one'][None], 10)[0])
    sampled = generate(model, prompts['batch3'], 10, **SAMPLING)
    assert torch.equal(sampled, generate(model, prompts['batch3'], 10, **SAMPLING))
    other_seed = generate(model, prompts['batch3'], 10, **dict(SAMPLING, seed=6))
    assert not torch.equal(sampled, other_seed)


@pytest.mark.parametrize('config,world', TENSOR_LAYOUTS, ids=LAYOUT_IDS)
def test_generation_gives_the_serial_tokens_in_every_tensor_mode(config, world):
    state, prompts = _serial_state(), _prompts()
    expected = _rank_generate(0, state, prompts)
    for result in run_distributed(_rank_generate, world, config, state, prompts, timeout=300):
        for name in prompts:
            assert torch.equal(result[name][0], expected[name][0]), name
            assert torch.equal(result[name][1], expected[name][1]), name


def test_generation_past_max_positions_slides_the_window():
    model, prompt = _gpt(_serial_state()), _ids(batch=3, seq=50, seed=3)
    assert torch.equal(generate(model, prompt, 30), _greedy_without_cache(model, prompt, 30))


@pytest.mark.parametrize('seq,kwargs,message', [
    (65, dict(max_new_tokens=1), "a prompt of 65 tokens exceeds the model's max_positions 64"),
    (6, dict(max_new_tokens=-1), 'max_new_tokens must be a non-negative integer, got -1'),
    (6, dict(max_new_tokens=2, top_k=0), 'top_k must be a positive integer or None, got 0'),
    (6, dict(max_new_tokens=2, temperature=-1.0), 'temperature must be a number >= 0, got -1.0'),
])
def test_bad_generation_arguments_are_named(seq, kwargs, message):
    with pytest.raises(ValueError, match=message):
        generate(_gpt(), _ids(batch=1, seq=seq)[0], **kwargs)


# ---------------------------------------------------------------------------- load_model
def _train_tp2_and_save(rank, path):
    """Two AdamW steps of a tiny GPT under 1D tp=2, saved; its full state dict."""
    torch.manual_seed(0)
    model = GPT.from_preset('tiny', dropout=0.0)
    engine, *_ = clt.initialize(model, make_optimizer(model.parameters()), GPTLMLoss())
    ids = _ids(batch=4, seq=16)
    for _ in range(2):
        engine_step(engine, replica_batch((ids, ids)))
    checkpoint.save(path, engine)
    return {k: v.cpu() for k, v in engine.model.state_dict().items()}


def _load_into_fresh(rank, path):
    torch.manual_seed(123)  # other initial weights: every tensor must come from the file
    model = GPT.from_preset('tiny', dropout=0.0)
    checkpoint.load_model(path, model)
    return {k: v.cpu() for k, v in model.state_dict().items()}


def _assert_bit_equal(expected, actual):
    assert expected.keys() == actual.keys()
    for key in expected:
        assert torch.equal(expected[key], actual[key]), key


def test_load_model_reads_a_tp2_checkpoint_into_serial_and_2d_bit_exactly(tmp_path):
    path = str(tmp_path / 'ckpt')
    saved = run_distributed(_train_tp2_and_save, 2, TP2, path, timeout=300)[0]
    serial = _load_into_fresh(0, path)  # no process group
    _assert_bit_equal(saved, serial)
    two_d = dict(parallel=dict(tensor=dict(size=4, mode='2d')))
    for state in run_distributed(_load_into_fresh, 4, two_d, path, timeout=300):
        _assert_bit_equal(saved, state)
    with pytest.raises(FileNotFoundError, match='is not a complete checkpoint'):
        checkpoint.load_model(str(tmp_path), GPT.from_preset('tiny'))


# ---------------------------------------------------------------------------- commands
GPT_JOB = """
model = dict(type='gpt', preset='tiny', hidden=32, layers=1, heads=4, max_positions=32, dropout=0.0)
data = dict(type='shakespeare', seq_len=16, val_fraction=0.05, plays=['macbeth'])
train = dict(global_batch_size=8, steps=3, eval_batches=2)
optimizer = dict(type='adamw', lr=1e-2)
"""
VIT_JOB = """
model = dict(type='vit', preset='tiny', hidden=32, layers=1, heads=4, dropout=0.0)
data = dict(type='digits', test_fraction=0.2)
train = dict(global_batch_size=16, steps=3)
optimizer = dict(type='adamw', lr=4e-3)
"""


def _train_job_and_save(rank, config_path, ckpt, steps):
    """A few steps of the launched job (the worker's builders), then the training run's own
    evaluation (``Trainer.evaluate`` with its hooks, as ``worker.train`` does), then a save
    with the job's extra; the test metrics."""
    import itertools

    from colossal_lite.checkpoint.job import job_extra
    from colossal_lite.context import global_context as gpc
    from colossal_lite.job import build_criterion, build_data, build_model, build_optimizer
    from colossal_lite.trainer import Trainer
    from colossal_lite.trainer import hooks as H
    spec = gpc.settings.job
    model = build_model(spec)
    train_dl, test_dl, _ = build_data(spec, gpc.device)
    engine, train_dl, test_dl, _ = clt.initialize(model, build_optimizer(spec, model),
                                                  build_criterion(spec), train_dl, test_dl)
    Trainer(engine).fit(train_dl, epochs=1, max_steps=steps, hooks=[H.LossHook()])
    hooks = [H.LossHook()] + ([] if spec.is_text else [H.AccuracyHook()])
    batches = spec.train.eval_batches if spec.is_text else None
    metrics = Trainer(engine).evaluate(itertools.islice(test_dl, batches), hooks=hooks)
    checkpoint.save(ckpt, engine, extra=job_extra(gpc.settings, config_path))
    return H.test_metrics(metrics)


def _job_checkpoint(tmp_path, text, config, world, name):
    """(checkpoint dir, the training run's test metrics) of a job trained under ``config``."""
    from colossal_lite.config import load_config
    path = tmp_path / f'{name}.py'
    path.write_text(text)
    ckpt = str(tmp_path / f'{name}_ckpt')
    cfg = dict(load_config(str(path)).settings.to_dict(), **config)
    metrics = run_distributed(_train_job_and_save, world, cfg, str(path), ckpt, 3, timeout=300)
    return ckpt, metrics[0]


def _loaded(ckpt):
    """The checkpoint's job model built serially in this process, its weights loaded."""
    from colossal_lite.checkpoint.job import job_settings
    from colossal_lite.job import build_model
    model = build_model(job_settings(ckpt).job).eval()
    checkpoint.load_model(ckpt, model)
    return model


@pytest.fixture(scope='module')
def gpt_job(tmp_path_factory):
    return _job_checkpoint(tmp_path_factory.mktemp('gpt'), GPT_JOB, TP2, 2, 'gpt')


@pytest.fixture
def no_workers(monkeypatch):
    """Fail the test if a command starts its workers."""
    from colossal_lite import launcher

    def start(*args, **kwargs):
        raise AssertionError('a worker was started')
    monkeypatch.setattr(launcher, 'run_workers', start)


def _cli(argv, capfd):
    from colossal_lite import cli
    capfd.readouterr()  # drop what earlier steps printed
    code = cli.main(argv)
    out, err = capfd.readouterr()
    return code, out, err


def test_generate_prints_the_same_text_serially_in_1d_and_2d(gpt_job, capfd):
    ckpt, _ = gpt_job
    outputs = {}
    for extra in ([], ['--nproc', '2'], ['--nproc', '4', '--tensor-mode', '2d']):
        code, out, err = _cli(['generate', ckpt, '--prompt', 'MACBETH:', '--tokens', '30',
                               '--greedy'] + extra, capfd)  # 8 + 30 tokens: past max_positions 32
        assert code == 0, err
        outputs[' '.join(extra) or 'serial'] = out
    expected = _serial_generation(ckpt, 'MACBETH:', 30)
    assert outputs == {k: expected + '\n' for k in outputs}, outputs
    sampled = {}
    for extra in ([], ['--nproc', '4', '--tensor-mode', '2d']):
        code, out, err = _cli(['generate', ckpt, '--prompt', 'MACBETH:', '--tokens', '12',
                               '--top-k', '8', '--temperature', '1.5', '--seed', '3'] + extra,
                              capfd)
        assert code == 0, err
        sampled[' '.join(extra) or 'serial'] = out
    assert len(set(sampled.values())) == 1 and len(set(out[8:20])) > 3, sampled


def test_generate_samples_top_k_40_at_temperature_0_8_and_prints_a_seed_that_repeats_it(
        gpt_job, capfd):
    """No flags: top-k 40 / temperature 0.8 with a seed drawn at random and printed on stderr
    (the text equals generate(...) with that seed in this process); --seed repeats it."""
    from colossal_lite.data import ByteTokenizer
    from colossal_lite.generation import generate
    ckpt, _ = gpt_job
    argv = ['generate', ckpt, '--prompt', 'MACBETH:', '--tokens', '12']
    code, out, err = _cli(argv, capfd)
    assert code == 0, err
    seed = int(re.search(r'seed (\d+) \(top-k 40, temperature 0.8; --seed \1 gives this text '
                         r'again\)', err).group(1))
    tok = ByteTokenizer()
    ids = generate(_loaded(ckpt), tok.encode('MACBETH:'), 12, top_k=40, temperature=0.8, seed=seed)
    assert out == tok.decode(ids) + '\n'
    code, again, err = _cli(argv + ['--seed', str(seed), '--nproc', '2'], capfd)
    assert code == 0 and again == out and f'seed {seed} ' in err, err


def _serial_generation(ckpt, prompt, tokens):
    """The reference: the job's GPT built in this process, loaded, greedy decoding by
    recomputing the full forward for every token."""
    from colossal_lite.data import ByteTokenizer
    tok = ByteTokenizer()
    ids = _greedy_without_cache(_loaded(ckpt), tok.encode(prompt)[None], tokens)[0]
    return tok.decode(ids)


def test_eval_prints_the_training_runs_test_loss_in_any_layout(gpt_job, capfd):
    ckpt, metrics = gpt_job
    for extra in ([], ['--nproc', '2'], ['--nproc', '4', '--tensor-mode', '2d']):
        code, out, err = _cli(['eval', ckpt] + extra, capfd)
        assert code == 0, err
        printed = float(re.search(r'evaluation: test_loss=([\d.]+)', out).group(1))
        assert printed == pytest.approx(metrics['test_loss'], abs=2e-6), extra


@pytest.fixture(scope='module')
def vit_job(tmp_path_factory):
    return _job_checkpoint(tmp_path_factory.mktemp('vit'), VIT_JOB, {}, 1, 'vit')


def test_eval_of_a_vit_prints_the_training_runs_loss_and_accuracy(vit_job, capfd):
    ckpt, metrics = vit_job
    code, out, err = _cli(['eval', ckpt], capfd)
    assert code == 0, err
    found = dict(re.findall(r'(test_\w+)=([\d.]+)', out))
    assert float(found['test_loss']) == pytest.approx(metrics['test_loss'], abs=2e-6)
    assert float(found['test_accuracy']) == pytest.approx(metrics['test_accuracy'], abs=2e-6)
    code, _, err = _cli(['generate', ckpt, '--prompt', 'x', '--tokens', '2'], capfd)
    assert code == 2 and "holds a 'vit' model; generate needs a causal language model" in err


@pytest.mark.parametrize('job,hf_class,inputs', [
    ('gpt_job', 'GPT2LMHeadModel', lambda: _ids(batch=2, seq=20)),
    ('vit_job', 'ViTForImageClassification',
     lambda: torch.randn(3, 1, 8, 8, generator=torch.Generator().manual_seed(4))),
])
def test_export_writes_a_transformers_directory_with_our_logits(request, tmp_path, capfd, job,
                                                                hf_class, inputs):
    import transformers
    ckpt = request.getfixturevalue(job)[0]
    code, _, err = _cli(['export', ckpt, '--hf', str(tmp_path / 'hf')], capfd)
    assert code == 0, err
    hf = getattr(transformers, hf_class).from_pretrained(str(tmp_path / 'hf')).eval()
    x = inputs()
    with torch.no_grad():
        ours, theirs = _loaded(ckpt)(x), hf(x).logits
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max() <= 1e-5 * _scale(theirs)


@pytest.mark.parametrize('argv,message', [
    (['--nproc', '3', '--tensor-mode', '2d'], '--nproc 3 does not fit --tensor-mode 2d: 2D tensor '
                                              'parallelism needs .* = q\\*q, got 3'),
    (['--nproc', '8', '--tensor-mode', '2.5d'], '--nproc 8 does not fit --tensor-mode 2.5d: '
                                                '2.5D tensor parallelism needs .*depth'),
    (['--depth', '2'], '--depth applies only to --tensor-mode 2.5d'),
    (['--nproc', '8'], 'cannot be split over 8 process\\(es\\) in tensor mode 1d'),
    (['--prompt', 'x' * 40], "a prompt of 40 tokens exceeds the model's max_positions 32"),
    (['--top-k', '0'], 'top_k must be a positive integer or None, got 0'),
    (['--greedy', '--temperature', '0.5'], '--greedy picks the most likely token: it takes no '
                                           '--temperature'),
])
def test_bad_generate_arguments_exit_2_before_any_worker_starts(gpt_job, capfd, no_workers,
                                                                argv, message):
    base = ['generate', gpt_job[0], '--prompt', 'MACBETH:', '--tokens', '4']
    code, _, err = _cli(base + argv, capfd)
    assert code == 2 and re.search(message, err), err


@pytest.mark.parametrize('argv,message', [
    (['--nproc', '8'], "tensor mode '1d' splits the attention heads 8 ways .* 'model.heads' "
                       "\\(attention heads\\) divisible by 8, got 4"),
    (['--batches', '0'], '--batches must be a positive integer, got 0'),
])
def test_bad_eval_arguments_exit_2_before_any_worker_starts(gpt_job, capfd, no_workers, argv,
                                                            message):
    code, _, err = _cli(['eval', gpt_job[0]] + argv, capfd)
    assert code == 2 and re.search(message, err), err


ON_2_NODES = ['--nnodes', '2', '--node-rank', '0', '--rdzv-endpoint', '127.0.0.1:29999']
SLURM_2_NODES = dict(SLURM_NNODES='2', SLURM_NODEID='0', SLURM_JOB_ID='7',
                     SLURM_JOB_NODELIST='127.0.0.1', MASTER_PORT='29999')


@pytest.mark.parametrize('command,argv,env,message', [
    ('generate', ['--nproc', '3', '--tensor-mode', '2d'] + ON_2_NODES, {},
     r'6 processes \(--nnodes 2 x --nproc 3\) do not fit --tensor-mode 2d: 2D tensor '
     r'parallelism needs .* = q\*q, got 6'),
    ('generate', ['--nproc', '4'] + ON_2_NODES, {},
     r'cannot be split over 8 process\(es\) \(--nnodes 2 x --nproc 4\) in tensor mode 1d'),
    ('generate', ['--nproc', '4'], SLURM_2_NODES,
     r'cannot be split over 8 process\(es\) \(SLURM_NNODES=2 x --nproc 4\) in tensor mode 1d'),
    ('eval', ['--nproc', '1', '--tensor-mode', '2d', '--nnodes', '3', '--node-rank', '0',
              '--rdzv-endpoint', '127.0.0.1:29999'], {},
     r'3 processes \(--nnodes 3 x --nproc 1\) do not fit --tensor-mode 2d'),
    ('eval', ['--nproc', '4'] + ON_2_NODES, {},
     r"on 8 processes \(--nnodes 2 x --nproc 4\): tensor mode '1d' splits the attention heads "
     r"8 ways .* divisible by 8, got 4"),
])
def test_multi_node_world_size_errors_name_nnodes_times_nproc(gpt_job, capfd, monkeypatch,
                                                              command, argv, env, message):
    """generate / eval on several nodes: the tensor-parallel size is nnodes x nproc, and an
    error about it names that total and the flags (or variables) it comes from."""
    import importlib
    for name in list(os.environ):
        if name.startswith('SLURM_') or name in ('MASTER_ADDR', 'MASTER_PORT'):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    module = importlib.import_module(f'colossal_lite.commands.{command}')
    monkeypatch.setattr(module, 'run_workers', lambda *a, **k: pytest.fail('a worker started'))
    base = ['generate', gpt_job[0], '--prompt', 'MACBETH:', '--tokens', '4'] \
        if command == 'generate' else ['eval', gpt_job[0]]
    code, _, err = _cli(base + argv, capfd)
    assert code == 2 and re.search(message, err), err


def test_commands_on_a_directory_that_is_not_a_job_checkpoint_exit_2(tmp_path, capfd, no_workers):
    for argv in (['generate', str(tmp_path), '--prompt', 'a', '--tokens', '1'],
                 ['eval', str(tmp_path)], ['export', str(tmp_path), '--hf', str(tmp_path / 'hf')]):
        code, _, err = _cli(argv, capfd)
        assert code == 2 and 'is not a complete checkpoint' in err, err


def test_generate_encodes_with_the_bpe_tokenizer_of_an_hf_job(tmp_path, capfd):
    from colossal_lite.data import corpus_files
    from tokenizers import Tokenizer
    run_dir = tmp_path / 'run'
    job = GPT_JOB.replace(
        "data = dict(type='shakespeare', seq_len=16, val_fraction=0.05, plays=['macbeth'])",
        f"data = dict(type='hf', path='text', data_files=[{str(corpus_files(['macbeth'])[0])!r}], "
        f"seq_len=16, tokenizer=dict(type='bpe', vocab_size=300))").replace(
        'eval_batches=2)', f'eval_batches=2, run_dir={str(run_dir)!r})')
    ckpt, _ = _job_checkpoint(tmp_path, job, {}, 1, 'bpe')
    tok = Tokenizer.from_file(str(run_dir / 'tokenizer.json'))
    prompt = tok.encode('MACBETH: So foul').ids
    expected = tok.decode(_greedy_without_cache(_loaded(ckpt), torch.tensor([prompt]), 6)[0]
                          .tolist())
    for extra in ([], ['--nproc', '2']):
        code, out, err = _cli(['generate', ckpt, '--prompt', 'MACBETH: So foul', '--tokens', '6',
                               '--greedy'] + extra, capfd)
        assert code == 0, err
        assert out == expected + '\n'
