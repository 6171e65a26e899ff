"""Derive the launcher's node layout from a SLURM allocation (one ``meshrun launch`` task per node).

``srun --ntasks-per-node=1 meshrun launch --nproc-per-node 8 train`` should need nothing else: the node count,
this node's index and the rendezvous host (the first host of the nodelist) come from SLURM, through
:class:`meshrun.env.ClusterEnv`, the one reader of the process layout.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from meshrun.env import ClusterEnv


class SlurmLayoutError(ValueError):
    """The SLURM allocation does not fit one launcher per node. The first line says how to run it."""


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


def detect_slurm(environ: Mapping[str, str] | None = None) -> SlurmPlacement | None:
    """The placement when running as a SLURM task with a nodelist, else None.

    Raises SlurmLayoutError when there is more than one launcher task per node (each would start nproc workers).
    """
    environ = os.environ if environ is None else environ
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist or "SLURM_NODEID" not in environ or "SLURM_NNODES" not in environ:
        return None
    try:
        env = ClusterEnv.detect(environ)
    except ValueError as exc:
        raise SlurmLayoutError(f"SLURM variables are inconsistent: {exc}") from None
    if env.source != "slurm":  # one task in the whole allocation: nothing to coordinate with
        return None
    if env.world_size != env.num_nodes:
        raise SlurmLayoutError(f"SLURM: {env.world_size} tasks on {env.num_nodes} nodes, but meshrun launch must run "
                         "once per node; use `srun --ntasks-per-node=1 meshrun launch --nproc-per-node N ...`.")
    return SlurmPlacement(job_id=environ.get("SLURM_JOB_ID", ""), nodelist=nodelist, num_nodes=env.num_nodes,
                          node_rank=env.node_rank, endpoint_host=env.master_addr, endpoint_port=env.master_port)
