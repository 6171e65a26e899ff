"""``summary.json``: what a run achieved, written by rank 0 when the process ends (finished, stopped or failed), or
by the launcher when a second Ctrl-C killed the workers (interrupted).

Everything is computed from ``metrics.jsonl`` (:mod:`meshrun.train.runlog`), so ``meshrun runs`` and ``meshrun
report`` compute the same numbers for a run that is still going or was killed before it could write a summary.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from meshrun.train.runlog import SUMMARY_FILE, of_kind, read_records

FINISHED, STOPPED, FAILED = "finished", "stopped early", "failed"
INTERRUPTED = "interrupted"
"""Stopped at once by a second Ctrl-C, without a checkpoint of its last step (the launcher writes this summary for
the workers it killed: meshrun.launch.run_record)."""


def _steady(train: list[dict[str, Any]], key: str) -> float | None:
    """Median of ``key`` over the train records, leaving out the first interval of each start (warm-up)."""
    values = [r[key] for r in train if isinstance(r.get(key), (int, float)) and not r.get("_first")]
    if not values:
        values = [r[key] for r in train if isinstance(r.get(key), (int, float))]
    return float(statistics.median(values)) if values else None


def _mark_warmup(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Train records, each first one after a start flagged ``_first`` (it holds compilation and warm-up)."""
    train, after_start = [], True
    for r in records:
        kind = r.get("kind", "train")
        if kind == "start":
            after_start = True
        elif kind == "train":
            train.append({**r, "_first": after_start})
            after_start = False
    return train


def compute_summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The summary numbers of a run from its records (any prefix of them: the run may still be going)."""
    train, evals = _mark_warmup(records), of_kind(records, "eval")
    starts, ckpts = of_kind(records, "start"), of_kind(records, "checkpoint")
    ranks = of_kind(records, "ranks")
    last = train[-1] if train else {}
    first_time = starts[0]["time"] if starts and "time" in starts[0] else (records[0].get("time") if records else None)
    end_time = records[-1].get("time") if records else None
    peaks = [r["peak_mem_gib"] for r in train if isinstance(r.get("peak_mem_gib"), (int, float))]
    peaks += [max(r["peak_mem_gib"]) for r in ranks if r.get("peak_mem_gib")]
    return {
        "steps": last.get("step", 0),
        "tokens": last.get("tokens_seen", 0),
        "wall_time_s": round(end_time - first_time, 3) if first_time is not None and end_time is not None else None,
        "final_train_loss": last.get("loss"),
        "final_val_loss": evals[-1]["loss"] if evals else None,
        "best_val_loss": min(r["loss"] for r in evals) if evals else None,
        "tokens_per_s": _steady(train, "tokens_per_s"),
        "mfu": _steady(train, "mfu"),
        "peak_mem_gib": max(peaks) if peaks else None,
        "restarts": max(len(starts) - 1, 0),
        "last_checkpoint_step": ckpts[-1]["step"] if ckpts else None,
        "layout": starts[-1].get("layout") if starts else None,
        "parallel": starts[-1].get("parallel") if starts else None,  # None from a run before it was recorded
        "world_size": starts[-1].get("world_size") if starts else None,
        "global_batch": starts[-1].get("global_batch") if starts else None,
    }


def write_summary(run_dir: Path, *, exit_reason: str, status: str, known: dict[str, Any] | None = None
                  ) -> dict[str, Any]:
    """Compute and write ``run_dir/summary.json`` atomically; returns what was written. Rank 0 only, or the launcher
    for workers it killed. ``known``: numbers the caller knows better than metrics.jsonl (the launcher's
    ``last_checkpoint_step``, read from the checkpoint folder)."""
    summary = {"status": status, "exit_reason": exit_reason, "time": round(time.time(), 3),
               **compute_summary(read_records(run_dir)), **(known or {})}
    path = Path(run_dir) / SUMMARY_FILE
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(summary, indent=1) + "\n")
    os.replace(partial, path)
    return summary
