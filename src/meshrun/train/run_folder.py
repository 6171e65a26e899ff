"""``run.dir``: one run's record (config.toml, logs/, metrics.jsonl, summary.json, checkpoints/).

Nothing is written into the record until the run is known to proceed: an invocation refused at start (a bad option,
a resume refused for a changed model) or one with nothing to train leaves an earlier run's folder as it was. Until
then the rank logs are kept in memory; :meth:`RunFolder.open` writes them, with config.toml, once training starts.
Where run.dir did not exist, such an invocation removes the empty folders it created (:func:`remove_empty_folders`).

meshrun resumes by default (the same command continues after a preemption, a Slurm requeue or an elastic restart);
``run.fresh`` (``meshrun train --fresh``) starts a new run instead, moving an earlier run in ``run.dir`` aside to
``<run.dir>.N`` first, so that nothing is deleted.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import time
from pathlib import Path
from typing import Any, Callable

from meshrun.config import ConfigError, JobConfig
from meshrun.env import ProcessPlacement
from meshrun.train.console import ConsoleFormatter

RECORD_FILES = ("config.toml", "metrics.jsonl", "summary.json", "logs", "checkpoints", "tensorboard", "profile")
"""What marks a folder as holding a run (the files and folders a run writes)."""


class RunFolder:
    """``run.dir`` of this process: created if absent at start, its record written by :meth:`open` only."""

    def __init__(self, job: JobConfig, env: ProcessPlacement, *, path: Path | None = None):
        self.path = Path(job.run.dir) if path is None else path  # path: a replica group's own folder
        self.env = env
        self.opened = False
        self.moved_to: Path | None = None
        """Where ``run.fresh`` moved the earlier run (rank 0 only knows it); None when nothing was moved."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)  # an empty folder is not a record; it fails early here
        except OSError as exc:
            raise ConfigError(f"run.dir={job.run.dir!r}: cannot create {self.path} ({exc.strerror}); choose a folder "
                              "this user can write") from None
        self._buffer = _setup_logging(env)

    def holds_run(self) -> bool:
        """The folder holds an earlier run's record (a new run would mix with it)."""
        return any((self.path / name).exists() for name in RECORD_FILES)

    def move_aside(self) -> Path | None:
        """Rank 0 (``run.fresh``): rename an earlier run to the first free ``<run.dir>.N`` and leave an empty folder;
        None when the folder holds no run. A rename: nothing is copied or deleted."""
        if not self.env.is_rank_zero or not self.holds_run():
            return None
        number = 1
        while (aside := self.path.with_name(f"{self.path.name}.{number}")).exists():
            number += 1
        try:
            self.path.rename(aside)
            self.path.mkdir()
        except OSError as exc:
            raise ConfigError(f"run.fresh: cannot move the earlier run {self.path} to {aside} ({exc.strerror}); "
                              "choose a new --run.dir instead") from None
        self.moved_to = aside
        return aside

    def start_fresh(self, job: JobConfig, coord: Any) -> bool:
        """Collective (``coord``: the checkpointer's). With run.fresh on a first start: refuse a separate
        checkpoint.dir holding checkpoints, move an earlier run aside (rank 0), and return True: start anew. An
        elastic restart of a fresh run (restart count > 0) returns False: it resumes the new run."""
        if not job.run.fresh or self.env.restart_count > 0:
            return False
        from meshrun.ckpt.folder import complete_steps, scan

        conflict = fresh_conflict(job, self.path, lambda folder: complete_steps(scan(folder)))
        if conflict:
            raise ConfigError(conflict)
        self.move_aside()  # rank 0
        coord.barrier("run.fresh: moving the earlier run aside")
        return True

    def open(self, config_toml: str) -> None:
        """The run proceeds: logs/rank_N.log (with the lines logged so far) on every rank, config.toml on rank 0."""
        try:
            (self.path / "logs").mkdir(exist_ok=True)
            handler = logging.FileHandler(self.path / "logs" / f"rank_{self.env.rank:05d}.log")
        except OSError as exc:
            raise ConfigError(f"run.dir={str(self.path)!r}: cannot write {self.path / 'logs'} ({exc.strerror}); "
                              "choose a folder this user can write") from None
        handler.setFormatter(self._buffer.formatter)
        logger = logging.getLogger("meshrun")
        self._buffer.setTarget(handler)
        self._buffer.flush()
        logger.removeHandler(self._buffer)
        logger.addHandler(handler)
        self._buffer.close()
        if self.env.is_rank_zero:
            (self.path / "config.toml").write_text(config_toml)
        self.opened = True


def first_missing(path: Path) -> Path | None:
    """The outermost folder of ``path`` that does not exist yet (where creating ``path`` starts); None when it
    exists."""
    path, missing = path.absolute(), None
    while not path.exists() and path.parent != path:
        missing, path = path, path.parent
    return missing


def remove_empty_folders(top: Path | None) -> None:
    """Remove ``top`` and every folder under it that is empty, deepest first: what an invocation that never
    proceeded created (``top`` from :func:`first_missing` before it started). A file keeps its folders."""
    if top is None or not top.is_dir():
        return
    for folder, _, _ in os.walk(top, topdown=False):
        try:
            os.rmdir(folder)
        except OSError:
            pass  # not empty: another process (or this run) wrote there


def _setup_logging(env: ProcessPlacement) -> logging.handlers.MemoryHandler:
    """Rank 0 logs warnings to the console; every rank keeps its lines (with its rank) in memory until the run
    proceeds, then in logs/rank_XXXXX.log. Returns the in-memory buffer."""
    import torch.distributed as dist

    logger = logging.getLogger("meshrun")
    logger.setLevel(logging.INFO)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    fmt = logging.Formatter(f"%(asctime)s [rank {env.rank}] %(levelname)s %(message)s")
    buffer = logging.handlers.MemoryHandler(capacity=100_000, flushLevel=logging.CRITICAL + 1)
    buffer.setFormatter(fmt)
    logger.addHandler(buffer)
    logger.propagate = False
    if not dist.is_initialized() or env.is_rank_zero:
        console = logging.StreamHandler()
        console.setLevel(logging.WARNING)
        console.setFormatter(ConsoleFormatter())  # the format of the trainer's own printed warnings
        logger.addHandler(console)
    return buffer


def describe_resume(manifest: dict[str, Any] | None, *, run_dir: Path, moved_to: Path | None, where: str = "") -> str:
    """The header line that says which run this invocation continues (step, date, layout of its checkpoint), or that
    it starts a new one."""
    if manifest is None:
        moved = f"; the earlier run was moved to {moved_to}" if moved_to else ""
        return f"new run in {run_dir}{moved}"
    layout = manifest.get("layout") or {}
    degrees = " ".join(f"{k}={layout[k]}" for k in ("dp_replicate", "dp_shard", "tp", "pp") if layout.get(k, 1) > 1)
    created = manifest.get("created_unix")
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(created)) if created else "an unknown date"
    return (f"resumed at step {manifest['step']}{f' ({where})' if where else ''} of the run in {run_dir}, from its "
            f"checkpoint of {when} saved by {manifest.get('world_size')} rank(s){f' ({degrees})' if degrees else ''}; "
            "--fresh starts a new run instead")


def fresh_conflict(job: JobConfig, run_dir: Path, steps_in: Callable[[Path], list[int]]) -> str | None:
    """run.fresh with a checkpoint.dir outside run.dir that holds checkpoints: the new run would mix with them."""
    if not job.checkpoint.dir:
        return None
    folder = Path(job.checkpoint.dir)
    if folder.resolve().is_relative_to(run_dir.resolve()):
        return None
    steps = steps_in(folder) if folder.is_dir() else []
    if not steps:
        return None
    return (f"run.fresh: checkpoint.dir={job.checkpoint.dir} holds checkpoints up to step {steps[-1]} of an earlier "
            "run, outside run.dir (so not moved aside); give an empty --checkpoint.dir for the new run")
