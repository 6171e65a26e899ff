"""Stragglers: which rank is slow, and why.

:class:`StragglerDetector` - every log interval, one all_gather of five floats per rank (or none of its own: the trainer
hands it the columns of its one per-rank gather, see :meth:`StragglerDetector.observe_table`); rank 0 names the ranks whose
step time is well above the others' and says whether data loading, the GPU (clocks, temperature and a GEMM re-run)
or neither is to blame. :class:`WorkTimer` measures the per-rank time it compares.
"""

from __future__ import annotations

import dataclasses
import socket
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from meshrun.watch.gather import collective_device, gather_floats
from meshrun.diag.gpu_health import gemm_tflops, nvml_state
from meshrun.env import ProcessPlacement


@dataclass(frozen=True)
class RankInfo:
    rank: int
    host: str
    local_rank: int


@dataclass(frozen=True)
class Straggler:
    """One slow rank: its mean step and data time over the window, against the median of the other ranks."""

    who: RankInfo
    step_s: float
    data_s: float
    median_s: float
    gpu_state: str = ""
    """Its GPU's SM clock and temperature from NVML when this interval was measured ('' without NVML)."""
    gemm_tflops: float | None = None
    """TFLOP/s of the GEMM re-run on this rank right after it was flagged (None when not re-run)."""
    gemm_median: float | None = None
    """Median TFLOP/s of the same GEMM over all ranks."""
    device: str = "GPU"
    """What the GEMM re-run ran on: 'GPU', or 'CPU' for ranks without one (the report then speaks of the CPU)."""

    @property
    def ratio(self) -> float:
        return self.step_s / self.median_s if self.median_s > 0 else float("inf")

    @property
    def data_share(self) -> float:
        return self.data_s / self.step_s if self.step_s > 0 else 0.0

    @property
    def gemm_share(self) -> float | None:
        if self.gemm_tflops is None or not self.gemm_median or np.isnan(self.gemm_tflops) or np.isnan(self.gemm_median):
            return None  # not re-run, or the GEMM could not run (no memory left, say)
        return self.gemm_tflops / self.gemm_median

    def verdict(self) -> str:
        """'data', 'device' (the GEMM re-run is below the others') or 'compute': what :meth:`cause` says, in a word
        that stays the same while the numbers move (repeated reports are only said again when it changes)."""
        if self.data_share >= 0.5:
            return "data"
        share = self.gemm_share
        return "device" if share is not None and share < 1 - GEMM_SLOW_FRACTION else "compute"

    def cause(self) -> str:
        """Slow data (the loader), a slow GPU or CPU (the GEMM re-run is below the others'), or neither."""
        verdict, share = self.verdict(), self.gemm_share
        if verdict == "data":
            return f"{self.data_share:.0%} of it waiting for data"
        if verdict == "device":
            if self.device == "CPU":  # ranks on CPU: a slower matmul means busier cores, not a faulty part
                return (f"its CPU is slow: a matmul re-run gives {self.gemm_tflops * 1e3:.3g} GFLOP/s, {share:.0%} of "
                        f"the ranks' median {self.gemm_median * 1e3:.3g}: its cores are busier (other processes or "
                        "threads on them? OMP_NUM_THREADS)")
            return (f"its GPU is slow: a GEMM re-run gives {self.gemm_tflops:.3g} TFLOP/s, {share:.0%} of the ranks' "
                    f"median {self.gemm_median:.3g}")
        cause = f"compute dominates (data loading {self.data_share:.0%})"
        if share is not None and self.device == "CPU":
            cause += (f"; its CPU runs a matmul at {share:.0%} of the median, so not the CPU itself: look at uneven "
                      "work, or time spent in communication")
        elif share is not None:
            cause += (f"; its GPU runs a GEMM at {share:.0%} of the median, so not the GPU itself: look at uneven "
                      "work, the host's CPU, or time spent in communication")
        return cause

    def describe(self) -> str:
        gpu = f"; GPU {self.gpu_state}" if self.gpu_state else ""
        return (f"rank {self.who.rank} (host {self.who.host}, local {self.who.local_rank}) is a straggler: "
                f"step {self.step_s:.3g} s vs median {self.median_s:.3g} s ({self.ratio:.1f}x), {self.cause()}{gpu}")


GEMM_SLOW_FRACTION = 0.15
"""A flagged rank whose GEMM re-run is more than this fraction below the ranks' median has a slow GPU."""


REPEAT_S = 300.0
"""An unchanged straggler verdict is printed again at most this often (seconds)."""


class StragglerNotices:
    """Which straggler reports to print (rank 0): the first; then one whenever the verdict changes (other ranks,
    another cause, or no straggler any more); an unchanged one again every ``repeat_s`` seconds. A slow rank is
    slow at every log step, and a line per step buried the log (41 lines in 40 steps)."""

    def __init__(self, repeat_s: float = REPEAT_S, clock: Callable[[], float] = time.monotonic):
        self.repeat_s, self.clock = repeat_s, clock
        self._said: tuple[tuple[int, str], ...] = ()
        self._since_step, self._at = 0, float("-inf")

    def to_say(self, step: int, report: StragglerReport | None) -> str | None:
        """The line to print for this interval's ``report`` (None: no straggler), or None to stay quiet."""
        key = tuple((s.who.rank, s.verdict()) for s in report.stragglers) if report is not None else ()
        now = self.clock()
        if key == self._said:
            if not key or now - self._at < self.repeat_s:
                return None
            self._at = now
            return f"{report} (unchanged since step {self._since_step})"
        previous, self._said, self._at = self._said, key, now
        if not key:
            ranks = ",".join(str(rank) for rank, _ in previous)
            return f"step {step}: no straggler now (rank {ranks} was one since step {self._since_step})"
        self._since_step = step
        return (f"{report} (said again when it changes, or after {self.repeat_s / 60:g} min; every report is in "
                "the rank log)")


@dataclass(frozen=True)
class StragglerReport:
    step: int
    stragglers: list[Straggler]

    def __str__(self) -> str:
        return "\n".join(f"step {self.step}: {s.describe()}" for s in self.stragglers)


def find_stragglers(times: np.ndarray, ranks: list[RankInfo], *, threshold: float,
                    min_gap_s: float) -> list[Straggler]:
    """Ranks whose step time is at least ``threshold`` x the median of the other ranks. Pure logic.

    ``times`` is (world, 2) [step_time_s, data_time_s] per rank, or (world, 5) with the GPU's SM clock, maximum
    SM clock (MHz) and temperature (C) after them (NaN without NVML). The median leaves the rank itself out, so
    that with two ranks the slow one is still compared against the fast one. Slowest first.
    """
    step = times[:, 0]
    if len(step) < 2:
        return []
    order = np.argsort(step, kind="stable")
    sorted_step = step[order]
    found = []
    for position, rank in enumerate(order):
        median = _median_without(sorted_step, position)
        if step[rank] >= threshold * median and step[rank] - median >= min_gap_s:
            found.append(Straggler(who=ranks[rank], step_s=float(step[rank]), data_s=float(times[rank, 1]),
                                   median_s=float(median), gpu_state=_gpu_state(times[rank])))
    return sorted(found, key=lambda s: -s.step_s)


def _gpu_state(row: np.ndarray) -> str:
    if len(row) < 5 or np.isnan(row[2]):
        return ""
    return f"SM clock {row[2]:.0f}/{row[3]:.0f} MHz, {row[4]:.0f} C"


def _median_without(sorted_values: np.ndarray, position: int) -> float:
    """Median of ``sorted_values`` without the element at ``position``, in O(1)."""
    remaining = len(sorted_values) - 1
    at = lambda k: sorted_values[k] if k < position else sorted_values[k + 1]  # noqa: E731 - index shift
    half = remaining // 2
    return float(at(half) if remaining % 2 else (at(half - 1) + at(half)) / 2)


class StragglerDetector:
    """Names slow ranks every log interval, at the cost of one all_gather of 5 floats per rank.

    What to pass: in synchronous data parallelism every rank's wall-clock step takes as long as the slowest
    rank's, because all wait at the gradient all-reduce. So ``step_time_s`` should be the time this rank spent
    working (data wait + compute measured before the first blocking collective, or CUDA-event compute time),
    and ``data_time_s`` the part of it spent waiting for the next batch. Averages per step over the interval.
    Each rank adds its GPU's SM clock and temperature (NVML, where ``nvidia-ml-py`` is importable). With
    ``gemm_check``, when a straggler is found every rank re-runs a short GEMM on ``compute_device`` (a few ms on a
    GPU) and the report says whether the flagged rank's GPU is itself slow.

    Construction is a collective (it gathers host names) unless ``ranks`` (from :func:`gather_rank_infos`) is
    given; every :meth:`observe` and :meth:`observe_table` is one too. Every rank of ``group`` must make the same
    calls in the same order.
    """

    def __init__(self, group=None, *, env: ProcessPlacement, threshold: float = 1.5, window: int = 5,
                 min_gap_s: float = 0.005, history: int = 512, device: torch.device | None = None,
                 gemm_check: bool = False, compute_device: torch.device | None = None,
                 ranks: list[RankInfo] | None = None, repeat_s: float = REPEAT_S):
        self.group, self.env, self.threshold, self.min_gap_s = group, env, threshold, min_gap_s
        self.window = max(1, window)
        self.device = device or collective_device(group)
        self.gemm_check = gemm_check
        self.compute_device = compute_device or self.device
        self._recent: deque[np.ndarray] = deque(maxlen=self.window)
        self._history: deque[np.ndarray] = deque(maxlen=max(history, self.window))
        self.ranks = ranks if ranks is not None else gather_rank_infos(env, group)
        self.notices = StragglerNotices(repeat_s)
        """What of the reports to print: see :class:`StragglerNotices`."""

    def gpu_clock(self) -> list[float]:
        """This rank's GPU: [SM clock MHz, max SM clock MHz, temperature C], NaN without NVML or a GPU."""
        return _gpu_clock(self.compute_device)

    def observe(self, step: int, step_time_s: float, data_time_s: float = 0.0) -> StragglerReport | None:
        """Record this interval; on rank 0 return a report when some rank is a straggler (else None).
        Collective: gathers [step_time_s, data_time_s, *gpu_clock()] from every rank."""
        times = gather_floats([step_time_s, data_time_s, *self.gpu_clock()], group=self.group, device=self.device)
        return self.observe_table(step, times)

    def observe_table(self, step: int, times: np.ndarray) -> StragglerReport | None:
        """:meth:`observe` for numbers already gathered: ``times`` is (world, 5), each rank's
        [step_time_s, data_time_s, *gpu_clock()] in rank order, the same on every rank.

        Every rank keeps the window and applies the same rule to the same gathered numbers, so all agree on
        whether to re-run the GEMM (a collective, with ``gemm_check``) without another message."""
        self._recent.append(times)
        if self.env.is_rank_zero:
            self._history.append(times)
        mean = np.mean(np.stack(self._recent), axis=0)  # (world, 5): smooths a one-off hiccup
        found = find_stragglers(mean, self.ranks, threshold=self.threshold, min_gap_s=self.min_gap_s)
        if found and self.gemm_check:
            found = self._rerun_gemm(found)  # collective: every rank found the same stragglers
        if not self.env.is_rank_zero:
            return None
        return StragglerReport(step=step, stragglers=found) if found else None

    def _rerun_gemm(self, found: list[Straggler]) -> list[Straggler]:
        """Every rank times the same GEMM now; the flagged ranks' TFLOP/s against the median of all ranks."""
        gpu = self.compute_device.type == "cuda"
        try:
            tflops = gemm_tflops(self.compute_device, n=4096 if gpu else 256, iters=10 if gpu else 5)
        except (RuntimeError, MemoryError):  # e.g. no room for 100 MB beside the model: still join the gather
            tflops = float("nan")
        values = gather_floats([tflops], group=self.group, device=self.device)[:, 0]  # (world,)
        median = float(np.nanmedian(values)) if not np.isnan(values).all() else float("nan")
        position = {info.rank: i for i, info in enumerate(self.ranks)}
        return [dataclasses.replace(s, gemm_tflops=float(values[position[s.who.rank]]), gemm_median=median,
                                    device="GPU" if gpu else "CPU") for s in found]

    def summary(self) -> list[dict[str, float | int | str]]:
        """Per rank (rank 0 only; empty elsewhere): median and max step time over the recorded intervals."""
        if not self._history:
            return []
        steps = np.stack(self._history)[:, :, 0]  # (intervals, world)
        return [{"rank": info.rank, "host": info.host, "median_step_s": float(np.median(steps[:, i])),
                 "max_step_s": float(np.max(steps[:, i]))} for i, info in enumerate(self.ranks)]


def gather_rank_infos(env: ProcessPlacement, group=None) -> list[RankInfo]:
    """Every rank's rank, host name and local rank, in rank order. Collective: every rank of ``group`` must call it
    (gather once and hand the list to :class:`StragglerDetector` and whatever else names hosts)."""
    mine = RankInfo(rank=env.rank, host=socket.gethostname(), local_rank=env.local_rank)
    if not dist.is_initialized():
        return [mine]
    gathered: list[RankInfo | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)  # note: collective, every rank must reach it
    return [info for info in gathered if info is not None]


def _gpu_clock(device: torch.device) -> list[float]:
    if device.type != "cuda":
        return [float("nan")] * 3
    state = nvml_state(device.index if device.index is not None else torch.cuda.current_device())
    return [float(state.get(key, float("nan"))) for key in ("sm_clock_mhz", "max_sm_clock_mhz", "temperature_c")]


class WorkTimer:
    """Time this rank spends on its own work: waiting for data, and running forward passes.

    In synchronous data parallelism the wall-clock step is the same on every rank (all wait at the gradient
    all-reduce), so stragglers show only in the time before the first blocking collective. Forward passes are timed
    with CUDA events on GPU (no sync until ``take``) and with the host clock on CPU. The host clock also times how
    long the host took to issue them: on a GPU, a host time near the GPU's says the GPU waited on the host.
    """

    def __init__(self, parts: list[torch.nn.Module], device: torch.device):
        self.cuda = device.type == "cuda"
        self.data_s, self.host_forward_s, self.events = 0.0, 0.0, []
        self._start: Any = None
        self._host_start = 0.0
        for part in parts:
            part.register_forward_pre_hook(self._before)
            part.register_forward_hook(self._after)

    def _now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _before(self, *_):
        self._start = self._now()
        self._host_start = time.perf_counter()

    def _after(self, *_):
        end = self._now()
        self.host_forward_s += time.perf_counter() - self._host_start
        if self.cuda:
            self.events.append((self._start, end))

    def add_data(self, seconds: float) -> None:
        self.data_s += seconds

    def take(self, steps: int) -> tuple[float, float, float]:
        """(work, data, host forward) seconds per step since the last call; syncs with the GPU."""
        return self.take_later(steps)()

    def take_later(self, steps: int) -> Callable[[], tuple[float, float, float]]:
        """:meth:`take` of the steps so far, computed when called (then it waits for their forward passes, and
        for nothing after them); the next interval starts now. Work is the data wait plus the forward passes (on
        the GPU's clock there); host forward is the host's time inside the forward passes."""
        data_s, host_forward_s, events = self.data_s, self.host_forward_s, self.events
        self.data_s, self.host_forward_s, self.events = 0.0, 0.0, []

        def result() -> tuple[float, float, float]:
            forward = sum(a.elapsed_time(b) for a, b in events) / 1000.0 if events else host_forward_s
            n = max(steps, 1)
            return (data_s + forward) / n, data_s / n, host_forward_s / n

        return result
