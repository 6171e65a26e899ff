"""meshrun's pieces for a user's own training script, with their own model and dataset.

    session = meshrun.Session(seed=0)              # reads torchrun / meshrun launch / SLURM, starts the group
    model = session.prepare_model(MyModel())       # on this rank's device, DDP-wrapped when world size > 1
    batches = session.step_batches(dataset, micro_batch=32, global_batch=256)
    for step in range(steps):
        for i, (x, y) in enumerate(batches.next_step()):
            with session.sync_gradients(model, last=i == batches.grad_accum - 1):
                loss_fn(model(x), y).backward()
        ...
    totals = session.sum_metrics(correct=..., total=...)   # exact: summed over every rank
    session.print(...)                                      # rank 0 only

Runs unchanged as one process (``python train.py``) and under ``meshrun launch``/``torchrun``/``srun``.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn
from torch.utils.data import Dataset

from meshrun.config import DistConfig, TrainConfig, resolve_batch
from meshrun.data.loader import StepBatches
from meshrun.dist.process_group import init_distributed, shutdown
from meshrun.env import ClusterEnv
from meshrun.train.metrics import SumMetrics
from meshrun.train.trainer import seed_rank_streams


class Session:
    """Process layout, device, data sharding and exact metrics for a user's script."""

    def __init__(self, *, seed: int = 1234, dist_config: DistConfig | None = None, env: ClusterEnv | None = None):
        self.env = env or ClusterEnv.detect()
        self.ctx = init_distributed(self.env, dist_config or DistConfig())
        self.device = self.ctx.device
        self.seed = seed

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """Same initial weights everywhere, moved to this rank's device, DDP-wrapped when distributed.

        Per-rank random streams (seed + rank) are set afterwards, for dropout and augmentation.
        """
        model = model.to(self.device)
        if self.world_size > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = DDP(model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        seed_rank_streams(self.seed, self.rank)
        return model

    def step_batches(self, dataset: Dataset, *, micro_batch: int, global_batch: int = 0,
                     grad_accum: int = 0) -> StepBatches:
        """This rank's micro-batches of each optimizer step; B_global = micro_batch x world size x accumulation."""
        plan = resolve_batch(TrainConfig(micro_batch=micro_batch, global_batch=global_batch, grad_accum=grad_accum),
                             dp_size=self.world_size, seq_len=1)
        return StepBatches(dataset, dp_rank=self.rank, dp_size=self.world_size, seed=self.seed,
                           micro_batch=micro_batch, grad_accum=plan.grad_accum, device=self.device)

    @contextlib.contextmanager
    def sync_gradients(self, model: nn.Module, *, last: bool) -> Iterator[None]:
        """Skip DDP's gradient all-reduce on every micro-batch but the last of an optimizer step."""
        if last or not hasattr(model, "no_sync"):
            yield
        else:
            with model.no_sync():
                yield

    def sum_metrics(self, **values: float | torch.Tensor) -> dict[str, float]:
        """Sum each value over every rank (one all-reduce every rank must reach)."""
        sums = SumMetrics(tuple(values), self.device)
        sums.add(**values)
        return sums.reduce()  # collective: every rank

    def print(self, *args, **kwargs) -> None:
        if self.env.is_rank_zero:
            print(*args, **kwargs, flush=True)

    def close(self) -> None:
        """Destroy the process group (idempotent; also run at interpreter exit)."""
        shutdown()
