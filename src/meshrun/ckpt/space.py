"""Disk space and a save: refuse early when the folder cannot hold the checkpoint, and turn a disk-full failure
into one line that says so.

A full disk shows up in DCP as a ``CheckpointException`` (a ``BaseException``, so ``except Exception`` misses it)
wrapping either ``OSError(ENOSPC)`` or, from the zip writer inside ``torch.save``, a bare RuntimeError such as
``[enforce fail at inline_container.cc:672] unexpected pos 704 vs 598``. On an object store there is no free space
to check; a failure there is described by the store (unreachable endpoint, missing credentials).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import CheckpointException

from meshrun.ckpt.state import walk
from meshrun.ckpt.storage import store_for


def payload_bytes(tree: dict[str, Any]) -> int:
    """Bytes of tensor data a save of ``tree`` writes over all ranks: each global tensor once (a DTensor's numel
    is its global size; plain tensors are replicated and DCP writes one copy). File overhead is not counted."""
    return sum(leaf.numel() * leaf.element_size() for _, leaf in walk(tree) if isinstance(leaf, torch.Tensor))


def free_bytes(folder: Path | str) -> int | None:
    """Free bytes on the file system of ``folder`` (for an unprivileged user), or None where it cannot be known or
    has no meaning (object stores)."""
    return store_for(folder).free_bytes(os.fspath(folder))


def no_space_message(folder: Path | str, needed: int, free: int | None) -> str:
    free_text = "an unknown amount" if free is None else f"{free:,} bytes"
    return (f"no space left on {folder}: {needed:,} bytes needed, {free_text} free; free some space there, lower "
            "checkpoint.keep_last, or set checkpoint.dir to a larger file system")


def check_room(folder: Path | str, needed: int) -> str | None:
    """The no-space message when ``folder`` has less than ``needed`` bytes free, else None (also when unknown)."""
    free = free_bytes(folder)
    return no_space_message(folder, needed, free) if free is not None and free < needed else None


def describe_failure(exc: BaseException, folder: Path | str, needed: int) -> str:
    """One line for a failed write: the no-space message when the disk is full (ENOSPC anywhere in the failure,
    or less free space than the save needs, as after a zip writer's 'unexpected pos'), the store's line for an
    unreachable object store or missing credentials, else each rank's error."""
    store_line = store_for(folder).describe_error(exc, os.fspath(folder))
    if store_line:
        return store_line
    causes = _causes(exc)
    full = any(isinstance(c, OSError) and c.errno == errno.ENOSPC for c in causes)
    free = free_bytes(folder)
    if full or (free is not None and free < needed):
        return no_space_message(folder, needed, free)
    if isinstance(exc, CheckpointException):
        return "; ".join(f"rank {rank}: {_first_line(pair[0])}" for rank, pair in sorted(exc.failures.items()))
    return _first_line(exc)


def _causes(exc: BaseException) -> list[BaseException]:
    """``exc``, the per-rank failures of a CheckpointException, and their causes and contexts."""
    seen: list[BaseException] = []
    todo = [exc]
    while todo:
        current = todo.pop()
        if current is None or any(current is s for s in seen):
            continue
        seen.append(current)
        if isinstance(current, CheckpointException):
            todo.extend(pair[0] if isinstance(pair, tuple) else pair for pair in current.failures.values())
        todo.extend((current.__cause__, current.__context__))
    return seen


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
