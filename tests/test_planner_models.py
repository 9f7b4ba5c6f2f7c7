"""The planner reads a model through its registry entry's descriptor, never by its name.

* no string in ``colossal_lite`` is the name of a model model_zoo registers;
* a model registered under another name with the same descriptor plans alike (same
  candidates, numbers and config but the ``type``);
* a model registered without a planner shape is refused, naming what to register;
* the descriptor expresses grouped-query attention, a gated MLP, rotary positions and an
  untied head (parameter layers and FLOPs; Llama against real builds:
  tests/test_planner_llama.py);
* the profile times the one entry registered with ``profile=True``; model_zoo's entries
  carry their Hugging Face adapters; bad descriptors are ValueErrors.
"""
import ast
import pathlib

import pytest

import model_zoo  # noqa: F401  (registers gpt/bert/vit)
from colossal_lite.auto import load_profile
from colossal_lite.auto.cost import Candidate, evaluate, stage_ranges
from colossal_lite.auto.model_spec import ModelShape, layer_params, model_shape
from colossal_lite.auto.planner import plan_config
from colossal_lite.auto.search import search
from colossal_lite.config import ParallelLayout
from colossal_lite.models import (HFAdapter, ModelTraits, PlannerShape, get_model, register_model,
                                  registered_models, unregister_model)
from model_zoo import GPT

REPO = pathlib.Path(__file__).resolve().parents[1]
SERIAL = ParallelLayout(1, 1, None, 1, 1)


def test_the_library_never_names_a_zoo_model():
    names = {k for k in registered_models()
             if get_model(k).builder.__module__.startswith('model_zoo')}
    assert {'gpt', 'bert', 'vit'} <= names
    offenders = []
    for path in (REPO / 'colossal_lite').rglob('*.py'):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in names:
                offenders.append(f'{path.relative_to(REPO)}:{node.lineno} {node.value!r}')
    assert offenders == []


@pytest.fixture
def gpt_copy():
    gpt = get_model('gpt')
    register_model('lm_copy', gpt.builder, gpt.presets, loss=gpt.loss, data=gpt.data,
                   rules=gpt.rules, shape=gpt.shape, traits=gpt.traits)
    yield 'lm_copy'
    unregister_model('lm_copy')


def test_a_model_registered_under_another_name_plans_alike(gpt_copy):
    ours, theirs = model_shape(gpt_copy, 'gpt2-small', 256), model_shape('gpt', 'gpt2-small', 256)
    profile = load_profile('nvlink8').with_devices(8, 4 * 2 ** 30)
    a, b = search(ours, profile, 8, 16), search(theirs, profile, 8, 16)
    assert a.evaluated == b.evaluated
    for x, y in zip(a.feasible + a.infeasible, b.feasible + b.infeasible):
        assert (x.candidate, x.step_time, x.memory) == (y.candidate, y.step_time, y.memory)
    cand = a.best.candidate
    config = plan_config(ours, cand, 16)
    assert config['model']['type'] == gpt_copy
    assert config == dict(plan_config(theirs, cand, 16),
                          model=dict(config['model'], type=gpt_copy))
    assert config['data'] == dict(type='shakespeare', seq_len=256)


def test_bundled_data_only_where_the_job_accepts_it():
    cand = Candidate(SERIAL, 1)
    assert 'data' not in plan_config(model_shape('bert', 'tiny', 32), cand, 8)  # none registered
    assert plan_config(model_shape('vit', 'tiny'), cand, 8)['data'] == dict(type='digits')
    assert 'data' not in plan_config(model_shape('vit', 'vit-base'), cand, 8)  # 224 px images


def test_a_model_without_a_planner_shape_is_refused():
    register_model('toy_no_shape', lambda width=4: width, presets=dict(small=dict(width=4)))
    try:
        with pytest.raises(NotImplementedError, match=r'register_model\(.*shape=PlannerShape'):
            model_shape('toy_no_shape', 'small')
    finally:
        unregister_model('toy_no_shape')


def _gqa_lm(vocab_size, max_positions, hidden, layers, heads, kv_heads, ffn, dropout=0.0):
    raise AssertionError('the planner never builds the model')


def test_the_descriptor_expresses_gqa_a_gated_mlp_and_an_untied_head():
    register_model('gqa_lm', _gqa_lm, shape=PlannerShape(kv_heads='kv_heads', ffn='ffn',
                                                         positions=None),
                   traits=ModelTraits(causal=True, gated_mlp=True))
    try:
        opts = dict(vocab_size=256, max_positions=64, hidden=64, layers=2, heads=8, kv_heads=2,
                    ffn=176)
        shape = ModelShape('gqa_lm', None, tuple(sorted(opts.items())), 64)
        h, kv, f = 64, 2 * 64 // 8, 176
        block = (h * h + h) * 2 + (h * kv + kv) * 2 + 4 * h + 2 * (h * f + f) + f * h + h
        assert layer_params(shape.block_layers(), None, SERIAL) == block
        assert shape.mlp_ratio == 176 / 64 and shape.kv_heads == 2
        assert shape.first_layers() == [('vocab_embedding', dict(v=256, h=h))]  # rotary: none
        # untied: the head counts its matrix, a pipelined last stage holds no embedding copy
        assert shape.last_layers(True) == [
            ('layernorm', dict(h=h)),
            ('vocab_classifier', dict(h=h, c=256, bias=False, tied=False))]
        assert len(stage_ranges(shape, 2, 'parameters')) == 2
        # FLOPs: 2 per weight element of q, k, v, o, gate, up, down and 4 s h per token
        weights = 2 * h * h + 2 * h * kv + 3 * h * f
        assert model_shape('gqa_lm', None, **opts).block_flops(10) == 10 * (
            2 * weights + 4 * 64 * h)
    finally:
        unregister_model('gqa_lm')


def test_the_profile_times_the_entry_registered_as_the_profile_model():
    from colossal_lite.auto.profile import _family_shape, profile_kind
    assert [k for k in registered_models() if get_model(k).profile] == [profile_kind()]
    assert _family_shape(64).kind == profile_kind() and _family_shape(64).traits.causal
    gpt = get_model('gpt')
    register_model('second_profile', gpt.builder, shape=gpt.shape, profile=True)
    try:
        with pytest.raises(ValueError, match='profile=True'):
            profile_kind()
    finally:
        unregister_model('second_profile')


def test_zoo_entries_carry_their_hf_adapters():
    gpt = get_model('gpt').hf
    assert isinstance(gpt, HFAdapter) and gpt.from_hf == GPT.from_hf and gpt.save_hf is GPT.save_hf
    assert all(get_model(k).hf is not None for k in ('bert', 'vit'))


def test_bad_descriptors_are_value_errors():
    with pytest.raises(ValueError, match='image, patch and channels'):
        PlannerShape(image='img_size')
    with pytest.raises(ValueError, match='classifier head'):
        PlannerShape(vocab=None, image='i', patch='p', channels='c')
    with pytest.raises(ValueError, match='inputs'):
        ModelTraits(inputs='audio')
    with pytest.raises(ValueError, match="counts blocks in option 'depth'"):
        register_model('bad_layers', _gqa_lm, shape=PlannerShape(layers='depth'))
    assert 'bad_layers' not in registered_models()
