"""Hangs: a watchdog thread per rank that names the rank that stopped and where the others wait.

:class:`HangWatchdog` - the trainer's ``beat(step, phase)`` only stores a tuple; the thread publishes it to the c10d
store every few seconds, and names the rank(s) that stopped making progress, where they were, and where the others
wait. It also dumps this process's Python stacks when this rank stalls.
"""

from __future__ import annotations

import faulthandler
import json
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

from meshrun.env import ProcessPlacement
from meshrun.units import format_ranks




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

    def __init__(self, *, env: ProcessPlacement, timeout_s: float, store=None, publish_every_s: float | None = None,
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
        # private: torch has no public accessor for the default group's store (2.8 to 2.13), and rebuilding it
        # would repeat torch's rendezvous (agent store, per-attempt prefix)
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
