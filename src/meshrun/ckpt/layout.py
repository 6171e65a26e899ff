"""How checkpoints lie in their folder, and which of them retention keeps.

    checkpoints/
      step_0001000/                 complete: DCP shards, .metadata, manifest.json, COMPLETE (written last)
      step_0002000/
      .step_0003000.tmp-1f2e3d4c/   being written (or abandoned by a killed job); never resumed
      .step_0000500.del-9a8b7c6d/   being deleted by retention

A directory appears under its final name only through an atomic rename of a finished temporary directory,
so a ``step_*`` directory holding ``COMPLETE`` is whole. Pure logic: no process group, no torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

STEP_RE = re.compile(r"^step_(\d+)$")
TMP_RE = re.compile(r"^\.step_(\d+)\.tmp-([0-9a-f]+)$")
TRASH_RE = re.compile(r"^\.step_(\d+)\.del-([0-9a-f]+)$")
MANIFEST = "manifest.json"
COMPLETE = "COMPLETE"


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

    path: Path
    step: int
    kind: str
    """'complete' (has COMPLETE), 'incomplete' (final name, no COMPLETE), 'tmp' (being written or abandoned),
    'trash' (being deleted) or 'symlink' (a step_* link; never followed)."""
    token: str = ""
    """The save's random id for 'tmp' and 'trash' entries."""


def classify(path: Path) -> Entry | None:
    """The entry for one directory, or None when the name is not a checkpoint's."""
    name = path.name
    for regex, kind in ((STEP_RE, "complete"), (TMP_RE, "tmp"), (TRASH_RE, "trash")):
        match = regex.match(name)
        if not match:
            continue
        step, token = int(match.group(1)), (match.group(2) if regex is not STEP_RE else "")
        if path.is_symlink():
            return Entry(path, step, "symlink", token)
        if not path.is_dir():
            return None
        if kind == "complete" and not (path / COMPLETE).is_file():
            kind = "incomplete"
        return Entry(path, step, kind, token)
    return None


def scan(folder: Path) -> list[Entry]:
    """Every checkpoint-like directory in ``folder``, oldest step first; [] when the folder does not exist."""
    if not folder.is_dir():
        return []
    entries = [entry for child in folder.iterdir() if (entry := classify(child)) is not None]
    return sorted(entries, key=lambda e: (e.step, e.kind, e.path.name))


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
