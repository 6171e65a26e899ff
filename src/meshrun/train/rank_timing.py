"""Per-rank timing of each log interval, gathered on rank 0 into one ``ranks`` record of metrics.jsonl.

Each rank contributes, per step averaged over the interval: its own working time (data wait + forward passes, the
time the straggler detector compares), the data wait alone, the rest of the wall-clock step (backward, optimizer and
waiting in collectives for the slowest rank), and its peak memory so far. One all_gather per log interval of these 4
floats per rank, to which the trainer adds the straggler detector's GPU-clock columns, so the detector gathers
nothing of its own: no rank writes a file of its own.
"""

from __future__ import annotations

import resource
from typing import Any

import numpy as np
import torch

FIELDS = ("work_s", "data_s", "rest_s", "peak_mem_gib")


def peak_memory_gib(device: torch.device) -> float:
    """This process's peak: CUDA allocator peak on a GPU, else the host's peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def timing_row(*, work_s: float, data_s: float, step_s: float, device: torch.device) -> list[float]:
    """This rank's :data:`FIELDS` for the interval (seconds per step, averaged over it)."""
    return [work_s, data_s, max(step_s - work_s, 0.0), peak_memory_gib(device)]


def ranks_record(table: np.ndarray, *, step: int, step_s: float) -> dict[str, Any]:
    """The ``ranks`` record of metrics.jsonl from a gathered table whose first columns are :data:`FIELDS`."""
    record: dict[str, Any] = {"kind": "ranks", "step": step, "step_s": step_s}
    for i, name in enumerate(FIELDS):
        record[name] = [round(v, 6) for v in table[:, i].tolist()]
    return record
