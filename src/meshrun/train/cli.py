"""``meshrun train``: the main job. Parses options, then hands over to the Trainer."""

from __future__ import annotations

import argparse
import sys
import traceback

from meshrun.config import ConfigError, join_overrides, load_config

EPILOG = """\
Options are set as --section.key=value (or --section.key value), on top of an optional TOML file, e.g.
  meshrun train --model.name=tiny --train.steps=100 --train.global_batch=64
  meshrun launch --nproc-per-node 2 train --config job.toml --train.micro_batch=4
Sections: model, data, train, parallel, dist, checkpoint, health, run, replicas (see docs/config.md).
"""


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="meshrun train", description="Train the reference model.",
                                     epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="TOML file with [section] tables")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config as TOML and exit")
    parser.add_argument("--dry-run", action="store_true",
                        help="build the mesh and apply the layout with a fake process group, then exit")
    parser.add_argument("--world-size", type=int, default=0, help="with --dry-run: the world size to check")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="with --dry-run: GPUs per node")
    parser.add_argument("--profile", action="store_true",
                        help="record steps 10-12 (the last 3 of a shorter run) with the torch profiler: "
                        "--run.profile_steps=10-12 unless that is set; on --run.profile_ranks (default 0); traces "
                        "and op tables go to <run.dir>/profile (docs/training.md)")
    args, rest = parser.parse_known_args(argv)
    return args, join_overrides(rest, command="meshrun train")


def default_profile_steps(total_steps: int) -> str:
    """--profile's window: steps 10-12, after the first steps' compilation and allocator warm-up; on a shorter run,
    its last three steps."""
    last = min(12, total_steps)
    return f"{max(1, last - 2)}-{last}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args, overrides = parse_args(argv)
        job = load_config(args.config, overrides)
        if args.profile and not job.run.profile_steps:
            job.run.profile_steps = default_profile_steps(job.train.steps)
    except ConfigError as exc:
        if _first_of_the_step():
            print(f"meshrun train: error: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        print(job.to_toml())
        return 0
    if args.dry_run:
        from meshrun.parallel.dryrun import dry_run

        return dry_run(job, world_size=args.world_size, gpus_per_node=args.gpus_per_node)
    return run(job)


def _first_of_the_step() -> bool:
    """Every task of `srun meshrun train ...` reads the same command line, so a command-line refusal is the same on
    all of them: rank 0 says it once (any process whose layout cannot be read says it too)."""
    from meshrun.env import ClusterEnv

    try:
        return ClusterEnv.detect().is_rank_zero
    except ValueError:
        return True


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _where(trainer) -> str:
    """'rank 3 (host b) at step 41: ' once the trainer exists; empty before."""
    if trainer is None:
        return ""
    import socket

    return f"rank {trainer.env.rank} ({socket.gethostname()}) at step {trainer.step}: "


def _is_peer_failure(exc: BaseException) -> bool:
    text = f"{type(exc).__name__} {exc}".lower()
    return any(word in text for word in ("connection closed", "connection reset", "broken pipe", "nccl", "gloo",
                                         "timed out", "distbackenderror", "distnetworkerror"))


def _stopped(trainer, result) -> int:
    """A run stopped early by SIGTERM/SIGUSR1 (after its final checkpoint) is not a finished run: one line on
    rank 0, and EXIT_PREEMPTED (143) on every rank so that schedulers and scripts can tell (and requeue)."""
    from meshrun.ckpt.preemption import EXIT_PREEMPTED

    if trainer.env.is_rank_zero:
        print(f"meshrun train: stopped at step {result.step} of {trainer.job.train.steps} by {result.stopped_by}; "
              f"checkpoint in {trainer.ckpt.folder}; exit code {EXIT_PREEMPTED}; run the same command to resume",
              file=sys.stderr, flush=True)
    return EXIT_PREEMPTED


def run(job) -> int:
    from meshrun.comm.process_group import shutdown
    from meshrun.placement import PlacementError
    from meshrun.train.nonfinite import NonFiniteError
    from meshrun.train.trainer import Trainer

    trainer, ending = None, ("failed", "interrupted")
    try:
        trainer = Trainer(job)
        result = trainer.fit()
        if result.stopped_by:
            ending = ("stopped early", f"stopped by {result.stopped_by} at step {result.step}")
            return _stopped(trainer, result)
        ending = ("finished", f"reached train.steps={job.train.steps}")
        return 0
    except (ConfigError, PlacementError) as exc:  # the message names the option or variable and the fix
        print(f"meshrun train: error: {exc}", file=sys.stderr)
        ending = ("failed", _first_line(exc))
        return 2
    except NonFiniteError as exc:  # the message says it all; no traceback
        print(f"meshrun train: error: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - one clear line first, then the traceback
        ending = ("failed", f"{_where(trainer)}{_first_line(exc)}")
        print(f"meshrun train: error: {ending[1]}", file=sys.stderr)
        if trainer is not None and _is_peer_failure(exc):
            print("  a collective failed: another rank probably died or was killed first; the launcher's "
                  "'Root Cause' lines name it, and <run.dir>/logs/rank_*.log hold each rank's last steps",
                  file=sys.stderr)
        traceback.print_exc()
        return 1
    finally:
        if trainer is not None:
            trainer.close()
            _write_summary(trainer, *ending)
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
