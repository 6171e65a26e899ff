"""The one exception type of the checkpoint package."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, found or trusted. The first line names the path or rank and the fix."""
