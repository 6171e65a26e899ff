"""Derive the launcher's node layout from a SLURM allocation (one ``meshrun launch`` task per node).

``srun -n $SLURM_NNODES --ntasks-per-node=1 meshrun launch --nproc-per-node 8 train`` needs nothing else: the node
count, this node's index and the rendezvous host (the first host of the nodelist) come from SLURM, through
:class:`meshrun.env.ClusterEnv`, the one reader of the process layout.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from meshrun.env import ClusterEnv


class SlurmLayoutError(ValueError):
    """The SLURM allocation does not fit one launcher per node. The first line says how to run it."""

    def __init__(self, message: str, *, speaker: bool = True):
        super().__init__(message)
        self.speaker = speaker
        """This task prints the refusal: every task of the step gets the same one, and only task 0 says it."""


@dataclass(frozen=True)
class SlurmPlacement:
    """Where this launcher sits in a SLURM allocation."""

    job_id: str
    """SLURM_JOB_ID ('' when unknown); also the rendezvous id, so concurrent jobs do not mix."""
    nodelist: str
    """The compressed nodelist as SLURM gives it."""
    num_nodes: int
    """Nodes in the allocation."""
    node_rank: int
    """This node's index (SLURM_NODEID)."""
    endpoint_host: str
    """MASTER_ADDR if set, else the first host of the expanded nodelist: every node computes the same one."""
    endpoint_port: int
    """MASTER_PORT if set, else a port derived from the job id (as :class:`ClusterEnv` does)."""

    def describe(self) -> str:
        return (f"SLURM job {self.job_id or '?'}: node {self.node_rank} of {self.num_nodes}, endpoint "
                f"{self.endpoint_host}:{self.endpoint_port} (from nodelist {self.nodelist})")


def detect_slurm(environ: Mapping[str, str] | None = None, *, command: str = "") -> SlurmPlacement | None:
    """The placement when running as a SLURM task with a nodelist, else None.

    Raises SlurmLayoutError when this is the batch script of a multi-node job (not a step: the other nodes never
    start) or when there is more than one launcher task per node (each would start nproc workers). ``command`` is
    the ``meshrun launch ...`` line, quoted back in the suggested srun line.
    """
    environ = os.environ if environ is None else environ
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist or "SLURM_NODEID" not in environ or "SLURM_NNODES" not in environ:
        return None
    command = command or "meshrun launch --nproc-per-node N ..."
    if _in_batch_step(environ):
        return _batch_step(environ, command)
    try:
        env = ClusterEnv.detect(environ)
    except ValueError as exc:
        raise SlurmLayoutError(f"SLURM variables are inconsistent: {exc}") from None
    if env.source != "slurm":  # one task in the whole allocation: nothing to coordinate with
        return None
    if env.world_size != env.num_nodes:
        counts = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE", "?")
        raise SlurmLayoutError(
            f"SLURM: this step runs {env.world_size} tasks on {env.num_nodes} nodes (tasks per node {counts}), but "
            f"meshrun launch must run once per node: it starts --nproc-per-node workers itself. Run `srun -n "
            f"{env.num_nodes} --ntasks-per-node=1 {command}`; inside an allocation made with --ntasks-per-node "
            "greater than 1, `srun --ntasks-per-node=1` alone is not enough, because srun keeps the job's task "
            "count (SLURM_NTASKS) and overrides --ntasks-per-node. Or drop meshrun launch and run one task per "
            "worker: `srun meshrun train ...`.", speaker=env.rank == 0)
    return SlurmPlacement(job_id=environ.get("SLURM_JOB_ID", ""), nodelist=nodelist, num_nodes=env.num_nodes,
                          node_rank=env.node_rank, endpoint_host=env.master_addr, endpoint_port=env.master_port)


def _in_batch_step(environ: Mapping[str, str]) -> bool:
    """The batch script of a job (sbatch), as opposed to a step started by srun: SLURM sets no step id there."""
    return "SLURM_JOB_ID" in environ and "SLURM_STEP_ID" not in environ and "SLURM_STEPID" not in environ


def _batch_step(environ: Mapping[str, str], command: str) -> None:
    """In the batch script: fine for a one-node job (a standalone launch); refused for several nodes."""
    nodes = environ.get("SLURM_NNODES", "1")
    if nodes.strip() in ("", "1"):
        return None
    raise SlurmLayoutError(
        f"SLURM: this is the batch script of job {environ.get('SLURM_JOB_ID')} on {nodes} nodes, not a job step: "
        f"meshrun launch here runs on the first node only and the other {int(nodes) - 1} would never join. Use "
        f"srun: `srun -n {nodes} --ntasks-per-node=1 {command}` (or write the script with `meshrun slurm`).")
