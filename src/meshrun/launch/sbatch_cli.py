"""``meshrun slurm [options] TARGET [args]``: write (``--submit``: and submit) the sbatch script of a job.

Exit codes: 0 written, printed or submitted; 2 the request does not fit the job (the message names the option);
1 sbatch refused the script (its message is shown).
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from meshrun.help_format import PlainHelpFormatter
from meshrun.launch.sbatch import MODES, SbatchError, SbatchRequest, build_script

EPILOG = """TARGET is one of
  train [--section.key=value ...]   meshrun's trainer (its layout and batch are checked before submitting)
  script.py [args]                  a torchrun-style script
  -m module [args]                  a module, as with python -m

examples:
  meshrun slurm --nodes 2 --gpus-per-node 4 --time 4:00:00 --dry-run train --config job.toml
  meshrun slurm --nodes 2 --gpus-per-node 8 --partition gpu --submit train --config job.toml
  meshrun slurm --nodes 4 --gpus-per-node 8 --mode per-gpu --submit -m my_pkg.train --lr 3e-4
See docs/slurm.md."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="meshrun slurm", epilog=EPILOG,
                                formatter_class=PlainHelpFormatter, description="Write an sbatch script for a meshrun job; --submit also submits it.")
    p.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    p.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node (default 0: a CPU job)")
    p.add_argument("--procs-per-node", type=int, default=0,
                   help="workers per node (default: one per GPU, or 1 on a CPU job)")
    p.add_argument("--cpus-per-task", type=int, default=0,
                   help="CPUs per Slurm task (default: 4 per worker, and a task holds all of a node's workers in "
                        "per-node mode; Slurm's own default is 1)")
    p.add_argument("--time", default="", help="time limit: 30 (minutes), 4:00:00, 1-12:00:00 (default: partition's)")
    p.add_argument("--partition", default="")
    p.add_argument("--account", default="")
    p.add_argument("--job-name", default="meshrun")
    p.add_argument("--output", default="slurm-%j.out", help="log file, appended to across requeues")
    p.add_argument("--mode", choices=MODES, default="per-node",
                   help="per-node: srun one `meshrun launch` per node (default); per-gpu: srun one task per worker")
    p.add_argument("--signal-lead", type=int, default=120, metavar="S",
                   help="SIGUSR1 to every task S seconds before the time limit, to save a checkpoint (0: none)")
    p.add_argument("--no-requeue", action="store_true", help="do not requeue after a stop on a signal")
    p.add_argument("--sbatch", action="append", default=[], metavar="OPTION",
                   help="an extra #SBATCH option, e.g. --sbatch=--qos=high (repeatable)")
    p.add_argument("--script", default="", help="where to write the script (default: <job-name>.sbatch)")
    p.add_argument("--dry-run", action="store_true", help="print the script; write and submit nothing")
    p.add_argument("--submit", action="store_true", help="write the script and submit it with sbatch")
    p.add_argument("-m", "--module", action="store_true", help="TARGET is a module (python -m)")
    p.add_argument("target", help="train, a script, or a module with -m")
    p.add_argument("target_args", nargs=argparse.REMAINDER)
    return p


def request_from_args(args: argparse.Namespace) -> SbatchRequest:
    target = ("-m", args.target) if args.module else (args.target,)
    return SbatchRequest(target=(*target, *args.target_args), nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                         procs_per_node=args.procs_per_node, cpus_per_task=args.cpus_per_task, time=args.time,
                         partition=args.partition, account=args.account, job_name=args.job_name, output=args.output,
                         mode=args.mode, signal_lead_s=args.signal_lead, requeue=not args.no_requeue,
                         extra=tuple(args.sbatch))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    request = request_from_args(args)
    try:
        script = build_script(request, command_line=shlex.join(["meshrun", "slurm", *argv]))
    except SbatchError as exc:
        print(f"meshrun slurm: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(script, end="")
        return 0
    path = Path(args.script or f"{request.job_name}.sbatch")
    path.write_text(script)
    print(f"meshrun slurm: wrote {path} ({request.nodes} node(s) x {request.workers_per_node} worker(s) = world size "
          f"{request.world_size}, {request.mode})", file=sys.stderr)
    return submit(path) if args.submit else 0


def submit(path: Path) -> int:
    """``sbatch PATH``; prints sbatch's answer (the job id). Returns 1 when sbatch is missing or refuses."""
    if shutil.which("sbatch") is None:
        print(f"meshrun slurm: sbatch is not installed here; submit {path} from a Slurm login node.", file=sys.stderr)
        return 1
    done = subprocess.run(["sbatch", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        print(f"meshrun slurm: sbatch refused {path}: {done.stderr.strip()}", file=sys.stderr)
        return 1
    print(done.stdout.strip())
    return 0
