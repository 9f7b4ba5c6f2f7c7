"""Llama with ``moe=dict(...)`` (Mixtral-style blocks: the MLP is ``colossal_lite.nn.MoE``):
the model's checks, the engine's wiring of the auxiliary losses and the balancing bias,
and exactness against the serial model through initialize -> execute_schedule -> step.

Every comparison runs 3 AdamW steps with eps=1 (the update follows the gradient's scale,
so an aux-loss gradient off by a constant factor shows) and checks the loss, every gathered
gradient, every weight and every layer's balancing bias (``router.balance.bias``).

Gradient accumulation: each micro-batch's aux loss is that micro-batch's (its own counts
``f``, as Megatron), so the accumulated objective is ``mean_m (loss_m + aux_m)``: the
reference is the serial model's plain loop ``loss_m.backward()`` per micro-batch (the layer's
default ``aux_loss_scale`` 1 adds ``aux_m``'s gradient) with the gradients divided by M.
Without the aux loss it is the serial full batch itself (also tested).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

import colossal_lite as clt
from colossal_lite import checkpoint, cli
from colossal_lite.checkpoint import state as checkpoint_state
from colossal_lite.amp import TorchAmp
from colossal_lite.config import ConfigError
from colossal_lite.engine import Engine
from colossal_lite.nn.moe import update_balance_biases
from colossal_lite.testing import (assert_matches_serial, engine_step, replica_batch,
                                   run_distributed, training_trace)
from colossal_lite.trainer import Trainer, hooks as H
from model_zoo import Llama

from tests.model_cases import make_case

MOE = dict(experts=4, top_k=2, aux_loss_coef=0.1, z_loss_coef=0.01, bias_update_rate=0.01)
CLIP = 1.0
TIMEOUT = 600
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _optimizer(params):
    """AdamW with eps=1: the step follows the gradient's scale (docs/DESIGN "Correctness")."""
    return torch.optim.AdamW(params, lr=0.05, eps=1.0, weight_decay=0.01)


def _case():
    return make_case('llama', batch=8, seq=16)


def _biases(model) -> dict:
    return {name: buf.detach().clone() for name, buf in model.named_buffers()
            if name.endswith('balance.bias')}


def _step(engine, batch):
    out = engine_step(engine, batch)
    if hasattr(engine.optimizer, 'full_gradients'):
        out['grads'] = engine.optimizer.full_gradients()
    out['bias'] = _biases(engine.model)
    return out


def _regrouped(batch, replicas: int, micro: int):
    """The rows of ``batch`` reordered so that a serial run's micro-batch m holds the rows of
    micro-batch m of every one of ``replicas`` data-parallel replicas (the grouping the aux
    loss's counts see; the loss, a mean over rows, is unchanged)."""
    rows = batch[0].shape[0]
    per, part = rows // replicas, rows // replicas // micro
    order = [r * per + m * part + j for m in range(micro) for r in range(replicas)
             for j in range(part)]
    return tuple(t[order] for t in batch)


def _trace(rank, moe, model_kw=(), regroup=1):
    """The engine's trace; ``regroup`` = D: the serial reference of D replicas x M
    micro-batches (:func:`_regrouped`)."""
    case = _case()
    torch.manual_seed(0)
    model = case.build(moe=dict(moe), **dict(model_kw))
    engine, *_ = clt.initialize(model, _optimizer(model.parameters()), case.criterion())
    assert engine.moe_layers
    batch = case.batch
    if regroup > 1:
        batch = _regrouped(batch, regroup, engine.num_microbatches)
    return training_trace(engine, batch, steps=3, step_fn=_step)


def _accumulating_step(criterion, optimizer, micro: int, autocast: bool = False):
    """The serial reference of M accumulated micro-batches: per micro-batch a plain
    ``loss_m.backward()`` (aux_loss_scale 1: the gradient of ``loss_m + aux_m``), the
    gradients divided by M, the optimizer step, the balancing biases updated."""
    def step(model, batch):
        optimizer.zero_grad(set_to_none=True)
        inputs, labels = batch
        losses = []
        for x, y in zip(inputs.chunk(micro), labels.chunk(micro)):
            with torch.autocast('cpu', dtype=torch.bfloat16, enabled=autocast):
                loss = criterion(model(x), y)
            loss.backward()
            losses.append(loss.detach().float())
        for p in model.parameters():
            if p.grad is not None:
                p.grad.div_(micro)
        optimizer.step()
        update_balance_biases(model)
        return {'loss': torch.stack(losses).mean(), 'bias': _biases(model)}
    return step


def _reference(rank, moe, micro, autocast=False):
    case = _case()
    torch.manual_seed(0)
    model = case.build(moe=dict(moe))
    step = _accumulating_step(case.criterion(), _optimizer(model.parameters()), micro, autocast)
    return training_trace(model, case.batch, steps=3, step_fn=step)


def _scaled_amp_trace(rank, moe, micro, scale):
    """The engine under fp16 mode 'torch' with a GradScaler of scale S (forced on CPU:
    bf16 autocast; S a power of 2, so scaling and unscaling are exact) and M micro-steps."""
    case = _case()
    torch.manual_seed(0)
    model = case.build(moe=dict(moe))
    optimizer = _optimizer(model.parameters())
    amp = TorchAmp(model, optimizer, scaler_kwargs=dict(init_scale=scale, growth_interval=1000),
                   use_scaler=True)
    engine = Engine(model, optimizer, case.criterion(), amp=amp, num_microbatches=micro)
    seen = []
    hook = model.blocks['0'].mlp.register_full_backward_hook(
        lambda *_: seen.append(model.blocks['0'].mlp.aux_loss_scale))
    trace = training_trace(engine, case.batch, steps=3, step_fn=_step)
    hook.remove()
    return trace, seen, engine.loss_scale


# ----------------------------------------------------------------------------- the model
def test_every_block_or_all_but_the_first_dense_become_moe():
    model = Llama.from_preset('tiny', layers=3, moe=dict(MOE, first_dense=1))
    kinds = [type(model.blocks[str(i)].mlp).__name__ for i in range(3)]
    assert kinds == ['SwiGLU', 'MoE', 'MoE']
    moe = model.blocks['2'].mlp
    assert (moe.num_experts, moe.top_k, moe.aux_loss_coef) == (4, 2, 0.1)
    assert model.state_dict()['blocks.2.mlp.experts.gate'].shape == (4, 64, 128)
    assert Llama.from_preset('tiny', moe=dict(MOE, ffn_hidden=32)).state_dict()[
        'blocks.0.mlp.experts.down'].shape == (4, 32, 64)


@pytest.mark.parametrize('moe,message', [
    (dict(experts=2, top_k=3), "'model.moe.top_k' = 3 exceeds 'model.moe.experts' = 2"),
    (dict(experts=4, top_k=2, capacity_factor=0),
     "'model.moe.capacity_factor' must be None (dropless) or a number > 0, got 0"),
    (dict(experts=4, top_k=2, capacity_factor=-1.5),
     "'model.moe.capacity_factor' must be None (dropless) or a number > 0, got -1.5"),
    (dict(experts=4), "'model.moe.top_k' is required"),
    (dict(experts=4, top_k=1, first_dense=3), "'model.moe.first_dense' must be an integer"),
    (dict(experts=4, top_k=1, topk=2), "unknown 'model.moe' keys ['topk']"),
    (dict(experts=4, top_k=1, expert_tensor_parallel=True),
     "'model.moe.expert_tensor_parallel' = True needs 1D tensor parallelism"),
    (dict(experts=4, top_k=1, expert_tensor_parallel='yes'),
     "'model.moe.expert_tensor_parallel' must be None, True or False, got 'yes'"),
])
def test_bad_moe_options_name_the_key(moe, message):
    with pytest.raises(ConfigError) as info:
        Llama.from_preset('tiny', moe=moe)
    assert message in str(info.value)


def _experts_error(rank):
    try:
        Llama.from_preset('tiny', moe=dict(experts=6, top_k=2))
    except ConfigError as err:
        return str(err)


def test_experts_not_divisible_by_expert_ranks_fails_before_any_collective():
    messages = run_distributed(_experts_error, 4, dict(parallel=dict(expert=4)))
    assert messages == ["'model.moe.experts' = 6 must be divisible by 'parallel.expert' = 4 "
                        "(each expert rank holds experts / parallel.expert of every MoE "
                        "layer)"] * 4


@pytest.mark.parametrize('moe,message', [
    ("dict(experts=2, top_k=3)", "'model.moe.top_k' = 3 exceeds 'model.moe.experts' = 2"),
    ("dict(experts=3, top_k=1)",
     "'model.moe.experts' = 3 must be divisible by 'parallel.expert' = 2"),
    ("dict(experts=4, top_k=1, capacity_factor=0)", "'model.moe.capacity_factor'"),
])
def test_cli_refuses_bad_moe_before_any_process_starts(tmp_path, moe, message):
    path = tmp_path / 'job.py'
    path.write_text(f"imports = ['model_zoo']\nparallel = dict(expert=2)\n"
                    f"model = dict(type='llama', preset='tiny', moe={moe})\n"
                    f"data = dict(type='shakespeare', seq_len=16)\n"
                    f"train = dict(global_batch_size=8)\n")
    with pytest.raises(ConfigError) as info:
        cli.check_job(str(path), 4, None)
    assert message in str(info.value)


def test_cli_refuses_an_expert_width_the_tensor_group_cannot_cut(tmp_path):
    path = tmp_path / 'job.py'
    path.write_text("imports = ['model_zoo']\n"
                    "parallel = dict(expert=2, tensor=dict(size=2, mode='1d'))\n"
                    "model = dict(type='llama', preset='tiny', "
                    "moe=dict(experts=4, top_k=1, ffn_hidden=33))\n"
                    "data = dict(type='shakespeare', seq_len=16)\n"
                    "train = dict(global_batch_size=8)\n")
    with pytest.raises(ConfigError) as info:
        cli.check_job(str(path), 8, None)
    assert ("the expert width ('model.moe.ffn_hidden', else 'model.intermediate') = 33 must "
            "be divisible by 'parallel.tensor.size' = 2") in str(info.value)


# ----------------------------------------------------------------------------- the engine
def test_engine_without_moe_layers_does_nothing_extra():
    model = make_case('llama').build()
    engine = Engine(model, _optimizer(model.parameters()))
    assert engine.moe_layers == []


def test_gradient_accumulation_equals_the_serial_micro_batch_objective():
    engine = run_distributed(_trace, 1, dict(gradient_accumulation=2), MOE)[0]
    reference = run_distributed(_reference, 1, None, MOE, 2)[0]
    assert_matches_serial(engine, reference)
    biases = engine.named(2, 'bias')   # moved by 3 updates (counts of both micro-batches)
    assert len(biases) == 2 and all(float(b.abs().max()) > 0 for b in biases.values())


def test_gradient_accumulation_without_aux_equals_the_serial_full_batch():
    moe = dict(MOE, aux_loss_coef=0.0, z_loss_coef=0.0)
    accumulated = run_distributed(_trace, 1, dict(gradient_accumulation=2), moe)[0]
    full = run_distributed(_trace, 1, None, moe)[0]
    assert_matches_serial(accumulated, full)


def _unscaled_trace(rank):
    Engine.scale_auxiliary_losses = lambda self: None   # in this child process only
    return _trace(rank, MOE)


def test_wrong_aux_scale_would_be_caught():
    """The comparison can fail: the same accumulation with the aux losses' gradient left
    at 1 (not 1/M) differs from the reference."""
    wrong = run_distributed(_unscaled_trace, 1, dict(gradient_accumulation=2))[0]
    reference = run_distributed(_reference, 1, None, MOE, 2)[0]
    with pytest.raises(AssertionError):
        assert_matches_serial(wrong, reference)


def test_amp_loss_scale_and_accumulation_scale_the_aux_gradient():
    (trace, seen, scale), = run_distributed(_scaled_amp_trace, 1, None, MOE, 2, 1024.0)
    assert scale == 1024.0 and seen and set(seen) == {512.0}   # S / M read in every backward
    reference = run_distributed(_reference, 1, None, MOE, 2, True)[0]
    assert_matches_serial(trace, reference, tol=1e-4)


# ----------------------------------------------------------------------------- layouts
def _config(parallel, **extra):
    return dict(parallel=parallel, clip_grad_norm=CLIP, **extra)


@pytest.fixture(scope='module')
def serial():
    """The serial engine's traces: (model options, micro-batches) -> trace. With M > 1 each
    micro-batch has its own aux loss (module doc), so a pipeline of M micro-batches over D
    replicas is compared with the serial engine accumulating the same M global
    micro-batches (rows regrouped: :func:`_regrouped`)."""
    return {(kw, m): run_distributed(_trace, 1, _config({}, num_microbatches=m), MOE, kw,
                                     2 if m > 1 else 1)[0]
            for kw, m in (((), 1), ((('layers', 4),), 2))}


LAYOUTS = {  # id: (world, config, model options)
    'data2-expert2': (2, _config(dict(expert=2)), ()),
    'data4-expert2': (4, _config(dict(expert=2)), ()),
    'data4-expert4': (4, _config(dict(expert=4)), ()),
    'expert2-tp2': (4, _config(dict(expert=2, tensor=dict(size=2, mode='1d'))), ()),
    'expert2-tp2-sp': (4, _config(dict(expert=2, tensor=dict(size=2, mode='1d',
                                                              sequence_parallel=True))), ()),
    'expert2-tp2-whole-experts': (4, _config(dict(expert=2, tensor=dict(size=2, mode='1d'))),
                                  (('expert_tensor_parallel', False),)),
    'expert2-pp2': (4, _config(dict(expert=2, pipeline=2), num_microbatches=2),
                    (('layers', 4),)),
    'expert2-pp2-interleaved': (4, _config(dict(expert=2, pipeline=dict(
        size=2, chunks=2, schedule='interleaved')), num_microbatches=2), (('layers', 4),)),
    'expert2-pp2-zero-bubble': (4, _config(dict(expert=2, pipeline=dict(
        size=2, schedule='zero_bubble')), num_microbatches=2), (('layers', 4),)),
    'expert2-zero3': (2, _config(dict(expert=2), zero=dict(stage=3)), ()),
    'expert2-sequence2': (4, _config(dict(expert=2, tensor=dict(size=2, mode='sequence'))), ()),
}


@pytest.mark.parametrize('layout', list(LAYOUTS))
def test_llama_moe_equals_serial(serial, layout):
    """Each layout's 3 AdamW steps equal serial. expert2-tp2 cuts each expert's width over
    the tensor pair (expert tensor parallelism, the default under 1D); -whole-experts keeps
    them whole (``expert_tensor_parallel=False``: replicated over the pair)."""
    world, config, options = LAYOUTS[layout]
    moe_kw = tuple(kv for kv in options if kv[0] == 'expert_tensor_parallel')
    model_kw = tuple(kv for kv in options if kv not in moe_kw)
    traces = run_distributed(_trace, world, config, dict(MOE, **dict(moe_kw)), model_kw,
                             timeout=TIMEOUT)
    assert_matches_serial(traces, serial[model_kw, config.get('num_microbatches', 1)])



SP_SHARED = dict(MOE, shared_experts=1, shared_gate=True, capacity_factor=1.5)


def test_shared_gated_experts_and_capacity_under_1d_sequence_parallel_equal_serial():
    """Under expert 2 x 1D t=2 with sequence parallelism the routed experts see the whole
    sequences (capacity counts per sequence as serially) while the shared expert and its gate
    run on each rank's sequence block (the gate's gradient summed over the pair)."""
    serial = run_distributed(_trace, 1, _config({}), SP_SHARED, ())[0]
    layout = dict(expert=2, tensor=dict(size=2, mode='1d', sequence_parallel=True))
    traces = run_distributed(_trace, 4, _config(layout), SP_SHARED, (), timeout=TIMEOUT)
    assert_matches_serial(traces, serial)


# ----------------------------------------------------------------------------- logging
def _logged(rank, regroup):
    """One trainer step with MoEStatsHook: its metrics (the step's 2 micro-batches: this
    replica's rows in halves; serially the regrouped global batch)."""
    case = _case()
    torch.manual_seed(0)
    model = case.build(moe=dict(MOE), layers=4)
    engine, *_ = clt.initialize(model, _optimizer(model.parameters()), case.criterion())
    batch = case.batch
    if regroup > 1:
        batch = _regrouped(batch, regroup, engine.num_microbatches)
    inputs, labels = replica_batch(batch)
    micro = list(zip(inputs.chunk(2), labels.chunk(2)))
    trainer = Trainer(engine)
    trainer.fit(micro, epochs=1, hooks=[H.LossHook(), H.MoEStatsHook()])
    counts = [layer.step_tokens_per_expert for layer in engine.moe_layers]
    return {k: trainer.metrics[k] for k in H.MOE_METRICS if k in trainer.metrics}, counts


def test_stats_hook_logs_tokens_per_expert_and_aux_loss_as_serial():
    (serial, counts), = run_distributed(_logged, 1, dict(num_microbatches=2), 2)
    # 8 x 16 tokens x top-2 over 4 experts: 64 slots per expert on average, in every layer
    assert serial['expert_tokens_mean'] == 64.0
    flat = torch.stack(counts)
    assert all(int(c.sum()) == 256 for c in counts)
    assert (serial['expert_tokens_min'], serial['expert_tokens_max']) == (
        float(flat.min()), float(flat.max()))
    assert serial['expert_tokens_max_over_mean'] == float((flat.max(1).values / 64).max())
    assert serial['moe_aux_loss'] > 0.1 * 4 * 0.5 and serial['moe_z_loss'] > 0   # 4 layers
    parallel = run_distributed(_logged, 4, dict(parallel=dict(pipeline=2, expert=2),
                                                num_microbatches=2), 1, timeout=TIMEOUT)
    for metrics, _ in parallel:
        assert set(metrics) == set(serial)
        for key, value in serial.items():
            assert abs(metrics[key] - value) <= 1e-5 * max(1.0, abs(value)), (key, metrics[key],
                                                                               value)


# ----------------------------------------------------------------------------- the config
def test_mixtral_plays_config_trains_and_logs_tokens_per_expert(tmp_path):
    """``colossal-lite train configs/mixtral_plays.py --nproc 4 --steps 6`` (data 4 = expert
    2 x expert_data 2): exit 0, the progress line with the loss and the tokens per expert,
    the final tokens-per-expert line, metrics.jsonl with them per step."""
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS='1')
    run = subprocess.run([sys.executable, '-m', 'colossal_lite.cli', 'train',
                          os.path.join(REPO, 'configs', 'mixtral_plays.py'), '--nproc', '4',
                          '--steps', '6'], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=TIMEOUT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert 'layout data=4 expert=2 pipeline=1' in run.stdout
    line = re.search(r'^step=5 epoch=0 loss=([\d.]+) expert_tokens_min=(\d+) '
                     r'expert_tokens_mean=(\d+) expert_tokens_max=(\d+)', run.stdout, re.M)
    assert line, run.stdout
    # 16 x 128 tokens x top-2 over 4 experts: 1024 slots per expert on average
    assert int(line[3]) == 1024 and int(line[2]) <= 1024 <= int(line[4])
    assert 'tokens per expert (last step, all MoE layers): min=' in run.stdout
    records = [json.loads(x) for x in
               (tmp_path / 'runs' / 'mixtral_plays' / 'metrics.jsonl').read_text().splitlines()]
    steps = [r for r in records if 'loss' in r]
    assert len(steps) == 6 and all(r['expert_tokens_mean'] == 1024 and r['moe_aux_loss'] > 0
                                   for r in steps)


# ----------------------------------------------------------------------------- checkpoints
def _moe_engine():
    case = _case()
    torch.manual_seed(0)
    model = case.build(moe=dict(MOE))
    engine, *_ = clt.initialize(model, _optimizer(model.parameters()), case.criterion())
    return engine


def _full_state(engine) -> dict:
    return {k: v.detach().cpu().clone()
            for k, v in checkpoint_state.tensor_state(engine).items()}


def _train_save(rank, path):
    engine = _moe_engine()
    for _ in range(2):
        _step(engine, replica_batch(_case().batch))
    checkpoint.save(path, engine)
    return _full_state(engine)


def _load_save(rank, path, again):
    engine = _moe_engine()
    checkpoint.load(path, engine)
    if again:
        checkpoint.save(again, engine)
    return _full_state(engine), tuple(engine.model.blocks['0'].mlp.experts.gate.shape)


def _merged(states):
    out = {}
    for state in states:
        for key, value in state.items():
            assert key not in out or torch.equal(out[key], value), f'ranks disagree on {key}'
            out[key] = value
    return out


def test_checkpoints_reshard_across_expert_layouts(tmp_path):
    """2 AdamW steps at E=4 (data 4), saved; loaded at E=2 x 1D t=2 (each rank holding 2
    experts cut in width: [2, 64, 64]) and saved again; loaded serially: weights, moments
    and balancing biases bit-equal to what E=4 saved, at every hop (DCP reshards the
    expert and tensor cuts)."""
    first, second = str(tmp_path / 'e4'), str(tmp_path / 'e2t2')
    saved = _merged(run_distributed(_train_save, 4, _config(dict(expert=4)), first,
                                    timeout=TIMEOUT))
    assert any('experts.gate' in k and k.endswith('exp_avg_sq') for k in saved)
    assert any(k.endswith('balance.bias') for k in saved)
    hops = [run_distributed(_load_save, 4, _config(dict(expert=2, tensor=dict(size=2, mode='1d'))),
                            first, second, timeout=TIMEOUT),
            run_distributed(_load_save, 1, _config({}), second, None, timeout=TIMEOUT)]
    assert {shape for _, shape in hops[0]} == {(2, 64, 64)}
    assert {shape for _, shape in hops[1]} == {(4, 64, 128)}
    for results in hops:
        loaded = _merged(state for state, _ in results)
        assert set(loaded) == set(saved), set(loaded) ^ set(saved)
        for key, value in saved.items():
            assert torch.equal(loaded[key].to(value.dtype), value), key
