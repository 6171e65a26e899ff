"""``meshrun`` command line: every command's entry, and nothing beyond dispatching to it.

Each command lives in its own module and exposes ``main(argv) -> int``; they are imported lazily so that
``meshrun plan`` does not pay for importing the trainer.
"""

from __future__ import annotations

import difflib
import importlib
import sys

COMMANDS = {
    "train": ("meshrun.train.cli", "train the reference model (or check a layout with --dry-run)"),
    "launch": ("meshrun.launch.cli", "start workers like torchrun, with the network worked out for you"),
    "lighthouse": ("meshrun.launch.lighthouse", "start the torchft lighthouse that joins replica groups (fault tolerance)"),
    "slurm": ("meshrun.launch.sbatch_cli", "write (and --submit) the sbatch script of a multi-node job"),
    "plan": ("meshrun.planner.cli", "offline: rank layout, groups, memory and traffic of a layout; time for a token budget"),
    "ckpt": ("meshrun.ckpt.cli", "list, verify and export checkpoints"),
    "doctor": ("meshrun.diag.doctor", "check nodes before training: network, versions, clocks, GPUs and their speed, storage, data"),
    "bench": ("meshrun.diag.bench",
              "measure collective bandwidth between workers (all-reduce, all-gather, ...), per group and per link"),
    "trace": ("meshrun.watch.step_trace", "where profiled steps' GPU time went: compute, exposed communication, idle"),
    "report": ("meshrun.report.cli", "HTML page and SVG plots of one or more runs: curves, per-rank heatmap, summary"),
    "runs": ("meshrun.report.runs", "one row per run directory: status, steps, loss, throughput, checkpoint"),
    "sample": ("meshrun.sample", "print what a checkpoint of the reference model writes after a prompt"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: meshrun <command> [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`meshrun <command> --help` describes each command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from meshrun import __version__

        print(f"meshrun {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        close = difflib.get_close_matches(command, list(COMMANDS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        print(f"meshrun: unknown command {command!r}{hint}; choose one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[command][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
