"""Per-rank timing of each log interval, gathered on rank 0 into one ``ranks`` record of metrics.jsonl.

Each rank contributes, per step averaged over the interval: its own working time (data wait + forward passes, the
time the straggler detector compares), the data wait alone, the rest of the wall-clock step (backward, optimizer and
waiting in collectives for the slowest rank), and its peak memory so far. One all_gather of 4 floats per rank per
log interval: no rank writes a file of its own.
"""

from __future__ import annotations

import resource
import socket
from typing import Any

import torch
import torch.distributed as dist

FIELDS = ("work_s", "data_s", "rest_s", "peak_mem_gib")


def peak_memory_gib(device: torch.device) -> float:
    """This process's peak: CUDA allocator peak on a GPU, else the host's peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def _collective_device(device: torch.device) -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather_hosts() -> list[str]:
    """Every rank's host name, in rank order. Collective: every rank must call it."""
    mine = socket.gethostname()
    if not dist.is_initialized():
        return [mine]
    hosts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, mine)  # note: collective, every rank must reach it
    return [str(h) for h in hosts]


def gather_rank_times(*, step: int, work_s: float, data_s: float, step_s: float,
                      device: torch.device, is_rank_zero: bool) -> dict[str, Any] | None:
    """The ``ranks`` record for this interval on rank 0 (None elsewhere). Collective: every rank must call it at
    the same step. Times are seconds per step, averaged over the interval."""
    mine = torch.tensor([work_s, data_s, max(step_s - work_s, 0.0), peak_memory_gib(device)],
                        dtype=torch.float64, device=_collective_device(device))  # (4,)
    if dist.is_initialized():
        parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, mine)  # note: collective, every rank must reach it
        table = torch.stack(parts).cpu()  # (world, 4); note: a CPU-GPU sync point on CUDA
    else:
        table = mine.cpu()[None, :]
    if not is_rank_zero:
        return None
    record: dict[str, Any] = {"kind": "ranks", "step": step, "step_s": step_s}
    for i, name in enumerate(FIELDS):
        record[name] = [round(v, 6) for v in table[:, i].tolist()]
    return record
