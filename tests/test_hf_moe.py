"""Hugging Face Mixtral and Qwen2-MoE <-> model_zoo Llama with ``moe`` (model_zoo/hf/moe_hf.py):
after ``Llama.from_hf`` our logits equal transformers' own (fp32, within 1e-5 of scale)
serially, at expert 2 (data 2 = E 2: each rank holds 2 of the 4 experts and half the batch)
and at expert 2 x 1D t=2; ``save_hf`` (serial and from expert 2 x t=2) writes a directory
transformers reloads with the same logits; greedy generation equals transformers'.

The HF models are tiny (hidden 64, 4 heads, 2 kv heads, 2 layers, 4 experts, top-2),
random-init then randomized (every weight, the stacked experts and the shared expert's gate
included), built in memory (no download), vocabulary 251 (padded to 252 under t=2).
Mixtral: every block MoE, softmax + renormalized top-2. Qwen2-MoE: block 0 dense
(``mlp_only_layers=[0]``), un-normalized top-2 (``norm_topk_prob=False``), a gated shared
expert, q/k/v biases.
"""
import pytest
import torch

from colossal_lite.generation import generate
from colossal_lite.testing import full_outputs, max_rel_diff, replica_batch, run_distributed
from model_zoo import Llama
from tests.test_hf_conversion import _randomized, _transformers, assert_equal_logits
from tests.test_hf_llama import PROMPT, V, hf_greedy, hf_logits, ids

TYPES = ('mixtral', 'qwen2_moe')
CLASSES = {'mixtral': 'MixtralForCausalLM', 'qwen2_moe': 'Qwen2MoeForCausalLM'}
TINY = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, num_experts_per_tok=2)
EXTRA = {'mixtral': dict(num_local_experts=4),
         'qwen2_moe': dict(num_experts=4, moe_intermediate_size=48,
                           shared_expert_intermediate_size=80, mlp_only_layers=[0],
                           norm_topk_prob=False)}


def hf_moe(model_type, **cfg):
    tf = _transformers()
    config_cls = {'mixtral': tf.MixtralConfig, 'qwen2_moe': tf.Qwen2MoeConfig}[model_type]
    config = config_cls(**dict(TINY, **{**EXTRA[model_type], **cfg}))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return _randomized(getattr(tf, CLASSES[model_type])(config))


def our_logits(model):
    """The full logits: every DATA replica runs its rows (full_outputs joins them)."""
    with torch.no_grad():
        return full_outputs(model.eval()(replica_batch(ids())))


NEW_TOKENS = 6


@pytest.mark.parametrize('model_type', TYPES)
def test_serial_logits_generation_and_save_hf_equal_transformers(model_type, tmp_path):
    tf = _transformers()
    hf = hf_moe(model_type)
    ours = Llama.from_hf(hf)
    moe = ours.arch_args['moe']
    assert (moe['experts'], moe['top_k']) == (4, 2)
    if model_type == 'qwen2_moe':
        assert type(ours.blocks['0'].mlp).__name__ == 'SwiGLU'
        assert (moe['first_dense'], moe['renormalize'], moe['shared_ffn_hidden']) == (1, False, 80)
        assert ours.state_dict()['blocks.1.mlp.shared_expert_gate.weight'].abs().max() > 0
    expected = hf_logits(hf)
    assert_equal_logits(our_logits(ours), expected)
    theirs = hf_greedy(hf, PROMPT, NEW_TOKENS)
    assert torch.equal(generate(ours, PROMPT, NEW_TOKENS), theirs)
    ours.save_hf(tmp_path)
    back = getattr(tf, CLASSES[model_type]).from_pretrained(tmp_path, local_files_only=True)
    assert_equal_logits(hf_logits(back.eval()), expected)
    assert_equal_logits(our_logits(Llama.from_hf(str(tmp_path))), expected)


def test_expert_maps_are_checked_by_the_logits():
    """The comparison can fail: gate and up of the stacked experts swapped, or the experts
    transposed the other way, move the logits far past the tolerance."""
    hf = hf_moe('mixtral')
    ours = Llama.from_hf(hf)
    expected = hf_logits(hf)[0]
    state = ours.state_dict()
    state['blocks.1.mlp.experts.gate'], state['blocks.1.mlp.experts.up'] = \
        state['blocks.1.mlp.experts.up'], state['blocks.1.mlp.experts.gate']
    ours.load_state_dict(state)
    assert max_rel_diff(our_logits(ours)[0], expected) > 1e-3
    qwen = Llama.from_hf(hf_moe('qwen2_moe'))
    state = qwen.state_dict()
    key = 'blocks.1.mlp.shared_expert_gate.weight'
    state[key] = -state[key]
    qwen.load_state_dict(state)
    assert max_rel_diff(our_logits(qwen)[0], hf_logits(hf_moe('qwen2_moe'))[0]) > 1e-3


def test_aux_loss_coefficient_follows_output_router_logits():
    """HF adds the aux loss only with output_router_logits; ours per layer: k * coef / L."""
    assert Llama.from_hf(hf_moe('mixtral')).arch_args['moe']['aux_loss_coef'] == 0.0
    hf = hf_moe('mixtral', output_router_logits=True, router_aux_loss_coef=0.02)
    assert Llama.from_hf(hf).arch_args['moe']['aux_loss_coef'] == pytest.approx(2 * 0.02 / 2)
    hf = hf_moe('qwen2_moe', output_router_logits=True, router_aux_loss_coef=0.02)
    assert Llama.from_hf(hf).arch_args['moe']['aux_loss_coef'] == pytest.approx(2 * 0.02 / 1)


def test_what_ours_or_hf_cannot_represent_raises_naming_it(tmp_path):
    with pytest.raises(ValueError, match='router_jitter_noise=0.1'):
        Llama.from_hf(hf_moe('mixtral', router_jitter_noise=0.1))
    with pytest.raises(ValueError, match='mlp_only_layers / decoder_sparse_step'):
        Llama.from_hf(hf_moe('qwen2_moe', mlp_only_layers=[1]))
    for moe, message in ((dict(score='sigmoid'), "score='sigmoid'"),
                         (dict(capacity_factor=1.5), 'capacity_factor=1.5'),
                         (dict(shared_experts=2), 'shared_experts=.*exactly one shared')):
        model = Llama.from_preset('tiny', moe=dict(experts=4, top_k=2, **moe))
        with pytest.raises(ValueError, match=message):
            model.save_hf(tmp_path / 'x')
    model = Llama.from_preset('tiny', moe=dict(experts=4, top_k=2, bias_update_rate=0.1))
    with torch.no_grad():
        model.blocks['1'].mlp.router.balance.bias[0] = 0.1
    with pytest.raises(ValueError, match='balance.bias is non-zero'):
        model.save_hf(tmp_path / 'y')


def test_preset_with_moe_exports_as_mixtral_or_qwen2_moe(tmp_path):
    tf = _transformers()
    for moe, qkv_bias, cls in ((dict(), False, 'MixtralForCausalLM'),
                               (dict(shared_experts=1, shared_gate=True, first_dense=1), True,
                                'Qwen2MoeForCausalLM')):
        torch.manual_seed(0)
        model = _randomized(Llama.from_preset('tiny', qkv_bias=qkv_bias,
                                              moe=dict(experts=4, top_k=2, **moe)))
        model.save_hf(tmp_path / cls)
        hf = tf.AutoModelForCausalLM.from_pretrained(tmp_path / cls, local_files_only=True)
        assert type(hf).__name__ == cls
        assert_equal_logits(hf_logits(hf.eval()), our_logits(model))


# ------------------------------------------------------------------ parallel layouts
def _rank_logits(rank, sources, directory):
    result = {}
    for model_type, hf in sources.items():
        model = Llama.from_hf(hf)
        result[model_type] = dict(logits=our_logits(model), vocab=model.arch_args['vocab_size'],
                                  local_experts=model.blocks['1'].mlp.experts.gate.shape[0])
        if directory:
            model.save_hf(f'{directory}/{model_type}')
    return result


@pytest.mark.parametrize('world,parallel,padded,save', [
    (2, dict(expert=2), V, False),
    (4, dict(expert=2, tensor=dict(size=2, mode='1d')), 252, True),
], ids=['expert2', 'expert2-tp2'])
def test_expert_parallel_equals_transformers(tmp_path, world, parallel, padded, save):
    tf = _transformers()
    sources = {t: hf_moe(t) for t in TYPES}
    expected = {t: hf_logits(m) for t, m in sources.items()}
    results = run_distributed(_rank_logits, world, dict(parallel=parallel), sources,
                              str(tmp_path) if save else None, timeout=600)
    for model_type in TYPES:
        for got in (r[model_type] for r in results):
            assert (got['vocab'], got['local_experts']) == (padded, 2)
            assert_equal_logits(got['logits'], expected[model_type], vocab=V)
        if save:
            back = getattr(tf, CLASSES[model_type]).from_pretrained(
                tmp_path / model_type, local_files_only=True).eval()
            assert back.config.vocab_size == V
            assert_equal_logits(hf_logits(back), expected[model_type])


# ------------------------------------------------------------------ training, idle experts
def _train_adamw(model, logits_of, batch, steps=3):
    """``steps`` AdamW steps (eps 1: the gradient's scale matters; weight decay 0.1) on the
    next-token loss of ``batch``."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1.0, weight_decay=0.1)
    for _ in range(steps):
        opt.zero_grad()
        logits = logits_of(model, batch)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                 batch[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
    return loss.item()


def test_training_with_an_idle_expert_equals_transformers(tmp_path):
    """Mixtral with 8 experts, top-1, 2 x 6 tokens: some experts receive no token in a step.
    Three AdamW steps of ours and of transformers' MixtralForCausalLM from the same weights
    end equal, every weight compared after ``save_hf`` (1e-5). Both store the experts
    stacked (transformers' ``experts.gate_up_proj [X, 2f, h]``), so an idle expert's rows
    get a zero gradient and AdamW decays them, in the serial model as here; the test checks
    that an expert was idle and that its rows moved by exactly that decay in both."""
    tf = _transformers()
    hf = hf_moe('mixtral', num_local_experts=8, num_experts_per_tok=1).train()
    ours = Llama.from_hf(hf).train()
    batch = ids(batch=2, seq=6)
    block = ours.blocks['1'].mlp
    idle_every_step = set(range(8))

    def our_logits_noting_idle(model, b):
        logits = model(b)
        idle_every_step.intersection_update(
            (block.last_tokens_per_expert == 0).nonzero().flatten().tolist())
        return logits

    key = 'model.layers.1.mlp.experts.down_proj'
    before = hf.state_dict()[key].clone()
    hf_loss = _train_adamw(hf, lambda m, b: m(input_ids=b).logits, batch)
    our_loss = _train_adamw(ours, our_logits_noting_idle, batch)
    assert idle_every_step, 'no expert of block 1 was idle in all 3 steps: the test needs one'
    assert abs(hf_loss - our_loss) <= 1e-5 * max(1.0, abs(hf_loss))
    ours.save_hf(tmp_path)
    back = tf.MixtralForCausalLM.from_pretrained(tmp_path, local_files_only=True).state_dict()
    trained = hf.state_dict()
    assert set(back) >= set(trained) - {k for k in trained if 'rotary' in k}
    worst = max(max_rel_diff(back[k], v) for k, v in trained.items() if k in back)
    assert worst <= 1e-5, worst
    for e in idle_every_step:   # zero gradient, zero moments: decay alone, lr * wd per step
        torch.testing.assert_close(trained[key][e], before[e] * (1 - 1e-2 * 0.1) ** 3,
                                   rtol=1e-6, atol=1e-7)
