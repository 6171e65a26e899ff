"""SLURM: one task per worker (``srun meshrun train``), or one ``meshrun launch`` per node.

Workers read ``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NTASKS``, ``SLURM_NODEID``, ``SLURM_NNODES`` and the
per-node task counts; the master host is the first host of the nodelist and the port is derived from the job id,
unless MASTER_ADDR/MASTER_PORT are set. ``srun -n $SLURM_NNODES --ntasks-per-node=1 meshrun launch --nproc-per-node 8
train`` needs nothing else: the node count, this node's index and the rendezvous host come from here.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from typing import Callable, Mapping

from meshrun.placement.process import ProcessPlacement
from meshrun.placement.base import ClusterEnvironment, NodePlacement, PlacementError, env_int
from meshrun.placement.slurm_lists import expand_nodelist, expand_tasks_per_node, slurm_port


class SlurmLayoutError(PlacementError):
    """The SLURM allocation does not fit one launcher per node. The first line says how to run it."""


class SlurmEnvironment(ClusterEnvironment):
    """A SLURM task of a step with more than one task (a single task is a plain single process)."""

    name = "slurm"
    title = "SLURM"
    rank_vars = "SLURM_PROCID/SLURM_NTASKS"
    local_vars = "SLURM_LOCALID/SLURM_STEP_TASKS_PER_NODE"
    node_vars = "SLURM_NODEID/SLURM_NNODES"

    def detect(self, environ: Mapping[str, str]) -> bool:
        return "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ and environ.get("SLURM_NTASKS") != "1"

    def placement(self, environ: Mapping[str, str]) -> ProcessPlacement:
        if _in_batch_step(environ):
            raise _direct_in_batch_step_error(environ)
        nodelist = _nodelist(environ, step=True)
        if not nodelist:
            raise ValueError("SLURM: SLURM_JOB_NODELIST is not set, so the master address is unknown; "
                             "run under srun or set MASTER_ADDR.")
        world_size = env_int(environ, "SLURM_NTASKS")
        num_nodes = env_int(environ, "SLURM_NNODES", env_int(environ, "SLURM_JOB_NUM_NODES", 1))
        node_rank = env_int(environ, "SLURM_NODEID", 0)
        local_world_size = _local_world_size(environ, node_rank=node_rank, world_size=world_size,
                                             num_nodes=num_nodes)
        master = environ.get("MASTER_ADDR") or expand_nodelist(nodelist)[0]
        port = env_int(environ, "MASTER_PORT", slurm_port(environ.get("SLURM_JOB_ID", "")))
        return ProcessPlacement(rank=env_int(environ, "SLURM_PROCID"), local_rank=env_int(environ, "SLURM_LOCALID", 0),
                          world_size=world_size, local_world_size=local_world_size, node_rank=node_rank,
                          num_nodes=num_nodes, master_addr=master, master_port=port, source=self.name)

    def node_placement(self, environ: Mapping[str, str], *, command: str) -> NodePlacement | None:
        """The placement when running as a SLURM task with a nodelist, else None.

        Raises SlurmLayoutError when this is the batch script of a multi-node job (not a step: the other nodes
        never start) or when there is more than one launcher task per node (each would start nproc workers).
        """
        nodelist = _nodelist(environ, step=False)
        if not nodelist or "SLURM_NODEID" not in environ or "SLURM_NNODES" not in environ:
            return None
        command = command or "meshrun launch --nproc-per-node N ..."
        if _in_batch_step(environ):
            return _batch_step(environ, command)
        if not self.detect(environ):  # one task in the whole allocation: nothing to coordinate with
            return None
        try:
            env = self.placement(environ)
            env.validate()
        except ValueError as exc:
            raise SlurmLayoutError(f"SLURM variables are inconsistent: {exc}") from None
        if env.world_size != env.num_nodes:
            raise _one_task_per_node_error(environ, env, command)
        return NodePlacement(source=self.name, title=self.title, job_id=environ.get("SLURM_JOB_ID", ""),
                             num_nodes=env.num_nodes, node_rank=env.node_rank, endpoint_host=env.master_addr,
                             endpoint_port=env.master_port, hosts=f"from nodelist {nodelist}",
                             busy_port_fix="the port is derived from the job id; before srun, export "
                                           "MASTER_PORT=<a free port> (the same for every node).")

    def check_master_address(self, env: ProcessPlacement, environ: Mapping[str, str], *,
                             resolve: Callable[[str], str]) -> None:
        """Several nodes: refuse a master host that resolves to loopback on this node.

        Debian and Ubuntu map a host's own name to 127.0.1.1 in /etc/hosts; on the first node the derived master
        then names loopback, and gloo advertises that address to the other nodes, which connect to their own
        127.0.1.1 and wait until the init timeout. A MASTER_ADDR the user set is trusted. Blocks for one lookup.
        """
        if env.num_nodes < 2 or environ.get("MASTER_ADDR"):
            return
        try:
            address = resolve(env.master_addr)
        except OSError:
            return  # an unknown name fails at init, with the address in the message
        if not ipaddress.ip_address(address).is_loopback:
            return
        raise ValueError(
            f"SLURM: the master host {env.master_addr!r} (first host of the job's nodelist) resolves to {address} "
            f"on {socket.gethostname()} (node {env.node_rank}), a loopback address: the other {env.num_nodes - 1} "
            "node(s) cannot reach it there, and gloo would advertise it to them. This is usually the "
            f"'127.0.1.1 <hostname>' line of Debian/Ubuntu's /etc/hosts. Fix: map {env.master_addr} to its "
            "routable address in /etc/hosts, or before srun set MASTER_ADDR to an address of it that every node "
            "reaches and GLOO_SOCKET_IFNAME (NCCL_SOCKET_IFNAME) to the interface that carries it.")


def _nodelist(environ: Mapping[str, str], *, step: bool) -> str:
    """The compressed nodelist: the step's (what srun placed) for workers, the job's for launchers."""
    names = ("SLURM_STEP_NODELIST",) if step else ()
    return next((environ[name] for name in (*names, "SLURM_JOB_NODELIST", "SLURM_NODELIST") if environ.get(name)), "")


def _local_world_size(environ: Mapping[str, str], *, node_rank: int, world_size: int, num_nodes: int) -> int:
    """This node's task count in the step: SLURM_STEP_TASKS_PER_NODE (what srun placed), else the job's
    SLURM_TASKS_PER_NODE, indexed by SLURM_NODEID. `srun -N2 -n3` gives '2,1': 2 here on node 0, 1 on node 1,
    where the job-level SLURM_NTASKS_PER_NODE (or the list's first entry) would say 2 on both."""
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        counts = expand_tasks_per_node(environ.get(name, ""))
        if not counts:
            continue
        if name == "SLURM_STEP_TASKS_PER_NODE" and (len(counts) != num_nodes or sum(counts) != world_size):
            raise ValueError(f"SLURM: SLURM_STEP_TASKS_PER_NODE={environ[name]!r} places {sum(counts)} tasks on "
                             f"{len(counts)} nodes, but SLURM_NTASKS={world_size} and SLURM_NNODES={num_nodes}.")
        if 0 <= node_rank < len(counts):
            return counts[node_rank]
    return env_int(environ, "SLURM_NTASKS_PER_NODE", max(1, world_size // max(1, num_nodes)))


def _one_task_per_node_error(environ: Mapping[str, str], env: ProcessPlacement, command: str) -> SlurmLayoutError:
    counts = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE", "?")
    return SlurmLayoutError(
        f"SLURM: this step runs {env.world_size} tasks on {env.num_nodes} nodes (tasks per node {counts}), but "
        f"meshrun launch must run once per node: it starts --nproc-per-node workers itself. Run `srun -n "
        f"{env.num_nodes} --ntasks-per-node=1 {command}`; inside an allocation made with --ntasks-per-node "
        "greater than 1, `srun --ntasks-per-node=1` alone is not enough, because srun keeps the job's task "
        "count (SLURM_NTASKS) and overrides --ntasks-per-node. Or drop meshrun launch and run one task per "
        "worker: `srun meshrun train ...`.", speaker=env.rank == 0)


def _in_batch_step(environ: Mapping[str, str]) -> bool:
    """The batch script of a job (sbatch), as opposed to a step started by srun: SLURM sets no step id there."""
    return "SLURM_JOB_ID" in environ and "SLURM_STEP_ID" not in environ and "SLURM_STEPID" not in environ


def _direct_in_batch_step_error(environ: Mapping[str, str]) -> PlacementError:
    """A worker started in the batch script itself: SLURM_NTASKS counts the job's tasks, but only this one runs."""
    tasks = env_int(environ, "SLURM_NTASKS")
    return PlacementError(
        f"SLURM: this is the batch script of job {environ.get('SLURM_JOB_ID')}, not a job step: SLURM_NTASKS={tasks} "
        f"counts the job's tasks, but only this process runs here, so rank 0 would wait for {tasks - 1} ranks that "
        "never start. Start one task per worker with srun: `srun meshrun train ...` (or `srun python train.py`), "
        "or one launcher per node: `srun -n $SLURM_NNODES --ntasks-per-node=1 meshrun launch --nproc-per-node N "
        "train ...`; `meshrun slurm` writes such a script.")


def _batch_step(environ: Mapping[str, str], command: str) -> None:
    """In the batch script: fine for a one-node job (a standalone launch); refused for several nodes."""
    nodes = environ.get("SLURM_NNODES", "1")
    if nodes.strip() in ("", "1"):
        return None
    raise SlurmLayoutError(
        f"SLURM: this is the batch script of job {environ.get('SLURM_JOB_ID')} on {nodes} nodes, not a job step: "
        f"meshrun launch here runs on the first node only and the other {int(nodes) - 1} would never join. Use "
        f"srun: `srun -n {nodes} --ntasks-per-node=1 {command}` (or write the script with `meshrun slurm`).")


def detect_slurm(environ: Mapping[str, str] | None = None, *, command: str = "") -> NodePlacement | None:
    """The SLURM placement of this launcher, or None (see :meth:`SlurmEnvironment.node_placement`)."""
    return SlurmEnvironment().node_placement(os.environ if environ is None else environ, command=command)
