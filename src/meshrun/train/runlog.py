"""The records a run appends to ``metrics.jsonl``, and reading them back while the run may still be writing.

Rank 0 writes one JSON object per line. ``kind`` says what it is:

* ``start``: a process group started (first start, elastic restart or a rerun that resumed): layout, batch, model;
* ``train``: one log interval, reduced over all ranks (loss, lr, tokens/s, MFU, peak memory);
* ``eval``: a validation loss;
* ``ranks``: one log interval's per-rank timing, gathered on rank 0 (work, data wait, rest of the step, peak memory);
* ``checkpoint``: a checkpoint was saved.

The end of a run is recorded in ``summary.json`` (:mod:`meshrun.train.summary`), not here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"


def read_records(run_dir: Path) -> list[dict[str, Any]]:
    """Every complete record of ``run_dir/metrics.jsonl`` in file order; a half-written last line (the run is
    still writing) and lines that are not JSON objects are skipped."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    records = []
    with path.open() as f:
        for line in f:
            if not line.endswith("\n"):
                break  # being written right now
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                records.append(record)
    return records


def of_kind(records: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """The records of one kind; a record without ``kind`` is a train record (older runs wrote none)."""
    return [r for r in records if r.get("kind", "train") == kind]


def read_summary(run_dir: Path) -> dict[str, Any] | None:
    """``summary.json`` as a dict, or None when the run has not ended (or the file is unreadable)."""
    try:
        data = json.loads((Path(run_dir) / SUMMARY_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def start_record(*, step: int, restart: int, world_size: int, nodes: int, layout: str, parallel: dict[str, Any],
                 batch_formula: str, global_batch: int, tokens_per_step: int, model: str, params: int,
                 device: str) -> dict[str, Any]:
    """The ``start`` record a process group writes once it is ready to train (after any resume). ``layout`` is the
    start-up header's line, for people; ``parallel`` the same layout as data (train/header.py: parallel_record),
    for the tools that read it (``meshrun runs``)."""
    return {"kind": "start", "step": step, "restart": restart, "world_size": world_size, "nodes": nodes,
            "layout": layout, "parallel": parallel, "batch_formula": batch_formula, "global_batch": global_batch,
            "tokens_per_step": tokens_per_step, "model": model, "params": params, "device": device}
