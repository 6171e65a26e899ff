"""This rank's micro-batches, one optimizer step at a time, with the data position kept for checkpoints."""

from __future__ import annotations

import time
from typing import Any, ClassVar, Iterator

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import DataLoader, Dataset

from meshrun.data.sampler import DataPosition, GlobalOrderSampler

Batch = tuple[torch.Tensor, torch.Tensor]


class StepBatches(Stateful):
    """Hands out the ``grad_accum`` micro-batches of each optimizer step and rolls over epochs.

    The position (epoch, samples consumed by all ranks) advances by one global batch per step, so it can be saved
    and restored at any world size (see sampler.py). As a Stateful checkpoint entry it saves that position as two
    int64 scalars, ``epoch`` and ``samples_in_epoch``, equal on every rank; loading one moves it there in place.
    """

    replicated: ClassVar[bool] = True
    """The position is global: every rank holds the same one, and a checkpoint stores it once."""

    def __init__(self, dataset: Dataset, *, dp_rank: int, dp_size: int, seed: int, micro_batch: int,
                 grad_accum: int, device: torch.device, num_workers: int = 0):
        self.global_batch = micro_batch * dp_size * grad_accum
        self.micro_batch, self.grad_accum, self.device = micro_batch, grad_accum, device
        self.sampler = GlobalOrderSampler(dataset, num_replicas=dp_size, rank=dp_rank, seed=seed,
                                          global_batch=self.global_batch)
        # Its own generator: creating a DataLoader iterator draws a seed, and from the global RNG that draw would
        # shift every later dropout mask after a resume (the iterator is created at a different step).
        self.loader = DataLoader(dataset, batch_size=micro_batch, sampler=self.sampler, num_workers=num_workers,
                                 pin_memory=device.type == "cuda", drop_last=False,
                                 generator=torch.Generator().manual_seed(seed))
        self.position = DataPosition()
        self._iterator: Iterator[Batch] | None = None
        self._fetch_s = 0.0

    def seek(self, position: DataPosition) -> None:
        """Continue from ``position`` (from a checkpoint); the next step takes the batch after it."""
        self.position = DataPosition(position.epoch, position.consumed)
        self._iterator = None

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": torch.tensor(self.position.epoch, dtype=torch.int64),
                "samples_in_epoch": torch.tensor(self.position.consumed, dtype=torch.int64)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.seek(DataPosition(int(state_dict["epoch"].item()), int(state_dict["samples_in_epoch"].item())))

    def next_step(self) -> list[Batch]:
        """The micro-batches of the next optimizer step, on the device."""
        started = time.perf_counter()
        if self.position.consumed >= self.sampler.usable:
            self.position = DataPosition(self.position.epoch + 1, 0)
            self._iterator = None
        if self._iterator is None:
            self.sampler.set_position(self.position)
            self._iterator = iter(self.loader)
        non_blocking = self.device.type == "cuda"
        batches = [tuple(t.to(self.device, non_blocking=non_blocking) for t in next(self._iterator))
                   for _ in range(self.grad_accum)]
        self.position = DataPosition(self.position.epoch, self.position.consumed + self.global_batch)
        self._fetch_s += time.perf_counter() - started
        return batches  # type: ignore[return-value]  # tuples of two tensors

    def take_fetch_time(self) -> float:
        """Seconds spent in next_step since the last call (straggler reports count them as this rank's work)."""
        seconds, self._fetch_s = self._fetch_s, 0.0
        return seconds


def eval_batches(dataset: Dataset, *, dp_rank: int, dp_size: int, micro_batch: int, samples: int,
                 device: torch.device) -> list[Batch]:
    """A fixed validation set, the same at any world size: the first ``samples`` windows, strided over dp ranks."""
    total = min(len(dataset), samples) if samples else len(dataset)
    indices = list(range(dp_rank, total, dp_size))
    batches = []
    for start in range(0, len(indices), micro_batch):
        items = [dataset[i] for i in indices[start: start + micro_batch]]
        batches.append((torch.stack([x for x, _ in items]).to(device), torch.stack([y for _, y in items]).to(device)))
    return batches
