"""``run.profile_steps``: record chosen optimizer steps on chosen ranks with the torch profiler.

Each profiled rank writes a Chrome/Perfetto trace and a table of its most expensive ops to
``<run.dir>/profile/``; on a GPU the table opens with where the device time went (compute, exposed
communication, idle: watch/step_trace.py). Only local work: no collective, so ranks that do not profile run exactly
as before.
"""

from __future__ import annotations

import logging
from contextlib import ExitStack
from pathlib import Path
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from meshrun.config import ConfigError, RunConfig
from meshrun.watch.step_trace import StepTime, describe_step_time, run_step_time

log = logging.getLogger("meshrun")


def describe(first: int, last: int, ranks: str, folder: Path) -> str:
    """The one line rank 0 prints: what is recorded, where it goes and how to open it."""
    return (f"profile: steps {first}-{last} on rank(s) {ranks} -> {folder}/rank_<N>.json (top ops in "
            "rank_<N>_summary.txt); open a trace in https://ui.perfetto.dev or chrome://tracing")


class StepProfiler:
    """The torch profiler over optimizer steps ``first..last`` of this rank, stepped once per optimizer step.

    Steps count from 1, as in the metrics. Started with the loop (at ``start_step``, later than 0 when resumed), it
    waits until the step before ``first``, warms up on it, records ``first..last`` and writes its files as soon as
    ``last`` is done.
    """

    def __init__(self, *, first: int, last: int, start_step: int, rank: int, device: torch.device, folder: Path,
                 announce: Callable[[], None], with_stack: bool = False):
        self.last, self.rank, self.folder, self.announce = last, rank, folder, announce
        self.cuda = device.type == "cuda"
        first = max(first, start_step + 1)  # resumed inside the window: record what is left of it
        warmup = 1 if first - 1 > start_step else 0
        steps = schedule(wait=first - 1 - start_step - warmup, warmup=warmup, active=last - first + 1, repeat=1)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        # stacks multiply the trace's size and the profiler's overhead; shapes are rarely needed to find a slow op
        self.prof: profile | None = profile(activities=activities, schedule=steps, on_trace_ready=self._write,
                                            record_shapes=False, with_stack=with_stack)
        self._running = ExitStack()

    def start(self) -> None:
        self._running.enter_context(self.prof)

    def step(self, step: int) -> None:
        """Call after optimizer step ``step`` (the number just completed); stops the profiler after the window."""
        if self.prof is None:
            return
        self.prof.step()
        if step >= self.last:
            self.close()

    def close(self) -> None:
        """Stop the profiler (a stop inside the window writes what was recorded). Never raises: profiling is an aid,
        and a failure here must not hide the error that ended the run."""
        if self.prof is None:
            return
        self.prof = None
        try:
            self._running.close()
        except Exception as exc:  # noqa: BLE001 - reported, then training ends as it would have
            log.warning("profiler: could not stop and write the trace: %s", exc)

    def _timeline(self, trace: Path) -> StepTime | None:
        """The device timeline of the trace just written; None on CPU, or when it cannot be read."""
        if not self.cuda:
            return None
        try:
            return run_step_time(trace)  # with the steps logged before the window, where this rank logs them
        except (OSError, ValueError, KeyError) as exc:  # the trace and the op table still get written
            log.warning("profiler: could not read back %s for its GPU timeline: %s", trace, exc)
            return None

    def _write(self, prof: profile) -> None:
        """The trace and the table of the 25 ops with the most self time (device time on GPU, CPU time on CPU)."""
        trace = self.folder / f"rank_{self.rank:05d}.json"
        sort_by = "self_device_time_total" if self.cuda else "self_cpu_time_total"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(trace))
            timeline = self._timeline(trace)
            table = prof.key_averages().table(sort_by=sort_by, row_limit=25)
            head = describe_step_time(timeline) + "\n\n" if timeline is not None else ""
            (self.folder / f"rank_{self.rank:05d}_summary.txt").write_text(head + table + "\n")
        except OSError as exc:  # a full disk ends the profile, not the run
            log.warning("profiler: could not write %s: %s", trace, exc)
            return
        log.info("profiler: wrote %s%s", trace, f"; {timeline.verdict()}" if timeline is not None else "")
        self.announce()


def build_profiler(run: RunConfig, *, rank: int, world_size: int, device: torch.device, run_dir: Path,
                   start_step: int, say: Callable[[str], None]) -> StepProfiler | None:
    """The profiler for this rank, not started yet; None when profiling is off, this rank is not listed, or a
    resumed run is past the window. ``say`` prints on rank 0 only."""
    window, ranks = run.profile_window(), run.profiled_ranks()
    if window is None:
        return None
    if ranks is not None and max(ranks) >= world_size:
        raise ConfigError(f"run.profile_ranks={run.profile_ranks!r} names rank {max(ranks)}, but the world size is "
                          f"{world_size} (ranks 0..{world_size - 1})")
    first, last = window
    folder = run_dir / "profile"
    if last <= start_step:
        say(f"profile: steps {first}-{last} were already done when this run resumed from step {start_step}; "
            "nothing recorded (choose later steps in run.profile_steps)")
        return None
    line = describe(first, last, run.profile_ranks, folder)
    if ranks is not None and rank not in ranks:
        say(line)  # rank 0 does not profile, so it says now where the other ranks' traces will be
        return None
    return StepProfiler(first=first, last=last, start_step=start_step, rank=rank, device=device, folder=folder,
                        announce=lambda: say(line))
