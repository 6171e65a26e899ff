"""Distributed, resumable and reshardable sampling of fixed-length token windows.

The global order of an epoch is one permutation that depends only on the base seed and the epoch. Optimizer step
``s`` of an epoch consumes the contiguous block ``perm[s*B : (s+1)*B]`` (B = global batch), and data-parallel rank
``r`` of ``R`` takes every R-th element of it, exactly as ``DistributedSampler`` strides. So the data position is one
world-size-independent number, the samples consumed in this epoch, and a run resumed on a different number of
ranks continues the same global order with no sample repeated or skipped, as long as the global batch is kept.
The tail of an epoch that cannot fill a whole global batch is dropped (and reported at start).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch
from torch.utils.data import Dataset, DistributedSampler


class TokenWindows(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` tokens: sample i is (x, y) = tokens[iT : iT+T], shifted by one."""

    def __init__(self, tokens: np.ndarray, seq_len: int, vocab_size: int | None = None):
        self.tokens, self.seq_len, self.vocab_size = tokens, seq_len, vocab_size

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_len)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.seq_len
        window = torch.from_numpy(np.asarray(self.tokens[start: start + self.seq_len + 1], dtype=np.int64))
        if self.vocab_size is not None and int(window.max()) >= self.vocab_size:
            raise ValueError(f"token {int(window.max())} in sample {index} is outside model.vocab_size="
                             f"{self.vocab_size}; raise model.vocab_size or check data.token_dtype")
        return window[:-1], window[1:]


@dataclass
class DataPosition:
    """Where the global order stands; the same on every rank, and independent of the world size."""

    epoch: int = 0
    consumed: int = 0
    """Samples of this epoch already taken by all ranks together."""


class GlobalOrderSampler(DistributedSampler):
    """A ``DistributedSampler`` that can start in the middle of an epoch and change world size between runs."""

    def __init__(self, dataset: Dataset, *, num_replicas: int, rank: int, seed: int, global_batch: int,
                 shuffle: bool = True):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=True)
        if global_batch % num_replicas:
            raise ValueError(f"global batch {global_batch} is not divisible by {num_replicas} data-parallel ranks")
        self.global_batch = global_batch
        self.usable = (len(dataset) // global_batch) * global_batch
        if self.usable == 0:
            raise ValueError(f"the dataset has {len(dataset)} samples, fewer than one global batch of {global_batch}; "
                             "use a larger corpus or a smaller train.global_batch / train.micro_batch")
        self.consumed = 0

    @property
    def steps_per_epoch(self) -> int:
        return self.usable // self.global_batch

    def set_position(self, position: DataPosition) -> None:
        if position.consumed % self.global_batch:
            raise ValueError(f"data position {position.consumed} is not a whole number of global batches of "
                             f"{self.global_batch}; resume with the global batch the run was saved with")
        self.set_epoch(position.epoch)
        self.consumed = position.consumed

    def global_order(self) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.dataset))
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(len(self.dataset), generator=generator).numpy()

    def __iter__(self) -> Iterator[int]:
        order = self.global_order()[self.consumed: self.usable]
        return iter(order[self.rank:: self.num_replicas].tolist())

    def __len__(self) -> int:
        return (self.usable - self.consumed) // self.num_replicas
