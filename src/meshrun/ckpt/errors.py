"""The exception type of the checkpoint package, and its usage-error kind."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, found or trusted. The first line names the path or rank and the fix."""

    def __init__(self, *args: object, same_on_every_rank: bool = False):
        super().__init__(*args)
        self.same_on_every_rank = same_on_every_rank
        """Every rank raises this same message (decided on rank 0 and broadcast, or from findings gathered from
        every rank): the first rank of each node says it for the node. Otherwise (the default) the rank that meets
        it says it: another rank may have met nothing, or only a peer's failure."""


class CheckpointPathError(CheckpointError):
    """The path given is not there, or is a file where a folder was expected: a usage error (``meshrun ckpt`` exits
    2 for it, as for any other wrong command line), not a checkpoint that failed a check (exit 1)."""
