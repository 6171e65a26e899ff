"""``run.profile_steps``: record chosen optimizer steps on chosen ranks with the torch profiler.

Each profiled rank writes a Chrome/Perfetto trace and a table of its most expensive ops to
``<run.dir>/profile/``; on a GPU the table opens with where the device time went (compute, exposed
communication, idle: watch/step_trace.py). Only local work: no collective, so ranks that do not profile run exactly
as before.
"""

from __future__ import annotations

import json
import logging
import statistics
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

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
    window, ranks = run.profile_window(), profiled_ranks(run, world_size)
    if window is None:
        return None
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


def profiled_ranks(run: RunConfig, world_size: int) -> frozenset[int] | None:
    """run.profile_ranks (None: all), checked against the world size (the run plan checks it first, before anything
    is written into run.dir: train/plan.py)."""
    ranks = run.profiled_ranks()
    if ranks is not None and max(ranks) >= world_size:
        raise ConfigError(f"run.profile_ranks={run.profile_ranks!r} names rank {max(ranks)}, but the world size is "
                          f"{world_size} (ranks 0..{world_size - 1})")
    return ranks


DATA_BOUND_SHARE = 0.3
"""A slow interval whose ranks spent this share of a step or more waiting for data is put down to data loading."""
IDLE_POINTS = 3.0
"""GPU utilisation this many points under the earlier intervals' median reads as GPUs that idled more."""


@dataclass(frozen=True)
class IntervalMachine:
    """What the machine did in one logged interval, for a slowdown's line and record: the GPUs' mean utilisation,
    their lowest SM clock and the throttle reasons NVML gave (from rank 0's node's system record; None without
    GPUs or system metrics), the host's CPU utilisation, and the largest share of a rank's step spent waiting for
    data (every rank's, from the interval's gathered timing)."""

    gpu_util_pct: float | None = None
    sm_clock_mhz: float | None = None
    throttle: tuple[str, ...] = ()
    cpu_util_pct: float | None = None
    data_share: float = 0.0

    @classmethod
    def of(cls, system: list[dict[str, Any]], data_share: float) -> IntervalMachine:
        """From the interval's system records (rank 0's node first; [] elsewhere or without them)."""
        node = system[0] if system else {}
        gpus = node.get("gpus", [])
        utils = [g["util_pct"] for g in gpus if "util_pct" in g]
        clocks = [g["sm_clock_mhz"] for g in gpus if "sm_clock_mhz" in g]
        return cls(gpu_util_pct=statistics.fmean(utils) if utils else None, sm_clock_mhz=min(clocks, default=None),
                   throttle=tuple(sorted({g["throttle"] for g in gpus if g.get("throttle")})),
                   cpu_util_pct=node.get("cpu_util_pct"), data_share=data_share)

    def describe(self, usual_util: float | None) -> str:
        """'GPUs busy 91% (99% before), lowest SM clock 1890 MHz, CPU 13%, data wait 0% of a step: the GPUs idled
        more than before: ...'."""
        parts = []
        if self.gpu_util_pct is not None:
            parts.append(f"GPUs busy {self.gpu_util_pct:.0f}%"
                         + (f" ({usual_util:.0f}% before)" if usual_util is not None else ""))
        if self.sm_clock_mhz is not None:
            parts.append(f"lowest SM clock {self.sm_clock_mhz:.0f} MHz"
                         + (f" ({', '.join(self.throttle)})" if self.throttle else ""))
        if self.cpu_util_pct is not None:
            parts.append(f"CPU {self.cpu_util_pct:.0f}%")
        parts.append(f"data wait {self.data_share:.0%} of a step")
        return ", ".join(parts) + f": {self.hint(usual_util)}"

    def hint(self, usual_util: float | None) -> str:
        if self.data_share >= DATA_BOUND_SHARE:
            return "the ranks waited for data (data.num_workers, the storage)"
        if self.gpu_util_pct is not None and usual_util is not None and self.gpu_util_pct < usual_util - IDLE_POINTS:
            return ("the GPUs idled more than before: they waited on their hosts (Python, launches, a sync, other "
                    "work on the CPUs) or on a collective")
        if self.gpu_util_pct is not None and usual_util is not None:
            return "the GPUs were as busy as before: slower kernels (clocks, heat) or longer collectives"
        return "the trace will tell"

    def fields(self, usual_util: float | None) -> dict[str, Any]:
        """The slowdown record's machine fields."""
        found: dict[str, Any] = {"data_share": round(self.data_share, 4)}
        for key, value in (("gpu_util_pct", self.gpu_util_pct), ("usual_gpu_util_pct", usual_util),
                           ("sm_clock_mhz", self.sm_clock_mhz), ("cpu_util_pct", self.cpu_util_pct)):
            if value is not None:
                found[key] = round(value, 2)
        return found


SLOWDOWN_STEPS = 2
"""Steps run.profile_on_slowdown records, after one step of profiler warm-up."""
SLOWDOWN_REFERENCE = 2
"""Earlier intervals (not counting the first after a start, which compiles and warms up) a slowdown is judged
against: fewer give no reliable median."""


class SlowdownWatch:
    """``run.profile_on_slowdown``: notices the first logged interval whose step time rose so far above the median of
    the run's earlier intervals that its tokens/s fell by ``fraction``, and names the steps to record.

    A slowdown that comes and goes (a GPU waiting on its host in some runs and not others, a throttled clock, a noisy
    neighbour) is gone by the time someone reruns with ``run.profile_steps``; this records it while it lasts. Every
    rank feeds it the same number (rank 0's step time from the interval's gathered timing table), so every rank
    agrees on it without a collective of its own, and only the listed ranks record.
    """

    def __init__(self, fraction: float, *, ranks: frozenset[int] | None, rank: int, run_dir: Path,
                 device: torch.device, profile_steps: tuple[int, int] | None):
        self.fraction, self.ranks, self.rank, self.device = fraction, ranks, rank, device
        self.folder = run_dir / "profile"
        self.window = profile_steps or (0, -1)
        """run.profile_steps: one torch profiler at a time, and intervals it slows are no slowdown."""
        self.step_times: list[float] = []
        self.gpu_utils: list[float] = []
        """The GPUs' mean utilisation of the judged intervals where it was sampled (rank 0's node)."""
        self.intervals = 0
        self.fired = False
        self.pending: dict | None = None
        """The slowdown record whose profile_steps this rank records, until :meth:`start` starts it."""

    def observe(self, *, step: int, interval_steps: int, step_s: float, last_step: int,
                machine: IntervalMachine | None = None) -> tuple[str, dict] | None:
        """One logged interval ending at ``step``: (the line to print, the metrics record) when it is the run's first
        slowdown, else None. ``machine``: what the machine did in it, for the line (rank 0's). A recording it asks for
        starts after this step (:meth:`start`)."""
        self.intervals += 1
        if self.intervals == 1:
            return None  # compilation and warm-up, not the run's pace
        if step - interval_steps < self.window[1] + 1 and step >= self.window[0]:
            return None  # holds run.profile_steps or the step after them, which writes the trace
        reference = statistics.median(self.step_times) if len(self.step_times) >= SLOWDOWN_REFERENCE else None
        usual_util = statistics.median(self.gpu_utils) if self.gpu_utils else None
        self.step_times.append(step_s)
        if machine is not None and machine.gpu_util_pct is not None:
            self.gpu_utils.append(machine.gpu_util_pct)
        if self.fired or reference is None or step_s * (1 - self.fraction) <= reference:
            return None
        self.fired = True
        first, last = step + 2, step + 1 + SLOWDOWN_STEPS
        record = {"kind": "slowdown", "step": step, "steps": interval_steps, "step_s": round(step_s, 6),
                  "median_step_s": round(reference, 6), "profile_steps": None,
                  **(machine.fields(usual_util) if machine is not None else {})}
        said = (f"slowdown: steps {step - interval_steps + 1}-{step} took {1e3 * step_s:.1f} ms each, "
                f"{1 - reference / step_s:.0%} fewer tokens/s than the median of the run's earlier intervals "
                f"({1e3 * reference:.1f} ms)" + (f"; {machine.describe(usual_util)}" if machine is not None else ""))
        if last > last_step:
            return f"{said}; too few steps left to record (run.profile_on_slowdown)", record
        if step < self.window[1]:
            return f"{said}; not recorded: run.profile_steps is still to come (run.profile_on_slowdown)", record
        record["profile_steps"] = [first, last]
        who = "all" if self.ranks is None else ",".join(map(str, sorted(self.ranks)))
        if self.ranks is None or self.rank in self.ranks:
            self.pending = record
        return (f"{said}; recording steps {first}-{last} on rank(s) {who} -> {self.folder_of(record)}/rank_<N>.json "
                "(run.profile_on_slowdown; meshrun trace reads it)", record)

    def folder_of(self, record: dict) -> Path:
        """Where a slowdown record's recorded steps go: <run.dir>/profile/slowdown_<first>-<last>."""
        first, last = record["profile_steps"]
        return self.folder / f"slowdown_{first}-{last}"

    def start(self, step: int) -> StepProfiler | None:
        """After step ``step``'s logging and profiler step: the profiler the slowdown asked for, started (None when
        none was asked for on this rank)."""
        if self.pending is None:
            return None
        record, self.pending = self.pending, None
        (first, last), folder = record["profile_steps"], self.folder_of(record)
        try:  # the slow interval's step time: what the trace's idle time is weighed against
            folder.mkdir(parents=True, exist_ok=True)
            part = folder / f"slowdown.json.{self.rank}"
            part.write_text(json.dumps(record) + "\n")
            part.replace(folder / "slowdown.json")
        except OSError as exc:
            log.warning("profiler: could not write %s: %s", folder / "slowdown.json", exc)
        profiler = StepProfiler(first=first, last=last, start_step=step, rank=self.rank, device=self.device,
                                folder=folder, announce=lambda: None)
        profiler.start()
        return profiler
