"""Run-time health: stragglers, hangs, and the NCCL flight recorder.

* :class:`StragglerDetector` - every log interval, one all_gather of five floats per rank; rank 0 names the ranks
  whose step time is well above the others' and says whether data loading, the GPU (clocks, temperature and a
  GEMM re-run) or neither is to blame.
* :class:`HangWatchdog` - a daemon thread per rank. The trainer's ``beat(step, phase)`` only stores a tuple; the
  thread publishes it to the c10d store every few seconds, and names the rank(s) that stopped making progress,
  where they were, and where the others wait. It also dumps this process's Python stacks when this rank stalls.
* :func:`enable_flight_recorder` - environment defaults that make NCCL keep a ring buffer of recent collectives
  and dump it on a timeout, so that a hang leaves a trace per rank in the run folder.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import json
import os
import socket
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, MutableMapping

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

from meshrun.diag.gpu_health import gemm_tflops, nvml_state
from meshrun.env import ClusterEnv
from meshrun.units import format_ranks


# ---- stragglers ------------------------------------------------------------------------------------------------


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

    def cause(self) -> str:
        """Slow data (the loader), a slow GPU (the GEMM re-run is below the others'), or neither."""
        if self.data_share >= 0.5:
            return f"{self.data_share:.0%} of it waiting for data"
        share = self.gemm_share
        if share is not None and share < 1 - GEMM_SLOW_FRACTION:
            return (f"its GPU is slow: a GEMM re-run gives {self.gemm_tflops:.3g} TFLOP/s, {share:.0%} of the ranks' "
                    f"median {self.gemm_median:.3g}")
        cause = f"compute dominates (data loading {self.data_share:.0%})"
        if share is not None:
            cause += (f"; its GPU runs a GEMM at {share:.0%} of the median, so not the GPU itself: look at uneven "
                      "work, the host's CPU, or time spent in communication")
        return cause

    def describe(self) -> str:
        gpu = f"; GPU {self.gpu_state}" if self.gpu_state else ""
        return (f"rank {self.who.rank} (host {self.who.host}, local {self.who.local_rank}) is a straggler: "
                f"step {self.step_s:.3g} s vs median {self.median_s:.3g} s ({self.ratio:.1f}x), {self.cause()}{gpu}")


GEMM_SLOW_FRACTION = 0.15
"""A flagged rank whose GEMM re-run is more than this fraction below the ranks' median has a slow GPU."""


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

    Construction is a collective (it gathers host names); so is every :meth:`observe`. Every rank of
    ``group`` must make the same calls in the same order.
    """

    def __init__(self, group=None, *, env: ClusterEnv, threshold: float = 1.5, window: int = 5,
                 min_gap_s: float = 0.005, history: int = 512, device: torch.device | None = None,
                 gemm_check: bool = False, compute_device: torch.device | None = None):
        self.group, self.env, self.threshold, self.min_gap_s = group, env, threshold, min_gap_s
        self.window = max(1, window)
        self.device = device or _collective_device(group)
        self.gemm_check = gemm_check
        self.compute_device = compute_device or self.device
        self._recent: deque[np.ndarray] = deque(maxlen=self.window)
        self._history: deque[np.ndarray] = deque(maxlen=max(history, self.window))
        self.ranks = self._gather_ranks()

    def _gather_ranks(self) -> list[RankInfo]:
        mine = RankInfo(rank=self.env.rank, host=socket.gethostname(), local_rank=self.env.local_rank)
        if not dist.is_initialized():
            return [mine]
        gathered: list[RankInfo | None] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(gathered, mine, group=self.group)  # note: collective, every rank must reach it
        return [info for info in gathered if info is not None]

    def observe(self, step: int, step_time_s: float, data_time_s: float = 0.0) -> StragglerReport | None:
        """Record this interval; on rank 0 return a report when some rank is a straggler (else None).

        Every rank keeps the window and applies the same rule to the same gathered numbers, so all agree on
        whether to re-run the GEMM (a collective) without another message."""
        clock = _gpu_clock(self.compute_device)  # [sm MHz, max sm MHz, C], NaN without NVML
        mine = torch.tensor([step_time_s, data_time_s, *clock], dtype=torch.float64, device=self.device)  # (5,)
        times = self._gather(mine)  # (world, 5)
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

    def _gather(self, mine: torch.Tensor) -> np.ndarray:
        if not dist.is_initialized():
            return mine.cpu().numpy()[None, :]
        parts = [torch.empty_like(mine) for _ in self.ranks]
        dist.all_gather(parts, mine, group=self.group)  # note: collective, every rank must reach it
        return torch.stack(parts).cpu().numpy()  # (world, k); note: a CPU-GPU sync point on CUDA

    def _rerun_gemm(self, found: list[Straggler]) -> list[Straggler]:
        """Every rank times the same GEMM now; the flagged ranks' TFLOP/s against the median of all ranks."""
        gpu = self.compute_device.type == "cuda"
        try:
            tflops = gemm_tflops(self.compute_device, n=4096 if gpu else 128, iters=10 if gpu else 3)
        except (RuntimeError, MemoryError):  # e.g. no room for 100 MB beside the model: still join the gather
            tflops = float("nan")
        values = self._gather(torch.tensor([tflops], dtype=torch.float64, device=self.device))[:, 0]  # (world,)
        median = float(np.nanmedian(values)) if not np.isnan(values).all() else float("nan")
        position = {info.rank: i for i, info in enumerate(self.ranks)}
        return [dataclasses.replace(s, gemm_tflops=float(values[position[s.who.rank]]), gemm_median=median)
                for s in found]

    def summary(self) -> list[dict[str, float | int | str]]:
        """Per rank (rank 0 only; empty elsewhere): median and max step time over the recorded intervals."""
        if not self._history:
            return []
        steps = np.stack(self._history)[:, :, 0]  # (intervals, world)
        return [{"rank": info.rank, "host": info.host, "median_step_s": float(np.median(steps[:, i])),
                 "max_step_s": float(np.max(steps[:, i]))} for i, info in enumerate(self.ranks)]


def _gpu_clock(device: torch.device) -> list[float]:
    if device.type != "cuda":
        return [float("nan")] * 3
    state = nvml_state(device.index if device.index is not None else torch.cuda.current_device())
    return [float(state.get(key, float("nan"))) for key in ("sm_clock_mhz", "max_sm_clock_mhz", "temperature_c")]


def _collective_device(group) -> torch.device:
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ---- hangs -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Heartbeat:
    """What one rank last published to the store."""

    rank: int
    host: str
    step: int
    phase: str
    age_s: float
    """Seconds since that rank's last beat, measured by that rank when it published."""
    limit_s: float
    """How long the current phase may go without a beat."""
    seq: int
    """Publication counter; it stops advancing when the process (or its watchdog thread) is gone."""
    index: int = 0
    """Beats since this step began: orders the phases of one step without comparing clocks."""
    done: bool = False
    inside: str = ""
    """Where the rank's training thread is, once its beat is old: 'collective: ...', 'backward: ...' (autograd's
    engine, where gradient collectives of DDP wait) or 'code: ...' (not in any collective); '' while on time."""

    @property
    def in_collective(self) -> bool:
        return self.inside.startswith(("collective:", "backward:"))


@dataclass(frozen=True)
class RankView:
    """The observer's view of one rank: its last heartbeat (None: never published) and how long ago it came."""

    rank: int
    beat: Heartbeat | None
    silent_s: float
    """Seconds since the observer last saw this rank publish (since watching started, if it never did)."""

    @property
    def age_s(self) -> float:
        return (self.beat.age_s if self.beat else 0.0) + self.silent_s

    def stalled(self, timeout_s: float) -> bool:
        limit = self.beat.limit_s if self.beat else timeout_s
        return self.beat is None or (not self.beat.done and (self.silent_s >= limit or self.age_s >= limit))

    def where(self) -> str:
        host = f" (host {self.beat.host})" if self.beat else ""
        if self.beat is None:
            return f"rank {self.rank}{host} has published no heartbeat in {self.silent_s:.0f} s (did it start?)"
        if self.silent_s >= self.beat.limit_s:
            return (f"rank {self.rank}{host} stopped publishing heartbeats {self.silent_s:.0f} s ago (process dead, "
                    f"frozen or cut off from the store); last seen at step {self.beat.step} '{self.beat.phase}'")
        return f"rank {self.rank}{host} last seen at step {self.beat.step} '{self.beat.phase}' {self.age_s:.0f} s ago"


def diagnose_hang(views: list[RankView], *, timeout_s: float) -> str | None:
    """None while every rank makes progress; else one line naming who is behind and where the others wait.

    Pure logic. "Behind" means: silent or never seen; else fewer beats into the run than the furthest ranks,
    compared as (step, beats since the step began), so every rank should beat the same phases in the same
    order. Finished ranks are ignored.
    """
    live = [v for v in views if not (v.beat and v.beat.done)]
    if not any(v.stalled(timeout_s) for v in live):
        return None
    seen = [v for v in live if v.beat is not None and v.silent_s < v.beat.limit_s]
    behind = [v for v in live if v not in seen]
    waiting = seen
    progress = lambda v: (v.beat.step, v.beat.index)  # noqa: E731 - the ordering rule, named
    if seen and len({progress(v) for v in seen}) > 1:
        top = max(progress(v) for v in seen)
        behind += [v for v in seen if progress(v) < top]
        waiting = [v for v in seen if progress(v) == top]
    if not behind:
        stuck = [v for v in waiting if v.beat.inside.startswith("code:")]
        in_collective = [v for v in waiting if v.beat.in_collective]
        if stuck and in_collective:
            return _stuck_outside_collectives(stuck, in_collective)
        first = waiting[0].beat
        return (f"hang: all {len(waiting)} ranks stalled at step {first.step} '{first.phase}' for "
                f"{min(v.age_s for v in waiting):.0f} s; no rank is behind, so suspect a deadlock or mismatched "
                "collective inside the step, or a phase slower than the watchdog timeout")
    parts = [v.where() for v in sorted(behind, key=lambda v: v.rank)[:8]]
    if len(behind) > 8:
        parts.append(f"and {len(behind) - 8} more ranks behind")
    for (step, phase), group in _by_position(waiting).items():
        parts.append(f"{_ranks_text([v.rank for v in group])} {'is' if len(group) == 1 else 'are'} waiting at "
                     f"step {step} '{phase}'")
    return "hang: " + "; ".join(parts)


def _stuck_outside_collectives(stuck: list[RankView], waiting: list[RankView]) -> str:
    """Same step and phase everywhere, but some ranks never reached the collective the others wait in."""
    parts = [f"rank {v.rank} (host {v.beat.host}) is stuck at step {v.beat.step} '{v.beat.phase}' outside any "
             f"collective, {v.age_s:.0f} s in {v.beat.inside.partition(': ')[2]}"
             for v in sorted(stuck, key=lambda v: v.rank)[:8]]
    inside = sorted({v.beat.inside.partition(": ")[2] for v in waiting})
    ranks = [v.rank for v in waiting]
    parts.append(f"{_ranks_text(ranks)} {'is' if len(ranks) == 1 else 'are'} waiting for "
                 f"{'it' if len(stuck) == 1 else 'them'} in a collective ({'; '.join(inside[:2])})")
    return "hang: " + "; ".join(parts)


def where_is(thread_id: int | None) -> str:
    """Where a thread is, in words (see Heartbeat.inside). Reads its Python stack; safe from another thread.

    Only the innermost frames inside torch count: a collective waits at the top of the stack (``wait``,
    ``all_reduce``, FSDP's reduce-scatter), while code that never reached one has its own frame on top.
    """
    frame = sys._current_frames().get(thread_id) if thread_id is not None else None
    if frame is None:
        return ""
    innermost = _describe(frame)
    while frame is not None and "/torch/" in _path(frame):
        if "/torch/distributed/" in _path(frame):
            return f"collective: {_describe(frame)}"
        if "/torch/autograd/" in _path(frame):
            return f"backward: {innermost} (C++ autograd; gradient hooks such as DDP's all-reduce wait there)"
        frame = frame.f_back
    return f"code: {innermost}"


def _path(frame) -> str:
    return frame.f_code.co_filename.replace("\\", "/")


def _describe(frame) -> str:
    return f"{frame.f_code.co_name} ({_short(_path(frame))}:{frame.f_lineno})"


def _short(path: str) -> str:
    for marker in ("/site-packages/", "/src/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path.rsplit("/", 2)[-1] if path.count("/") > 2 else path


def _by_position(views: list[RankView]) -> dict[tuple[int, str], list[RankView]]:
    groups: dict[tuple[int, str], list[RankView]] = {}
    for view in sorted(views, key=lambda v: v.rank):
        groups.setdefault((view.beat.step, view.beat.phase), []).append(view)
    return groups


def _ranks_text(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> 'ranks 0-2,5'; [3] -> 'rank 3'."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + format_ranks(ranks)


class HangWatchdog:
    """A daemon thread that notices when this rank, or any rank, stops making progress.

    The trainer calls :meth:`beat` at points in the step (``beat(step, "forward")``, ``beat(step, "optimizer")``,
    ...); a beat only stores a tuple. Every ``publish_every_s`` the thread writes this rank's last beat to the
    c10d store (one small ``set``). Then:

    * every rank checks itself: no beat for ``timeout_s`` -> it logs where it stopped and dumps the Python stacks
      of all its threads (to ``stack_file``, else stderr);
    * rank 0 (every rank with ``check_all``) reads all heartbeats and logs :func:`diagnose_hang`'s line, naming
      the ranks that are behind and where the others wait.

    Each stall is reported once (again after another ``timeout_s`` if it persists). ``on_hang`` receives the
    message, e.g. to abort. Call :meth:`stop` before destroying the process group (its store goes with it).

    With ``end_job``, the observer's verdict ends the job: it is written to the store, and every rank's thread,
    seeing it there within ``publish_every_s``, calls ``end`` (default :func:`end_process`: the verdict on rank 0's
    stderr and in every rank's torchelastic error file, then exit code :data:`EXIT_HANG`). Ranks stuck in C++ with the GIL held
    cannot run their thread; they fail when the others are gone, or at ``dist.timeout_s``.
    """

    def __init__(self, *, env: ClusterEnv, timeout_s: float, store=None, publish_every_s: float | None = None,
                 check_all: bool = False, stack_file: str | Path | None = None,
                 log: Callable[[str], None] | None = None, on_hang: Callable[[str], None] | None = None,
                 end_job: bool = False, end: Callable[[str], None] | None = None):
        self.env, self.timeout_s, self.end_job = env, timeout_s, end_job
        self.end = end or (lambda verdict: end_process(verdict, say=env.is_rank_zero))
        self._watched = threading.get_ident()  # the training thread: the one that creates the watchdog
        self.publish_every_s = publish_every_s or min(5.0, max(0.2, timeout_s / 4))
        self.check_all, self.stack_file, self.on_hang = check_all, stack_file, on_hang
        self.log = log or (lambda message: print(message, file=sys.stderr, flush=True))
        self.host = socket.gethostname()
        self.reports: list[str] = []
        self._store = _thread_store(store, timeout_s=max(10.0, 2 * self.publish_every_s))
        self._beat = (-1, "start", time.monotonic(), timeout_s, 0)  # (step, phase, when, limit, index)
        self._seq = 0
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (seq, when the observer saw it change)
        self._reported: dict[str, float] = {}  # message kind -> when it was last logged
        self._store_error_logged = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="meshrun-hang-watchdog", daemon=True)

    def start(self) -> "HangWatchdog":
        self._started = time.monotonic()
        self._publish()
        self._thread.start()
        return self

    def beat(self, step: int, phase: str, *, timeout_s: float | None = None) -> None:
        """Record progress (cheap: no I/O). ``timeout_s`` overrides the limit until the next beat (slow phases)."""
        last_step, _, _, _, index = self._beat
        # one tuple assignment, atomic under the GIL: the thread never sees half a beat
        self._beat = (step, phase, time.monotonic(), timeout_s or self.timeout_s,
                      index + 1 if step == last_step else 0)

    def stop(self) -> None:
        """Publish 'finished' (so rank 0 does not mistake an exit for a hang) and end the thread."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self.publish_every_s + 5)
        self._publish(done=True)

    def __enter__(self) -> "HangWatchdog":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.wait(self.publish_every_s):
            self._publish()
            self._check_self()
            if self._store is not None and (self.check_all or self.env.is_rank_zero):
                self._check_all_ranks()
            if self.end_job and self._store is not None:
                self._end_if_decided()

    def _end_if_decided(self) -> None:
        """Another rank's (or this rank's) verdict is in the store: end this process with it."""
        try:
            if not self._store.check([_VERDICT_KEY]):
                return
            verdict = self._store.get(_VERDICT_KEY).decode()
        except Exception as exc:  # noqa: BLE001 - as in _publish
            self._store_failed(exc)
            return
        self.end(verdict)

    def _publish(self, *, done: bool = False) -> None:
        if self._store is None:
            return
        step, phase, when, limit, index = self._beat
        self._seq += 1
        age = time.monotonic() - when
        inside = where_is(self._watched) if age >= limit / 2 and not done else ""
        beat = Heartbeat(rank=self.env.rank, host=self.host, step=step, phase=phase, age_s=age,
                         limit_s=limit, seq=self._seq, index=index, done=done, inside=inside)
        try:
            self._store.set(_heartbeat_key(self.env.rank), json.dumps(beat.__dict__))
        except Exception as exc:  # noqa: BLE001 - the store is gone or slow; say so once and keep watching
            self._store_failed(exc)

    def _check_self(self) -> None:
        step, phase, when, limit, _ = self._beat
        age = time.monotonic() - when
        if age >= limit and self._due(f"self:{when}"):
            self._emit(f"hang: this rank (rank {self.env.rank}, host {self.host}) has made no progress for "
                       f"{age:.0f} s; last beat at step {step} '{phase}'; Python stacks of all threads follow",
                       dump_stacks=True)

    def _check_all_ranks(self) -> None:
        try:
            views = self._read_views()
        except Exception as exc:  # noqa: BLE001 - as in _publish
            self._store_failed(exc)
            return
        message = diagnose_hang(views, timeout_s=self.timeout_s)
        if message and self._due("all:" + ",".join(str(v.rank) for v in views if v.stalled(self.timeout_s))):
            self._emit(message, dump_stacks=False)
            if self.end_job:
                try:
                    self._store.set(_VERDICT_KEY, f"{message}; ending the job (health.hang_action=exit)")
                except Exception as exc:  # noqa: BLE001 - as in _publish
                    self._store_failed(exc)

    def _read_views(self) -> list[RankView]:
        now = time.monotonic()
        keys = [_heartbeat_key(rank) for rank in range(self.env.world_size)]
        present = [rank for rank, key in enumerate(keys) if rank in self._seen or self._store.check([key])]
        multi_get = getattr(self._store, "multi_get", None)  # one round trip where torch has it
        wanted = [keys[r] for r in present]
        values = (multi_get(wanted) if multi_get else [self._store.get(k) for k in wanted]) if wanted else []
        beats = {rank: Heartbeat(**json.loads(value)) for rank, value in zip(present, values)}
        views = []
        for rank in range(self.env.world_size):
            beat = beats.get(rank)
            if beat is not None and self._seen.get(rank, (None,))[0] != beat.seq:
                self._seen[rank] = (beat.seq, now)
            since = now - self._seen[rank][1] if beat is not None else now - self._started
            views.append(RankView(rank=rank, beat=beat, silent_s=since))
        return views

    def _due(self, kind: str) -> bool:
        """Report each stall once, and again only after another timeout_s."""
        now = time.monotonic()
        if now - self._reported.get(kind, -float("inf")) < self.timeout_s:
            return False
        self._reported[kind] = now
        return True

    def _emit(self, message: str, *, dump_stacks: bool) -> None:
        self.reports.append(message)
        self.log(message)
        if dump_stacks:
            _dump_stacks(self.stack_file)
        if self.on_hang is not None:
            self.on_hang(message)

    def _store_failed(self, exc: Exception) -> None:
        if not self._store_error_logged:
            self._store_error_logged = True
            self.log(f"hang watchdog on rank {self.env.rank}: cannot use the c10d store "
                     f"({type(exc).__name__}: {exc}); heartbeats of other ranks are not checked")


EXIT_HANG = 124
"""Exit code of every rank of a job ended by a hang verdict (as GNU timeout's)."""
_VERDICT_KEY = "meshrun/health/verdict"


def end_process(verdict: str, *, say: bool = True) -> None:
    """Print the verdict (``say``: rank 0 only, not once per rank), leave it in torchelastic's error file for the
    launcher's summary, and exit at once.

    ``os._exit``: the training thread is stuck, so nothing else would ever return to the interpreter.
    """
    if say:
        print(verdict, file=sys.stderr, flush=True)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        try:
            ErrorHandler().record_exception(HangVerdict(verdict))
        except OSError:
            pass
    os._exit(EXIT_HANG)


class HangVerdict(RuntimeError):
    """What the hang watchdog concluded; recorded in the error file the launcher reads."""


def _heartbeat_key(rank: int) -> str:
    return f"meshrun/health/heartbeat/{rank}"


def _thread_store(store, *, timeout_s: float):
    """A store this thread may use while the main thread uses its own (a clone: separate connection)."""
    if store is None and dist.is_available() and dist.is_initialized():
        store = dist.distributed_c10d._get_default_store()
    if store is None:
        return None
    clone = getattr(store, "clone", None)  # torch >= 2.6; older: share the store (its client serialises calls)
    if clone is None:
        return store
    try:
        store = clone()
    except RuntimeError:
        return store
    store.set_timeout(timedelta(seconds=timeout_s))  # short: a dead master must not freeze the watchdog
    return store


def _dump_stacks(stack_file: str | Path | None) -> None:
    try:
        if stack_file is None:
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            return
        with open(stack_file, "a") as handle:
            faulthandler.dump_traceback(file=handle, all_threads=True)
    except (OSError, ValueError, AttributeError):  # stderr without a file descriptor (captured): nothing to do
        pass


def torch_at_least(major: int, minor: int) -> bool:
    """Whether the installed torch release is at least major.minor (local suffixes such as +cu130 ignored)."""
    parts = torch.__version__.split("+")[0].split(".")
    return (int(parts[0]), int(parts[1])) >= (major, minor)


# ---- NCCL flight recorder ------------------------------------------------------------------------------------


def enable_flight_recorder(environ: MutableMapping[str, str], *, run_dir: str | Path,
                           buffer_size: int = 2000, new_names: bool | None = None) -> dict[str, str]:
    """Set flight-recorder defaults in ``environ`` unless the user set them; return what was set.

    Must happen before the NCCL process group is created (the launcher sets it for workers, or the trainer
    sets ``os.environ`` before ``init_process_group``). On a collective timeout each rank then writes its last
    ``buffer_size`` collectives to ``<run_dir>/nccl_trace/rank_<N>``; read them with ``torchfrtrace``.
    torch 2.9 and newer read the TORCH_FR_* names and warn about the older TORCH_NCCL_* ones, which torch 2.8
    reads; only the names this torch reads are set (``new_names`` overrides the version check).
    """
    if new_names is None:
        new_names = torch_at_least(2, 9)
    trace_prefix = str(Path(run_dir) / "nccl_trace" / "rank_")
    wanted = [(("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"), str(buffer_size)),
              (("TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_DUMP_ON_TIMEOUT"), "1"),
              (("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"), trace_prefix)]
    applied: dict[str, str] = {}
    for names, value in wanted:
        if any(name in environ for name in names):
            continue  # the user chose (in either spelling); leave it alone
        name = names[0] if new_names else names[1]
        environ[name] = applied[name] = value
    if any(name in applied for name in ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")):
        os.makedirs(Path(trace_prefix).parent, exist_ok=True)
    return applied


class WorkTimer:
    """Time this rank spends on its own work: waiting for data, and running forward passes.

    In synchronous data parallelism the wall-clock step is the same on every rank (all wait at the gradient
    all-reduce), so stragglers show only in the time before the first blocking collective. Forward passes are timed
    with CUDA events on GPU (no sync until ``take``) and with the host clock on CPU.
    """

    def __init__(self, parts: list[torch.nn.Module], device: torch.device):
        self.cuda = device.type == "cuda"
        self.data_s, self.host_forward_s, self.events = 0.0, 0.0, []
        self._start: Any = None
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

    def _after(self, *_):
        end = self._now()
        if self.cuda:
            self.events.append((self._start, end))
        else:
            self.host_forward_s += end - self._start

    def add_data(self, seconds: float) -> None:
        self.data_s += seconds

    def take(self, steps: int) -> tuple[float, float]:
        """(work, data) seconds per step since the last call; syncs with the GPU."""
        forward = self.host_forward_s + sum(a.elapsed_time(b) for a, b in self.events) / 1000.0
        work, data = (self.data_s + forward) / max(steps, 1), self.data_s / max(steps, 1)
        self.data_s, self.host_forward_s, self.events = 0.0, 0.0, []
        return work, data
