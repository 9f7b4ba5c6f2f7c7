"""3D tensor parallelism (d = q = 2, 8 ranks) equals the serial model.

Two forked 8-rank runs (module fixtures): one checks every 3D layer alone against
the serial torch/1D layer built from the same full weights, and the exact byte
count of a Linear; the other checks GPT, BERT and ViT tiny presets (loss, logits,
every gradient, parameters at each of 3 AdamW steps) against serial traces
computed in this (unlaunched) process, with ``colossal_lite.testing``'s harness.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from colossal_lite.communication import comm_profile
from colossal_lite.nn.functional import attention
from colossal_lite.nn.parallel_1d import PatchEmbedding1D
from colossal_lite.nn import CrossEntropyLoss, gather_logits
from colossal_lite.nn.parallel_3d import (AttentionCore3D, Classifier3D, Dropout3D, Embedding3D,
                                          LayerNorm3D, Linear3D, PatchEmbedding3D,
                                          VocabParallelClassifier3D, VocabParallelEmbedding3D,
                                          default_cube, first_token_3d, gather_activation,
                                          qkv_3d, split_activation)
from colossal_lite.formulas import linear_3d_bytes
from colossal_lite.testing import assert_matches_serial, max_rel_diff, run_distributed
from colossal_lite.tensor import gather_full

from tests.model_cases import FAMILIES, rank_traces, serial_traces

CFG = dict(parallel=dict(tensor=dict(size=8, mode='3d')))
TOL = 1e-5
B, S, H = 8, 4, 16


def _diff(out, name, actual, expected):
    out[name] = max_rel_diff(actual.detach(), expected.detach())


def _grads_diff(out, prefix, par_module, ser_module):
    ser = dict(ser_module.named_parameters())
    for name, p in par_module.named_parameters():
        _diff(out, f'{prefix}.grad.{name}', gather_full(p.grad, p), ser[name].grad)


def _run_pair(out, name, par, ser, x_full, cube, in_layout, out_layout):
    """Forward + backward of a layer on split input vs the serial layer on the full input."""
    x_ser = x_full.clone().requires_grad_()
    x_par = split_activation(x_full, in_layout).requires_grad_()
    y_ser, y_par = ser(x_ser), par(x_par)
    dy = torch.randn_like(y_ser)
    y_ser.backward(dy)
    y_par.backward(split_activation(dy, out_layout))
    _diff(out, f'{name}.out', gather_activation(y_par, out_layout), y_ser)
    _diff(out, f'{name}.dx', gather_activation(x_par.grad, in_layout), x_ser.grad)
    _grads_diff(out, name, par, ser)


def _linear_checks(out, cube):
    torch.manual_seed(1)
    ser = nn.Sequential(nn.Linear(H, 2 * H), nn.GELU(), nn.Linear(2 * H, H), nn.Linear(H, H))
    x = torch.randn(B, S, H)
    for name, keep in (('linear_chain', False), ('linear_chain_keep', True)):
        par = nn.Sequential(Linear3D(H, 2 * H, region='enter', keep_gathered=keep), nn.GELU(),
                            Linear3D(2 * H, H, region='exit', keep_gathered=keep),
                            Linear3D(H, H, region=None, keep_gathered=keep))
        par.load_state_dict(ser.state_dict())
        ser.zero_grad()
        _run_pair(out, name, par, ser, x, cube, cube.standard, cube.standard)
    _diff(out, 'linear_chain.state_dict', par.state_dict()['3.weight'], ser.state_dict()['3.weight'])


def _norm_embed_checks(out, cube):
    torch.manual_seed(2)
    ser_ln, par_ln = nn.LayerNorm(H), LayerNorm3D(H)
    with torch.no_grad():
        ser_ln.weight.normal_(), ser_ln.bias.normal_()
    par_ln.load_state_dict(ser_ln.state_dict())
    _run_pair(out, 'layernorm', par_ln, ser_ln, torch.randn(B, S, H) * 3 + 1, cube,
              cube.standard, cube.standard)
    ids = torch.randint(0, 32, (B, S))
    for name, ser, par in (('embedding', nn.Embedding(32, H), Embedding3D(32, H)),
                           ('vocab_embedding', nn.Embedding(32, H), VocabParallelEmbedding3D(32, H))):
        par.load_state_dict(ser.state_dict())
        y_ser, y_par = ser(ids), par(ids)
        dy = torch.randn_like(y_ser)
        y_ser.backward(dy)
        y_par.backward(split_activation(dy, cube.standard))
        _diff(out, f'{name}.out', gather_activation(y_par, cube.standard), y_ser)
        _grads_diff(out, name, par, ser)
    torch.manual_seed(3)
    ser_pe = PatchEmbedding1D(4, 2, 1, H)
    torch.manual_seed(3)
    par_pe = PatchEmbedding3D(4, 2, 1, H)
    for key, value in ser_pe.state_dict().items():   # same initial draws as serial
        _diff(out, f'patch_init.{key}', par_pe.state_dict()[key], value)
    images = torch.randn(B, 1, 4, 4)
    y_ser, y_par = ser_pe(images), par_pe(images)
    dy = torch.randn_like(y_ser)
    y_ser.backward(dy)
    y_par.backward(split_activation(dy, cube.standard))
    _diff(out, 'patch.out', gather_activation(y_par, cube.standard), y_ser)
    _grads_diff(out, 'patch', par_pe, ser_pe)


def _head_checks(out, cube):
    torch.manual_seed(4)
    x = torch.randn(B, S, H)
    labels = torch.randint(0, 32, (B, S))
    labels[0, :2] = -100
    cases = (('classifier', nn.Linear(H, 5), Classifier3D(H, 5), True),
             ('vocab_classifier', nn.Linear(H, 32), VocabParallelClassifier3D(H, 32, bias=True), False))
    for name, ser, par, pooled in cases:
        par.load_state_dict(ser.state_dict())
        x_ser = x.clone().requires_grad_()
        x_par = split_activation(x, cube.standard).requires_grad_()
        lab = labels[:, 0] % 5 if pooled else labels
        z_ser = ser(x_ser[:, 0] if pooled else x_ser)
        z_par = par(first_token_3d(x_par) if pooled else x_par)
        loss_ser = F.cross_entropy(z_ser.reshape(-1, z_ser.shape[-1]), lab.reshape(-1))
        loss_par = CrossEntropyLoss()(z_par, lab)
        none_par = CrossEntropyLoss(reduction='none')(z_par, lab)
        none_ser = F.cross_entropy(z_ser.reshape(-1, z_ser.shape[-1]), lab.reshape(-1),
                                   reduction='none').view(lab.shape)
        loss_ser.backward()
        loss_par.backward()
        _diff(out, f'{name}.logits', gather_logits(z_par), z_ser)
        _diff(out, f'{name}.loss', loss_par, loss_ser)
        _diff(out, f'{name}.loss_none', none_par, none_ser)
        _diff(out, f'{name}.dx', gather_activation(x_par.grad, cube.standard), x_ser.grad)
        _grads_diff(out, name, par, ser)


def _attention_checks(out, cube):
    torch.manual_seed(5)
    qkv = [torch.randn(B, S, H) for _ in range(3)]
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, -1] = 0
    mask[6, -2:] = 0
    ser_in = [t.clone().requires_grad_() for t in qkv]
    par_in = [split_activation(t, cube.swapped).requires_grad_() for t in qkv]
    y_ser = attention(*ser_in, 4, causal=True, key_padding_mask=mask)
    y_par = AttentionCore3D(4, causal=True)(*par_in, key_padding_mask=mask)
    dy = torch.randn_like(y_ser)
    y_ser.backward(dy)
    y_par.backward(split_activation(dy, cube.swapped))
    _diff(out, 'attention.out', gather_activation(y_par, cube.swapped), y_ser)
    for k, (a, b) in enumerate(zip(par_in, ser_in)):
        _diff(out, f'attention.d{"qkv"[k]}', gather_activation(a.grad, cube.swapped), b.grad)


class _QKV(nn.Module):
    """q * k + v from three projections: fused (``qkv_3d``) or three serial nn.Linear."""

    def __init__(self, make, fused):
        super().__init__()
        self.fused = fused
        self.query, self.key, self.value = (make() for _ in range(3))

    def forward(self, x):
        if self.fused:
            q, k, v = qkv_3d(x, self.query, self.key, self.value)
        else:
            q, k, v = self.query(x), self.key(x), self.value(x)
        return q * k + v


def _fused_qkv_checks(out, cube):
    torch.manual_seed(6)
    ser = _QKV(lambda: nn.Linear(H, H), fused=False)
    x = torch.randn(B, S, H)
    for name, keep in (('fused_qkv', False), ('fused_qkv_keep', True)):
        par = _QKV(lambda: Linear3D(H, H, region='enter', keep_gathered=keep), fused=True)
        par.load_state_dict(ser.state_dict())
        ser.zero_grad()
        _run_pair(out, name, par, ser, x, cube, cube.standard, cube.swapped)


def _dropout_and_error_checks(out, cube):
    drop = Dropout3D(0.5)
    x = split_activation(torch.randn(B, S, H), cube.standard).requires_grad_()
    y = drop(x)
    kept = (y != 0).float()
    y.backward(torch.ones_like(y))
    out['dropout.values'] = (y - x.detach() * kept * 2).abs().max().item()
    out['dropout.grad'] = (x.grad - kept * 2).abs().max().item()
    out['dropout.kept_fraction_off'] = max(0.0, abs(kept.mean().item() - 0.5) - 0.35)
    drop.eval()
    out['dropout.eval'] = (drop(x) - x).abs().max().item()
    try:
        Embedding3D(32, H)(torch.zeros(6, S, dtype=torch.long))
        out['error.batch'] = 1.0
    except ValueError as err:
        out['error.batch'] = 0.0 if 'q^2 = 2^2 = 4, got batch 6' in str(err) else 1.0
    try:
        Linear3D(H, 18, region='enter')
        out['error.out_features'] = 1.0
    except ValueError as err:
        out['error.out_features'] = 0.0 if '18 divisible by 4' in str(err) else 1.0


def _comm_checks(out, cube):
    b, s, h_in, h_out, q = B, S, H, 2 * H, cube.q
    for region, keep in (('enter', False), ('exit', False), (None, False), ('enter', True)):
        layer = Linear3D(h_in, h_out, region=region, keep_gathered=keep)
        layout = cube.swapped if region == 'exit' else cube.standard
        x = split_activation(torch.randn(b, s, h_in), layout).requires_grad_()
        with comm_profile() as stats:
            layer(x).sum().backward()
        expected = linear_3d_bytes(b, s, h_in, h_out, q, keep_gathered=keep)
        calls = 8 if keep else 10
        _, j, l = cube.coords
        if region is None and j != l:   # swap_layout: send + recv of y forward, of dy backward
            expected += 4 * 4 * b * s * h_out // q ** 3
        out[f'bytes.{region}.{keep}'] = abs(stats.bytes() - expected)
        out[f'calls.{region}.{keep}'] = abs(stats.calls() - calls
                                            - (4 if region is None and j != l else 0))


def layer_worker(rank):
    cube = default_cube()
    out = {}
    for check in (_linear_checks, _norm_embed_checks, _head_checks, _attention_checks,
                  _fused_qkv_checks, _dropout_and_error_checks, _comm_checks):
        check(out, cube)
    return out


@pytest.fixture(scope='module')
def layer_results():
    return run_distributed(layer_worker, 8, CFG, timeout=300)


@pytest.mark.parametrize('group', ['linear_chain', 'linear_chain_keep', 'layernorm', 'embedding',
                                   'vocab_embedding',
                                   'patch', 'classifier', 'vocab_classifier', 'attention',
                                   'fused_qkv', 'fused_qkv_keep', 'dropout', 'error', 'bytes',
                                   'calls'])
def test_3d_layer_equals_serial(layer_results, group):
    for rank, res in enumerate(layer_results):
        items = {k: v for k, v in res.items() if k.split('.')[0] in (group, group + '_init')
                 or (group == 'patch' and k.startswith('patch_init'))}
        assert items, f'no checks recorded for {group}'
        worst = max(items, key=items.get)
        assert items[worst] <= TOL, f'rank {rank}: {worst} differs by {items[worst]:.3g}'


# ------------------------------------------------------------------ model zoo under 3D
MODEL_BATCH = dict(batch=4, seq=8)


@pytest.fixture(scope='module')
def model_results():
    """Serial traces (this process has no launched context) and every rank's traces."""
    states, expected = serial_traces(FAMILIES, MODEL_BATCH)
    return expected, run_distributed(rank_traces, 8, CFG, states, MODEL_BATCH, timeout=300)


@pytest.mark.parametrize('name', FAMILIES)
def test_3d_model_equals_serial(model_results, name):
    """Loss, logits, every gradient and the parameters at each of 3 AdamW steps."""
    expected, results = model_results
    assert_matches_serial([r[name] for r in results], expected[name], TOL)
