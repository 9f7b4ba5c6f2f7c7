"""Shared pieces of the engine / amp / trainer tests: tiny zoo models, batches, serial references,
and a two-half MLP for the serial schedule tests.

The serial reference runs in the parent process (no launch: serial layers) with a
plain torch loop (forward, backward, torch's clip_grad_norm_, AdamW). Ranks build
the parallel model from the serial full weights, take their data-parallel slice of
each global batch, train through ``initialize``/``Engine`` and return the worst
relative differences, which the tests assert.
"""
from __future__ import annotations

import torch

import colossal_lite.nn as col_nn
from colossal_lite.context import ParallelMode, global_context as gpc
from model_zoo import BERT, GPT, BertPretrainingLoss, GPTLMLoss, ViT

FAMILIES = ('gpt', 'bert', 'vit')
B, S = 8, 8
LR = 1e-3
# eps 1e-6 (torch default 1e-8): Adam divides by sqrt(v) + eps, which turns rounding noise on
# gradients that are ~0 in exact arithmetic (attention key biases) into O(lr) updates
EPS = 1e-6


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=LR, eps=EPS)


def build(family: str, **overrides):
    cls = {'gpt': GPT, 'bert': BERT, 'vit': ViT}[family]
    return cls.from_preset('tiny', **overrides)


def criterion(family: str):
    return {'gpt': GPTLMLoss, 'bert': BertPretrainingLoss, 'vit': col_nn.CrossEntropyLoss}[family]()


def global_batch(family: str, seed: int = 0, batch: int = B):
    """(inputs, labels) of the whole batch; every BERT token is labelled so each replica's
    mean is over the same number of tokens (then the replica average is the serial mean)."""
    g = torch.Generator().manual_seed(seed)
    if family == 'gpt':
        ids = torch.randint(0, 256, (batch, S), generator=g)
        return ids, ids
    if family == 'bert':
        ids = torch.randint(0, 256, (batch, S), generator=g)
        mask = torch.ones(batch, S, dtype=torch.long)
        mask[:, -2:] = torch.randint(0, 2, (batch, 2), generator=g)
        return (ids, mask), (torch.randint(0, 256, (batch, S), generator=g),
                             torch.randint(0, 2, (batch,), generator=g))
    return torch.randn(batch, 1, 8, 8, generator=g), torch.randint(0, 10, (batch,), generator=g)


def slice_batch(obj, parts: int, index: int):
    """The ``index``-th of ``parts`` equal chunks of every tensor along the batch dim."""
    if torch.is_tensor(obj):
        return obj.chunk(parts, dim=0)[index]
    return type(obj)(slice_batch(o, parts, index) for o in obj)


def replica_batch(batch):
    """This rank's data-parallel slice of a global batch."""
    return slice_batch(batch, gpc.get_world_size(ParallelMode.DATA),
                       gpc.get_local_rank(ParallelMode.DATA))


def _call(fn, first, obj):
    return fn(*first, *obj) if isinstance(obj, (tuple, list)) else fn(*first, obj)


def serial_loss(model, family, batch):
    inputs, labels = batch
    return _call(criterion(family), (_call(model, (), inputs),), labels)


def serial_reference(family: str, batches, steps: int = 3, clip: float = 0.0, seed: int = 1,
                     **overrides):
    """Initial weights, and after a plain serial loop: first loss, first (clipped) grads, first
    grad norm, weights after ``steps`` AdamW steps. ``batches[i]`` feeds step i (cycled)."""
    torch.manual_seed(seed)
    model = build(family, **overrides)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    opt = make_optimizer(model.parameters())
    out = {'init': init}
    for step in range(steps):
        opt.zero_grad()
        loss = serial_loss(model, family, batches[step % len(batches)])
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip else float('inf'))
        if step == 0:
            out.update(loss=loss.item(), norm=norm.item(),
                       grads={n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    out['params'] = {k: v.clone() for k, v in model.state_dict().items()}
    return out


def mlp(seed: int = 0) -> torch.nn.Sequential:
    """A small two-half MLP: ``[0]`` = Linear + Tanh (first half), ``[1]`` = Linear (second)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh()),
                               torch.nn.Linear(16, 5))


def mlp_batch(batch: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 6, generator=g), torch.randint(0, 5, (batch,), generator=g)


def full_batch_grads(model: torch.nn.Module, batch) -> tuple:
    """(loss, {name: grad}) of one plain backward of the mean cross entropy on ``batch``."""
    model.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(model(batch[0]), batch[1])
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
