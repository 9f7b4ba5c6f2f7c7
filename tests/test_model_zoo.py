"""Model zoo presets have the published sizes; serial models behave as documented."""
import pytest
import torch

from model_zoo import BERT, GPT, ViT, GPTLMLoss


def _numel(model):
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize('build, expected', [
    # Hugging Face GPT2LMHeadModel('gpt2'), tied head counted once
    (lambda: GPT.from_preset('gpt2-small', vocab_size=50257), 124_439_808),
    # Hugging Face BertForPreTraining('bert-base-uncased')
    (lambda: BERT.from_preset('bert-base', vocab_size=30522), 110_106_428),
    # ViT-B/16 at 224 px, 1000 classes (timm vit_base_patch16_224)
    (lambda: ViT.from_preset('vit-base'), 86_567_656),
])
def test_presets_have_the_published_parameter_counts(build, expected):
    assert _numel(build()) == expected


def test_lm_head_is_tied_to_the_token_embedding():
    model = GPT.from_preset('tiny')
    assert model.lm_head.weight is model.wte.weight
    assert 'lm_head.weight' in model.state_dict()


def test_gpt_is_causal_and_the_loss_is_next_token():
    torch.manual_seed(0)
    model = GPT.from_preset('tiny').eval()
    ids = torch.randint(0, 256, (2, 12))
    changed = ids.clone()
    changed[:, 8:] = (changed[:, 8:] + 1) % 256
    assert torch.allclose(model(ids)[:, :8], model(changed)[:, :8], atol=1e-6)
    assert not torch.allclose(model(ids)[:, 8:], model(changed)[:, 8:], atol=1e-3)
    logits = model(ids)
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 256), ids[:, 1:].reshape(-1))
    assert torch.allclose(GPTLMLoss()(logits, ids), expected, atol=1e-6)


def test_bert_padding_mask_hides_padded_keys():
    torch.manual_seed(0)
    model = BERT.from_preset('tiny').eval()
    ids = torch.randint(0, 256, (1, 10))
    mask = torch.ones(1, 10, dtype=torch.long)
    mask[0, 7:] = 0
    other = ids.clone()
    other[0, 7:] = (other[0, 7:] + 5) % 256
    mlm_a, nsp_a = model(ids, mask)
    mlm_b, nsp_b = model(other, mask)
    assert torch.allclose(mlm_a[:, :7], mlm_b[:, :7], atol=1e-5)
    assert torch.allclose(nsp_a, nsp_b, atol=1e-5)


@pytest.mark.parametrize('build, message', [
    (lambda: GPT.from_preset('gpt5'), "unknown GPT preset 'gpt5'"),
    (lambda: GPT.from_preset('tiny', hiden=3), "unknown GPT options ['hiden']"),
    (lambda: GPT.from_preset('tiny', hidden=30, heads=4), 'hidden size 30 must be divisible by the number of heads 4'),
    (lambda: ViT.from_preset('tiny', img_size=9), 'img_size 9 must be divisible by patch_size 2'),
])
def test_bad_model_options_are_clear_errors(build, message):
    with pytest.raises(ValueError) as info:
        build()
    assert message in str(info.value)


def test_sequence_longer_than_positions_is_an_error():
    with pytest.raises(ValueError, match='sequence length 65 exceeds max_positions 64'):
        GPT.from_preset('tiny')(torch.zeros(1, 65, dtype=torch.long))
