"""scikit-learn's 8x8 handwritten digits (1797 images, shipped inside the package, no network).

Images ``[N, 1, 8, 8]`` float32, pixel values 0..16 scaled to [0, 1] and then
standardised with the training split's mean and standard deviation; labels
``[N]`` int64 in 0..9. The split is a permutation drawn from ``seed``.
"""
from __future__ import annotations

from typing import Tuple

import torch
from torch.utils.data import TensorDataset


def _load_digits():
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise ImportError('the digits data set needs scikit-learn: pip install scikit-learn '
                          "(or bash scripts/install.sh test)") from exc
    return load_digits()


def digits_datasets(test_fraction: float = 0.2, seed: int = 0) -> Tuple[TensorDataset, TensorDataset]:
    """Train and test ``TensorDataset(images [N,1,8,8], labels [N])``."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f'test_fraction must be in (0, 1), got {test_fraction}')
    bunch = _load_digits()
    images = torch.as_tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.as_tensor(bunch.target, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    n_test = max(1, int(round(len(labels) * test_fraction)))
    train_idx, test_idx = order[n_test:], order[:n_test]
    mean, std = images[train_idx].mean(), images[train_idx].std()
    images = (images - mean) / std
    return (TensorDataset(images[train_idx], labels[train_idx]),
            TensorDataset(images[test_idx], labels[test_idx]))
