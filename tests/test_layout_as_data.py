"""Layout as data: weights drawn by name, placements, described (meta) builds.

* A model built after ``launch(seed=S)`` in any layout holds, bit for bit, the weights of
  the model built in one process with seed S -- without any ``load_state_dict``.
* Every GPT parameter's placement turns its local shard into a DTensor whose full tensor
  is the full parameter, and survives a JSON round trip.
* A loss of the user's own on ``gather_logits`` output trains like the serial model in
  every family (gather_logits is differentiable everywhere).
* gpt2-xl built on meta for a described layout, in this process with no process group,
  holds exactly the per-rank parameter bytes of the family formulas.
"""
import time

import pytest
import torch
import torch.nn.functional as F

import colossal_lite.nn as col_nn
from colossal_lite.config import parse_parallel
from colossal_lite.context import ParallelContext, global_context as gpc, use_context
from colossal_lite.formulas import params as param_formulas
from colossal_lite.tensor import (Placement, layout_mesh, parameter_bytes, placements,
                                  to_dtensor)
from colossal_lite.testing import (assert_matches_serial, plain_step, run_distributed,
                                   training_trace)
from model_zoo import BERT, GPT, ViT

SEED = 4321
LAYOUTS = {
    'dp2_1d2': (4, dict(tensor=dict(size=2, mode='1d'))),
    '2d': (4, dict(tensor=dict(size=4, mode='2d'))),
    '2.5d_d1': (4, dict(tensor=dict(size=4, mode='2.5d', depth=1))),
    '2.5d_d2': (8, dict(tensor=dict(size=8, mode='2.5d', depth=2))),
    '3d': (8, dict(tensor=dict(size=8, mode='3d'))),
    'dp2_seq2': (4, dict(tensor=dict(size=2, mode='sequence', zigzag=False))),  # ViT: 10 tokens
}


def _models(mode):
    vit = dict(img_size=6) if mode == 'sequence' else {}  # 1 + 9 tokens split in 2
    return {'gpt': GPT.from_preset('tiny'), 'bert': BERT.from_preset('tiny'),
            'vit': ViT.from_preset('tiny', **vit)}


def _serial_states(mode):
    torch.manual_seed(SEED)
    return {name: m.state_dict() for name, m in _models(mode).items()}


def _custom_loss(logits, ids):
    """Label-smoothed next-token loss plus a z-loss, on full logits."""
    flat = logits[:, :-1].reshape(-1, logits.shape[-1])
    ce = F.cross_entropy(flat, ids[:, 1:].reshape(-1), label_smoothing=0.1)
    return ce + 1e-3 * torch.logsumexp(flat, dim=-1).pow(2).mean()


def _ids():
    return torch.randint(0, 256, (8, 8), generator=torch.Generator().manual_seed(7))


def _gathered_trace(model):
    """One backward (no update) of the custom loss on ``gather_logits`` output: loss,
    gathered logits and every full gradient (DATA replicas take their rows)."""
    def loss_fn(logits, ids):
        return _custom_loss(col_nn.gather_logits(logits), ids)
    return training_trace(model, (_ids(), _ids()), steps=1, step_fn=plain_step(loss_fn))


def _rank_checks(rank, mode):
    models = _models(mode)  # seeded by launch(seed=SEED): no load_state_dict anywhere
    states = {name: m.state_dict() for name, m in models.items()}
    gpt = models['gpt']
    mesh = layout_mesh(gpc.layout)
    dtensor_diffs, round_trips = {}, []
    for name, param in gpt.named_parameters():
        placement = placements(gpt)[name]
        round_trips.append(Placement.from_json(placement.to_json()) == placement)
        full = to_dtensor(param.detach(), placement, mesh, gpc.layout).full_tensor()
        dtensor_diffs[name] = (full - states['gpt'][name]).abs().max().item()
    return dict(states=states if rank == 0 else None, dtensor=dtensor_diffs,
                round_trips=round_trips, trace=_gathered_trace(gpt))


@pytest.mark.parametrize('name', list(LAYOUTS))
def test_weights_placements_and_gathered_logits_in_every_layout(name):
    world, parallel = LAYOUTS[name]
    mode = parallel['tensor']['mode']
    expected = _serial_states(mode)
    torch.manual_seed(SEED)
    serial = _gathered_trace(GPT.from_preset('tiny'))
    results = run_distributed(_rank_checks, world, dict(parallel=parallel, seed=SEED), mode,
                              timeout=300)
    for model_name, state in expected.items():
        got = results[0]['states'][model_name]
        assert set(got) == set(state), model_name
        for key, value in state.items():
            assert torch.equal(got[key], value), f'{name} {model_name}.{key} differs from serial'
    for rank, res in enumerate(results):
        assert all(res['round_trips']) and len(res['round_trips']) > 10
        assert max(res['dtensor'].values()) == 0.0, (rank, res['dtensor'])
    assert_matches_serial([r['trace'] for r in results], serial)


def test_weights_depend_only_on_seed_and_name():
    torch.manual_seed(1)
    a = GPT.from_preset('tiny', layers=3)
    torch.manual_seed(1)
    b = GPT.from_preset('tiny', layers=2)      # a model with fewer layers: same first layers
    torch.manual_seed(2)
    c = GPT.from_preset('tiny', layers=2)
    for key, value in b.state_dict().items():
        assert torch.equal(a.state_dict()[key], value), key
    assert not torch.equal(b.state_dict()['blocks.0.attn.query.weight'],
                           c.state_dict()['blocks.0.attn.query.weight'])
    assert not torch.equal(a.state_dict()['blocks.0.attn.query.weight'],
                           a.state_dict()['blocks.0.attn.key.weight'])


def _oversized_parameters(rank):
    """Parameters whose storage is larger than the parameters in it (a shard viewing the
    full tensor it was cut from would keep that tensor alive). q/k/v lie back to back in
    one storage (``col_nn.place_qkv_adjacent``): a storage counts all its parameters."""
    model = GPT(vocab_size=256, max_positions=32, hidden=64, layers=2, heads=4, dropout=0.0)
    storages = {}
    for name, p in model.named_parameters():
        names, nbytes = storages.setdefault(p.untyped_storage().data_ptr(), ([], [0]))
        names.append(name)
        nbytes[0] += p.numel() * p.element_size()
    sizes = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
             for p in model.parameters()}
    return [n for ptr, (names, nbytes) in storages.items() if sizes[ptr] != nbytes[0]
            for n in names]


@pytest.mark.parametrize('world, tensor', [(2, dict(size=2, mode='1d')),
                                           (4, dict(size=4, mode='2d'))], ids=['1d', '2d'])
def test_each_rank_holds_only_its_shards(world, tensor):
    results = run_distributed(_oversized_parameters, world, dict(parallel=dict(tensor=tensor)))
    assert results == [[]] * world


# ---------------------------------------------------------------------------- described builds
XL_LAYOUTS = {  # gpt2-xl has 25 heads, which no split of 2, 4 or 8 divides: 32 heads of 50
    '1d_t8': (8, dict(tensor=dict(size=8, mode='1d'))),
    '2d_q4': (16, dict(tensor=dict(size=16, mode='2d'))),
    '2.5d_q2_d2': (8, dict(tensor=dict(size=8, mode='2.5d', depth=2))),
    '3d_q2': (8, dict(tensor=dict(size=8, mode='3d'))),
}


def _gpt_param_numel(layout, vocab, positions, hidden, layers):
    f = param_formulas(layout.mode, layout)
    h = hidden
    block = (2 * f['layernorm'](h) + 3 * f['linear'](h, h, True, 'enter')
             + f['linear'](h, h, True, 'exit') + f['linear'](h, 4 * h, True, 'enter')
             + f['linear'](4 * h, h, True, 'exit'))
    return (f['vocab_embedding'](vocab, h) + f['embedding'](positions, h) + layers * block
            + f['layernorm'](h) + f['vocab_classifier'](h, vocab, False, True))


def _described(world, parallel, rank=0):
    layout = parse_parallel(parallel).with_world_size(world)
    return layout, ParallelContext.describe(layout, rank)


@pytest.mark.parametrize('name', list(XL_LAYOUTS))
def test_gpt2_xl_on_meta_for_a_described_layout(name):
    world, parallel = XL_LAYOUTS[name]
    layout, ctx = _described(world, parallel, rank=world - 1)
    start = time.perf_counter()
    with use_context(ctx), torch.device('meta'):
        model = GPT.from_preset('gpt2-xl', heads=32)
    elapsed = time.perf_counter() - start
    assert not gpc.is_initialized()
    assert all(p.is_meta for p in model.parameters())
    expected = 4 * _gpt_param_numel(layout, 50304, 1024, 1600, 48)
    assert parameter_bytes(model) == expected
    # a guard against per-element Python work in a meta build (it takes ~0.3 s here), not a
    # speed claim: a wall-clock bound near the typical time fails on a slow CI host
    assert elapsed < 20.0, f'meta build took {elapsed:.2f} s'


def test_described_build_reports_split_errors_and_refuses_to_run():
    layout, ctx = _described(4, dict(tensor=dict(size=4, mode='1d')))
    with use_context(ctx), torch.device('meta'), pytest.raises(ValueError, match='6 attention heads'):
        GPT.from_preset('tiny', hidden=48, heads=6)
    layout, ctx = _described(4, dict(tensor=dict(size=4, mode='2d')))
    with use_context(ctx), pytest.raises(ValueError, match='divisible by 2'):
        col_nn.Linear(16, 15)
    with use_context(ctx):
        layer = col_nn.LayerNorm(16)        # built (not on meta): shapes and shards only
    assert layer.weight.shape == (8,)
    with pytest.raises(RuntimeError, match='described layout'):
        layer(torch.randn(4, 2, 8))


def test_placements_of_a_described_3d_model():
    layout, ctx = _described(8, dict(tensor=dict(size=8, mode='3d')), rank=5)
    with use_context(ctx), torch.device('meta'):
        model = GPT.from_preset('tiny')
    places = placements(model)
    fc1 = places['blocks.0.mlp.fc1.weight']
    assert fc1.shape == (128, 32)
    assert [m.name for _, m in fc1.cuts] == ['PARALLEL_3D_WEIGHT', 'PARALLEL_3D_INPUT',
                                             'PARALLEL_3D_OUTPUT']
    assert model.get_submodule('blocks.0.mlp.fc1').weight.shape == (32, 16)
    assert [m.name for m in fc1.grad_sum] == []      # one replica: nothing for the engine
    assert places['lm_head.weight'] == places['wte.weight']
