"""Hugging Face Llama, Mistral and Qwen2 <-> model_zoo Llama: after ``Llama.from_hf`` our
logits equal transformers' own (fp32, within 1e-5 of scale) serially and in 1D (t=2: the
kv heads split; t=4: 2 kv heads replicated), 2D, 3D, sequence, ring x Ulysses and
pipeline layouts;
``save_hf`` from 1D t=2 writes a directory transformers reloads with the same logits;
greedy generation (``colossal_lite.generation``) gives transformers' ``generate`` tokens;
each config field ours cannot represent raises a ValueError naming it.

The HF models are tiny (hidden 64, 4 heads, 2 kv heads, 2 layers), random-init and then
randomized (RMSNorm weights and biases too), built in memory (no download). The vocabulary
of 251 is odd, so every tensor layout pads it (embedding and LM head; 252 in each used here;
sequence mode does not split the vocabulary).
Llama has Llama-3 rope scaling, Mistral a sliding window as long as its positions (no
effect: accepted), Qwen2 q/k/v biases and a tied LM head. The helpers (randomizing, the
comparison) are tests/test_hf_conversion.py's.
"""
import pytest
import torch

from colossal_lite.generation import generate
from colossal_lite.testing import full_outputs, max_rel_diff, replica_batch, run_distributed
from model_zoo import Llama
from tests.test_hf_conversion import TOL, _randomized, _transformers, assert_equal_logits

V = 251        # odd: padded to 252 by every split used here
PADDED = 252
TYPES = ('llama', 'mistral', 'qwen2')
CLASSES = {'llama': 'LlamaForCausalLM', 'mistral': 'MistralForCausalLM',
           'qwen2': 'Qwen2ForCausalLM'}
TINY = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
LLAMA3 = dict(rope_type='llama3', rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
              high_freq_factor=4.0, original_max_position_embeddings=16)


def hf_llama(model_type='llama', cls=None, **cfg):
    """A tiny randomized transformers model of ``model_type`` (defaults: module doc)."""
    tf = _transformers()
    extra = {'llama': dict(rope_parameters=LLAMA3), 'mistral': dict(sliding_window=64),
             'qwen2': dict(tie_word_embeddings=True)}[model_type]
    config_cls = {'llama': tf.LlamaConfig, 'mistral': tf.MistralConfig,
                  'qwen2': tf.Qwen2Config}[model_type]
    config = config_cls(**dict(TINY, **{**extra, **cfg}))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return _randomized(getattr(tf, cls or CLASSES[model_type])(config))


def ids(batch=4, seq=8):
    return torch.randint(0, V, (batch, seq), generator=torch.Generator().manual_seed(7))


def hf_logits(model):
    with torch.no_grad():
        return [model(input_ids=ids()).logits]


def our_logits(model):
    with torch.no_grad():
        return full_outputs(model.eval()(ids()))


def hf_greedy(model, prompt, tokens):
    """transformers' greedy continuation (``min_new_tokens``: no early stop at eos)."""
    with torch.no_grad():
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                              max_new_tokens=tokens, min_new_tokens=tokens, pad_token_id=0)


PROMPT = torch.tensor([[5, 17, 200, 3, 99], [8, 8, 150, 42, 7]])
NEW_TOKENS = 8


# ------------------------------------------------------------------ serial
@pytest.mark.parametrize('model_type', TYPES)
def test_serial_logits_generation_and_save_hf_equal_transformers(model_type, tmp_path):
    tf = _transformers()
    hf = hf_llama(model_type)
    ours = Llama.from_hf(hf)
    assert ours.arch_args['vocab_size'] == V            # serial: no padding
    expected = hf_logits(hf)
    assert_equal_logits(our_logits(ours), expected)
    assert torch.equal(generate(ours, PROMPT, NEW_TOKENS), hf_greedy(hf, PROMPT, NEW_TOKENS))
    ours.save_hf(tmp_path)
    back = getattr(tf, CLASSES[model_type]).from_pretrained(tmp_path, local_files_only=True)
    assert_equal_logits(hf_logits(back.eval()), expected)
    assert_equal_logits(our_logits(Llama.from_hf(str(tmp_path))), expected)


def test_conversion_details_are_checked_by_the_logits():
    """The comparison can fail: a broken map (gate and up swapped, the rope scaling dropped)
    moves the logits far past the tolerance; the Llama-3 scaling, GQA and bias are read."""
    hf = hf_llama('llama')
    ours = Llama.from_hf(hf)
    assert ours.arch_args['rope_scaling'] == dict(factor=8.0, low_freq_factor=1.0,
                                                  high_freq_factor=4.0, original_max_positions=16)
    assert ours.arch_args['rope_theta'] == 500000.0 and ours.arch_args['kv_heads'] == 2
    expected = hf_logits(hf)[0]
    state = ours.state_dict()
    state['blocks.0.mlp.gate_proj.weight'], state['blocks.0.mlp.up_proj.weight'] = \
        state['blocks.0.mlp.up_proj.weight'], state['blocks.0.mlp.gate_proj.weight']
    ours.load_state_dict(state)
    assert max_rel_diff(our_logits(ours)[0], expected) > 1e-3
    unscaled = Llama(**dict(ours.arch_args, rope_scaling=None))
    unscaled.load_state_dict(Llama.from_hf(hf).state_dict())
    assert max_rel_diff(our_logits(unscaled)[0], expected) > 1e-3
    qwen = Llama.from_hf(hf_llama('qwen2'))
    assert qwen.arch_args['qkv_bias'] and qwen.arch_args['tie_embeddings']
    assert qwen.state_dict()['blocks.1.attn.k_proj.bias'].abs().max() > 0


def test_headless_model_and_preset_export(tmp_path):
    """``LlamaModel`` loads its body (the untied head keeps its seeded weights); a preset
    model exports as LlamaForCausalLM, one with q/k/v biases as Qwen2ForCausalLM."""
    tf = _transformers()
    lm = hf_llama('llama')
    ours = Llama.from_hf(lm.model)
    with torch.no_grad():
        lm.lm_head.weight.copy_(ours.state_dict()['lm_head.weight'])
    assert_equal_logits(our_logits(ours), hf_logits(lm))
    for qkv_bias, cls in ((False, 'LlamaForCausalLM'), (True, 'Qwen2ForCausalLM')):
        torch.manual_seed(0)
        model = _randomized(Llama.from_preset('tiny', qkv_bias=qkv_bias, tie_embeddings=qkv_bias))
        model.save_hf(tmp_path / cls)
        hf = tf.AutoModelForCausalLM.from_pretrained(tmp_path / cls, local_files_only=True)
        assert type(hf).__name__ == cls
        assert_equal_logits(hf_logits(hf.eval()), our_logits(model))


# ------------------------------------------------------------------ errors
def test_config_fields_ours_cannot_represent_raise_naming_them(tmp_path):
    tf = _transformers()
    cases = [
        (hf_llama('llama', hidden_act='gelu'), {}, "hidden_act='gelu'"),
        (hf_llama('llama', head_dim=32), {}, 'head_dim=32'),
        (hf_llama('llama', mlp_bias=True), {}, 'mlp_bias=True'),
        (hf_llama('llama', attention_bias=True), {}, 'attention_bias=True: .* o_proj'),
        (hf_llama('llama', rope_parameters=dict(rope_type='linear', factor=2.0)), {},
         "rope_type='linear'"),
        (hf_llama('llama', rope_parameters=dict(rope_type='default', rope_theta=1e4,
                                                partial_rotary_factor=0.5)), {},
         'partial_rotary_factor=0.5'),
        (hf_llama('mistral', sliding_window=16), {}, 'sliding_window=16'),
        (hf_llama('qwen2', use_sliding_window=True, sliding_window=16, max_window_layers=1), {},
         r'sliding_window=16: layers \[1\]'),
        (hf_llama('llama'), dict(kv_heads=4), 'override kv_heads=4 contradicts'),
        (hf_llama('llama'), dict(vocab_size=200), 'vocab_size=200 is smaller'),
    ]
    for source, overrides, message in cases:
        with pytest.raises(ValueError, match=message):
            Llama.from_hf(source, **overrides)
    # Mixtral / Qwen2-MoE are read with moe=dict(...): tests/test_hf_moe.py
    for hf, message in ((tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=32, n_layer=1, n_head=4)),
                         "reads model_type 'llama', 'mistral', 'qwen2', 'mixtral', "
                         "'qwen2_moe'.*'gpt2'"),):
        with pytest.raises(ValueError, match=message):
            Llama.from_hf(hf)
    # what has no effect is accepted: a window as long as the positions, Qwen2's unused one
    Llama.from_hf(hf_llama('qwen2', use_sliding_window=True, sliding_window=64,
                           max_window_layers=1))
    Llama.from_hf(hf_llama('qwen2', sliding_window=16))          # use_sliding_window=False
    assert Llama.from_hf(hf_llama('llama', attention_dropout=0.1)).arch_args['dropout'] == 0.1
    model = Llama.from_preset('tiny', qkv_bias=True)
    model.hf_config = dict(hf_llama('llama').config.to_dict())   # as if read from a Llama
    with pytest.raises(ValueError, match='qkv_bias=True.* cannot be written as Llama'):
        model.save_hf(tmp_path)


# ------------------------------------------------------------------ parallel layouts
def _rank_logits(rank, sources, directory, tokens):
    """Every model type read for the launched layout: its full logits and padded vocabulary;
    with ``directory`` its ``save_hf`` there, with ``tokens`` its greedy continuation."""
    result = {}
    for model_type, hf in sources.items():
        model = Llama.from_hf(hf)
        out = dict(logits=our_logits(model), vocab=model.arch_args['vocab_size'])
        if directory:
            model.save_hf(f'{directory}/{model_type}')
        if tokens:
            out['tokens'] = generate(model, PROMPT, tokens)
        result[model_type] = out
    return result


def _check_layout(world, parallel, tmp_path=None, tokens=0, types=TYPES, padded=PADDED):
    tf = _transformers()
    sources = {t: hf_llama(t) for t in types}
    expected = {t: hf_logits(m) for t, m in sources.items()}
    results = run_distributed(_rank_logits, world, dict(parallel=parallel), sources,
                              tmp_path and str(tmp_path), tokens, timeout=600)
    for model_type in types:
        for rank_result in results:
            got = rank_result[model_type]
            assert got['vocab'] == padded, (model_type, got['vocab'])
            assert_equal_logits(got['logits'], expected[model_type], vocab=V)
            if tokens:
                assert torch.equal(got['tokens'], hf_greedy(sources[model_type], PROMPT, tokens))
        if tmp_path:
            back = getattr(tf, CLASSES[model_type]).from_pretrained(
                tmp_path / model_type, local_files_only=True).eval()
            assert back.config.vocab_size == V
            assert_equal_logits(hf_logits(back), expected[model_type])


def test_1d_t2_splits_the_kv_heads_saves_hf_and_generates_greedily(tmp_path):
    _check_layout(2, dict(tensor=dict(size=2, mode='1d')), tmp_path, tokens=NEW_TOKENS)


@pytest.mark.parametrize('world, tensor, padded', [
    (4, dict(size=4, mode='1d'), PADDED),   # 2 kv heads < 4 ranks: replicated per group
    (4, dict(size=4, mode='2d'), PADDED),
    (2, dict(size=2, mode='sequence'), V),  # the sequence is split, the vocabulary is not
    (4, dict(size=4, mode='ulysses', ring=2), V),   # ring x Ulysses: heads split over 2
], ids=['1d-t4', '2d', 'sequence', 'ring2xulysses2'])
def test_tensor_and_sequence_modes_equal_transformers(world, tensor, padded):
    _check_layout(world, dict(tensor=tensor), padded=padded)


def test_3d_equals_transformers():
    _check_layout(8, dict(tensor=dict(size=8, mode='3d')))   # q=2: the vocabulary cut q^2=4 ways


def _pipeline_rank(rank, sources):
    """pipeline=2 x 1D t=2: stage 0 sends its activation to stage 1 (same tensor rank),
    which returns the full logits; the tied Qwen2 head lives on stage 1 with its embedding."""
    from colossal_lite import communication as C
    from colossal_lite.context import ParallelMode, global_context as gpc
    result = {}
    x_ids = replica_batch(ids())
    for model_type, hf in sources.items():
        model = Llama.from_hf(hf).eval()
        with torch.no_grad():
            if gpc.get_local_rank(ParallelMode.PIPELINE) == 0:
                C.send(model(x_ids), ParallelMode.PIPELINE, dst=1)
                result[model_type] = None
            else:
                x = C.recv(torch.empty(*x_ids.shape, 64), ParallelMode.PIPELINE, src=0)
                result[model_type] = full_outputs(model(x_ids, stage_input=x))
    return result


def test_pipeline_two_stages_equals_transformers():
    sources = {t: hf_llama(t) for t in TYPES}
    config = dict(parallel=dict(pipeline=2, tensor=dict(size=2, mode='1d')), num_microbatches=2)
    results = run_distributed(_pipeline_rank, 4, config, sources, timeout=600)
    for model_type, hf in sources.items():
        lasts = [r[model_type] for r in results if r[model_type] is not None]
        assert len(lasts) == 2
        for out in lasts:
            assert_equal_logits(out, hf_logits(hf), vocab=V)


# ------------------------------------------------------------------ commands
LLAMA_JOB = """
model = dict(type='llama', preset='tiny', hidden=32, layers=1, heads=4, kv_heads=2,
             intermediate=64, max_positions=32, dropout=0.0)
data = dict(type='shakespeare', seq_len=16, val_fraction=0.05, plays=['macbeth'])
train = dict(global_batch_size=8, steps=30, eval_batches=2)
optimizer = dict(type='adamw', lr=1e-2)
"""
STEPS = 30   # enough that greedy decoding is no longer one repeated byte


def test_export_and_generate_commands_on_a_llama_checkpoint(tmp_path, capfd):
    """A Llama job trained 3 steps under 1D t=2: ``colossal-lite export`` writes a
    LlamaForCausalLM with our logits, and ``colossal-lite generate`` (serial and --nproc 2)
    prints the exported model's greedy ``generate`` text."""
    from colossal_lite.data import ByteTokenizer
    from colossal_lite.config import load_config
    from tests.test_generation import TP2, _cli, _loaded, _train_job_and_save
    tf = _transformers()
    (tmp_path / 'llama.py').write_text(LLAMA_JOB)
    ckpt = str(tmp_path / 'ckpt')
    config = dict(load_config(str(tmp_path / 'llama.py')).settings.to_dict(), **TP2)
    run_distributed(_train_job_and_save, 2, config, str(tmp_path / 'llama.py'), ckpt, STEPS,
                    timeout=300)
    code, _, err = _cli(['export', ckpt, '--hf', str(tmp_path / 'hf')], capfd)
    assert code == 0, err
    hf = tf.LlamaForCausalLM.from_pretrained(str(tmp_path / 'hf'), local_files_only=True).eval()
    x = ids(batch=2, seq=20)
    with torch.no_grad():
        ours, theirs = _loaded(ckpt)(x), hf(input_ids=x).logits
    assert_equal_logits([ours], [theirs])
    tok = ByteTokenizer()
    prompt = tok.encode('MACBETH:')[None]
    expected = tok.decode(hf_greedy(hf, prompt, 12)[0].tolist())
    assert len(set(expected[len('MACBETH:'):])) > 1, expected
    for extra in ([], ['--nproc', '2']):
        code, out, err = _cli(['generate', ckpt, '--prompt', 'MACBETH:', '--tokens', '12',
                               '--greedy'] + extra, capfd)
        assert code == 0, err
        assert out == expected + '\n', (extra, out, expected)
