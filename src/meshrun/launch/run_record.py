"""What a launcher leaves in the run folder after a second Ctrl-C killed its workers.

Workers killed with SIGKILL write no ``summary.json``, and without one ``meshrun runs`` lists the run as running
for 10 minutes, then as failed. The launcher of a ``train`` target reads run.dir from the workers' own command
line and writes the summary in their place, unless a process of this launch already wrote one (rank 0 that
finished its stop just before the second Ctrl-C came). It also tells whether the workers had published their
stop checkpoint, so that the launcher's last line says what was kept.

Single process, no process group; reads and writes the local run folder only (a run folder on another node's
disk is that node's launcher's to write).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshrun.launch.args import Target

if TYPE_CHECKING:
    from meshrun.config import JobConfig


@dataclass(frozen=True)
class KilledRun:
    """What the run folder says after a second Ctrl-C."""

    run_dir: Path | None
    """run.dir of a ``train`` target when this node holds its metrics.jsonl; None otherwise (nothing to read)."""
    stop_checkpoint: int | None = None
    """The step of the final checkpoint the workers published during this launch (their stop save), if any."""
    last_step: int | None = None
    """The last step rank 0 logged."""
    newest_checkpoint: int | None = None
    """The newest complete checkpoint: where the same command resumes."""
    summary_written: bool = False
    """True when this call wrote summary.json; False when a worker of this launch had written it already."""

    def outcome(self) -> str:
        """The end of the launcher's last line: what the second Ctrl-C stopped, and what was kept."""
        if self.stop_checkpoint is not None:
            return (f"stopped at once by a second Ctrl-C, after the workers had published the checkpoint of step "
                    f"{self.stop_checkpoint}")
        if self.run_dir is None:
            return "stopped at once by a second Ctrl-C (workers killed; a save still under way is not kept)"
        kept = (f"the newest complete one is step {self.newest_checkpoint}" if self.newest_checkpoint is not None
                else "none was saved")
        return f"stopped at once by a second Ctrl-C (no checkpoint of step {self.last_step or 0}; {kept})"


@dataclass(frozen=True)
class TrainFolders:
    """Where a ``train`` target's workers write."""

    run_dir: Path
    checkpoints: str
    """checkpoint.dir, or <run.dir>/checkpoints when it is empty (a path or an object-store URL)."""


def train_folders(target: Target) -> TrainFolders | None:
    """run.dir and the checkpoint folder of a ``meshrun train`` target, resolved from its --config and
    --section.key options as the workers resolve them; None for other targets, or for a command line the workers
    refuse themselves."""
    if target.kind != "meshrun" or target.name != "train":
        return None
    job = _train_config(list(target.args))
    if job is None:
        return None
    run_dir = Path(job.run.dir)
    return TrainFolders(run_dir=run_dir, checkpoints=job.checkpoint.dir or str(run_dir / "checkpoints"))


def _train_config(args: list[str]) -> JobConfig | None:
    """The job the workers load from ``meshrun train``'s command line, read by train's own parser; None where it
    refuses the line (the workers refused it too)."""
    import contextlib
    import io

    from meshrun.config_checks import ConfigError
    from meshrun.config_load import load_config
    from meshrun.train.cli import parse_args

    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            flags, overrides = parse_args(args)  # argparse's refusals: said already by the workers
        return load_config(flags.config, overrides)
    except (ConfigError, OSError, ValueError, SystemExit):
        return None


def record_killed_run(folders: TrainFolders | None, *, since: float) -> KilledRun:
    """After a second Ctrl-C: write ``summary.json`` in the run folder unless a process of this launch (started at
    wall-clock time ``since``) wrote one, and return what the folder says. Nothing is written where the run folder
    holds no metrics.jsonl (another target, a run that never started, or rank 0 on another node's disk), and a
    folder that cannot be read counts as none: the launcher's last line must come out whatever the disk does."""
    try:
        return _record(folders, since=since)
    except OSError:
        return KilledRun(run_dir=None)


def _record(folders: TrainFolders | None, *, since: float) -> KilledRun:
    from meshrun.train.runlog import METRICS_FILE, read_records, read_summary
    from meshrun.train.summary import INTERRUPTED, STOPPED, compute_summary, write_summary

    if folders is None or not (folders.run_dir / METRICS_FILE).is_file():
        return KilledRun(run_dir=None)
    records = read_records(folders.run_dir)
    numbers = compute_summary(records)
    newest = newest_complete(folders.checkpoints, recorded=numbers["last_checkpoint_step"])
    found = KilledRun(run_dir=folders.run_dir, stop_checkpoint=stop_checkpoint(records, since=since),
                      last_step=numbers["steps"], newest_checkpoint=newest)
    written = read_summary(folders.run_dir)
    if written is not None and written.get("time", 0.0) >= since:  # rank 0 ended first and said how itself
        return found
    if found.stop_checkpoint is not None:
        status, reason = STOPPED, (f"stopped by SIGINT at step {found.stop_checkpoint}; a second Ctrl-C then "
                                   "killed the workers before they exited")
    else:
        kept = f"newest checkpoint step {newest}" if newest is not None else "no checkpoint"
        status, reason = INTERRUPTED, (f"stopped at once by a second Ctrl-C at step {numbers['steps']} (no "
                                       f"checkpoint of that step; {kept})")
    try:
        write_summary(folders.run_dir, exit_reason=reason, status=status,
                      known={"last_checkpoint_step": newest})
    except OSError:
        return found  # the launcher's line still says how the run ended
    return replace(found, summary_written=True)


def newest_complete(folder: str, *, recorded: int | None) -> int | None:
    """The newest complete checkpoint in a local checkpoint folder (an async save that was killed recorded its step
    when it was staged, yet never published it); ``recorded`` (metrics.jsonl's) for an object store, or a folder
    this node cannot list."""
    from meshrun.ckpt.folder import complete_steps, scan
    from meshrun.ckpt.storage import is_url

    if is_url(folder) or not Path(folder).is_dir():
        return recorded
    steps = complete_steps(scan(folder))
    return steps[-1] if steps else None


def stop_checkpoint(records: list[dict[str, Any]], *, since: float) -> int | None:
    """The step of the newest final checkpoint recorded at or after wall-clock time ``since``. A final save is
    synchronous, so its record means the checkpoint was published (an async save records when it is staged)."""
    from meshrun.train.runlog import of_kind

    saved = [r["step"] for r in of_kind(records, "checkpoint")
             if r.get("final") and r.get("time", 0.0) >= since and isinstance(r.get("step"), int)]
    return saved[-1] if saved else None
