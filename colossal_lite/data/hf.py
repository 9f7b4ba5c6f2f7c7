"""Your own text through Hugging Face ``datasets`` and ``tokenizers`` (local files only).

``data=dict(type='hf', path=..., data_files=..., split='train', text_column='text',
seq_len=64, val_fraction=0.05, tokenizer=dict(type='bpe', vocab_size=4096))``:

1. **Load** (:func:`load_texts`): ``path`` is a ``datasets`` builder (``'text'``,
   ``'json'``, ``'parquet'``, ``'csv'``) reading ``data_files`` (a glob, a list of them,
   or a dict split -> globs), or a directory written by ``save_to_disk``
   (``load_from_disk``). ``HF_DATASETS_OFFLINE=1`` / ``HF_HUB_OFFLINE=1`` are set before
   ``datasets`` is imported: nothing is fetched from the network.
2. **Tokenizer** (:func:`get_tokenizer`): ``dict(type='file', path='tokenizer.json')`` loads
   a ``tokenizers`` file; ``dict(type='bpe', vocab_size=V)`` trains a byte-level BPE on the
   text column (seconds for a few MB) and saves it as ``<run dir>/tokenizer.json`` with
   ``tokenizer.source.json`` (the data's fingerprint, V, the column): a later run on the
   same data loads it instead of training again.
3. **Pack** (:func:`pack`): ``Dataset.map`` (batched, 4096 rows per batch) tokenizes the
   rows, joins them (rows of the ``'text'`` builder are lines: a ``\\n`` is put back after
   each; other rows are documents: ``<|endoftext|>`` between them when the tokenizer has
   it) and cuts every batch's stream into blocks of ``seq_len`` tokens (the batch's last
   ``< seq_len`` tokens are dropped). A block is both input and labels: ``GPTLMLoss``
   shifts the labels itself, so ``seq_len`` tokens give ``seq_len - 1`` predictions. The
   map carries a fingerprint of (data, tokenizer, seq_len), so ``datasets``' cache holds
   the packed blocks once and every later run, and every rank, memory-maps the same Arrow
   file.
4. **Split and read** (:func:`hf_datasets`): the last ``round(W * val_fraction)`` (>= 1) of
   the W blocks validate, the rest train (nothing overlaps). :class:`PackedBlocks` reads
   rows by index from the memory-mapped table, so each data-parallel replica reads only the
   rows of its slice (``DataParallelLoader``: order ``randperm(N, seed + epoch)``).

Every problem with the source raises ``ValueError`` naming the key (``data.path``,
``data.data_files``, ``data.split``, ``data.text_column``, ``data.tokenizer``) and the
value; ``job/checks.py`` turns them into ``ConfigError`` before any process starts.
Each function takes the typed ``data`` section (``colossal_lite.config.job.DataSection``).
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
from typing import Dict, List, Mapping, Optional, Tuple

import torch
from torch.utils.data import Dataset

BUILDERS = ('text', 'json', 'parquet', 'csv')
EOS = '<|endoftext|>'
_ROWS_PER_MAP_BATCH = 4096


def _offline():
    os.environ.setdefault('HF_DATASETS_OFFLINE', '1')
    os.environ.setdefault('HF_HUB_OFFLINE', '1')


def _datasets():
    _offline()
    try:
        import datasets
    except ImportError as err:
        raise ImportError("data type 'hf' needs the datasets and tokenizers packages: "
                          "pip install 'colossal_lite[hf]' (or pip install datasets tokenizers)"
                          ) from err
    return datasets


def _patterns(data_files) -> Dict[str, List[str]]:
    if isinstance(data_files, (str, os.PathLike)):
        return {'train': [os.fspath(data_files)]}
    if isinstance(data_files, Mapping):
        return {str(k): [os.fspath(p) for p in ([v] if isinstance(v, (str, os.PathLike)) else v)]
                for k, v in data_files.items()}
    if isinstance(data_files, (list, tuple)) and data_files:
        return {'train': [os.fspath(p) for p in data_files]}
    raise ValueError(f"'data.data_files' must be a file or glob, a list of them or a dict "
                     f"split -> files, got {data_files!r}")


def check_source(data):
    """The cheap checks of a source (no loading): the builder or saved directory exists, every
    ``data_files`` pattern matches files and none is empty."""
    path = data.path
    if not isinstance(path, str):
        raise ValueError(f"'data.path' must be one of {list(BUILDERS)} or a directory saved by "
                         f"Dataset.save_to_disk, got {path!r}")
    if path not in BUILDERS:
        if not os.path.isdir(path):
            raise ValueError(f"'data.path' = {path!r} is neither a builder {list(BUILDERS)} nor "
                             f"an existing directory (from Dataset.save_to_disk; relative paths "
                             f"are taken from {os.getcwd()})")
        if data.data_files is not None:
            raise ValueError(f"'data.data_files' is for the builders {list(BUILDERS)}; "
                             f"'data.path' = {path!r} is a saved dataset directory")
        return
    if data.data_files is None:
        raise ValueError(f"'data.path' = {path!r} reads local files: give 'data.data_files' "
                         f"(a file, a glob or a list of them)")
    for pattern in sum(_patterns(data.data_files).values(), []):
        files = sorted(glob.glob(pattern, recursive=True))
        if not files:
            raise ValueError(f"'data.data_files': no file matches {pattern!r} (relative paths "
                             f"are taken from {os.getcwd()})")
        for name in files:
            if os.path.isdir(name):
                raise ValueError(f"'data.data_files': {name!r} is a directory, not a file")
            if os.path.getsize(name) == 0:
                raise ValueError(f"'data.data_files': {name!r} is empty")


def load_texts(data):
    """The ``split`` of the source as a ``datasets.Dataset``, checked to hold the text
    column with some text."""
    datasets = _datasets()
    check_source(data)
    path, split, column = data.path, data.split, data.text_column
    if path in BUILDERS:
        files = _patterns(data.data_files)
        if split not in files:
            raise ValueError(f"'data.split' = {split!r} is not a split of 'data.data_files' "
                             f"(splits: {sorted(files)})")
        found = {k: sorted(f for p in v for f in glob.glob(p, recursive=True))
                 for k, v in files.items()}
        try:
            loaded = datasets.load_dataset(path, data_files=found, split=split,
                                           cache_dir=data.cache_dir)
        except Exception as err:  # a parser error of the user's file
            raise ValueError(f"'data': datasets could not read {found[split][:3]} as {path!r}: "
                             f"{type(err).__name__}: {err}") from err
    else:
        loaded = datasets.load_from_disk(path)
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise ValueError(f"'data.split' = {split!r} is not a split of {path!r} "
                                 f"(splits: {sorted(loaded)})")
            loaded = loaded[split]
    if column not in loaded.column_names:
        raise ValueError(f"'data.text_column' = {column!r} is not a column of {path!r} "
                         f"(columns: {loaded.column_names})")
    if len(loaded) == 0:
        raise ValueError(f"'data': split {split!r} of {path!r} has no rows")
    return loaded


def get_tokenizer(data, texts, run_dir: Optional[str]):
    """The ``tokenizers.Tokenizer`` of ``data.tokenizer`` (see module doc); a BPE is trained on
    ``texts`` (a ``Dataset``) unless ``run_dir`` holds one trained on the same data."""
    from tokenizers import Tokenizer
    spec = data.tokenizer
    if spec.type == 'file':
        return Tokenizer.from_file(spec.path)
    source = dict(fingerprint=texts._fingerprint, vocab_size=spec.vocab_size,
                  text_column=data.text_column)
    path = os.path.join(run_dir or '.', 'tokenizer.json')
    meta = os.path.join(run_dir or '.', 'tokenizer.source.json')
    if os.path.isfile(path) and os.path.isfile(meta):
        with open(meta) as f:
            if json.load(f) == source:
                return Tokenizer.from_file(path)
    from tokenizers import ByteLevelBPETokenizer
    bpe = ByteLevelBPETokenizer()
    column = data.text_column

    def batches():
        for start in range(0, len(texts), _ROWS_PER_MAP_BATCH):
            yield [t or '' for t in texts[start:start + _ROWS_PER_MAP_BATCH][column]]
    bpe.train_from_iterator(batches(), vocab_size=spec.vocab_size, min_frequency=2,
                            special_tokens=[EOS], length=len(texts))
    os.makedirs(run_dir or '.', exist_ok=True)
    tmp = f'{path}.{os.getpid()}.tmp'
    bpe.save(tmp)
    os.replace(tmp, path)
    with open(meta, 'w') as f:
        json.dump(source, f)
    return Tokenizer.from_file(path)


def pack(texts, tokenizer, seq_len: int, column: str, lines: bool):
    """``Dataset`` of ``ids`` blocks (int32, ``seq_len`` each), cached by ``datasets`` under a
    fingerprint of (data, tokenizer, seq_len, joining rule); see the module doc."""
    datasets = _datasets()
    eos = tokenizer.token_to_id(EOS)
    tail = [] if lines or eos is None else [eos]
    suffix = '\n' if lines else ''

    def blocks(batch):
        stream = []
        for enc in tokenizer.encode_batch([(t or '') + suffix for t in batch[column]]):
            stream.extend(enc.ids)
            stream.extend(tail)
        count = len(stream) // seq_len
        return {'ids': [stream[i * seq_len:(i + 1) * seq_len] for i in range(count)]}

    key = json.dumps([texts._fingerprint, hashlib.sha256(tokenizer.to_str().encode()).hexdigest(),
                      seq_len, column, lines])
    features = datasets.Features({'ids': datasets.Sequence(datasets.Value('int32'))})
    return texts.map(blocks, batched=True, batch_size=_ROWS_PER_MAP_BATCH,
                     remove_columns=texts.column_names, features=features,
                     new_fingerprint=hashlib.sha256(key.encode()).hexdigest()[:32],
                     desc=f'tokenizing and packing into blocks of {seq_len}')


class PackedBlocks(Dataset):
    """Rows ``[start, stop)`` of a packed ``Dataset``: ``(ids [seq_len], labels [seq_len])``
    int64 with labels = ids, read by index from the memory-mapped Arrow table."""

    def __init__(self, packed, start: int, stop: int):
        self.packed = packed.with_format('numpy', columns=['ids'])
        self.start, self.stop = start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    def take(self, indices: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """The samples at ``indices`` stacked: one read of the table."""
        rows = (indices + self.start).tolist()
        ids = torch.as_tensor(self.packed[rows]['ids']).long()
        return ids, ids

    def __getitem__(self, index: int):
        ids, labels = self.take(torch.tensor([index]))
        return ids[0], labels[0]


def hf_datasets(data, run_dir: Optional[str] = None) -> Tuple[PackedBlocks, PackedBlocks, int]:
    """(train blocks, validation blocks, tokenizer vocabulary size) of a ``data`` section
    (a ``config.job.DataSection``); see the module doc."""
    texts = load_texts(data)
    tokenizer = get_tokenizer(data, texts, run_dir)
    packed = pack(texts, tokenizer, data.seq_len, data.text_column, data.path == 'text')
    blocks = len(packed)
    n_val = max(1, int(round(blocks * data.val_fraction)))
    if blocks - n_val < 1:
        raise ValueError(f"'data': the text gives {blocks} blocks of 'data.seq_len' = "
                         f"{data.seq_len} tokens: too few to split with 'data.val_fraction' = "
                         f"{data.val_fraction}")
    return (PackedBlocks(packed, 0, blocks - n_val), PackedBlocks(packed, blocks - n_val, blocks),
            tokenizer.get_vocab_size())


def tokenizer_vocab(data) -> int:
    """The vocabulary the model needs for ``data.tokenizer`` without training anything: the
    file's size, or the BPE's ``vocab_size`` (an upper bound of the trained size)."""
    spec = data.tokenizer
    if spec.type == 'bpe':
        return spec.vocab_size
    from tokenizers import Tokenizer
    if not os.path.isfile(spec.path):
        raise ValueError(f"'data.tokenizer.path' = {spec.path!r} is not a file (relative "
                         f"paths are taken from {os.getcwd()})")
    try:
        return Tokenizer.from_file(spec.path).get_vocab_size()
    except Exception as err:
        raise ValueError(f"'data.tokenizer.path' = {spec.path!r} is not a tokenizers file: "
                         f"{type(err).__name__}: {err}") from err
