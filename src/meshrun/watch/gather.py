"""A row of floats per rank gathered onto every rank, for the per-rank timing record and the straggler detector of a
running job. (One fact per node for ``meshrun doctor`` is :mod:`meshrun.diag.gather`.)"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist


def collective_device(group=None) -> torch.device:
    """Where a tensor for a collective on ``group`` lives: the current GPU under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather_floats(values: Sequence[float], *, group=None, device: torch.device | None = None) -> np.ndarray:
    """(world, len(values)) float64: every rank's ``values`` in rank order, on every rank; (1, k) without a process
    group. One all_gather: every rank of ``group`` must call it at the same point with as many values."""
    mine = torch.tensor(list(values), dtype=torch.float64, device=device or collective_device(group))  # (k,)
    if not dist.is_initialized():
        return mine.cpu().numpy()[None, :]
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)  # note: collective, every rank must reach it
    return torch.stack(parts).cpu().numpy()  # (world, k); note: a CPU-GPU sync point on CUDA
