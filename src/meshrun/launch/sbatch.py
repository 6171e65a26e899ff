"""``meshrun slurm``: the sbatch script for a multi-node job, checked against the job before it is submitted.

Two ways to start the workers, both on torch.distributed:

* per-node (default): ``srun`` starts one ``meshrun launch`` per node, which runs torch's elastic agent and its
  ``--nproc-per-node`` workers (the layout comes from SLURM, see docs/launch.md);
* per-GPU: ``srun`` starts one task per worker and each task runs the target directly (``ProcessPlacement`` reads
  ``SLURM_PROCID`` and the step's per-node counts).

The script ends a job at its time limit or at preemption with a checkpoint: ``--signal=USR1@LEAD`` (no ``B:``, so
every task gets it) makes each worker save and exit 143, after which the script requeues the job
(``--requeue``); the requeued job runs in the same folder and resumes from the newest checkpoint. A preemption's
SIGTERM is handled the same way. This module only writes text; :mod:`meshrun.launch.sbatch_cli` parses and submits.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from dataclasses import dataclass, field

from meshrun.config import ConfigError, JobConfig, load_config, resolve_batch
from meshrun.comm.mesh import ParallelDims
from meshrun.launch.args import WORKER_COMMANDS

MODES = ("per-node", "per-gpu")
CPUS_PER_WORKER = 4
"""CPUs per worker when --cpus-per-task is not given: its training process, and the agent's and data loader's share.
Slurm's own default is one CPU per task, which in per-node mode is one CPU for all of a node's workers."""
EXIT_STOPPED_BY_SIGNAL = 143
"""What a worker (and ``meshrun launch``) exits with after saving on SIGTERM/SIGUSR1 (docs/fault_tolerance.md)."""


class SbatchError(ValueError):
    """The request does not fit the job. The first line names the option, the values given and the fix."""


@dataclass(frozen=True)
class SbatchRequest:
    """What ``meshrun slurm`` was asked for."""

    target: tuple[str, ...]
    """What every worker runs: ('train', '--k=v', ...), ('script.py', ...) or ('-m', 'module', ...)."""
    nodes: int = 1
    """Nodes (#SBATCH --nodes)."""
    gpus_per_node: int = 0
    """GPUs per node (#SBATCH --gpus-per-node); 0 for a CPU job."""
    procs_per_node: int = 0
    """Workers per node; 0 means one per GPU (or 1 on a CPU job)."""
    cpus_per_task: int = 0
    """CPUs per Slurm task (#SBATCH --cpus-per-task); 0: CPUS_PER_WORKER per worker (see :func:`choose_cpus`)."""
    time: str = ""
    """Time limit in Slurm's format (MM, HH:MM:SS, D-HH:MM, ...); empty leaves the partition's default."""
    partition: str = ""
    account: str = ""
    job_name: str = "meshrun"
    output: str = "slurm-%j.out"
    """Log file; appended to, so a requeued job adds to the same file."""
    mode: str = "per-node"
    """per-node (one meshrun launch per node) or per-gpu (one srun task per worker)."""
    signal_lead_s: int = 120
    """Seconds before the time limit at which every task gets SIGUSR1 (0: no early signal, only the limit's SIGTERM)."""
    requeue: bool = True
    """Requeue the job after the workers stopped on a signal, so that it resumes from the checkpoint."""
    extra: tuple[str, ...] = field(default_factory=tuple)
    """Further #SBATCH options, as written after '#SBATCH ' (e.g. '--qos=high')."""

    @property
    def workers_per_node(self) -> int:
        return self.procs_per_node or self.gpus_per_node or 1

    @property
    def world_size(self) -> int:
        return self.nodes * self.workers_per_node


def time_limit_seconds(value: str) -> int:
    """Slurm's time formats in seconds: '30' (minutes), 'MM:SS', 'HH:MM:SS', 'D-HH', 'D-HH:MM', 'D-HH:MM:SS'."""
    match = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", value.strip())
    if not match:
        raise SbatchError(f"--time {value!r}: use Slurm's format, e.g. 30 (minutes), 4:00:00 or 1-12:00:00.")
    days, first, second, third = (int(g) if g is not None else None for g in match.groups())
    if days is not None:  # D-HH[:MM[:SS]]
        return ((days * 24 + first) * 60 + (second or 0)) * 60 + (third or 0)
    if third is not None:
        return (first * 60 + second) * 60 + third
    if second is not None:  # MM:SS
        return first * 60 + second
    return first * 60


def check_request(request: SbatchRequest) -> None:
    """Refuse what would fail (or waste the allocation) once the job runs. Raises SbatchError."""
    if request.mode not in MODES:
        raise SbatchError(f"--mode {request.mode!r}: choose per-node (one meshrun launch per node) or per-gpu "
                          "(one srun task per worker).")
    for option, value, low in (("--nodes", request.nodes, 1), ("--gpus-per-node", request.gpus_per_node, 0),
                               ("--procs-per-node", request.procs_per_node, 0),
                               ("--cpus-per-task", request.cpus_per_task, 0),
                               ("--signal-lead", request.signal_lead_s, 0)):
        if value < low:
            raise SbatchError(f"{option} {value}: must be {low} or more.")
    if request.gpus_per_node and request.procs_per_node and request.procs_per_node != request.gpus_per_node:
        raise SbatchError(
            f"--procs-per-node {request.procs_per_node} with --gpus-per-node {request.gpus_per_node}: each worker "
            f"drives one GPU, so give as many workers as GPUs per node (drop --procs-per-node, or set "
            f"--gpus-per-node {request.procs_per_node}).")
    if not request.target:
        raise SbatchError("no target: give `train [--section.key=value ...]`, a script, or `-m module`.")
    if request.time:
        limit = time_limit_seconds(request.time)
        if request.signal_lead_s and request.signal_lead_s >= limit:
            raise SbatchError(
                f"--signal-lead {request.signal_lead_s} is not shorter than --time {request.time} ({limit} s): the "
                "workers would be told to stop as soon as they start; lower --signal-lead (e.g. "
                f"{max(10, limit // 4)}) or raise --time.")
    if request.mode == "per-node" and 0 < request.cpus_per_task < request.workers_per_node:
        raise SbatchError(
            f"--cpus-per-task {request.cpus_per_task} with {request.workers_per_node} workers per node: in per-node "
            f"mode one task holds all of a node's workers, which would share {request.cpus_per_task} CPU(s); give "
            f"at least {request.workers_per_node} (the default is {CPUS_PER_WORKER} per worker: "
            f"{CPUS_PER_WORKER * request.workers_per_node}), or --mode per-gpu.")
    if request.target[0] == "train":
        check_train(request)


def choose_cpus(request: SbatchRequest) -> tuple[int, str]:
    """(--cpus-per-task, why) of the job: the one given, else CPUS_PER_WORKER per worker of a task (and one per data
    loader process of a train target beyond that): Slurm's default of one CPU per task would put every worker of a
    per-node task on one core."""
    workers = request.workers_per_node if request.mode == "per-node" else 1
    if request.cpus_per_task:
        return request.cpus_per_task, "as given"
    loaders = train_config(request.target[1:]).data.num_workers if request.target[0] == "train" else 0
    per_worker = max(CPUS_PER_WORKER, 1 + loaders)
    how = f"{per_worker} per worker" + (f" (1 + data.num_workers={loaders})" if per_worker > CPUS_PER_WORKER else "")
    return per_worker * workers, (f"{how} x {workers} workers in each task" if workers > 1 else how) + \
        "; --cpus-per-task to choose"


def train_config(args: tuple[str, ...]) -> JobConfig:
    """The job config that ``meshrun train ARGS`` would use: --config FILE plus --section.key=value overrides."""
    config_path, overrides, items = None, [], list(args)
    while items:
        item = items.pop(0)
        if item == "--config" and items:
            config_path = items.pop(0)
        elif item.startswith("--config="):
            config_path = item.split("=", 1)[1]
        elif item.startswith("--") and "." in item.split("=", 1)[0]:
            overrides.append(item if "=" in item or not items else f"{item}={items.pop(0)}")
    return load_config(config_path, overrides)


def check_train(request: SbatchRequest) -> None:
    """The parallel layout and the global batch against the job's world size, as the trainer will check them."""
    try:
        config = train_config(request.target[1:])
        dims = ParallelDims.from_config(config.parallel, world_size=request.world_size,
                                        gpus_per_node=request.workers_per_node)
        resolve_batch(config.train, dp_size=dims.dp_size, seq_len=config.model.seq_len)
    except ConfigError as exc:
        raise SbatchError(f"{exc} (job: --nodes {request.nodes} x {request.workers_per_node} workers per node = "
                          f"world size {request.world_size})") from None
    if not config.checkpoint.final:
        raise SbatchError("checkpoint.final=false: a job stopped at its time limit or preempted would end without a "
                          "checkpoint and its requeued run would start over; drop --checkpoint.final=false.")
    if config.checkpoint.resume not in ("auto",) and request.requeue:
        raise SbatchError(f"checkpoint.resume={config.checkpoint.resume}: a requeued job would not resume from its "
                          "checkpoint; use checkpoint.resume=auto, or pass --no-requeue.")


def worker_command(request: SbatchRequest) -> list[str]:
    """The srun line of the job step. It repeats --cpus-per-task: since Slurm 22.05 srun no longer inherits the
    job's value, and a step would otherwise get one CPU per task (all of a node's workers on one core)."""
    target = list(request.target)
    python = target[0] == "-m" or target[0].endswith(".py")
    cpus = [f"--cpus-per-task={request.cpus_per_task}"]
    if request.mode == "per-node":
        target = target if python or target[0] in WORKER_COMMANDS else ["--no-python", *target]
        return ["srun", f"--nodes={request.nodes}", f"--ntasks={request.nodes}", "--ntasks-per-node=1", *cpus,
                "meshrun", "launch", "--nproc-per-node", str(request.workers_per_node), *target]
    direct = ["meshrun", *target] if target[0] in WORKER_COMMANDS else (["python", "-u", *target] if python else target)
    return ["srun", f"--nodes={request.nodes}", f"--ntasks={request.world_size}",
            f"--ntasks-per-node={request.workers_per_node}", *cpus, *direct]


def sbatch_lines(request: SbatchRequest) -> list[str]:
    tasks = 1 if request.mode == "per-node" else request.workers_per_node
    lines = [f"--job-name={request.job_name}", f"--nodes={request.nodes}", f"--ntasks-per-node={tasks}"]
    if request.gpus_per_node:
        lines.append(f"--gpus-per-node={request.gpus_per_node}")
    lines.append(f"--cpus-per-task={request.cpus_per_task}")
    lines += [f"--{name}={value}" for name, value in (("time", request.time), ("partition", request.partition),
                                                      ("account", request.account)) if value]
    lines += [f"--output={request.output}", "--open-mode=append"]
    if request.signal_lead_s:
        lines.append(f"--signal=USR1@{request.signal_lead_s}")
    lines.append("--requeue" if request.requeue else "--no-requeue")
    return lines + [line.removeprefix("#SBATCH").strip() for line in request.extra]


def build_script(request: SbatchRequest, *, command_line: str) -> str:
    """The sbatch script text (checked first). ``command_line`` is the meshrun slurm line, quoted in the header."""
    check_request(request)
    cpus, why = choose_cpus(request)
    request = dataclasses.replace(request, cpus_per_task=cpus)
    step = " ".join(shlex.quote(part) for part in worker_command(request))
    head = [f"#SBATCH {line}" for line in sbatch_lines(request)]
    signal_note = (f"SIGUSR1 reaches every task {request.signal_lead_s} s before the time limit"
                   if request.signal_lead_s else "the time limit's SIGTERM reaches every task")
    body = [
        "set -u",
        f"# --cpus-per-task={cpus}: {why}",
        f"# {signal_note} (a preemption sends SIGTERM): each worker saves a",
        f"# final checkpoint and exits {EXIT_STOPPED_BY_SIGNAL}. Slurm's SIGKILL after KillWait is the hard stop.",
        f"echo \"meshrun slurm: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST (restart ${{SLURM_RESTART_COUNT:-0}})\"",
        step,
        "code=$?",
    ]
    if request.requeue:
        body += [f"if [ \"$code\" -eq {EXIT_STOPPED_BY_SIGNAL} ]; then",
                 "  # stopped on a signal after saving: run again from the checkpoint (checkpoint.resume=auto)",
                 "  echo \"meshrun slurm: requeueing job $SLURM_JOB_ID; it resumes from the newest checkpoint\"",
                 "  scontrol requeue \"$SLURM_JOB_ID\"",
                 "fi"]
    body.append("exit \"$code\"")
    return "\n".join(["#!/bin/bash", f"# generated by: {command_line}", *head, "", *body]) + "\n"
