"""The graph planner on a mixture-of-experts model: grouped expert matmuls as local regions
with the experts split over a mesh axis (``auto/graph/experts.py``)."""
import warnings

import pytest
import torch

from colossal_lite.testing import run_distributed

transformers = pytest.importorskip('transformers')

MESH = {'data': 2, 'tensor': 2}
LAYERS = 2


def tiny_moe(kind: str):
    """transformers' Mixtral or Qwen2-MoE (shared expert and its gate), 4 experts, top-2."""
    from tests.test_auto_graph import WithLabels
    torch.manual_seed(0)
    common = dict(vocab_size=64, hidden_size=64, num_hidden_layers=LAYERS,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  num_experts_per_tok=2)
    if kind == 'mixtral':
        cfg = transformers.MixtralConfig(intermediate_size=512, num_local_experts=4, **common)
        return WithLabels(transformers.MixtralForCausalLM(cfg))
    cfg = transformers.Qwen2MoeConfig(intermediate_size=128, moe_intermediate_size=512,
                                      shared_expert_intermediate_size=128, num_experts=4,
                                      decoder_sparse_step=1, mlp_only_layers=[], **common)
    return WithLabels(transformers.Qwen2MoeForCausalLM(cfg))


def ids_batch(seed):
    return torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(seed))


def test_experts_mm_of_each_expert_group_sums_to_the_grouped_matmul():
    """Two ranks' halves of the experts (other rows zero) sum to the full grouped matmul,
    forward and backward; empty experts included."""
    from colossal_lite.auto.graph.experts import experts_mm
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 0, 5, 2])
    offs = counts.cumsum(0)
    x = torch.randn(int(offs[-1]), 6, generator=g, requires_grad=True)
    w = torch.randn(4, 6, 5, generator=g, requires_grad=True)
    grad = torch.randn(int(offs[-1]), 5, generator=g)
    rows = torch.repeat_interleave(torch.arange(4), counts)
    ref = torch.einsum('si,sio->so', x, w[rows])
    ref_dx, ref_dw = torch.autograd.grad(ref, (x, w), grad)
    halves = [(w[:2], 0), (w[2:], 2)]
    out = sum(experts_mm(x, part, offs, first) for part, first in halves)
    dx, dw = torch.autograd.grad(out, (x, w), grad)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(dx, ref_dx)
    torch.testing.assert_close(dw, ref_dw)
    assert torch.count_nonzero(experts_mm(x, w[:1], offs, 0)[3:]) == 0   # expert 0's rows only


def _expert_parallel_steps(rank, kind):
    warnings.simplefilter('ignore')
    from colossal_lite.auto import parallelize
    from colossal_lite.communication.profile import comm_profile
    from tests.test_auto_graph import lm_loss
    pins = {f'model.model.layers.{layer}.mlp.experts.{name}': ['R', 'S0']
            for layer in range(LAYERS) for name in ('gate_up_proj', 'down_proj')}
    model, plan = parallelize(tiny_moe(kind), (ids_batch(1),), loss_fn=lm_loss, mesh=MESH,
                              pins=pins)
    grouped = [name for name, node in plan.nodes.items() if 'grouped_mm' in node['op']]
    # the planner's own choice is free; the expert split is forced to check its numerics
    model, plan = parallelize(tiny_moe(kind), (ids_batch(1),), loss_fn=lm_loss, mesh=MESH,
                              pins={**pins, **{name: ['R', 'P'] for name in grouped}})
    out = {}
    for name, ids in (('example', ids_batch(1)), ('other', ids_batch(2))):
        model.zero_grad()
        with comm_profile() as stats:
            loss = model(ids)
            with model.backward_context():
                loss.backward()
        out[name] = (loss.item(), {n: p.grad.full_tensor() for n, p in model.named_parameters()})
    out['ops'] = sorted({str(op) for op in stats._bytes})
    out['bytes'] = ({op: stats.bytes(op=op) for op in ('all_reduce', 'all_gather',
                     'reduce_scatter', 'all_to_all') if stats.bytes(op=op)},
                    plan.predicted['comm_bytes'])
    out['grouped'] = {name: plan.nodes[name] for name in grouped}
    out['unruled'] = plan.unruled
    out['lowered_failure'] = model.lowered.failure
    return out


@pytest.mark.parametrize('kind', ['mixtral', 'qwen2_moe'])
def test_hf_moe_with_experts_split_over_tensor_equals_serial(kind):
    """transformers' Mixtral / Qwen2-MoE planned on data 2 x tensor 2 with each rank of the tensor axis
    holding two of the four experts: loss and gradients equal the serial model on the example
    batch and on another batch (other routing), through the lowered program; the experts
    are never gathered (the only tensor-axis traffic is activations' all_reduce)."""
    results = run_distributed(_expert_parallel_steps, 4, None, kind, timeout=600)
    serial = tiny_moe(kind)
    for name, seed in (('example', 1), ('other', 2)):
        serial.zero_grad()
        ids = ids_batch(seed)
        loss = serial.model(ids, labels=ids).loss
        loss.backward()
        for out in results:
            got_loss, grads = out[name]
            assert got_loss == pytest.approx(loss.item(), rel=1e-6)
            for n, p in serial.named_parameters():
                torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-6)
    first = results[0]
    assert first['lowered_failure'] is None
    assert len(first['grouped']) == 2 * LAYERS
    for node in first['grouped'].values():
        assert node['in'][1] == ['R', 'S0'] and node['out'] == [['R', 'P']]
    assert not any('grouped_mm' in op for op in first['unruled'])
    assert not any('all_gather' in op for op in first['ops']), first['ops']
    measured, predicted = first['bytes']
    assert measured == predicted and measured     # the planner prices the region's edges

