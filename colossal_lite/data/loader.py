"""Data-parallel batches: each DATA rank takes its own slice of every global batch.

For epoch ``e`` the order of the samples is ``randperm(N)`` drawn from a
generator seeded with ``seed + e`` (identical on every rank), cut into global
batches of ``B`` indices (the last incomplete one dropped unless
``drop_last=False``). Data rank ``r`` of ``D`` takes indices
``[r * B/D, (r + 1) * B/D)`` of each global batch, so the union over ranks is
exactly the serial run's batch, in the serial order. Ranks that differ only in
tensor or pipeline coordinates share a data rank and therefore get the same
slice: a parallel model takes the full (data-local) batch, as a serial one would.

Position (``state_dict`` / ``load_state_dict``, saved in checkpoints): the epoch being
read, the global samples of its order already handed out (whole global batches) and the
seed. Counted in global samples, it does not depend on the data-parallel size: a loader
with another ``data_size`` (or another global batch that divides the count) resumes at the
same sample of the same order, so a resumed run reads the batches the uninterrupted run
would have read.
"""
from __future__ import annotations

from typing import Iterator, Optional, Tuple

import torch
from torch.utils.data import Dataset, TensorDataset, default_collate

from ..context import ParallelMode, global_context as gpc


def _take(dataset: Dataset, indices: torch.Tensor, device: Optional[torch.device]):
    if isinstance(dataset, TensorDataset):
        batch = tuple(t[indices] for t in dataset.tensors)
    elif hasattr(dataset, 'take'):  # reads a whole batch at once (data.hf.PackedBlocks)
        batch = tuple(dataset.take(indices))
    else:
        batch = default_collate([dataset[int(i)] for i in indices])
    if device is not None:
        batch = tuple(t.to(device, non_blocking=True) for t in batch)
    return batch


class DataParallelLoader:
    """Iterable over this data rank's slices of seeded global batches (see module doc).

    ``data_rank`` / ``data_size`` default to the launched DATA group (0 / 1 when serial);
    ``device`` (optional) is where the batches are moved.
    ``len(loader)`` is the number of global batches per epoch; ``set_epoch`` changes
    the order; iterating without ``set_epoch`` advances the epoch by itself.
    """

    def __init__(self, dataset: Dataset, global_batch_size: int, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = True, data_rank: Optional[int] = None,
                 data_size: Optional[int] = None, device: Optional[torch.device] = None):
        if data_size is None:
            data_size = gpc.get_world_size(ParallelMode.DATA)
        if data_rank is None:
            data_rank = gpc.get_local_rank(ParallelMode.DATA)
        if global_batch_size < 1 or global_batch_size % data_size:
            raise ValueError(f'global batch size must be a positive multiple of the data-parallel '
                             f'size {data_size}, got {global_batch_size}')
        if not 0 <= data_rank < data_size:
            raise ValueError(f'data_rank must be in [0, {data_size}), got {data_rank}')
        if drop_last and len(dataset) < global_batch_size:
            raise ValueError(f'the data set has {len(dataset)} samples, fewer than one global '
                             f'batch of {global_batch_size}')
        self.dataset, self.global_batch_size = dataset, global_batch_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.data_rank, self.data_size = data_rank, data_size
        self.local_batch_size = global_batch_size // data_size
        self.device = device
        self.epoch = 0
        self._explicit_epoch = False
        self._position = None     # (epoch, global samples handed out) of the latest pass
        self._start = 0           # global batches to skip in the next pass (after a load)

    def set_epoch(self, epoch: int):
        self.epoch, self._explicit_epoch = epoch, True

    def __len__(self) -> int:
        n = len(self.dataset)
        return n // self.global_batch_size if self.drop_last else -(-n // self.global_batch_size)

    def global_order(self, epoch: int) -> torch.Tensor:
        n = len(self.dataset)
        if not self.shuffle:
            return torch.arange(n)
        return torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + epoch))

    def _slice(self, order: torch.Tensor, step: int) -> torch.Tensor:
        batch = order[step * self.global_batch_size:(step + 1) * self.global_batch_size]
        if len(batch) % self.data_size:
            raise ValueError(f'the last global batch has {len(batch)} samples, not divisible by '
                             f'the data-parallel size {self.data_size}; use drop_last=True')
        local = len(batch) // self.data_size
        return batch[self.data_rank * local:(self.data_rank + 1) * local]

    def local_indices(self, epoch: int, step: int) -> torch.Tensor:
        """This rank's sample indices in global batch ``step`` of ``epoch``."""
        return self._slice(self.global_order(epoch), step)

    def __iter__(self) -> Iterator[Tuple[torch.Tensor, ...]]:
        epoch, start = self.epoch, self._start
        if not self._explicit_epoch:
            self.epoch += 1
        self._explicit_epoch, self._start = False, 0
        self._position = (epoch, start * self.global_batch_size)
        order = self.global_order(epoch)
        for step in range(start, len(self)):
            self._position = (epoch, (step + 1) * self.global_batch_size)
            yield _take(self.dataset, self._slice(order, step), self.device)

    # ------------------------------------------------------------------ position
    def state_dict(self) -> dict:
        """Where the next batch comes from: ``epoch``, ``samples`` (global samples of that
        epoch's order already handed out), ``seed``, and for checks ``num_samples``,
        ``global_batch_size``, ``data_size``. An epoch read to its end counts as the start
        of the next one."""
        epoch, samples = self._position if self._position is not None else (self.epoch, 0)
        if self._position is None and self._start:
            samples = self._start * self.global_batch_size
        if samples + self.global_batch_size > len(self) * self.global_batch_size:
            epoch, samples = epoch + 1, 0
        return dict(epoch=epoch, samples=samples, seed=self.seed, num_samples=len(self.dataset),
                    global_batch_size=self.global_batch_size, data_size=self.data_size)

    def check_state(self, state: dict) -> int:
        """The global batches to skip in the saved epoch; ValueError (no communication) when
        this loader cannot continue at the saved sample: another data set size, or a
        position that is not a whole number of this loader's global batches."""
        if state.get('num_samples') != len(self.dataset):
            raise ValueError(f"the saved data position is over {state.get('num_samples')} samples, "
                             f"this loader's data set has {len(self.dataset)}")
        samples = state['samples']
        if samples % self.global_batch_size:
            raise ValueError(
                f"the saved data position ({samples} samples into epoch {state['epoch']}, saved "
                f"with global batch {state['global_batch_size']} on data-parallel size "
                f"{state['data_size']}) is not a whole number of this loader's global batches "
                f"of {self.global_batch_size} (data-parallel size {self.data_size})")
        return samples // self.global_batch_size

    def load_state_dict(self, state: dict) -> None:
        """Continue at the saved position: the next pass reads the saved epoch's order (with
        the saved seed) from the saved sample on (see :meth:`check_state`)."""
        start = self.check_state(state)
        self.seed, self.epoch, self._start = state['seed'], state['epoch'], start
        self._explicit_epoch, self._position = False, None
