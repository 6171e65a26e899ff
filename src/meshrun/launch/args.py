"""Command line of ``meshrun launch``: torchrun's own parser plus the few options meshrun adds.

Every torchrun flag keeps working in both spellings (``--nproc_per_node`` and ``--nproc-per-node``) because the
parser *is* torchrun's (:func:`torch.distributed.run.get_args_parser`); meshrun only adds its options and works out
which flags the user typed, so that a default never overrides a decision (torch 2.8 gives ``--master-port`` a
default of 29500, so "given" cannot be read off the value).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from torch.distributed.run import get_args_parser

from meshrun.help_format import PlainHelpFormatter
from meshrun.launch.exit_barrier import DEFAULT_TIMEOUT_S as DEFAULT_EXIT_BARRIER_TIMEOUT_S
from meshrun.placement import load_environment

DEFAULT_RDZV_TIMEOUT_S = 120
"""Rendezvous join timeout. torchrun's own default (600 s) is far too long to wait for a typo in an address."""

WORKER_COMMANDS = ("train", "bench", "doctor")
"""meshrun commands that run on every worker: the bare word runs ``python -m meshrun <command> ...``. (Listed here
rather than read from meshrun.cli, which sits above the launcher.)"""

USAGE = """meshrun launch [torchrun options] [meshrun options] TARGET [target args]

TARGET is one of
  train [--section.key=value ...]   meshrun's trainer (python -m meshrun train ...)
  bench ... | doctor ...            the other meshrun commands that run on every worker
  script.py [args]                  any torchrun-style script, unchanged
  -m module [args]                  a module, as with python -m
  --no-python program [args]        a program that is not Python"""


class LaunchUsageError(ValueError):
    """A wrong command line. The message's first line names the option and the fix."""


@dataclass(frozen=True)
class Target:
    """What every worker runs."""

    kind: str
    """'meshrun' (a meshrun command), 'script', 'module' or 'program'."""
    name: str
    """The script path, module, program or meshrun command as the user wrote it."""
    args: tuple[str, ...]
    """Arguments after the target."""

    def describe(self) -> str:
        shown = " ".join((self.name, *self.args))
        label = self.kind
        return f"{label} {shown}" if len(shown) <= 100 else f"{label} {shown[:97]}..."


@dataclass
class LaunchArgs:
    """The parsed command line: torchrun's namespace, the flags typed explicitly, and the target."""

    ns: argparse.Namespace
    """torchrun's namespace (plus meshrun's options); the launcher edits it before handing it to torch."""
    given: frozenset[str]
    """Destinations of the options the user typed (e.g. 'master_port'), whatever their value."""
    target: Target
    """What the workers run."""
    option_tokens: tuple[str, ...]
    """The argv tokens before the target (used to re-launch agents for --simulate-nodes)."""


def build_parser() -> argparse.ArgumentParser:
    """torchrun's parser with meshrun's options added."""
    parser = get_args_parser()
    parser.prog = "meshrun launch"
    parser.usage = USAGE
    parser.formatter_class = PlainHelpFormatter  # torch's help texts carry reStructuredText
    parser.description = ("Start workers like torchrun (same flags, same worker environment), with the network "
                          "worked out for you. See docs/launch.md.")
    group = parser.add_argument_group("meshrun")
    group.add_argument("--rdzv-timeout", "--rdzv_timeout", type=int, default=DEFAULT_RDZV_TIMEOUT_S,
                       help="Seconds to wait for the endpoint to be reachable and for all nodes to join "
                            f"(c10d join_timeout; default {DEFAULT_RDZV_TIMEOUT_S}).")
    group.add_argument("--exit-barrier-timeout", "--exit_barrier_timeout", metavar="SECONDS",
                       default=str(DEFAULT_EXIT_BARRIER_TIMEOUT_S),  # a string: checked by parse_launch_args
                       help="Once this node's workers finished, how long its launcher waits for the other nodes' "
                            "launchers before it exits (torch's exit barrier; default "
                            f"{DEFAULT_EXIT_BARRIER_TIMEOUT_S:g}). It stops sooner when the missing launchers' "
                            "heartbeats to the c10d rendezvous stopped.")
    group.add_argument("--simulate-nodes", "--simulate_nodes", type=int, default=0, metavar="K",
                       help="Rehearse a K-node job on this machine: K elastic agents joined by a c10d rendezvous "
                            "on loopback.")
    group.add_argument("--environment", metavar="MODULE:CLASS",
                       help="Load your cluster environment (a meshrun.ClusterEnvironment subclass, e.g. "
                            "my_envs:LSFEnvironment) on this launcher and every worker; the same as exporting "
                            "MESHRUN_ENVIRONMENT. See docs/launch.md, \"Other schedulers\".")
    group.add_argument("--dry-run", "--dry_run", action="store_true",
                       help="Print what would be decided and exit without starting anything.")
    return parser


def parse_launch_args(argv: list[str]) -> LaunchArgs:
    """Parse ``meshrun launch`` arguments; raise :class:`LaunchUsageError` for values torch would reject late."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    given = _given_options(argv)
    parse_nnodes(ns.nnodes)
    nproc = str(ns.nproc_per_node).strip()
    if nproc.lstrip("+-").isdecimal() and int(nproc) < 1:
        raise LaunchUsageError(f"--nproc-per-node {ns.nproc_per_node}: give 1 or more workers per node, or auto, gpu "
                               "or cpu.")
    if ns.max_restarts < 0:
        raise LaunchUsageError(f"--max-restarts {ns.max_restarts}: must be 0 or more.")
    if ns.rdzv_timeout <= 0:
        raise LaunchUsageError(f"--rdzv-timeout {ns.rdzv_timeout}: must be a positive number of seconds.")
    ns.exit_barrier_timeout = parse_exit_barrier_timeout(ns.exit_barrier_timeout)
    if ns.simulate_nodes < 0 or ns.simulate_nodes == 1:
        raise LaunchUsageError(f"--simulate-nodes {ns.simulate_nodes}: give 2 or more nodes to rehearse "
                               "(leave it out for a single-node job).")
    check_numa_binding(getattr(ns, "numa_binding", None), nproc)
    if ns.environment:
        try:
            load_environment(ns.environment, option="--environment")
        except ValueError as exc:
            raise LaunchUsageError(str(exc)) from None
    tail = 1 + len(ns.training_script_args)
    return LaunchArgs(ns=ns, given=given, target=detect_target(ns), option_tokens=tuple(argv[:len(argv) - tail]))


def parse_exit_barrier_timeout(value: str) -> float:
    """'300' -> 300.0. Raise naming --exit-barrier-timeout unless it is a number of seconds, 0 or more."""
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):  # also refuses nan
        raise LaunchUsageError(f"--exit-barrier-timeout {value!r}: give a number of seconds, 0 or more (how long a "
                               "node whose workers finished waits for the other nodes' launchers; default "
                               f"{DEFAULT_EXIT_BARRIER_TIMEOUT_S:g}, 0 does not wait).")
    return seconds


def check_numa_binding(mode: str | None, nproc: str, *, gpus: int | None = None) -> None:
    """torchrun's ``--numa-binding`` (torch 2.9 and newer) binds worker i to the CPUs near GPU i, and fails deep in
    torch where there is no such GPU: refuse that here, naming the option. ``gpus``: this node's CUDA GPUs (counted
    when None)."""
    if not mode:
        return
    if gpus is None:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        raise LaunchUsageError(f"--numa-binding {mode}: binds each worker to the CPUs near its GPU, and this node "
                               "has no CUDA GPU; drop --numa-binding (CPU workers are spread by the OS)")
    if nproc.isdecimal() and int(nproc) > gpus:
        raise LaunchUsageError(f"--numa-binding {mode}: worker i is bound near GPU i, and this node has {gpus} GPU(s) "
                               f"for --nproc-per-node {nproc}; give --nproc-per-node {gpus} or fewer, or drop "
                               "--numa-binding")


def _given_options(argv: list[str]) -> frozenset[str]:
    """Destinations of the options present in ``argv``: parse again with every default suppressed."""
    parser = build_parser()
    for action in parser._actions:  # argparse has no public way to list actions
        if action.option_strings:
            action.default = argparse.SUPPRESS
    ns = parser.parse_args(argv)
    return frozenset(vars(ns)) - {"training_script", "training_script_args"}


def parse_nnodes(value: str) -> tuple[int, int]:
    """'2' -> (2, 2); '1:4' -> (1, 4). Raise naming --nnodes when malformed."""
    parts = value.split(":")
    try:
        low, high = (int(parts[0]), int(parts[0])) if len(parts) == 1 else (int(parts[0]), int(parts[1]))
    except (ValueError, IndexError):
        raise LaunchUsageError(f"--nnodes {value!r}: give a number of nodes (2) or a range MIN:MAX (1:4).") from None
    if len(parts) > 2 or not 0 < low <= high:
        raise LaunchUsageError(f"--nnodes {value!r}: give N >= 1, or MIN:MAX with 1 <= MIN <= MAX.")
    return low, high


def detect_target(ns: argparse.Namespace) -> Target:
    """Classify what the workers run. The bare word ``train`` means meshrun's trainer (write ./train for a file)."""
    name, args = ns.training_script, tuple(ns.training_script_args)
    if ns.module:
        return Target(kind="module", name=name, args=args)
    if ns.no_python:
        return Target(kind="program", name=name, args=args)
    if name in WORKER_COMMANDS:
        return Target(kind="meshrun", name=name, args=args)
    return Target(kind="script", name=name, args=args)


PLACEMENT_OPTIONS = frozenset({"nnodes", "nproc_per_node", "node_rank", "rdzv_backend", "rdzv_endpoint", "rdzv_id",
                               "rdzv_conf", "rdzv_timeout", "standalone", "max_restarts", "master_addr",
                               "master_port", "local_addr", "numa_binding", "simulate_nodes"})
"""Launch options (by destination) that say where and how many workers run: after a meshrun command they are a
misplaced launch option, not one of the command's (``--dry-run`` and ``--environment`` are not here: train takes a
``--dry-run`` of its own)."""


def check_target(target: Target) -> None:
    """Fail before starting agents when a script does not exist, when a launch option was put after a meshrun
    command, which would hand it to every worker (torchrun would start N workers that all fail), or when
    ``bench``'s own options cannot run."""
    if target.kind == "script" and not Path(target.name).is_file():
        raise LaunchUsageError(f"script {target.name!r} not found (cwd {Path.cwd()}); give a path to a Python "
                               f"file, `-m module`, or a meshrun command ({', '.join(WORKER_COMMANDS)}).")
    if target.kind == "meshrun":  # a user's script may take any option; meshrun's commands take none of these
        launch_options = {o for a in build_parser()._actions if a.dest in PLACEMENT_OPTIONS for o in a.option_strings}
        misplaced = [a for a in target.args if a.split("=", 1)[0] in launch_options]
        if misplaced:
            option = misplaced[0].split("=", 1)[0]
            raise LaunchUsageError(f"{option} comes after `{target.name}`, so it would go to every worker, not to the "
                                   f"launcher; put launch options before the command: meshrun launch {option} ... "
                                   f"{target.name} ...")
    bench_args = _bench_args(target)
    if bench_args is not None:  # refused once, here, rather than by every worker
        from meshrun.diag.bench import launch_usage_error

        problem = launch_usage_error(bench_args)
        if problem:
            raise LaunchUsageError(f"bench: {problem}")


def _bench_args(target: Target) -> list[str] | None:
    """The options of `meshrun bench` when the workers run it (``bench ...`` or ``-m meshrun bench ...``)."""
    if target.kind == "meshrun" and target.name == "bench":
        return list(target.args)
    if target.kind == "module" and target.name == "meshrun" and target.args[:1] == ("bench",):
        return list(target.args[1:])
    return None


def apply_target(ns: argparse.Namespace, target: Target) -> None:
    """Rewrite ``train ...`` into torchrun's form ``-m meshrun train ...``; other targets pass as they are."""
    if target.kind == "meshrun":
        ns.module = True
        ns.training_script = "meshrun"
        ns.training_script_args = [target.name, *target.args]
