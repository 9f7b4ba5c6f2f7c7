"""Bundled data: the Shakespeare corpus, byte tokens, windows, digits, data-parallel slicing."""
import pytest
import torch

from colossal_lite.data import (ByteTokenizer, DataParallelLoader, corpus_files, digits_datasets,
                                load_corpus, text_datasets)
from colossal_lite.testing import run_distributed


def test_corpus_is_bundled_and_tokens_round_trip():
    files = corpus_files()
    assert len(files) >= 8 and all(f.stat().st_size > 50_000 for f in files)
    text = load_corpus()
    assert 900_000 < len(text) < 1_200_000 and 'To be, or not to be' in text
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids.dtype == torch.int64 and ids.max() < tok.vocab_size == 256
    assert tok.decode(ids) == text
    with pytest.raises(ValueError, match="unknown plays \\['faust'\\]"):
        corpus_files(['hamlet', 'faust'])


def test_windows_split_the_stream_without_overlap():
    train, val = text_datasets(seq_len=64, val_fraction=0.1, plays=['macbeth', 'tempest'])
    stream = ByteTokenizer().encode(load_corpus(['macbeth', 'tempest']))
    ids, labels = train.tensors
    assert torch.equal(ids, labels) and ids.shape[1] == 64
    n_train, n_val = len(train), len(val)
    assert abs(n_val / (n_train + n_val) - 0.1) < 0.01
    joined = torch.cat([ids.reshape(-1), val.tensors[0].reshape(-1)])
    assert torch.equal(joined, stream[:joined.numel()])   # train first, validation after
    with pytest.raises(ValueError, match='seq_len must be at least 2 .*got 1'):
        text_datasets(seq_len=1)


def test_digits_images_normalised_and_split_deterministically():
    train, test = digits_datasets(test_fraction=0.25, seed=3)
    x, y = train.tensors
    assert x.shape[1:] == (1, 8, 8) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert len(train) + len(test) == 1797 and abs(len(test) - 449) <= 1
    assert abs(x.mean().item()) < 1e-4 and abs(x.std().item() - 1) < 1e-4
    assert set(y.tolist()) == set(range(10))
    again, _ = digits_datasets(test_fraction=0.25, seed=3)
    other, _ = digits_datasets(test_fraction=0.25, seed=4)
    assert torch.equal(again.tensors[0], x) and not torch.equal(other.tensors[1], y)


def _loaders(dataset, batch, size, seed=5):
    return [DataParallelLoader(dataset, batch, seed=seed, data_rank=r, data_size=size)
            for r in range(size)]


def test_data_ranks_split_each_global_batch_like_the_serial_loader():
    train, _ = digits_datasets()
    serial = list(DataParallelLoader(train, 12, seed=5, data_rank=0, data_size=1))
    per_rank = [list(loader) for loader in _loaders(train, 12, 3)]
    assert len(serial) == len(train) // 12 == len(per_rank[0])
    for step, (images, labels) in enumerate(serial):
        assert torch.equal(torch.cat([per_rank[r][step][0] for r in range(3)]), images)
        assert torch.equal(torch.cat([per_rank[r][step][1] for r in range(3)]), labels)
    loader = DataParallelLoader(train, 12, seed=5, data_rank=0, data_size=1)
    first, second = next(iter(loader))[1], next(iter(loader))[1]    # epochs advance by themselves
    assert not torch.equal(first, second)
    loader.set_epoch(0)
    assert torch.equal(next(iter(loader))[1], serial[0][1])


def test_loader_rejects_batches_the_data_ranks_cannot_share():
    train, _ = digits_datasets()
    with pytest.raises(ValueError, match='multiple of the data-parallel size 4, got 10'):
        DataParallelLoader(train, 10, data_rank=0, data_size=4)
    with pytest.raises(ValueError, match='fewer than one global batch of 4096'):
        DataParallelLoader(train, 4096, data_rank=0, data_size=1)


def _launched_slices(rank):
    from colossal_lite.context import ParallelMode, global_context as gpc
    train, _ = text_datasets(seq_len=16, plays=['macbeth'])
    ids, _ = next(iter(DataParallelLoader(train, 8, seed=1)))
    return gpc.get_local_rank(ParallelMode.DATA), ids


def test_launched_loader_gives_tensor_peers_the_same_slice():
    config = dict(parallel=dict(tensor=dict(size=2, mode='1d')))
    results = run_distributed(_launched_slices, 4, config, timeout=300)
    train, _ = text_datasets(seq_len=16, plays=['macbeth'])
    serial = next(iter(DataParallelLoader(train, 8, seed=1, data_rank=0, data_size=1)))[0]
    by_data_rank = {}
    for data_rank, ids in results:
        if data_rank in by_data_rank:
            assert torch.equal(by_data_rank[data_rank], ids)    # tensor peers: same data
        by_data_rank[data_rank] = ids
    assert sorted(by_data_rank) == [0, 1]
    assert torch.equal(torch.cat([by_data_rank[0], by_data_rank[1]]), serial)


# ---------------------------------------------------------------------------- your own data (hf)
LINES = ['First Citizen: Before we proceed any further, hear me speak.',
         'All: Speak, speak.', '', 'First Citizen: You are all resolved rather to die than to famish?',
         'All: Resolved. resolved.'] * 40


def _hf(tmp_path, **changes):
    """A parsed ``hf`` data section over a local text file of LINES (cache in tmp_path)."""
    from colossal_lite.config.job import DataSection, TokenizerSection
    text = tmp_path / 'corpus.txt'
    if not text.exists():
        text.write_text('\n'.join(LINES) + '\n')
    data = dict(path='text', data_files=str(text), split='train', text_column='text',
                seq_len=16, val_fraction=0.1, tokenizer=dict(type='bpe', vocab_size=300),
                cache_dir=str(tmp_path / 'cache'))
    data.update(changes)
    return DataSection('hf', tokenizer=TokenizerSection(**data.pop('tokenizer')), **data)


def test_text_file_is_tokenized_and_packed_into_blocks_that_decode_to_the_text(tmp_path):
    from colossal_lite.data.hf import hf_datasets
    from tokenizers import Tokenizer
    train, val, vocab = hf_datasets(_hf(tmp_path), str(tmp_path / 'run'))
    tok = Tokenizer.from_file(str(tmp_path / 'run' / 'tokenizer.json'))
    assert vocab == tok.get_vocab_size() <= 300
    stream = tok.encode(''.join(line + '\n' for line in LINES)).ids
    blocks = len(stream) // 16      # one map batch (< 4096 rows): only the last partial block dropped
    n_val = round(blocks * 0.1)
    assert (len(train), len(val)) == (blocks - n_val, n_val)
    ids, labels = train.take(torch.arange(len(train)))
    assert ids.dtype == torch.int64 and ids.shape == (blocks - n_val, 16) and torch.equal(ids, labels)
    joined = torch.cat([ids.reshape(-1), val.take(torch.arange(n_val))[0].reshape(-1)])
    assert joined.tolist() == stream[:blocks * 16]          # train first, validation after
    assert tok.decode(joined.tolist()) == ''.join(line + '\n' for line in LINES)[:len(tok.decode(joined.tolist()))]
    assert torch.equal(train[3][0], ids[3])


def test_json_documents_with_a_tokenizer_file_are_joined_by_end_of_text(tmp_path):
    import json as js
    from colossal_lite.data.hf import EOS, hf_datasets
    from tokenizers import Tokenizer
    hf_datasets(_hf(tmp_path), str(tmp_path / 'run'))                 # trains tokenizer.json
    path = str(tmp_path / 'run' / 'tokenizer.json')
    docs = [dict(content=f'document {i}: ' + ' '.join(LINES[i:i + 5]), n=i) for i in range(60)]
    (tmp_path / 'docs.jsonl').write_text(''.join(js.dumps(d) + '\n' for d in docs))
    data = _hf(tmp_path, path='json', data_files=str(tmp_path / 'docs.jsonl'), text_column='content',
               tokenizer=dict(type='file', path=path))
    train, val, _ = hf_datasets(data)
    tok = Tokenizer.from_file(path)
    eos = tok.token_to_id(EOS)
    assert eos is not None
    stream = [i for d in docs for i in tok.encode(d['content']).ids + [eos]]
    got = torch.cat([train.take(torch.arange(len(train)))[0], val.take(torch.arange(len(val)))[0]])
    assert got.reshape(-1).tolist() == stream[:got.numel()] and got.numel() == len(stream) // 16 * 16


def test_tokenizer_and_packing_are_made_once_and_deterministic(tmp_path):
    import os
    from colossal_lite.data.hf import hf_datasets, load_texts, pack
    from tokenizers import Tokenizer
    data = _hf(tmp_path)
    first, _, _ = hf_datasets(data, str(tmp_path / 'a'))
    saved = tmp_path / 'a' / 'tokenizer.json'
    stamp = os.stat(saved).st_mtime_ns
    again, _, _ = hf_datasets(data, str(tmp_path / 'a'))                # reused, not retrained
    assert os.stat(saved).st_mtime_ns == stamp
    assert again.packed.cache_files == first.packed.cache_files and first.packed.cache_files
    hf_datasets(data, str(tmp_path / 'b'))                              # trained afresh: same
    assert (tmp_path / 'b' / 'tokenizer.json').read_text() == saved.read_text()
    other = pack(load_texts(data), Tokenizer.from_file(str(saved)), 8, 'text', True)
    assert other.cache_files != first.packed.cache_files                # seq_len in the fingerprint
    a = [b[0] for b in DataParallelLoader(first, 4, seed=3, data_rank=0, data_size=1)]
    b = [b[0] for b in DataParallelLoader(again, 4, seed=3, data_rank=0, data_size=1)]
    c = [b[0] for b in DataParallelLoader(again, 4, seed=4, data_rank=0, data_size=1)]
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and not torch.equal(a[0], c[0])


def test_replicas_read_their_own_slice_of_the_packed_blocks(tmp_path):
    from colossal_lite.data.hf import hf_datasets
    train, _, _ = hf_datasets(_hf(tmp_path), str(tmp_path / 'run'))
    serial = list(DataParallelLoader(train, 8, seed=2, data_rank=0, data_size=1))
    per_rank = [list(loader) for loader in _loaders(train, 8, 4, seed=2)]
    assert len(serial) == len(train) // 8
    for step, (ids, _) in enumerate(serial):
        assert torch.equal(torch.cat([per_rank[r][step][0] for r in range(4)]), ids)
    loaders = _loaders(train, 8, 4, seed=2)
    taken = torch.cat([l.local_indices(0, step) for step in range(len(serial)) for l in loaders])
    assert len(set(taken.tolist())) == len(taken) == len(serial) * 8    # no block twice per epoch


def test_a_saved_dataset_directory_loads_from_disk(tmp_path):
    import datasets
    from colossal_lite.data.hf import hf_datasets
    saved = str(tmp_path / 'saved')
    datasets.DatasetDict(train=datasets.Dataset.from_dict({'body': LINES})).save_to_disk(saved)
    train, _, _ = hf_datasets(_hf(tmp_path, path=saved, data_files=None, text_column='body'),
                              str(tmp_path / 'run'))
    reference, _, _ = hf_datasets(_hf(tmp_path), str(tmp_path / 'run2'))
    assert len(train) > 0 and len(reference) > 0


@pytest.mark.parametrize('change, message', [
    (dict(data_files='nowhere/*.txt'), "'data.data_files': no file matches 'nowhere/*.txt'"),
    (dict(path='no_such_dir'), "'data.path' = 'no_such_dir' is neither a builder"),
    (dict(text_column='body'), "'data.text_column' = 'body' is not a column of 'text' (columns: ['text'])"),
    (dict(split='validation'), "'data.split' = 'validation' is not a split of 'data.data_files'"),
    ('empty', "is empty"),
])
def test_bad_sources_are_named(tmp_path, change, message):
    from colossal_lite.data.hf import hf_datasets
    if change == 'empty':
        (tmp_path / 'empty.txt').write_text('')
        change = dict(data_files=[str(tmp_path / 'corpus.txt'), str(tmp_path / 'empty.txt')])
        _hf(tmp_path)
        (tmp_path / 'corpus.txt').write_text('x\n')
    with pytest.raises(ValueError) as info:
        hf_datasets(_hf(tmp_path, **change), str(tmp_path / 'run'))
    assert message in str(info.value)
