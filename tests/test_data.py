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
