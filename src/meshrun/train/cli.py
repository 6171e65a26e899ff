"""``meshrun train``: the main job. Parses options, then hands over to the Trainer."""

from __future__ import annotations

import argparse
import sys
import traceback

from meshrun.config import ConfigError, JobConfig, join_overrides, load_config
from meshrun.help_format import PlainHelpFormatter

EPILOG = """\
Options are set as --section.key=value (or --section.key value), on top of an optional TOML file, e.g.
  meshrun train --model.name=tiny --train.steps=100 --train.global_batch=64
  meshrun launch --nproc-per-node 2 train --config job.toml --train.micro_batch=4
Every option is below, as --section.key=DEFAULT with its description (also in docs/config.md).
"""


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    epilog = EPILOG
    if {"-h", "--help"} & set(argv):  # the option list is read from the config classes' source: only for help
        from meshrun.config_help import options_help

        epilog += "\n" + options_help()
    parser = argparse.ArgumentParser(prog="meshrun train", description="Train the reference model.",
                                     epilog=epilog, formatter_class=PlainHelpFormatter)
    parser.add_argument("--config", help="TOML file with [section] tables")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config as TOML and exit")
    parser.add_argument("--fresh", action="store_true",
                        help="start a new run instead of resuming the one in run.dir, which is moved to "
                        "<run.dir>.N first (--run.fresh=true; docs/training.md)")
    parser.add_argument("--dry-run", action="store_true",
                        help="check the layout for --world-size ranks as a real start does (as `meshrun plan` "
                        "does), apply it with a fake process group, print each rank's shards, then exit")
    parser.add_argument("--world-size", type=int, help="with --dry-run only: the number of ranks to check")
    parser.add_argument("--gpus-per-node", type=int,
                        help="with --dry-run only: GPUs per node of the machine checked for (default 8; 0: CPU "
                        "processes)")
    parser.add_argument("--profile", action="store_true",
                        help="record steps 10-12 (the last 3 of a shorter run) with the torch profiler: "
                        "--run.profile_steps=10-12 unless that is set; on --run.profile_ranks (default 0); traces "
                        "and op tables go to <run.dir>/profile (docs/training.md)")
    args, rest = parser.parse_known_args(argv)
    flags = [flag for action in parser._actions for flag in action.option_strings if flag.startswith("--")]
    return args, join_overrides(rest, command="meshrun train", flags=flags)


def default_profile_steps(total_steps: int) -> str:
    """--profile's window: steps 10-12, after the first steps' compilation and allocator warm-up; on a shorter run,
    its last three steps."""
    last = min(12, total_steps)
    return f"{max(1, last - 2)}-{last}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args, overrides = parse_args(argv)
        refuse_dry_run_options(args)
        job = load_config(args.config, overrides)
        if args.fresh:
            job.run.fresh = True
        if args.profile and not job.run.profile_steps:
            job.run.profile_steps = default_profile_steps(job.train.steps)
        if args.print_config:
            job = _with_model_shape(job)
    except ConfigError as exc:
        speaks, launched = _first_of_the_step()
        if speaks:
            print(f"meshrun train: error: {exc}", file=sys.stderr, flush=True)
        elif launched:
            _outlast_the_node_leader(2)
        return 2
    if (args.print_config or args.dry_run) and not _first_of_the_step()[0]:
        return 0  # the same printout on every rank of a launch: each node's first rank prints it
    if args.print_config:
        print(job.to_toml())
        return 0
    if args.dry_run:
        from meshrun.parallel.dryrun import dry_run

        return dry_run(job, world_size=args.world_size or 0,
                       gpus_per_node=8 if args.gpus_per_node is None else args.gpus_per_node)
    return run(job)


def refuse_dry_run_options(args: argparse.Namespace) -> None:
    """--world-size and --gpus-per-node describe the machine a --dry-run checks for; a real run takes its world
    from the launcher, so there they would be ignored: refused, naming the fix."""
    if args.dry_run:
        return
    if args.world_size is not None:
        raise ConfigError(f"--world-size {args.world_size} sets the ranks a --dry-run checks, and this is a real run "
                          "(its ranks come from the launcher): add --dry-run, or start the ranks with `meshrun launch "
                          f"--nproc-per-node {max(args.world_size, 1)} train ...`")
    if args.gpus_per_node is not None:
        raise ConfigError(f"--gpus-per-node {args.gpus_per_node} describes the machine a --dry-run checks for, and "
                          "this is a real run (on this machine's GPUs): add --dry-run, or start one rank per GPU "
                          f"with `meshrun launch --nproc-per-node {max(args.gpus_per_node, 1)} train ...`")


def _with_model_shape(job: JobConfig) -> JobConfig:
    """``job`` with model.name's size written into the [model] fields left at 0, as the run's config.toml has them
    (a copy; raises ConfigError for a shape that does not fit together)."""
    import dataclasses

    from meshrun.models.build import model_shape, resolved_model

    return dataclasses.replace(job, model=resolved_model(job.model, model_shape(job)))


def _first_of_the_step() -> tuple[bool, bool]:
    """(whether this process says a command-line refusal, whether a launcher's agent started it). Every process reads
    the same command line, so the refusal is the same on all of them. Under a launcher (meshrun launch, torchrun)
    each node has a console of its own: the node's local rank 0 says it there. The tasks of `srun meshrun train ...`
    share srun's one output: rank 0 says it once. A process whose layout cannot be read says it too."""
    from meshrun.env import ProcessPlacement

    try:
        placement = ProcessPlacement.detect()
    except ValueError:
        return True, False
    if placement.source == "torchrun":
        return placement.local_rank == 0, True
    return placement.is_rank_zero, False


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _where(trainer) -> str:
    """'rank 3 (host b) at step 41: ' once the trainer exists; empty before."""
    if trainer is None:
        return ""
    import socket

    return f"rank {trainer.env.rank} ({socket.gethostname()}) at step {trainer.step}: "


def _stopping_signal(trainer) -> str | None:
    """The signal this rank was stopping for (SIGINT, SIGTERM, ...) when it failed; None when none had come."""
    flag = trainer.ckpt.preemption if trainer is not None else None
    return flag.signal_name if flag is not None and flag.is_set() else None


def _is_peer_failure(exc: BaseException) -> bool:
    text = f"{type(exc).__name__} {exc}".lower()
    return any(word in text for word in ("connection closed", "connection reset", "broken pipe", "nccl", "gloo",
                                         "timed out", "distbackenderror", "distnetworkerror"))


def _stopped(trainer, result) -> int:
    """A run stopped early by SIGTERM/SIGUSR1 or Ctrl-C (after its final checkpoint) is not a finished run: one
    line on rank 0, and EXIT_PREEMPTED (143), or 130 after Ctrl-C, on every rank so that schedulers and scripts can
    tell (and requeue)."""
    from meshrun.ckpt.preemption import exit_code, signal_label

    code = exit_code(result.stopped_by)
    if trainer.env.is_rank_zero:
        again = " without --fresh" if trainer.job.run.fresh else ""
        _say(f"meshrun train: stopped at step {result.step} of {trainer.job.train.steps} by {signal_label(result.stopped_by)}; "
             f"checkpoint in {trainer.ckpt.folder}; exit code {code}; run the same command{again} to resume")
    return code


def _say(line: str, rank: int = 0) -> None:
    """One line on stderr in one write (ranks writing at the same moment never glue their lines together); other
    ranks than 0 name themselves (once: a message that starts with its rank keeps it)."""
    named = f": error: rank {rank}: "
    text = line if rank == 0 or named in line else line.replace(": error: ", named, 1)
    sys.stderr.write(text.rstrip("\n") + "\n")  # one write of the whole line: stderr is line-buffered
    sys.stderr.flush()


def _rank(trainer) -> int:
    from meshrun.env import ProcessPlacement

    try:
        return trainer.env.rank if trainer is not None else ProcessPlacement.detect().rank
    except ValueError:
        return 0


def _local_rank(trainer) -> int:
    from meshrun.env import ProcessPlacement

    try:
        return trainer.env.local_rank if trainer is not None else ProcessPlacement.detect().local_rank
    except ValueError:
        return 0


NODE_LEADER_GRACE_S = 5.0
"""How long a rank that leaves its refusal to the node's local rank 0 stays before exiting (the launcher's agent
ends the wait sooner: see :func:`_outlast_the_node_leader`)."""


def _outlast_the_node_leader(code: int) -> None:
    """Stay until the node's local rank 0 has said the refusal this rank leaves to it, at most NODE_LEADER_GRACE_S.

    Before the trainer exists each rank reaches its refusal at its own pace (imports, the corpus), and torch's agent
    stops a node's other workers as soon as one exits: a quiet rank that left first could cut local rank 0 off
    before it printed, and the launcher would name the quiet rank's empty output. Here the agent's SIGTERM, sent
    once local rank 0 has exited, ends the wait, and this rank exits with ``code`` all the same; without an agent
    (srun) the wait runs out and the rank returns ``code``."""
    import signal
    import time

    try:
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(code))
    except ValueError:  # not the main thread: no signal could end the wait
        return
    try:
        time.sleep(NODE_LEADER_GRACE_S)
    except KeyboardInterrupt:  # Ctrl-C reached the whole node: local rank 0 has it too; leave with ``code``
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)


def _clean_error(exc: BaseException) -> tuple[str, int, bool] | None:
    """(line, exit code, every rank raises it alike) for the errors whose message says it all (no traceback helps),
    else None. Version checks and the non-finite verdict are agreed by all ranks, and so are the checkpoint errors
    decided on rank 0 or from gathered findings (``same_on_every_rank``, ckpt/errors.py) and a config refusal that
    reads no rank (``same_on_node``, train/plan.py): the first rank of each node says them once, so that every
    node's console holds the reason. Any other is said by the rank that raised it: its peers may have met nothing."""
    import errno

    from meshrun.ckpt.errors import CheckpointError
    from meshrun.diag.fingerprint import FingerprintMismatch
    from meshrun.placement import PlacementError
    from meshrun.train.nonfinite import NonFiniteError

    if isinstance(exc, (ConfigError, PlacementError)):  # the message names the option or variable and the fix
        return str(exc), 2, isinstance(exc, ConfigError) and exc.same_on_node
    if isinstance(exc, CheckpointError):
        return str(exc), 1, exc.same_on_every_rank
    if isinstance(exc, (NonFiniteError, FingerprintMismatch)):
        return str(exc), 1, True
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return (f"{exc.filename or 'a file'}: no space left on the device ({exc.strerror}); free space or choose "
                "another folder", 1, False)
    return None


def run(job) -> int:
    from pathlib import Path

    from meshrun.comm.process_group import shutdown
    from meshrun.train.run_folder import first_missing, remove_empty_folders
    from meshrun.train.trainer import Trainer

    trainer, ending = None, ("failed", "interrupted")
    created = first_missing(Path(job.run.dir))  # removed again (if still empty) when the run does not proceed
    try:
        trainer = Trainer(job)
        result = trainer.fit()
        if result.stopped_by:
            ending = ("stopped early", f"stopped by {result.stopped_by} at step {result.step}")
            return _stopped(trainer, result)
        ending = ("finished", f"reached train.steps={job.train.steps}")
        return 0
    except KeyboardInterrupt:  # Ctrl-C before the trainer watches for it (or with checkpoint.final off)
        if _rank(trainer) == 0:
            _say(f"meshrun train: interrupted by Ctrl-C{f' at step {trainer.step}' if trainer else ''} before a "
                 "checkpoint could be saved; exit code 130")
        return 130
    except Exception as exc:  # noqa: BLE001 - one clear line first, then (unless it says it all) the traceback
        clean = _clean_error(exc)
        ending = ("failed", f"{_where(trainer)}{_first_line(exc)}")
        rank = _rank(trainer)
        stopping = _stopping_signal(trainer)
        if stopping is not None and _is_peer_failure(exc):
            # A stop was under way here when a peer ended first, mid-collective: a second Ctrl-C reached the other
            # node's agent a moment earlier (or the peer was killed outright). The stop is the story, not a trace.
            from meshrun.ckpt.preemption import exit_code, signal_label

            code = exit_code(stopping)
            ending = ("stopped early", f"stopped by {stopping} at step {trainer.step}; another rank ended first")
            _say(f"meshrun train: {_where(trainer)}stopping for {signal_label(stopping)} when another rank ended "
                 f"first (no checkpoint of the current step); exit code {code}.")
            return code
        if clean is not None:
            line, code, agreed = clean
            if rank == 0 or not agreed or _local_rank(trainer) == 0:  # agreed: once per node, each node's console
                _say(f"meshrun train: error: {line}", 0 if agreed else rank)  # agreed: no rank of its own to name
            elif trainer is None:
                _outlast_the_node_leader(code)
            return code
        _say(f"meshrun train: error: {ending[1]}", rank)
        if trainer is not None and _is_peer_failure(exc):
            print("  a collective failed: another rank probably died or was killed first; the launcher's "
                  "'Root Cause' lines name it, and <run.dir>/logs/rank_*.log hold each rank's last steps",
                  file=sys.stderr)
        traceback.print_exc()
        return 1
    finally:
        if trainer is not None:
            trainer.close()
            if trainer.folder.opened:  # a run that never proceeded leaves its folder as it was
                _write_summary(trainer, *ending)
        if trainer is None or not trainer.folder.opened:  # ... and leaves no empty folder it created
            remove_empty_folders(created)
        shutdown()


def _write_summary(trainer, status: str, reason: str) -> None:
    """Rank 0 writes <run.dir>/summary.json; a failure to write it is reported, never raised over the run's own
    outcome."""
    if not trainer.env.is_rank_zero:
        return
    from meshrun.train.summary import write_summary

    try:
        write_summary(trainer.run_dir, exit_reason=reason, status=status)
    except OSError as exc:
        print(f"meshrun train: warning: could not write {trainer.run_dir / 'summary.json'}: {exc}", file=sys.stderr)
