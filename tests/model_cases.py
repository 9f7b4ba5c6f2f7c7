"""Tiny GPT, BERT and ViT cases shared by the model-equivalence tests of every layout.

``make_case(name, batch)`` gives (build_model, inputs, labels, build_loss); everything is
deterministic, so the parent (serial reference) and each forked rank build the same data.
"""
import torch

from model_zoo import BERT, GPT, ViT, BertPretrainingLoss, GPTLMLoss

import colossal_lite.nn as col_nn


def _gpt(batch, seq=16, **overrides):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (batch, seq), generator=g)
    return (lambda: GPT.from_preset('tiny', **overrides)), (ids,), ids, GPTLMLoss


def _bert(batch, seq=16, **overrides):
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 256, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, seq - 5:] = 0          # padded tails of different lengths
    mask[-1, seq - 3:] = 0
    mlm = torch.full((batch, seq), -100)
    picks = torch.rand(batch, seq, generator=g) < 0.3
    picks[:, : seq // 2] &= torch.rand(batch, seq // 2, generator=g) < 0.3  # uneven spread
    mlm[picks] = ids[picks]
    nsp = torch.randint(0, 2, (batch,), generator=g)

    def loss():
        criterion = BertPretrainingLoss()
        return lambda out, labels: criterion(out, *labels)
    return (lambda: BERT.from_preset('tiny', **overrides)), (ids, mask), (mlm, nsp), loss


def _vit(batch, **overrides):
    g = torch.Generator().manual_seed(3)
    images = torch.randn(batch, 1, 8, 8, generator=g)
    labels = torch.randint(0, 10, (batch,), generator=g)
    return (lambda: ViT.from_preset('tiny', **overrides)), (images,), labels, col_nn.CrossEntropyLoss


CASES = {'gpt': _gpt, 'bert': _bert, 'vit': _vit}


def make_case(name, batch=4, **overrides):
    return CASES[name](batch, **overrides)


def serial_state(name, **overrides):
    """The serial model's initial full state dict (seeded)."""
    build, *_ = make_case(name, **overrides)
    torch.manual_seed(0)
    return {k: v.clone() for k, v in build().state_dict().items()}
