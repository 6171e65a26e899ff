"""How checkpoints lie in their folder, and which of them retention keeps.

    checkpoints/
      step_0001000/                 complete: DCP shards, .metadata, manifest.json, COMPLETE (written last)
      step_0002000/
      .step_0003000.tmp-1f2e3d4c/   being written (or abandoned by a killed job); never resumed
      .step_0000500.del-9a8b7c6d/   being deleted by retention

A directory appears under its final name only through an atomic rename of a finished temporary directory,
so a ``step_*`` directory holding ``COMPLETE`` is whole. On an object store (``s3://``, ``gs://``), which cannot
rename atomically, each save writes ``step_N/attempt-<id>/`` and ``step_N/COMPLETE`` names the attempt that is
whole; the other attempts of a step are unfinished saves (kind 'tmp'). See :mod:`meshrun.ckpt.storage`.
No process group, no torch.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from meshrun.ckpt.storage import ATTEMPT_RE, COMPLETE, Item, Store, attempt_named, store_for

STEP_RE = re.compile(r"^step_(\d+)$")
TMP_RE = re.compile(r"^\.step_(\d+)\.tmp-([0-9a-f]+)$")
TRASH_RE = re.compile(r"^\.step_(\d+)\.del-([0-9a-f]+)$")
MANIFEST = "manifest.json"


def step_dir_name(step: int) -> str:
    """'step_0001000': zero-padded so that a plain `ls` sorts by step (scans parse the number anyway)."""
    return f"step_{step:07d}"


def tmp_dir_name(step: int, token: str) -> str:
    return f".step_{step:07d}.tmp-{token}"


def trash_dir_name(step: int, token: str) -> str:
    return f".step_{step:07d}.del-{token}"


@dataclass(frozen=True)
class Entry:
    """One checkpoint-like directory in a checkpoint folder."""

    path: str
    """Its location (a path, or a URL on an object store)."""
    step: int
    kind: str
    """'complete' (has COMPLETE), 'incomplete' (final name, no COMPLETE), 'tmp' (being written or abandoned),
    'trash' (being deleted) or 'symlink' (a step_* link; never followed)."""
    token: str = ""
    """The save's random id for 'tmp' and 'trash' entries."""


def classify(path: str | os.PathLike) -> Entry | None:
    """The entry for one local directory, or None when the name is not a checkpoint's."""
    store = store_for(path)
    location = os.fspath(path)
    kind = ("link" if os.path.islink(location) else "dir" if os.path.isdir(location) else "file")
    return _classify(store, Item(location, store.name(location), kind))


def _classify(store: Store, item: Item) -> Entry | None:
    for regex, kind in ((STEP_RE, "complete"), (TMP_RE, "tmp"), (TRASH_RE, "trash")):
        match = regex.match(item.name)
        if not match:
            continue
        step, token = int(match.group(1)), (match.group(2) if regex is not STEP_RE else "")
        if item.kind == "link":
            return Entry(item.path, step, "symlink", token)
        if item.kind != "dir":
            return None
        if kind == "complete" and not store.exists(store.join(item.path, COMPLETE)):
            kind = "incomplete"
        return Entry(item.path, step, kind, token)
    return None


def scan(folder: str | os.PathLike) -> list[Entry]:
    """Every checkpoint-like directory in ``folder`` (a path or URL), oldest step first; [] when the folder does
    not exist. On an object store, the unpublished attempts inside each step are entries of kind 'tmp'."""
    store = store_for(folder)
    entries = [entry for item in store.list(os.fspath(folder)) if (entry := _classify(store, item)) is not None]
    if store.kind == "object":
        entries += [attempt for entry in entries if entry.kind in ("complete", "incomplete")
                    for attempt in _unpublished_attempts(store, entry)]
    return sorted(entries, key=lambda e: (e.step, e.kind, e.path))


def _unpublished_attempts(store: Store, entry: Entry) -> list[Entry]:
    """The attempts of a step directory that its COMPLETE does not name (all of them when it has none)."""
    published = None
    if entry.kind == "complete":
        try:
            published = attempt_named(store.read(store.join(entry.path, COMPLETE)))
        except (OSError, RuntimeError):  # unreadable or crafted: no attempt of this step is trusted
            published = None
    return [Entry(item.path, entry.step, "tmp", match.group(1)) for item in store.list(entry.path)
            if item.kind == "dir" and (match := ATTEMPT_RE.match(item.name)) and item.name != published]


def complete_steps(entries: list[Entry]) -> list[int]:
    return sorted(e.step for e in entries if e.kind == "complete")


def steps_to_keep(steps: list[int], *, keep_last: int, keep_every: int, protect: tuple[int, ...] = ()) -> set[int]:
    """Retention: the newest ``keep_last`` steps, every multiple of ``keep_every``, and ``protect``.

    The newest step is always kept, whatever keep_last says, so retention can never leave a folder with no
    complete checkpoint.
    """
    ordered = sorted(set(steps))
    keep = set(ordered[-max(1, keep_last):])
    if keep_every > 0:
        keep |= {s for s in ordered if s % keep_every == 0}
    keep |= {s for s in protect if s in ordered}
    return keep
