"""One run directory read into memory: its records, summary and status, tolerant of a run still writing."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshrun.train.runlog import METRICS_FILE, of_kind, read_records, read_summary
from meshrun.train.summary import FAILED, compute_summary

RUNNING = "running"
QUIET_S = 600.0
"""A run without summary.json whose metrics.jsonl changed within this many seconds counts as running."""


@dataclass
class Run:
    """What ``report`` and ``runs`` know of one run directory."""

    path: Path
    name: str
    records: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    """compute_summary's numbers, with status and exit_reason (from summary.json once the run has ended)."""

    def kind(self, kind: str) -> list[dict[str, Any]]:
        return of_kind(self.records, kind)

    @property
    def t0(self) -> float:
        """Wall-clock time of the run's first record (the time axis starts here)."""
        return self.records[0]["time"] if self.records and "time" in self.records[0] else 0.0


def is_run_dir(path: Path) -> bool:
    return (path / METRICS_FILE).is_file()


def is_current(records: list[dict[str, Any]], written: dict[str, Any]) -> bool:
    """summary.json was written after the last process started: it says how the run ended."""
    starts = of_kind(records, "start")
    last_start = starts[-1].get("time", 0.0) if starts else 0.0
    return written.get("time", 0.0) >= last_start


def status_of(path: Path, records: list[dict[str, Any]], written: dict[str, Any] | None,
              now: float | None = None) -> tuple[str, str]:
    """(status, reason). summary.json decides, unless a process started after it was written (running again);
    without one, recent writes mean running, and silence means the processes died without writing it."""
    if written is not None and is_current(records, written):
        return str(written.get("status", FAILED)), str(written.get("exit_reason", ""))
    mtime = (path / METRICS_FILE).stat().st_mtime
    idle = (now if now is not None else time.time()) - mtime
    if idle < QUIET_S:
        return RUNNING, f"last record {idle:.0f} s ago"
    return FAILED, f"no summary.json and no record for {idle / 60:.0f} min (killed?)"


def load_run(path: Path, name: str | None = None) -> Run:
    """Read ``path``; raise FileNotFoundError naming it when it holds no metrics.jsonl."""
    path = Path(path)
    if not is_run_dir(path):
        raise FileNotFoundError(f"{path}: not a run directory (no {METRICS_FILE}); give the run.dir of a "
                                "`meshrun train` run, e.g. runs/default")
    records = read_records(path)
    written = read_summary(path)
    status, reason = status_of(path, records, written)
    summary = {**compute_summary(records), "status": status, "exit_reason": reason}
    if written is not None and is_current(records, written) and "last_checkpoint_step" in written:
        # the launcher that killed its workers read it from the checkpoint folder: an async save the kill cut short
        # is in metrics.jsonl, yet was never published
        summary["last_checkpoint_step"] = written["last_checkpoint_step"]
    return Run(path=path, name=name or path.name, records=records, summary=summary)


def unique_names(paths: list[Path]) -> list[str]:
    """Short labels for runs compared on one plot: the directory name, with its parent's when names repeat."""
    names = [p.resolve().name for p in paths]
    return [f"{p.resolve().parent.name}/{n}" if names.count(n) > 1 else n for p, n in zip(paths, names)]
