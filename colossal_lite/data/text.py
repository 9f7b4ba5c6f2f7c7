"""The bundled Shakespeare corpus, a byte-level tokenizer and fixed-length token windows.

Tokenizer: bytes (vocab 256). The corpus is plain ASCII, so every character is
one token and ``decode(encode(text)) == text`` exactly. We chose bytes over a
small BPE because it needs no training, no cached vocabulary file and no extra
package at run time, it is identical on every machine, and 256 divides by every
tensor-parallel size we use (2, 4, 8), so the vocab-parallel embedding and LM
head split evenly without padding. The cost is longer sequences per word
(about 4-5x a BPE), which is fine for the small models trained here.

Windows: the token stream of all plays is cut into non-overlapping windows of
``seq_len`` tokens; a sample is ``(window, window)`` because ``GPTLMLoss``
shifts the labels itself (``logits[:, t]`` predicts ``labels[:, t + 1]``). The
split is by position in the stream: the first ``1 - val_fraction`` of the
windows train, the rest validate, so no validation text is seen in training.
"""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import torch
from torch.utils.data import TensorDataset

CORPUS_DIR = Path(__file__).resolve().parent / 'shakespeare'


def corpus_files(names: Optional[Sequence[str]] = None) -> List[Path]:
    """The bundled plays (``hamlet``, ``macbeth``, ...), sorted by name; ``names`` selects some."""
    available = {p.stem: p for p in sorted(CORPUS_DIR.glob('*.txt')) if p.stem != 'README'}
    if not available:
        raise FileNotFoundError(f'no corpus files under {CORPUS_DIR}; is the package data installed?')
    if names is None:
        return list(available.values())
    unknown = sorted(set(names) - set(available))
    if unknown:
        raise ValueError(f'unknown plays {unknown}; available: {sorted(available)}')
    return [available[n] for n in names]


def load_corpus(names: Optional[Sequence[str]] = None) -> str:
    """The text of the selected plays (all by default), joined by blank lines."""
    return '\n\n'.join(p.read_text(encoding='utf-8') for p in corpus_files(names))


class ByteTokenizer:
    """UTF-8 bytes as tokens: ``vocab_size = 256``, lossless round trip."""

    vocab_size = 256

    def encode(self, text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(text.encode('utf-8')), dtype=torch.uint8).long()

    def decode(self, ids) -> str:
        data = bytes(int(i) for i in (ids.tolist() if torch.is_tensor(ids) else ids))
        return data.decode('utf-8', errors='replace')


class TokenWindows(TensorDataset):
    """``len(tokens) // seq_len`` samples ``(ids [seq_len], labels [seq_len])`` with labels = ids."""

    def __init__(self, tokens: torch.Tensor, seq_len: int):
        if seq_len < 2:
            raise ValueError(f'seq_len must be at least 2 (one next-token target), got {seq_len}')
        count = tokens.numel() // seq_len
        if count < 1:
            raise ValueError(f'{tokens.numel()} tokens do not fill one window of seq_len={seq_len}')
        windows = tokens[:count * seq_len].reshape(count, seq_len).contiguous()
        super().__init__(windows, windows)
        self.seq_len = seq_len


def text_datasets(seq_len: int, val_fraction: float = 0.05, plays: Optional[Sequence[str]] = None,
                  tokenizer: Optional[ByteTokenizer] = None) -> Tuple[TokenWindows, TokenWindows]:
    """Train and validation :class:`TokenWindows` from the bundled corpus (see module doc)."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f'val_fraction must be in (0, 1), got {val_fraction}')
    tokens = (tokenizer or ByteTokenizer()).encode(load_corpus(plays))
    windows = tokens.numel() // seq_len
    n_val = max(1, int(round(windows * val_fraction)))
    if windows - n_val < 1:
        raise ValueError(f'the corpus gives {windows} windows of seq_len={seq_len}: too few to '
                         f'split with val_fraction={val_fraction}')
    cut = (windows - n_val) * seq_len
    return TokenWindows(tokens[:cut], seq_len), TokenWindows(tokens[cut:], seq_len)
