"""Hugging Face -> our model, for the launched layout (``from_hf``).

No network: the source is a local directory written by ``save_pretrained`` (read with
``local_files_only=True``) or an in-memory transformers model. Every rank reads the full
HF weights and converts them to our full serial state dict; the model's
``load_state_dict(full)`` keeps this rank's shards (and only its pipeline stages' keys).
No collective runs here beyond what building the model does.

Vocabulary padding rule: the vocabulary is padded with zero rows (embedding, tied LM
head, MLM decoder bias) to the smallest multiple of the launched layout's vocabulary
split that holds it -- 1 serial or data parallel, t for 1D, q for 2D and 2.5D, q^2 for
3D (``colossal_lite.config.families.family(mode).vocab_split``); ``vocab_size=`` in the
overrides picks any larger size instead (e.g. a multiple of 128, the same in every
layout). The padded logits are 0 (zero rows, zero bias) and the first ``V_hf`` equal
HF's; the HF size is kept as ``model.hf_vocab_size`` so ``save_hf`` cuts it back.
"""
from __future__ import annotations

import math
import os
from typing import Dict, Tuple

import torch

from .family import HFFamily, KeyReader, State

# constructor options a caller may set freely; every other override must equal HF's value
FREE_OPTIONS = ('dropout', 'checkpoint', 'init_std')


def vocab_split() -> int:
    """How many parts the launched layout cuts the vocabulary into (1 when not launched)."""
    from colossal_lite.context import current_context
    from colossal_lite.config.families import family
    layout = current_context().layout
    return 1 if layout is None else family(layout.mode).vocab_split(layout)


def padded_vocab(size: int) -> int:
    split = vocab_split()
    return math.ceil(size / split) * split


def load_source(source, fam: HFFamily):
    """The transformers model of ``source``: an in-memory model, or a local directory."""
    import transformers
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not os.path.isdir(path):
            raise ValueError(f'{fam.name}.from_hf takes a local directory written by '
                             f'save_pretrained (no download); {path!r} is not a directory')
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        _check_type(config, fam)
        name = (config.architectures or [fam.hf_class(config)])[0]
        _check_class(name, fam)
        with torch.random.fork_rng(devices=[]):  # HF's init must not move this rank's RNG
            return getattr(transformers, name).from_pretrained(path, local_files_only=True)
    if isinstance(source, torch.nn.Module) and hasattr(source, 'config'):
        _check_type(source.config, fam)
        _check_class(type(source).__name__, fam)
        return source
    raise TypeError(f'{fam.name}.from_hf takes a local directory or a transformers model, '
                    f'got {type(source).__name__}')


def _check_type(config, fam: HFFamily):
    if config.model_type in fam.unsupported:
        raise ValueError(f'{fam.name}.from_hf cannot read model_type={config.model_type!r}: '
                         f'{fam.unsupported[config.model_type](config)}')
    if config.model_type not in fam.model_types:
        types = ', '.join(repr(t) for t in fam.model_types)
        raise ValueError(f"{fam.name}.from_hf reads model_type {types}; the HF "
                         f"config has model_type={config.model_type!r}")


def _check_class(name: str, fam: HFFamily):
    if name not in fam.classes:
        raise ValueError(f'{fam.name}.from_hf reads {sorted(fam.classes)}; got {name}')


def model_kwargs(fam: HFFamily, hf_config, hf_class: str, overrides: Dict) -> Dict:
    """Our constructor's arguments: HF's architecture, the padded vocabulary, and
    ``overrides`` (free options, or architecture values equal to HF's)."""
    kwargs = fam.kwargs(hf_config, hf_class)
    hf_vocab = fam.vocab_of(hf_config)
    for key, value in overrides.items():
        if key == 'vocab_size' and hf_vocab is not None:
            if value < hf_vocab:
                raise ValueError(f'vocab_size={value} is smaller than the HF vocabulary '
                                 f'{hf_vocab} (config.vocab_size)')
        elif key in kwargs and key not in FREE_OPTIONS and kwargs[key] != value:
            raise ValueError(f'override {key}={value!r} contradicts the HF model, which has '
                             f'{key}={kwargs[key]!r}; only {list(FREE_OPTIONS)} and a larger '
                             f'vocab_size may differ')
    kwargs.update(overrides)
    if hf_vocab is not None and 'vocab_size' not in overrides:
        kwargs['vocab_size'] = padded_vocab(hf_vocab)
    return kwargs


def pad_rows(state: State, keys, size: int) -> State:
    """``state`` with dim 0 of each of ``keys`` padded with zeros to ``size`` rows."""
    out = dict(state)
    for key in keys:
        if key in out and out[key].shape[0] < size:
            t = out[key]
            out[key] = torch.cat([t, t.new_zeros(size - t.shape[0], *t.shape[1:])])
    return out


def build(cls, source, overrides: Dict, fam: HFFamily):
    """``cls.from_hf``: our model for the launched layout holding ``source``'s weights."""
    hf_model = load_source(source, fam)
    hf_class = type(hf_model).__name__
    kwargs = model_kwargs(fam, hf_model.config, hf_class, overrides)
    reader = KeyReader(hf_model.state_dict(), fam.classes[hf_class])
    state = fam.to_ours(reader, kwargs)
    unread = reader.unread(fam.ignored)
    if unread:
        raise ValueError(f'{hf_class} weights that {cls.__name__} has no place for: {unread}')
    if fam.vocab_keys:
        state = pad_rows(state, fam.vocab_keys, kwargs['vocab_size'])
    model = cls(**kwargs)
    _load(model, state, fam.seeded.get(hf_class, ()))
    model.hf_vocab_size = fam.vocab_of(hf_model.config)
    model.hf_config = hf_model.config.to_dict()
    return model


def _load(model, state: State, seeded: Tuple[str, ...]):
    """Load the converted full state; our keys under the ``seeded`` prefixes (a head the
    HF class lacks) keep their seeded initial weights, any other missing key is an error."""
    result = model.load_state_dict({k: v.detach() for k, v in state.items()}, strict=False)
    missing = [k for k in result.missing_keys if not k.startswith(seeded)]
    if result.unexpected_keys or missing:
        raise ValueError(f'conversion error: keys our model lacks {result.unexpected_keys}, '
                         f'keys left without a weight {missing}')
