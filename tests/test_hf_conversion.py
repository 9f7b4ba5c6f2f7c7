"""Hugging Face GPT-2 -> model_zoo GPT: equal logits after converting the weights.

Needs ``transformers`` (in the 'test' extra); without it the test fails with a message.
"""
import pytest
import torch

from model_zoo.hf import gpt_from_hf, gpt_kwargs_from_hf


def _transformers():
    try:
        import transformers
    except ImportError as exc:  # a failure, never a skip: the comparison is the point
        pytest.fail(f'tests/test_hf_conversion.py needs transformers: pip install transformers '
                    f'(or bash scripts/install.sh test); import failed with: {exc}')
    return transformers


def _tiny_hf(vocab=100, n_inner=None):
    tf = _transformers()
    cfg = tf.GPT2Config(vocab_size=vocab, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                        n_inner=n_inner, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # HF inits small or constant: randomize so every map is tested
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model


def test_gpt2_logits_equal_after_conversion_with_padded_vocab():
    hf = _tiny_hf(vocab=100, n_inner=64)
    ours = gpt_from_hf(hf, vocab_size=128).eval()
    ids = torch.randint(0, 100, (3, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = hf(ids).logits
        mine = ours(ids)
    assert mine.shape == (3, 16, 128)
    scale = theirs.abs().max()
    assert (mine[..., :100] - theirs).abs().max() <= 1e-5 * scale
    assert mine[..., 100:].abs().max() == 0
    # the conversion is not the identity on a broken map: swapping q and k changes the logits
    state = ours.state_dict()
    state['blocks.0.attn.query.weight'], state['blocks.0.attn.key.weight'] = \
        state['blocks.0.attn.key.weight'], state['blocks.0.attn.query.weight']
    ours.load_state_dict(state)
    with torch.no_grad():
        assert (ours(ids)[..., :100] - theirs).abs().max() > 1e-3 * scale


def test_gpt_kwargs_reject_what_we_do_not_model():
    tf = _transformers()
    with pytest.raises(ValueError, match='tanh-GELU'):
        gpt_kwargs_from_hf(tf.GPT2Config(activation_function='relu'))
    with pytest.raises(ValueError, match='smaller than the HF vocabulary'):
        gpt_kwargs_from_hf(tf.GPT2Config(vocab_size=300), vocab_size=256)
