"""The CUDA paths of colossal_lite, each checked against a CPU or plain-torch reference.

Every test here is marked ``gpu`` and skipped where ``torch.cuda.is_available()`` is False,
so the CPU suite collects and skips them; ``scripts/gpu_check.sh`` runs them on a GPU machine
(``python -m pytest -m gpu tests/test_gpu.py``). Until that script has run on a GPU, none of
these paths has ever executed on one.

* launch: a world of one rank through ``colossal_lite.launch`` picks NCCL and ``cuda:0``,
  registers a CUDA stream per parallel mode, runs real NCCL collectives, and trains a tiny
  GPT to the CPU model's loss, gradients and weights (fp32 tolerance).
* ``colossal-lite train``: the same job on NCCL + CUDA and on gloo + CPU logs the same
  losses (and with two GPUs, data parallel over NCCL).
* AMP: torch autocast fp16 with ``torch.amp.GradScaler`` and naive fp16 (fp32 masters)
  track the fp32 run (losses, and the update of SGD); an overflowing loss scale skips the
  step without touching a weight and halves the scale, step by step.
* HybridAdam: CUDA parameters (torch's fused Adam, or apex when installed) and mixed
  CPU/CUDA parameters equal ``torch.optim.AdamW`` / ``Adam`` after 8 steps, with a loss
  scale too; its state dict goes to torch's AdamW and back on CUDA.
* NVIDIA apex: detected when installed (then apex amp trains like fp32, in a subprocess:
  apex O1 patches torch globally), else ``fp16.mode='apex'`` is a named ConfigError.
* chunk ZeRO-3 ``placement='auto'``: without ``device_memory_limit`` the budget is the free
  memory ``torch.cuda.mem_get_info`` reported when the engine was built; the cache budget
  is that minus the traced non-model peak; masters and Adam moments stay on the CPU; the
  run equals serial CPU AdamW (also under a forced budget that evicts).
* offload: ZeRO-2 ``offload_optimizer`` and ZeRO-3 ``placement='cpu'`` keep masters and
  optimizer states on the CPU and end where the same run with them on the GPU ends.
* generation: KV-cached and full logits on CUDA equal the CPU's; greedy and top-k tokens
  (window sliding past ``max_positions``) equal the CPU's.
* checkpoints: saved from CUDA, loaded on CPU, saved again and loaded on CUDA: every model
  and optimizer tensor bit-equal, and training continues as the original (plain AdamW and
  HybridAdam); a checkpoint saved under NCCL loads into a serial CPU engine.
* RNG: ``run_state.resume`` restores the CUDA generator and the per-mode CUDA streams, so
  draws after the restore repeat those after the save.

The bodies are helpers taking the device (``_..._run(device)``), so everything but the
CUDA-only assertions can be run on CPU while developing (``world_of_one`` picks gloo there).
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import colossal_lite as clt
import colossal_lite.generation as generation
import colossal_lite.nn.optimizer.cpu_adam as cpu_adam
import colossal_lite.run_state as run_state
from colossal_lite import checkpoint
from colossal_lite.amp import apex_amp_module, build_amp
from colossal_lite.config import ConfigError
from colossal_lite.context import ParallelMode, seed, seed_manager
from colossal_lite.context import global_context as gpc
from colossal_lite.nn.optimizer import HybridAdam
from colossal_lite.testing import (Trace, assert_matches_serial, free_port, make_optimizer,
                                   max_rel_diff, plain_step, training_trace)
from model_zoo import GPT, GPTLMLoss, Llama

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason='needs a CUDA GPU (torch.cuda.is_available() is False); run scripts/gpu_check.sh '
           'on a GPU machine')]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA = torch.device('cuda', 0)  # the device under test (set it to the CPU to try the helpers)
CPU = torch.device('cpu')
STEPS = 4
FP32_TOL = 1e-4         # CUDA vs CPU fp32 (other kernels, other summation order)
CHUNK_MB = 8192 * 4 / 2 ** 20   # 8192 fp32 elements per chunk: the tiny GPT in 6 chunks
MEM_SLACK = 256 * 2 ** 20       # other processes may allocate on a shared GPU
MODES = (ParallelMode.DATA, ParallelMode.PIPELINE, ParallelMode.TENSOR)


# ---------------------------------------------------------------------------- shared pieces
def build(**overrides):
    options = dict(layers=2, hidden=32, heads=4, max_positions=16, dropout=0.0)
    options.update(overrides)
    return GPT.from_preset('tiny', **options)


def global_batch(seed_: int = 0):
    ids = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(seed_))
    return ids, ids


def serial_init(seed_: int = 1) -> dict:
    torch.manual_seed(seed_)
    return {k: v.clone() for k, v in build().state_dict().items()}


def sgd(params):
    """SGD: the update follows the gradient's scale (Adam would hide a scaled gradient)."""
    return torch.optim.SGD(params, lr=0.5)


def hybrid_adam(params):
    """make_optimizer's AdamW as HybridAdam (CPU tensors through the C++ kernel)."""
    return HybridAdam(params, lr=1e-3, eps=1e-6, weight_decay=0.01)


@contextlib.contextmanager
def world_of_one(config=None, backend=None):
    """``colossal_lite.launch`` of one rank in this process (default backend: NCCL where
    CUDA is available, else gloo); the process group is destroyed and ``gpc.device`` put
    back to the CPU on exit."""
    try:
        clt.launch(dict(config or {}, timeout=120), rank=0, world_size=1, host='127.0.0.1',
                   port=free_port(), backend=backend)
        yield gpc
    finally:
        gpc.destroy()
        gpc.device = CPU


@contextlib.contextmanager
def serial_on(device: torch.device):
    """A serial run (no process group) whose engines live on ``device``."""
    saved = gpc.device
    gpc.device = torch.device(device)
    if gpc.device.type == 'cuda':
        torch.cuda.set_device(gpc.device)
    try:
        yield
    finally:
        gpc.device = saved


def _engine(init, optimizer_fn=make_optimizer, **config):
    model = build()
    model.load_state_dict(init)
    engine, *_ = clt.initialize(model, optimizer_fn(model.parameters()), GPTLMLoss(),
                                config=config)
    return engine


def _train(engine, batch, steps: int = STEPS, record=None) -> list:
    """``steps`` engine steps on ``batch``; the losses. ``record(engine)`` after each."""
    losses = []
    for _ in range(steps):
        engine.zero_grad()
        _, _, loss = engine.execute_schedule(batch)
        assert engine.step()
        losses.append(float(loss))
        if record is not None:
            record(engine)
    return losses


def _cpu(obj):
    if torch.is_tensor(obj):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    return obj


def _trace_cpu(trace: Trace) -> Trace:
    return Trace([_cpu(step) for step in trace.steps])


def serial_reference(init, batch, optimizer_fn=make_optimizer, steps: int = STEPS) -> dict:
    """The tiny GPT trained on the CPU with no launch: losses, weights, optimizer state by
    parameter name."""
    model = build()
    model.load_state_dict(init)
    opt = optimizer_fn(model.parameters())
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = GPTLMLoss()(model(batch[0]), batch[1])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    names = {id(p): n for n, p in model.named_parameters()}
    return {'losses': losses, 'params': _cpu(model.state_dict()),
            'state': {names[id(p)]: _cpu(s) for p, s in opt.state.items()}}


def _weights(engine) -> dict:
    """Full fp32 weights by state_dict key (naive AMP: the fp32 masters)."""
    weights = _cpu(engine.model.state_dict())
    names = {}
    for n, p in engine.model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)   # a tied weight under each of its names
    for p, master in getattr(engine.amp, 'pairs', ()):
        for n in names[id(p)]:
            weights[n] = _cpu(master)
    return {k: v.float() for k, v in weights.items()}


def _worst_state(actual: dict, expected: dict) -> float:
    """Largest moment difference, relative to the largest value of that moment over all
    parameters (moments of gradients that are rounding noise compare at their scale);
    the step counts must be equal."""
    worst = 0.0
    for slot in ('exp_avg', 'exp_avg_sq'):
        scale = max(s[slot].abs().max().item() for s in expected.values())
        for name, slots in expected.items():
            assert float(actual[name]['step']) == float(slots['step']), name
            diff = (actual[name][slot].float().cpu() - slots[slot]).abs().max().item()
            worst = max(worst, diff / scale)
    return worst


def _worst_params(actual: dict, expected: dict) -> float:
    assert set(actual) == set(expected), set(actual) ^ set(expected)
    return max(max_rel_diff(actual[k].cpu(), v) for k, v in expected.items())


def _close(actual, expected, tol: float) -> bool:
    return all(abs(a - e) <= tol * max(1.0, abs(e)) for a, e in zip(actual, expected)) \
        and len(actual) == len(expected)


# ---------------------------------------------------------------------------- launch / NCCL
def _launched_run(init, batch, steps: int = STEPS) -> dict:
    """Launch a world of one rank with the default backend, check real collectives on the
    run's device and train the tiny GPT through initialize (its trace, on the CPU)."""
    with world_of_one():
        out = {'backend': dist.get_backend(), 'device': gpc.device,
               'mode_streams': {m: seed_manager.get_states()[m][1] is not None for m in MODES}}
        if gpc.device.type == 'cuda':
            out['current'] = torch.cuda.current_device()
        x = torch.arange(1.0, 5.0, device=gpc.device)
        summed = x.clone()
        dist.all_reduce(summed)
        gathered = torch.empty(4, device=gpc.device)
        (getattr(dist, 'all_gather_single', None) or dist.all_gather_into_tensor)(gathered, x)
        dist.barrier()
        out['collectives'] = bool(torch.equal(summed, x) and torch.equal(gathered, x))
        engine = _engine(init)
        out['param_device'] = next(engine.model.parameters()).device
        out['trace'] = _trace_cpu(training_trace(engine, batch, steps=steps))
    return out


def test_launch_picks_nccl_and_cuda_and_trains_to_the_cpu_model():
    """launch() of one rank: backend NCCL, device cuda:0 (= torch's current device), one CUDA
    RNG stream per mode, NCCL all_reduce / all_gather / barrier work, and 4 AdamW steps on
    CUDA give the CPU model's losses, gradients and weights within fp32 tolerance."""
    init, batch = serial_init(), global_batch()
    model = build()
    model.load_state_dict(init)
    serial = training_trace(model, batch, steps=STEPS, step_fn=plain_step(
        GPTLMLoss(), make_optimizer(model.parameters()), outputs=False))
    out = _launched_run(init, batch)
    assert out['backend'] == 'nccl', out['backend']
    assert out['device'] == CUDA and out['current'] == 0, out
    assert out['param_device'] == CUDA
    assert all(out['mode_streams'].values()), out['mode_streams']
    assert out['collectives']
    assert_matches_serial(out['trace'], serial, tol=FP32_TOL)


TINY_JOB = """
imports = ['model_zoo']
model = dict(type='gpt', preset='tiny', hidden=32, layers=2, heads=4, max_positions=16, dropout=0.0)
data = dict(type='shakespeare', seq_len=16, val_fraction=0.05, plays=['macbeth'])
train = dict(global_batch_size=8, steps=6, log_every=1, eval_batches=2, run_dir={run_dir!r})
optimizer = dict(type='adamw', lr=1e-2)
backend = {backend!r}
parallel = dict(data={data})
"""


def _cli_losses(tmp_path, name: str, backend: str, nproc: int = 1, env=None) -> list:
    """``colossal-lite train`` of TINY_JOB (its own run_dir); the losses of metrics.jsonl."""
    run_dir = tmp_path / name
    path = tmp_path / f'{name}.py'
    path.write_text(TINY_JOB.format(run_dir=str(run_dir), backend=backend, data=nproc))
    full_env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS='1', **(env or {}))
    run = subprocess.run([sys.executable, '-m', 'colossal_lite.cli', 'train', str(path),
                          '--nproc', str(nproc)], cwd=str(tmp_path), env=full_env,
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    records = [json.loads(line) for line in (run_dir / 'metrics.jsonl').read_text().splitlines()]
    return [r['loss'] for r in records if 'loss' in r]


def test_cli_train_on_nccl_and_cuda_logs_the_cpu_losses(tmp_path):
    """The library's launcher (elastic agent, spawned worker) with backend='nccl' (which
    launch() refuses without CUDA) logs the losses of the gloo + CPU run
    (CUDA_VISIBLE_DEVICES='')."""
    cuda = _cli_losses(tmp_path, 'cuda', 'nccl')
    cpu = _cli_losses(tmp_path, 'cpu', 'gloo', env={'CUDA_VISIBLE_DEVICES': ''})
    assert len(cuda) == len(cpu) == 6, (cuda, cpu)
    assert _close(cuda, cpu, 5e-4), (cuda, cpu)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason='needs 2 GPUs')
def test_cli_data_parallel_over_two_gpus_logs_the_cpu_losses(tmp_path):
    """Two workers on two GPUs (NCCL all-reduce of the gradients) log the losses of two
    gloo workers on the CPU."""
    cuda = _cli_losses(tmp_path, 'cuda', 'nccl', nproc=2)
    cpu = _cli_losses(tmp_path, 'cpu', 'gloo', nproc=2, env={'CUDA_VISIBLE_DEVICES': ''})
    assert len(cuda) == len(cpu) == 6 and _close(cuda, cpu, 5e-4), (cuda, cpu)


# ---------------------------------------------------------------------------- mixed precision
def _update_error(init, ref: dict, got: dict) -> float:
    """|update - reference update| / |reference update| over all weights (global norms)."""
    num = sum(((got[k] - init[k]) - (ref[k] - init[k])).pow(2).sum() for k in init)
    den = sum((ref[k] - init[k]).pow(2).sum() for k in init)
    return float((num / den).sqrt())


def _amp_run(init, batch, fp16: dict, steps: int = STEPS) -> dict:
    """fp32 and ``fp16`` engines (SGD) in a world of one rank: losses, final fp32 weights,
    the overflow flags and loss scales of the mixed run, its strategy's facts."""
    with world_of_one():
        fp32 = _engine(init, sgd)
        ref_losses = _train(fp32, batch, steps)
        mixed = _engine(init, sgd, fp16=fp16)
        flags, scales = [], []
        losses = _train(mixed, batch, steps, record=lambda e: (flags.append(e.overflow),
                                                               scales.append(e.loss_scale)))
        amp = mixed.amp
        return {'ref_losses': ref_losses, 'losses': losses, 'ref': _weights(fp32),
                'got': _weights(mixed), 'overflow': flags, 'scales': scales,
                'param_dtype': next(mixed.model.parameters()).dtype,
                'scaler': getattr(amp, 'scaler', None), 'amp_dtype': getattr(amp, 'dtype', None),
                'device': gpc.device}


@pytest.mark.parametrize('fp16', [dict(mode='torch'), dict(mode='naive', dtype='float16')],
                         ids=['torch-autocast-fp16', 'naive-fp16'])
def test_fp16_training_tracks_fp32(fp16):
    """fp16 on CUDA: torch autocast with a torch.amp.GradScaler (fp32 weights) and naive fp16
    (fp16 weights, fp32 masters, our scaler): no overflow at the default scale (2^16, kept),
    each step's loss within 1e-3 of fp32's (relative), the 4 SGD updates within 1e-2 of
    fp32's (relative, all weights). The same runs on CPU: bf16 autocast 2e-5 and 0.004,
    naive fp16 1e-6 and 0.001, naive bf16 6e-5 and 0.006."""
    init, batch = serial_init(), global_batch()
    out = _amp_run(init, batch, fp16)
    assert out['device'] == CUDA
    assert out['overflow'] == [False] * STEPS and out['scales'] == [2.0 ** 16] * STEPS, out
    if fp16['mode'] == 'torch':
        assert isinstance(out['scaler'], torch.amp.GradScaler) and out['scaler'].is_enabled()
        assert out['amp_dtype'] == torch.float16 and out['param_dtype'] == torch.float32
        assert out['scaler'].state_dict()['_growth_tracker'] == STEPS
    else:
        assert out['param_dtype'] == torch.float16
    assert out['losses'][-1] < out['losses'][0], out['losses']
    assert _close(out['losses'], out['ref_losses'], 1e-3), (out['losses'], out['ref_losses'])
    assert _update_error(init, out['ref'], out['got']) <= 1e-2


OVERFLOWING = {  # from a loss scale of 2^40 fp16 gradients overflow; no growth in 10^6 steps
    'torch-grad-scaler': dict(mode='torch', initial_scale=2.0 ** 40, growth_interval=10 ** 6),
    'naive-fp16': dict(mode='naive', dtype='float16', initial_scale=2.0 ** 40, hysteresis=1,
                       max_scale=2.0 ** 40, growth_interval=10 ** 6),
}


def _overflow_run(init, batch, fp16: dict, steps: int = 40) -> list:
    """Per step of an ``fp16`` engine (SGD): (overflow, scale before, scale after, whether
    any fp32 weight changed, the scale its state_dict holds)."""
    with world_of_one():
        engine = _engine(init, sgd, fp16=fp16)
        rows = []
        for _ in range(steps):
            before, scale = _weights(engine), engine.loss_scale
            _train(engine, batch, 1)
            after = _weights(engine)
            changed = any(not torch.equal(before[k], after[k]) for k in before)
            saved = engine.amp.state_dict()['scaler']['scale']
            rows.append((engine.overflow, scale, engine.loss_scale, changed, saved))
        return rows


@pytest.mark.parametrize('name', sorted(OVERFLOWING))
def test_loss_scaler_skips_overflowing_steps_and_backs_off(name):
    """Starting at 2^40 the fp16 gradients overflow (torch.amp.GradScaler under autocast;
    our scaler with hysteresis 1 under naive fp16): every such step leaves every fp32 weight
    bit-equal and halves the scale; a clean step changes the weights and keeps the scale;
    the scale comes down to a power of two that trains; the state dict holds the scale."""
    rows = _overflow_run(serial_init(), global_batch(), OVERFLOWING[name])
    assert rows[0][0], 'a loss scale of 2^40 should overflow fp16 gradients'
    for overflow, before, after, changed, saved in rows:
        assert after == (before / 2 if overflow else before), rows
        assert changed == (not overflow), rows
        assert saved == after
    clean = [r for r in rows if not r[0]]
    assert clean, 'the scale never came down to one that trains'
    assert clean[0][1] == 2.0 ** (40 - rows.index(clean[0])), rows


# ---------------------------------------------------------------------------- HybridAdam
SHAPES = [(33, 17), (5,), (128, 64), (1,), (7, 3, 5)]


def _hybrid_vs_torch(devices, adamw: bool = True, loss_scale: float = 1.0, steps: int = 8):
    """HybridAdam over parameters on ``devices`` (one per shape, cycled) against torch's
    AdamW (``adamw``) or Adam with L2, on the same devices: (ours, reference params,
    our optimizer, reference optimizer)."""
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=g) for s in SHAPES]
    grads = [[torch.randn(s, generator=g) for s in SHAPES] for _ in range(steps)]
    where = [torch.device(devices[i % len(devices)]) for i in range(len(SHAPES))]
    ours = [torch.nn.Parameter(t.clone().to(d)) for t, d in zip(init, where)]
    ref = [torch.nn.Parameter(t.clone().to(d)) for t, d in zip(init, where)]
    hyper = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    opt = HybridAdam(ours, adamw_mode=adamw, **hyper)
    ref_opt = (torch.optim.AdamW if adamw else torch.optim.Adam)(ref, **hyper)
    for step_grads in grads:
        for p, q, gr in zip(ours, ref, step_grads):
            p.grad = (gr * loss_scale).to(p.device)
            q.grad = gr.to(q.device)
        opt.step(loss_scale=loss_scale)
        ref_opt.step()
    return ours, ref, opt, ref_opt


def _optimizer_diff(ours, ref, opt, ref_opt) -> float:
    worst = max(max_rel_diff(p.detach().cpu(), q.detach().cpu()) for p, q in zip(ours, ref))
    for p, q in zip(ours, ref):
        for key in ('exp_avg', 'exp_avg_sq'):
            worst = max(worst, max_rel_diff(opt.state[p][key].cpu(), ref_opt.state[q][key].cpu()))
        assert float(opt.state[p]['step']) == float(ref_opt.state[q]['step'])
    return worst


@pytest.mark.parametrize('adamw', [True, False], ids=['adamw', 'adam-l2'])
@pytest.mark.parametrize('loss_scale', [1.0, 1024.0], ids=['unscaled', 'loss-scale-1024'])
def test_hybrid_adam_on_cuda_equals_torch_adam(adamw, loss_scale):
    """8 steps of HybridAdam on CUDA parameters (torch's fused kernel, apex's when installed)
    equal torch.optim.AdamW / Adam on CUDA (weights and moments, 1e-6); the moments and the
    step count live on the GPU; gradients scaled by S with step(loss_scale=S) change nothing."""
    ours, ref, opt, ref_opt = _hybrid_vs_torch([CUDA], adamw, loss_scale)
    assert _optimizer_diff(ours, ref, opt, ref_opt) <= 1e-6
    for p in ours:
        state = opt.state[p]
        assert p.device == state['exp_avg'].device == state['exp_avg_sq'].device \
            == state['step'].device == CUDA


def _state_dict_hops(devices, target: torch.device):
    """HybridAdam trained over ``devices``; its state dict into torch's AdamW on ``target``,
    that one's into a fresh HybridAdam on ``target``; one more step of both. (our params,
    torch's, our optimizer, torch's)."""
    ours, _, opt, _ = _hybrid_vs_torch(devices)
    hyper = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    plain = [torch.nn.Parameter(p.detach().to(target)) for p in ours]
    again = [torch.nn.Parameter(p.detach().to(target)) for p in ours]
    torch_adamw = torch.optim.AdamW(plain, **hyper)
    torch_adamw.load_state_dict(opt.state_dict())
    hybrid = HybridAdam(again, **hyper)
    hybrid.load_state_dict(torch_adamw.state_dict())
    g = torch.Generator().manual_seed(5)
    for p, q in zip(plain, again):
        p.grad = torch.randn(p.shape, generator=g).to(target)
        q.grad = p.grad.clone()
    torch_adamw.step()
    hybrid.step()
    return again, plain, hybrid, torch_adamw


def test_hybrid_adam_over_cpu_and_cuda_parameters_and_its_state_dict():
    """One HybridAdam over parameters on the CPU (C++ kernel) and on CUDA (fused) equals
    torch's AdamW over the same placement; each state lives with its parameter. Its state
    dict loads into torch's AdamW on CUDA and torch's back into a HybridAdam on CUDA (step
    counts moved to the GPU, as its fused step needs), and both take the same next step."""
    ours, ref, opt, ref_opt = _hybrid_vs_torch([CPU, CUDA])
    assert _optimizer_diff(ours, ref, opt, ref_opt) <= 1e-6
    for p in ours:
        assert all(opt.state[p][k].device == p.device for k in ('exp_avg', 'exp_avg_sq', 'step'))
    again, plain, hybrid, torch_adamw = _state_dict_hops([CPU, CUDA], CUDA)
    assert all(hybrid.state[p]['step'].device == CUDA for p in again)
    assert _optimizer_diff(again, plain, hybrid, torch_adamw) <= 1e-6


# ---------------------------------------------------------------------------- NVIDIA apex
APEX_SCRIPT = r"""
import json, sys
import colossal_lite as clt
from colossal_lite.context import global_context as gpc
from colossal_lite.testing import free_port
from tests.test_gpu import _engine, _train, global_batch, serial_init, sgd
clt.launch(dict(timeout=120), rank=0, world_size=1, host='127.0.0.1', port=free_port())
init, batch = serial_init(), global_batch()
fp32 = _train(_engine(init, sgd), batch, 3)
engine = _engine(init, sgd, fp16=dict(mode=sys.argv[1]))
mixed = _train(engine, batch, 3)
print(json.dumps(dict(fp32=fp32, mixed=mixed, amp=engine.amp.name, device=str(gpc.device))))
gpc.destroy()
"""


def _mixed_in_subprocess(mode: str) -> dict:
    """APEX_SCRIPT in a fresh interpreter: fp32 and fp16 ``mode`` losses (3 SGD steps)."""
    run = subprocess.run([sys.executable, '-c', APEX_SCRIPT, mode], cwd=REPO,
                         env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True,
                         timeout=240)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_nvidia_apex_is_used_when_installed_else_named_and_torch_is_the_fallback(monkeypatch):
    """With NVIDIA apex (apex.amp and its amp_C kernels): fp16 mode 'apex' trains like fp32
    (losses within 1e-2, in a fresh process) and HybridAdam steps CUDA tensors through apex's
    multi_tensor_adam, not torch's. Without it (the registry's unrelated 'apex' package
    included): mode 'apex' is a ConfigError naming NVIDIA apex, and HybridAdam's CUDA step
    is torch's AdamW with fused=True. Either way it equals torch's AdamW (1e-6)."""
    apex = cpu_adam._apex_adam() is not None
    if apex_amp_module() is None:
        model = build().to(CUDA)
        with pytest.raises(ConfigError, match='NVIDIA apex'):
            build_amp(dict(mode='apex'), model, sgd(model.parameters()))
    else:
        out = _mixed_in_subprocess('apex')
        assert out['amp'] == 'apex' and out['device'].startswith('cuda'), out
        assert _close(out['mixed'], out['fp32'], 1e-2), out
    fused = []
    real = cpu_adam.torch_adamw

    def spy(*args, **kwargs):
        fused.append(kwargs.get('fused'))
        return real(*args, **kwargs)
    monkeypatch.setattr(cpu_adam, 'torch_adamw', spy)
    assert _optimizer_diff(*_hybrid_vs_torch([CUDA])) <= 1e-6
    assert fused == ([] if apex else [True] * 8), (apex, fused)


# ---------------------------------------------------------------------------- ZeRO on CUDA
def _zero_run(init, batch, zero: dict, optimizer_fn=make_optimizer, steps: int = STEPS) -> dict:
    """An engine with ``zero`` in a world of one rank: losses, final weights, the full
    optimizer state, where masters / moments / weights live, and (stage 3) the chunk
    manager's ledger and policy facts with ``mem_get_info`` read around the build."""
    with world_of_one():
        cuda = gpc.device.type == 'cuda'
        free_before = torch.cuda.mem_get_info(gpc.device)[0] if cuda else None
        engine = _engine(init, optimizer_fn, zero=zero)
        free_after, total = torch.cuda.mem_get_info(gpc.device) if cuda else (None, None)
        losses = _train(engine, batch, steps)
        zero_opt = engine.optimizer
        out = {'losses': losses, 'params': _cpu(engine.model.state_dict()),
               'state': _cpu(zero_opt.state_dict()['state']),
               'free_before': free_before, 'free_after': free_after, 'total': total,
               'device': gpc.device,
               'master_devices': {b.master.device.type for b in zero_opt.buckets},
               'state_devices': {t.device.type for s in zero_opt.state.values()
                                 for t in s.values() if torch.is_tensor(t) and t.dim() > 0},
               'param_devices': {p.device.type for p in engine.model.parameters()}}
        manager = getattr(zero_opt, 'manager', None)
        if manager is not None:
            policy = manager.policy
            out.update(ledger=manager.ledger.stats(), policy=policy.name,
                       non_model=getattr(policy, 'non_model_bytes', None),
                       cache_budget=getattr(policy, 'cache_budget', None),
                       hits=getattr(policy, 'hits', None),
                       evictions=getattr(policy, 'evictions', None),
                       payload=max(c.payload_bytes for c in manager.chunks))
            out['param_devices'] = {c.device.type for c in manager.chunks}
        return out


def _check_auto(out: dict, ref: dict, limit: int):
    assert out['device'] == CUDA and out['policy'] == 'auto'
    assert out['ledger']['limit'] == limit, out
    assert out['non_model'] > 0 and out['cache_budget'] == limit - out['non_model'], out
    assert 0 < out['ledger']['peak'] <= limit and out['ledger']['moved_h2d'] > 0, out
    assert out['hits'] > 0, out
    assert out['master_devices'] == {'cpu'} and out['state_devices'] == {'cpu'}, out
    assert out['param_devices'] == {CUDA.type}, out
    assert _close(out['losses'], ref['losses'], FP32_TOL), (out['losses'], ref['losses'])
    assert _worst_params(out['params'], ref['params']) <= FP32_TOL
    assert _worst_state(out['state'], ref['state']) <= FP32_TOL


def test_chunk_zero_auto_budget_comes_from_mem_get_info():
    """ZeRO-3 placement='auto' on CUDA without device_memory_limit: the ledger's limit is the
    free memory when the chunk manager was built, so it lies between what mem_get_info
    reported after and before the engine's build (below the total); the cache budget is
    that limit minus the traced non-model peak; the accounted peak stays under the limit;
    fp32 masters and Adam moments stay on the CPU while the chunks compute on the GPU
    (shards copied host-to-device, cache hits, nothing evicted); 4 steps equal serial CPU
    AdamW. Then a limit leaving room for 3 of the 6 shard copies above that non-model peak:
    Belady evicts, the result is the same."""
    init, batch = serial_init(), global_batch()
    ref = serial_reference(init, batch)
    zero = dict(stage=3, placement='auto', chunk_size_mb=CHUNK_MB)
    out = _zero_run(init, batch, zero)
    limit = out['ledger']['limit']
    assert limit is not None, 'no device budget: mem_get_info was not read'
    assert out['free_after'] - MEM_SLACK <= limit <= out['free_before'] + MEM_SLACK, out
    assert limit < out['total'] and out['evictions'] == 0, out
    _check_auto(out, ref, limit)
    tight = out['non_model'] + 3 * out['payload']
    forced = _zero_run(init, batch, dict(zero, device_memory_limit=tight))
    assert forced['evictions'] > 0, forced
    _check_auto(forced, ref, tight)


OFFLOAD_CASES = {
    'zero2-offload_optimizer': (dict(stage=2, offload_optimizer=True), dict(stage=2)),
    'zero3-placement-cpu': (dict(stage=3, placement='cpu', chunk_size_mb=CHUNK_MB),
                            dict(stage=3, placement='device', chunk_size_mb=CHUNK_MB)),
}


@pytest.mark.parametrize('case', sorted(OFFLOAD_CASES))
@pytest.mark.parametrize('optimizer', ['adamw', 'hybrid_adam'])
def test_offloaded_optimizer_states_live_on_the_cpu_and_match_the_gpu_run(case, optimizer):
    """ZeRO-2 offload_optimizer / ZeRO-3 placement='cpu' on CUDA: fp32 masters and Adam
    moments on the CPU (stepped by torch's AdamW there or HybridAdam's C++ kernel), the
    model computing on the GPU; 4 steps end where the same ZeRO stage with everything on
    the GPU ends (losses and weights: 1e-5, moments: 1e-4) and where serial CPU AdamW ends."""
    offloaded, on_gpu = OFFLOAD_CASES[case]
    fn = make_optimizer if optimizer == 'adamw' else hybrid_adam
    init, batch = serial_init(), global_batch()
    ref = serial_reference(init, batch)
    off = _zero_run(init, batch, offloaded, fn)
    dev = _zero_run(init, batch, on_gpu, fn)
    assert off['master_devices'] == {'cpu'} and off['state_devices'] == {'cpu'}, off
    assert dev['master_devices'] == dev['state_devices'] == {CUDA.type}, dev
    assert off['param_devices'] == dev['param_devices'] == {CUDA.type}
    assert _close(off['losses'], dev['losses'], 1e-5), (off['losses'], dev['losses'])
    assert _worst_params(off['params'], dev['params']) <= 1e-5
    # moments stepped by two kernels (C++ on the CPU, fused on CUDA) after 4 steps of
    # gradients that differ in rounding: measured on an H100, 3.4e-7 (torch AdamW on both
    # sides) and 1.4e-5 (HybridAdam), while one step of either kernel pair agrees to 1e-7
    assert _worst_state(off['state'], dev['state']) <= FP32_TOL
    assert _close(off['losses'], ref['losses'], FP32_TOL)
    assert _worst_params(off['params'], ref['params']) <= FP32_TOL


# ---------------------------------------------------------------------------- generation
@torch.no_grad()
def _logits(model, ids, prefill: int = 5):
    """(full-sequence logits, a prefill then one token at a time through the KV cache)."""
    full = model(ids)
    cache = model.new_kv_cache()
    steps = [model(ids[:, :prefill], kv_cache=cache)]
    for t in range(prefill, ids.shape[1]):
        steps.append(model(ids[:, t:t + 1], kv_cache=cache))
    return full.cpu(), torch.cat(steps, dim=1).cpu()


def _generation_run(device, state, prompt, monkeypatch=None) -> dict:
    """Logits and tokens of the model on ``device``; with ``monkeypatch``, the smallest gap
    between the two largest logits at any greedy pick (how far from a tie each choice is)."""
    model = build().to(device)
    model.load_state_dict(state)
    model.eval()
    gaps = []
    if monkeypatch is not None:
        real = generation.pick

        def recording_pick(logits, top_k, temperature, generator):
            top2 = logits.float().topk(2, dim=-1).values
            gaps.append((top2[:, 0] - top2[:, 1]).min().item())
            return real(logits, top_k, temperature, generator)
        monkeypatch.setattr(generation, 'pick', recording_pick)
    greedy = generation.generate(model, prompt, 24)
    if monkeypatch is not None:
        monkeypatch.setattr(generation, 'pick', real)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3)).to(device)
    full, incremental = _logits(model, ids)
    return {'greedy': greedy, 'gap': min(gaps) if gaps else None,
            'sampled': generation.generate(model, prompt, 24, top_k=8, temperature=2.0, seed=3),
            'full': full, 'incremental': incremental}


def _generation_state():
    """(weights, the 2 x 16 token rows they memorized): the tiny GPT after 100 CPU Adam steps
    on two random rows, so its greedy continuation of a row's first tokens is that row
    (varied tokens, confident logits) -- a random tiny GPT repeats one token, and near-ties
    would make greedy tokens depend on rounding."""
    torch.manual_seed(0)
    model = build()
    rows = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(100):
        opt.zero_grad()
        GPTLMLoss()(model(rows), rows).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, rows


def test_generation_on_cuda_gives_the_cpu_logits_and_tokens(monkeypatch):
    """The tiny GPT on CUDA: full-sequence and KV-cached logits equal the CPU's (fp32
    tolerance); 24 greedy tokens after 6 prompt tokens of 2 rows (the memorized rows
    through the KV cache, then the 16-position window slides) and 24 top-k samples
    (temperature 2, seeded) equal the CPU's token for token. The CPU's greedy picks are at
    least 1e-2 from a tie, so equal tokens are what fp32 promises."""
    state, rows = _generation_state()
    prompt = rows[:, :6]
    cpu = _generation_run(CPU, state, prompt, monkeypatch)
    cuda = _generation_run(CUDA, state, prompt)
    assert cpu['gap'] > 1e-2, f'near-tie in the CPU greedy picks ({cpu["gap"]:.2e})'
    assert torch.equal(cpu['greedy'][:, :16], rows), 'the CPU model lost its memorized rows'
    assert max_rel_diff(cuda['full'], cpu['full']) <= FP32_TOL
    assert max_rel_diff(cuda['incremental'], cpu['full']) <= FP32_TOL
    assert cuda['greedy'].shape == (2, 30)
    assert torch.equal(cuda['greedy'], cpu['greedy'])
    assert torch.equal(cuda['sampled'], cpu['sampled'])


# ---------------------------------------------------------------------------- checkpoints
def _snapshot(engine) -> dict:
    """Every model and optimizer tensor on the CPU, keyed by name; and where they live."""
    names = {id(p): n for n, p in engine.model.named_parameters()}
    out = {'model.' + k: v for k, v in _cpu(engine.model.state_dict()).items()}
    devices = {p.device.type for p in engine.model.parameters()}
    for p, slots in engine.optimizer.state.items():
        for slot, value in slots.items():
            out[f'optim.{names[id(p)]}.{slot}'] = _cpu(torch.as_tensor(value))
            if torch.is_tensor(value) and value.dim() > 0:
                devices.add(value.device.type)
    return {'tensors': out, 'devices': devices, 'step': engine.global_step}


def _assert_same(a: dict, b: dict):
    assert set(a['tensors']) == set(b['tensors']), set(a['tensors']) ^ set(b['tensors'])
    differ = [k for k, v in a['tensors'].items()
              if v.dtype != b['tensors'][k].dtype or not torch.equal(v, b['tensors'][k])]
    assert not differ, f'not bit-equal after the round trip: {differ[:5]}'
    assert a['step'] == b['step']


def _round_trip(tmp_path, first: torch.device, second: torch.device, optimizer_fn) -> dict:
    """Train on ``first``, save; load into a fresh engine on ``second``, save; load that into
    a fresh engine on ``first``; then one more step on the original and on the copy."""
    init, other, batch = serial_init(), serial_init(7), global_batch()
    with serial_on(first):
        original = _engine(init, optimizer_fn)
        _train(original, batch, 2)
        checkpoint.save(str(tmp_path / 'a'), original)
        saved = _snapshot(original)
    with serial_on(second):
        moved = _engine(other, optimizer_fn)
        checkpoint.load(str(tmp_path / 'a'), moved)
        there = _snapshot(moved)
        checkpoint.save(str(tmp_path / 'b'), moved)
    with serial_on(first):
        back = _engine(other, optimizer_fn)
        checkpoint.load(str(tmp_path / 'b'), back)
        home = _snapshot(back)
        out = {'saved': saved, 'there': there, 'home': home, 'misplaced': _misplaced_steps(back)}
        if not out['misplaced']:   # else HybridAdam's fused CUDA step would read host memory
            out['next_losses'] = (_train(original, batch, 1), _train(back, batch, 1))
            out['next'] = (_snapshot(original), _snapshot(back))
    return out


def _misplaced_steps(engine) -> list:
    """HybridAdam keeps each step count where its parameter lives (a CUDA parameter's in
    GPU memory, which torch's fused CUDA Adam reads); the names of those that are not."""
    if not isinstance(engine.optimizer, HybridAdam):
        return []
    names = {id(p): n for n, p in engine.model.named_parameters()}
    return [names[id(p)] for p, s in engine.optimizer.state.items()
            if torch.is_tensor(s.get('step')) and s['step'].device != p.device]


@pytest.mark.parametrize('optimizer', ['adamw', 'hybrid_adam'])
def test_checkpoint_saved_on_cuda_loads_on_cpu_and_back(tmp_path, optimizer):
    """A serial engine on CUDA (2 steps) saved, loaded into a CPU engine, saved again and
    loaded into a CUDA engine: every model and optimizer tensor bit-equal at each hop, each
    engine's tensors on its own device, and the reloaded CUDA engine's next step equals the
    original's (HybridAdam: its fused CUDA step takes the loaded step counts)."""
    fn = make_optimizer if optimizer == 'adamw' else hybrid_adam
    out = _round_trip(tmp_path, CUDA, CPU, fn)
    _assert_same(out['saved'], out['there'])
    _assert_same(out['saved'], out['home'])
    assert out['saved']['devices'] == out['home']['devices'] == {CUDA.type}
    assert out['there']['devices'] == {'cpu'}
    assert not out['misplaced'], f'checkpoint.load left these step counts off the GPU: ' \
        f'{out["misplaced"][:3]}'
    (a,), (b,) = out['next_losses']
    assert abs(a - b) <= 1e-6 * max(1.0, abs(a)), (a, b)
    after, copy = out['next']
    assert max(max_rel_diff(copy['tensors'][k], v) for k, v in after['tensors'].items()) <= 1e-6


def _saved_under_launch(tmp_path, init, batch) -> dict:
    """A launched world of one trains 2 steps and saves (DCP over the default group; DTensor
    views over the device mesh); a fresh engine there loads it back. Both snapshots."""
    with world_of_one():
        engine = _engine(init)
        _train(engine, batch, 2)
        checkpoint.save(str(tmp_path / 'launched'), engine)
        fresh = _engine(serial_init(7))
        checkpoint.load(str(tmp_path / 'launched'), fresh)
        return {'saved': _snapshot(engine), 'reloaded': _snapshot(fresh)}


def test_checkpoint_saved_under_nccl_loads_into_a_serial_cpu_engine(tmp_path):
    """Saved by a launched NCCL world of one (CUDA tensors), loaded back there and into a
    serial CPU engine (another layout): bit-equal model and optimizer tensors."""
    init, batch = serial_init(), global_batch()
    out = _saved_under_launch(tmp_path, init, batch)
    _assert_same(out['saved'], out['reloaded'])
    assert out['saved']['devices'] == {CUDA.type}
    with serial_on(CPU):
        engine = _engine(serial_init(7))
        checkpoint.load(str(tmp_path / 'launched'), engine)
        on_cpu = _snapshot(engine)
    _assert_same(out['saved'], on_cpu)
    assert on_cpu['devices'] == {'cpu'}


# ---------------------------------------------------------------------------- RNG state
def _draws(device) -> list:
    """Draws from the default generators (device and CPU), dropout, and two mode streams."""
    out = [torch.randn(16, device=device), F.dropout(torch.ones(64, device=device), 0.5),
           torch.rand(4)]
    with seed(ParallelMode.TENSOR):
        out.append(torch.rand(16, device=device))
    with seed(ParallelMode.DATA):
        out.append(torch.randn(8, device=device))
    return [t.cpu() for t in out]


def _rng_run(tmp_path) -> dict:
    """In a launched world of one: save a checkpoint, draw, scramble every generator, resume
    through run_state (the worker's path), draw again."""
    path = str(tmp_path / 'ckpt')
    with world_of_one():
        device = gpc.device
        engine = _engine(serial_init())
        _train(engine, global_batch(), 1)
        checkpoint.save(path, engine)
        first = _draws(device)
        torch.manual_seed(123)
        if device.type == 'cuda':
            torch.cuda.manual_seed(456)
        with seed(ParallelMode.TENSOR):
            torch.rand(100, device=device)
        scrambled = _draws(device)
        step = run_state.resume(types.SimpleNamespace(checkpoint=None), engine, None, None, path)
        again = _draws(device)
    saved = torch.load(os.path.join(path, 'rng_0.pt'), weights_only=True)
    return {'first': first, 'scrambled': scrambled, 'again': again, 'step': step,
            'saved_cuda': saved['cuda'],
            'saved_mode_cuda': [saved['modes'][m.value][1] for m in MODES]}


def test_run_state_resume_restores_the_cuda_rng_streams(tmp_path):
    """The checkpoint holds the CUDA generator's state and each mode's CUDA stream; after
    scrambling every generator, run_state.resume restores them: the draws on CUDA (default
    stream, dropout, TENSOR and DATA streams) and on the CPU repeat bit for bit."""
    out = _rng_run(tmp_path)
    assert out['step'] == 1
    assert out['saved_cuda'] is not None and out['saved_cuda'].dtype == torch.uint8
    assert all(s is not None for s in out['saved_mode_cuda'])
    assert not any(torch.equal(a, b) for a, b in zip(out['first'], out['scrambled']))
    assert all(torch.equal(a, b) for a, b in zip(out['first'], out['again']))


# ---------------------------------------------------------------------------- MoE, graph plans
def _moe_llama(device):
    torch.manual_seed(0)
    model = Llama.from_preset('tiny', max_positions=16, moe=dict(
        experts=4, top_k=2, aux_loss_coef=0.01, z_loss_coef=0.001))
    return model.to(device).train()


def _moe_run(device) -> dict:
    """Loss, every gradient and block 1's tokens per expert of one forward + backward."""
    model = _moe_llama(device)
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0)).to(device)
    logits = model(ids)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
    loss.backward()
    return {'loss': loss.item(), 'grads': {n: p.grad.cpu() for n, p in model.named_parameters()},
            'tokens': model.blocks['1'].mlp.last_tokens_per_expert.cpu()}


def test_moe_llama_on_cuda_equals_cpu():
    """The tiny Llama with 4 experts (top-2, aux and z losses through the routing weights):
    the same routing (tokens per expert), loss and every gradient on CUDA as on the CPU."""
    cpu, cuda = _moe_run(CPU), _moe_run(CUDA)
    assert torch.equal(cuda['tokens'], cpu['tokens'])
    assert abs(cuda['loss'] - cpu['loss']) <= FP32_TOL * max(1.0, abs(cpu['loss']))
    assert set(cuda['grads']) == set(cpu['grads'])
    worst = max(max_rel_diff(cuda['grads'][k], v) for k, v in cpu['grads'].items())
    assert worst <= FP32_TOL, worst


def _hf_llama(device):
    transformers = pytest.importorskip('transformers')
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg).to(device)


class _HFLoss(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids, labels=ids, use_cache=False).loss


def _graph_plan_run(device, autocast) -> dict:
    """3 AdamW steps of HF Llama planned on a one-rank mesh (the lowered per-rank program on
    ``device``), with ``fp16=dict(mode='torch')`` when ``autocast``; and of the plain model
    under the same engine settings."""
    from colossal_lite.auto import parallelize
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1)).to(device)
    config = dict(fp16=dict(mode='torch', dtype='bfloat16')) if autocast else {}
    out = {}
    with world_of_one(backend='nccl' if device.type == 'cuda' else 'gloo'):
        for planned in (True, False):
            model = _HFLoss(_hf_llama(device))
            if planned:
                model, _ = parallelize(model, (ids,), mesh=(1,), autocast=autocast)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3)
            engine = clt.initialize(model, opt, config=config)[0]
            losses = []
            for _ in range(3):
                loss = engine(ids)
                engine.backward(loss)
                engine.step()
                engine.zero_grad()
                losses.append(loss.item())
            params = {n: (p.full_tensor() if hasattr(p, 'full_tensor') else p).detach().cpu()
                      for n, p in model.named_parameters()}
            out[planned] = dict(losses=losses, params=params,
                                failure=model.lowered.failure if planned else None)
    return out


@pytest.mark.parametrize('autocast', [None, torch.bfloat16], ids=['fp32', 'bf16-autocast'])
def test_graph_plan_runs_lowered_on_cuda_as_the_plain_model(autocast):
    """parallelize on a one-rank NCCL mesh: the lowered program runs on CUDA (no lowering
    failure) and 3 AdamW steps equal the plain HF model's under the same engine (fp32:
    1e-5; bf16 autocast, captured under it: losses 1e-3, weights 3e-3)."""
    out = _graph_plan_run(CUDA, autocast)
    planned, plain = out[True], out[False]
    assert planned['failure'] is None
    loss_tol, param_tol = (1e-5, 1e-5) if autocast is None else (1e-3, 3e-3)
    assert max(abs(a - b) for a, b in zip(planned['losses'], plain['losses'])) \
        <= loss_tol * plain['losses'][0]
    worst = max(max_rel_diff(planned['params'][k], v)
                for k, v in plain['params'].items())
    assert worst <= param_tol, worst
