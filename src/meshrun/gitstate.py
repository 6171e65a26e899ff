"""Which commit a folder's code is at, and whether it differs from it: the one git probe of meshrun.

The rule for "dirty": tracked files, staged or not, differ from HEAD (``git diff HEAD``); untracked files do not
count. Used by the checkpoint manifest (git_commit, git_dirty) and by the cross-node code fingerprint."""

from __future__ import annotations

import hashlib
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class GitState:
    commit: str
    """Full commit hash of HEAD."""
    diff: str | None
    """``git diff HEAD`` of the tracked files; None when it could not be read."""

    @property
    def dirty(self) -> bool | None:
        """Tracked files differ from HEAD; None when unknown."""
        return None if self.diff is None else bool(self.diff.strip())

    def describe(self) -> str:
        """'<commit>' or '<commit> +dirty <diff hash>' (12 and 8 hex digits)."""
        if self.dirty is None:
            return f"{self.commit[:12]} +dirty (diff not hashed)"
        if not self.dirty:
            return self.commit[:12]
        return f"{self.commit[:12]} +dirty {hashlib.sha256(self.diff.encode()).hexdigest()[:8]}"


def git_state(folder: Path) -> GitState | None:
    """HEAD and the tracked diff of ``folder``'s repository; None outside a repository or without git.

    Blocks for up to two git calls of at most 10 s each."""
    commit = _git(folder, "rev-parse", "HEAD")
    if not commit:
        return None
    return GitState(commit=commit, diff=_git(folder, "diff", "HEAD", "--no-ext-diff"))


def _git(folder: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None
