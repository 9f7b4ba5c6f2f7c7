"""Text generation from a causal LM (``model_zoo.GPT``) with a KV cache, in any tensor layout.

``generate(model, prompt_ids, max_new_tokens, top_k=None, temperature=1.0, seed=0)``::

    cache  = model.new_kv_cache()
    logits = model(prompt, kv_cache=cache, last_only=True)   # prefill: the prompt at once
    repeat max_new_tokens times:
        z    = gather_logits(logits)[:, -1]          # full [b, V] on every rank
        next = argmax(z)                             # greedy (top_k None or temperature 0)
             | sample(softmax(topk(z / T, k)))       # generator seeded with `seed` on every rank
        logits = model(next, kv_cache=cache, last_only=True)   # attends to every cached key

Past ``max_positions`` the context window slides: once the cache is full, every step runs
the last ``max_positions`` tokens afresh (a new cache), as a model cropping its input to
its positions does; a prompt longer than ``max_positions`` is an error.

A packed prompt (``position_ids=``: several documents per row, positions restarting at 0
where each starts; docs/llama.md) is prefilled with ``packed=True``; the cache then
continues each row's last document (its positions, attention within it), so the tokens
are those the last document alone would produce as the prompt.

Every rank holds the full prompt (the model splits its inputs as the layout needs), the
same full logits (``gather_logits``: all_gathers over the vocabulary and batch cuts) and
the same CPU generator, so every rank picks the same token with no extra collective.
2D / 2.5D / 3D split a batch over ``q`` / ``d*q`` / ``q^2`` ranks: a batch that does not
divide is padded with copies of its last prompt, whose outputs are dropped (tokens are
drawn for the real rows only, so the output does not depend on the layout).
"""
from __future__ import annotations

import numbers
from typing import Optional

import torch

from .config.families import family
from .context import current_context
from .nn import gather_logits


def batch_split() -> int:
    """Ranks the current tensor mode splits a batch over (1: serial, 1D)."""
    layout = current_context().layout
    return 1 if layout is None else family(layout.mode).batch_split(layout)


def check_arguments(model, prompt_len: int, max_new_tokens, top_k, temperature) -> None:
    """ValueError naming the argument: an empty prompt, one longer than the model's
    ``max_positions``, a bad ``max_new_tokens`` / ``top_k`` / ``temperature``.
    No communication (run on every rank alike, or in a parent before workers start)."""
    if prompt_len < 1:
        raise ValueError('the prompt is empty: generation needs at least one prompt token')
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) \
            or max_new_tokens < 0:
        raise ValueError(f'max_new_tokens must be a non-negative integer, got {max_new_tokens!r}')
    limit = getattr(model, 'max_positions', None)
    if limit is not None and prompt_len > limit:
        raise ValueError(f'a prompt of {prompt_len} tokens exceeds the model\'s max_positions '
                         f'{limit}')
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral)
                              or top_k < 1):
        raise ValueError(f'top_k must be a positive integer or None, got {top_k!r}')
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) \
            or not temperature >= 0:
        raise ValueError(f'temperature must be a number >= 0, got {temperature!r}')


def pick(logits: torch.Tensor, top_k: Optional[int], temperature: float,
         generator: torch.Generator) -> torch.Tensor:
    """Next tokens ``[b]`` from full logits ``[b, V]``: argmax when ``top_k`` is None or
    ``temperature`` is 0, else a draw from the softmax of the ``top_k`` largest
    ``logits / temperature`` (``generator`` on CPU). Local."""
    logits = logits.float().cpu()
    if top_k is None or temperature == 0:
        return logits.argmax(dim=-1)
    values, indices = (logits / temperature).topk(min(top_k, logits.shape[-1]), dim=-1)
    choice = torch.multinomial(values.softmax(dim=-1), 1, generator=generator)
    return indices.gather(-1, choice).squeeze(-1)


@torch.no_grad()
def generate(model, prompt_ids: torch.Tensor, max_new_tokens: int, *, top_k: Optional[int] = None,
             temperature: float = 1.0, seed: int = 0,
             position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The prompt followed by ``max_new_tokens`` generated tokens (see the module doc).

    ``prompt_ids``: the full ``[s]`` or ``[b, s]`` ids, identical on every rank; returns
    ``[s + n]`` or ``[b, s + n]`` on every rank. ``position_ids`` (the prompt's shape): a
    packed prompt, continued in its last document (module doc). Collective in a launched
    tensor layout (every rank calls it with the same arguments); the model is put in eval
    mode."""
    single = prompt_ids.dim() == 1
    prompt = prompt_ids.unsqueeze(0) if single else prompt_ids
    if prompt.dim() != 2 or prompt.shape[0] == 0:
        raise ValueError(f'prompt_ids must be a [s] or [b, s] tensor of token ids, got shape '
                         f'{tuple(prompt_ids.shape)}')
    positions = None
    if position_ids is not None:
        if tuple(position_ids.shape) != tuple(prompt_ids.shape):
            raise ValueError(f'position_ids {tuple(position_ids.shape)} must have the shape of '
                             f'prompt_ids {tuple(prompt_ids.shape)}')
        positions = position_ids.reshape(prompt.shape).cpu()
    check_arguments(model, prompt.shape[1], max_new_tokens, top_k, temperature)
    b = prompt.shape[0]
    pad = -b % batch_split()  # 2D/2.5D/3D split the batch: pad with copies of the last row
    device = next(model.parameters()).device
    limit = getattr(model, 'max_positions', None)
    generator = torch.Generator().manual_seed(int(seed))
    model.eval()
    cache = model.new_kv_cache()
    out = prompt.cpu()
    step = out
    for _ in range(max_new_tokens):
        if limit is not None and cache.length + step.shape[1] > limit:
            cache, step = model.new_kv_cache(), out[:, -limit:]  # the window slides
        packed = {}
        if positions is not None and cache.length == 0:  # a packed (re)fill; then continued
            pos = positions[:, -step.shape[1]:]
            packed = dict(packed=True,
                          position_ids=torch.cat([pos, pos[-1:].expand(pad, -1)]).to(device))
        step = torch.cat([step, step[-1:].expand(pad, -1)]).to(device)
        logits = gather_logits(model(step, kv_cache=cache, last_only=True, **packed))[:b, -1]
        step = pick(logits, top_k, temperature, generator).unsqueeze(1)  # the real rows only
        out = torch.cat([out, step], dim=1)
        if positions is not None:
            positions = torch.cat([positions, positions[:, -1:] + 1], dim=1)
    return out[0] if single else out
