"""A log step's values read back without stopping the GPU, and, in one process, read one step late.

At each log step (train.log_every) the trainer reads the interval's loss, the gradient norm and the non-finite
guard's counts back to the host. Read at once, that waits for the step's last kernel: the GPU then runs dry while the
host writes the records and launches the next step. On one H200 that cost about 5 ms per log step (the 124m model
ran 1.020x faster logging every 15 steps than every 5; docs/benchmarks.md, round 21), 1.5% of its throughput at the
default interval of 10 steps.

:class:`LogSnapshot` takes what the record needs at the log step: the host's counters as they are then, and the
device's values copied into pinned host memory behind the step's kernels, without waiting. In one process the
trainer queues the next step first and reads the snapshot after it (:meth:`Trainer.defers_log` says when: not
before an evaluation, a checkpoint, the last step or a profiled step, which read the GPU anyway), so the GPU always
has a step queued (logging every 5 steps then ran within 1.1% of every 15, inside the power cap's clock swings). The
record is the same; it is written one step later. With several ranks the log step gathers
per-rank timings and system records, collectives whose results the host reads at once, so the snapshot is read at
the log step as before.

:class:`IntervalClock` times what each record covers, from the end of the previous log step's work to the end of
this one's, less the evaluations and checkpoints in between: a boundary taken when the record is written would put
the next step, queued by then, in this record and leave the next one short of it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch


class PendingValues:
    """Scalars (0-d tensors, or numbers) copied to the host behind the kernels that make them: on a GPU into pinned
    memory without waiting (:meth:`ready` says whether they have arrived), elsewhere at once."""

    def __init__(self, values: Sequence[torch.Tensor | float], device: torch.device):
        # numbers by a fill kernel: a tensor made from a host number would be copied from pageable memory, a sync
        stacked = torch.stack([v.detach().reshape(()).to(torch.float64) if isinstance(v, torch.Tensor)
                               else torch.full((), float(v), dtype=torch.float64, device=device) for v in values])
        self.event: torch.cuda.Event | None = None
        if stacked.is_cuda:
            self.host = torch.empty(stacked.shape, dtype=torch.float64, pin_memory=True)
            self.host.copy_(stacked, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = stacked

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def read(self) -> list[float]:
        """The values; waits for the kernels that made them (not for any queued after them)."""
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


Mark = torch.cuda.Event | float
"""An interval boundary: a timing event on a GPU, the host clock's seconds elsewhere."""


class IntervalClock:
    """The training time of each logged interval, its boundaries taken where a step's work ends.

    On a GPU a boundary is a timing event queued behind the step's kernels, read when the record is written (not
    waited for at the log step); the time between two of them is the GPU's clock, its idle stretches (the host
    issuing, logging) included. Elsewhere the kernels ran on the host, so the step has ended when the host reaches
    the log step and the host clock marks it. Evaluations and checkpoint saves are left out of the interval they
    fall in (:meth:`pause`, :meth:`resume`); the log steps' own work (gathers, records) is in the next interval, so
    the intervals tile the training time.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.start: Mark = self.mark()
        self.segments: list[tuple[Mark, Mark]] = []
        """The current interval's stretches of training before a pause."""

    def mark(self) -> Mark:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def pause(self) -> None:
        """Before an evaluation or a checkpoint save: the interval's training stops here."""
        self.segments.append((self.start, self.mark()))

    def resume(self) -> None:
        """After it: the interval's training goes on from here."""
        self.start = self.mark()

    def take(self) -> Callable[[], float]:
        """At a log step, right after its work is queued: closes the interval there and opens the next. Returns the
        closed interval's seconds, to call when its record is written (on a GPU it waits for the log step's work)."""
        end = self.mark()
        segments, self.segments, self.start = [*self.segments, (self.start, end)], [], end
        return lambda: sum(_seconds(a, b) for a, b in segments)


def _seconds(start: Mark, end: Mark) -> float:
    if isinstance(start, float) and isinstance(end, float):
        return end - start
    end.synchronize()  # note: waits for the kernels queued before ``end``, not for those after it
    return start.elapsed_time(end) / 1000.0


@dataclass
class LogSnapshot:
    """What one log step's records need, taken at that step."""

    step: int
    epoch: int
    lr: float
    tokens_seen: int
    steps: int
    """Optimizer steps in the interval this record closes."""
    values: PendingValues
    """loss sum and tokens (summed over ranks), gradient norm (NaN when none), non-finite steps, the first of them."""
    has_norm: bool
    timing: Callable[[], tuple[float, float, float]]
    """This rank's (work, data, host forward) seconds per step over the interval (WorkTimer.take_later)."""
    seconds: Callable[[], float]
    """The interval's training time, up to the end of this step's work (IntervalClock.take)."""

    def read(self) -> tuple[dict[str, float], float | None, int, int]:
        """(totals, gradient norm or None, non-finite steps so far, the first of them)."""
        loss_sum, tokens, norm, bad, first = self.values.read()
        return {"loss_sum": loss_sum, "tokens": tokens}, norm if self.has_norm else None, int(bad), int(first)
