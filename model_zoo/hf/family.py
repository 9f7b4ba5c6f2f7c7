"""What one model family needs to convert to and from Hugging Face: :class:`HFFamily`.

A family is a small table of functions (one module per family: ``gpt2.py``, ``bert.py``,
``vit.py``, ``llama.py``); ``convert.py`` and ``export.py`` hold the shared machinery.
Weights travel as *full* (unsharded) state dicts with our serial keys on one side and the
HF model's keys on the other; sharding is left to our models' ``load_state_dict`` /
``state_dict``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Tuple, Union

import torch

State = Dict[str, torch.Tensor]


@dataclass(frozen=True)
class HFFamily:
    """One family's conversion.

    * ``model_type``: the HF ``config.model_type`` (or a tuple of them: one family, one key
      layout, several HF model types, e.g. llama / mistral / qwen2); ``classes``: the HF
      classes read (``from_hf``), each mapped to the HF key prefix of its body
      (``'transformer.'``, ...).
    * ``kwargs(hf_config, hf_class) -> dict``: our constructor's arguments (a ValueError
      naming the HF config field for what ours cannot represent).
    * ``to_ours(reader, kwargs) -> State``: our full state from the HF weights (read
      through ``reader``, unprefixed body keys); it may leave out only the keys under
      ``seeded[hf_class]``.
    * ``to_hf(state, kwargs) -> (hf_class, State)``: the class written by ``save_hf`` and
      its full state dict (with prefixes); ``config(kwargs, vocab, base) -> PretrainedConfig``.
      ``hf_class`` None: the class is ``class_of(config)``.
    * ``class_of(hf_config) -> str`` (families of several model types): the class of a
      config's model type, read from a directory whose config names no ``architectures``
      and written by ``save_hf`` when ``to_hf`` names none (default: the first of ``classes``).
    * ``unsupported``: HF model types the family knows but cannot read, each mapped to
      ``reason(hf_config) -> str`` naming the config field (e.g. MoE's ``num_local_experts``).
    * ``vocab_keys``: our keys whose dim 0 is the vocabulary (padded / cut);
      ``vocab_of(hf_config)``: the HF vocabulary size (None: no vocabulary).
    * ``ignored``: regexes of HF keys that are read by nothing on purpose (documented);
      ``seeded``: per HF class, our key prefixes it has no weights for (they keep our
      seeded initial weights, e.g. the MLM head when reading a ``BertModel``).
    """

    name: str
    model_type: Union[str, Tuple[str, ...]]
    classes: Dict[str, str]
    kwargs: Callable
    to_ours: Callable
    to_hf: Callable
    config: Callable
    vocab_keys: Tuple[str, ...] = ()
    vocab_of: Callable = lambda hf_config: None
    ignored: Tuple[str, ...] = ()
    seeded: Dict[str, Tuple[str, ...]] = field(default_factory=dict)
    class_of: Optional[Callable] = None
    unsupported: Dict[str, Callable] = field(default_factory=dict)

    @property
    def model_types(self) -> Tuple[str, ...]:
        return (self.model_type,) if isinstance(self.model_type, str) else tuple(self.model_type)

    def hf_class(self, hf_config) -> str:
        """The HF class of ``hf_config`` when nothing names one (``class_of``)."""
        return self.class_of(hf_config) if self.class_of else next(iter(self.classes))


_FAMILIES: Dict[str, HFFamily] = {}  # our model class name -> its family


def register(family: HFFamily) -> HFFamily:
    _FAMILIES[family.name] = family
    return family


def family_for(cls: type) -> HFFamily:
    """The family of our model class ``cls`` (or of the nearest base class that has one)."""
    for base in cls.__mro__:
        if base.__name__ in _FAMILIES:
            return _FAMILIES[base.__name__]
    raise TypeError(f'{cls.__name__} has no Hugging Face conversion; families: '
                    f'{sorted(_FAMILIES)}')


class KeyReader:
    """An HF state dict with its body prefix stripped that records which keys were read,
    so a conversion that leaves a weight unread fails instead of dropping it silently."""

    def __init__(self, hf_state: State, prefix: str = ''):
        self.state = {key[len(prefix):] if prefix and key.startswith(prefix) else key: value
                      for key, value in hf_state.items()}
        self.read = set()

    def __contains__(self, key: str) -> bool:
        return key in self.state

    def __getitem__(self, key: str) -> torch.Tensor:
        self.read.add(key)
        return self.state[key]

    def unread(self, ignored: Iterable[str] = ()) -> List[str]:
        patterns = [re.compile(p) for p in ignored]
        return sorted(k for k in self.state
                      if k not in self.read and not any(p.fullmatch(k) for p in patterns))


def renames(pairs: Iterable[Tuple[str, str]], layers: int, per_layer: Iterable[Tuple[str, str]],
            ours_block: str, hf_block: str) -> List[Tuple[str, str]]:
    """(our key, HF key) pairs: ``pairs`` as given plus ``per_layer`` for every block
    (``ours_block.format(i=i)`` + our suffix, ``hf_block.format(i=i)`` + HF suffix)."""
    out = list(pairs)
    for i in range(layers):
        out += [(ours_block.format(i=i) + a, hf_block.format(i=i) + b) for a, b in per_layer]
    return out


def linear(ours: str, theirs: str, bias: bool = True) -> List[Tuple[str, str]]:
    """A Linear / LayerNorm pair: ``.weight`` (and ``.bias``) under both names."""
    out = [(ours + '.weight', theirs + '.weight')]
    return out + [(ours + '.bias', theirs + '.bias')] if bias else out


def read_renamed(reader: KeyReader, pairs: Iterable[Tuple[str, str]],
                 optional: Optional[Callable[[str], bool]] = None) -> State:
    """Our state from ``reader`` through (our key, HF key) ``pairs``; an HF key that is
    absent is skipped when ``optional(our_key)`` says so (else KeyError)."""
    out = {}
    for ours, theirs in pairs:
        if theirs not in reader and optional is not None and optional(ours):
            continue
        out[ours] = reader[theirs]
    return out


def square_size(value) -> Tuple[int, int]:
    """(h, w) from an int or a pair (HF image / patch sizes)."""
    return tuple(value) if isinstance(value, (list, tuple)) else (value, value)


def keep_token(token_id, vocab: int):
    """A special-token id of a saved config, or None where it falls outside ``vocab``."""
    return token_id if token_id is not None and token_id < vocab else None


def without_meta(config: dict) -> dict:
    """An HF config dict without the entries ``save_pretrained`` writes itself."""
    drop = ('model_type', 'architectures', 'transformers_version', '_name_or_path')
    return {k: v for k, v in config.items() if k not in drop}
