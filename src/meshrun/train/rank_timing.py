"""Per-rank timing of each log interval, gathered on rank 0 into one ``ranks`` record of metrics.jsonl.

Each rank contributes, per step averaged over the interval: its own working time (data wait + forward passes, the
time the straggler detector compares), the data wait alone, the rest of the wall-clock step (backward, optimizer and
waiting in collectives for the slowest rank), its peak memory so far, and the host's time inside the forward passes
(on a GPU, near the working time when the GPU waited on the host to issue them). One all_gather per log interval of
these 5 floats per rank, to which the trainer adds the straggler detector's GPU-clock columns, so the detector gathers
nothing of its own: no rank writes a file of its own.
"""

from __future__ import annotations

import logging
import resource
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from meshrun.watch.gather import gather_floats

if TYPE_CHECKING:
    from meshrun.train.trainer import Trainer

log = logging.getLogger("meshrun")

FIELDS = ("work_s", "data_s", "rest_s", "peak_mem_gib", "forward_host_s")


def peak_memory_gib(device: torch.device) -> float:
    """This process's peak: CUDA allocator peak on a GPU, else the host's peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def timing_row(*, work_s: float, data_s: float, step_s: float, device: torch.device,
               forward_host_s: float = 0.0) -> list[float]:
    """This rank's :data:`FIELDS` for the interval (seconds per step, averaged over it)."""
    return [work_s, data_s, max(step_s - work_s, 0.0), peak_memory_gib(device), forward_host_s]


def step_times(table: np.ndarray) -> np.ndarray:
    """Each rank's wall-clock step time from a gathered table: its working time plus the rest."""
    return table[:, FIELDS.index("work_s")] + table[:, FIELDS.index("rest_s")]


def rank0_step_s(table: np.ndarray) -> float:
    """Rank 0's wall-clock step time from a gathered table."""
    return float(step_times(table)[0])


def data_share(table: np.ndarray) -> float:
    """The largest share of a rank's step that it spent waiting for data, from a gathered table."""
    return float(np.max(table[:, FIELDS.index("data_s")] / np.maximum(step_times(table), 1e-9)))


def ranks_record(table: np.ndarray, *, step: int, step_s: float) -> dict[str, Any]:
    """The ``ranks`` record of metrics.jsonl from a gathered table whose first columns are :data:`FIELDS`."""
    record: dict[str, Any] = {"kind": "ranks", "step": step, "step_s": step_s}
    for i, name in enumerate(FIELDS):
        record[name] = [round(v, 6) for v in table[:, i].tolist()]
    return record


def log_rank_timing(trainer: Trainer, steps: int, elapsed: float, *, step: int | None = None,
                    timing: Callable[[], tuple[float, float, float]] | None = None) -> np.ndarray:
    """Every rank's own working time (data + forward, before any blocking collective), peak memory and, for the
    straggler detector, GPU clock, in one gather: the ``ranks`` record, and the numbers compared across ranks.
    Returns the gathered table, the same on every rank (its first columns are :data:`FIELDS`). ``step`` and
    ``timing``: the log step's, when its record is written later (train/log_step.py); else the trainer's now."""
    health = trainer.health
    step = trainer.step if step is None else step
    work_s, data_s, forward_host_s = timing() if timing is not None else health.timer.take(steps)
    step_s = elapsed / max(steps, 1)
    # the first interval holds warm-up (compilation, allocator growth), not a rank's speed
    observe = health.stragglers is not None and step > trainer.start_step + trainer.job.train.log_every
    row = timing_row(work_s=work_s, data_s=data_s, step_s=step_s, device=trainer.device,
                     forward_host_s=forward_host_s)
    if observe:
        row += health.stragglers.gpu_clock()
    table = gather_floats(row)  # collective: every rank; (world, 5), or (world, 8) with the clock
    if trainer.env.is_rank_zero:
        trainer.sink.record(ranks_record(table, step=step, step_s=step_s))
    if not observe:
        return table
    trainer.beat("straggler_check")
    times = np.concatenate([table[:, :2], table[:, len(FIELDS):]], axis=1)  # (world, 5): work, data, clock
    report = health.stragglers.observe_table(step, times)  # collective when the GEMM is re-run
    if report is not None:
        log.info("%s", report)  # every report in the rank log; on the console when the verdict changes
    notice = health.notice(step, report)
    if notice:
        trainer.sink.print(f"warning: {notice}")
    return table
