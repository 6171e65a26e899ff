"""The interface every cluster environment implements, and what the launcher needs from one.

A cluster environment knows one way processes are started (torchrun, SLURM's srun, Open MPI's mpirun, ...). It
answers two questions: is this process running under it (:meth:`ClusterEnvironment.detect`), and what is the
placement (:meth:`ClusterEnvironment.placement`, the common :class:`~meshrun.placement.process.ProcessPlacement` fields). An
environment that can also place ``meshrun launch`` (one launcher per node, before any worker exists) answers
:meth:`ClusterEnvironment.node_placement` with a :class:`NodePlacement`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping

if TYPE_CHECKING:  # the record imports the registry, which imports this interface
    from meshrun.placement.process import ProcessPlacement


class PlacementError(ValueError):
    """The environment's variables do not fit the launch. The first line says how to run it."""

    def __init__(self, message: str, *, speaker: bool = True):
        super().__init__(message)
        self.speaker = speaker
        """This process prints the refusal: every task of a step gets the same one, and only task 0 says it."""


@dataclass(frozen=True)
class NodePlacement:
    """Where this node's ``meshrun launch`` sits, as a cluster environment tells it before the workers start."""

    source: str
    """Name of the environment that placed it ('slurm'); the plan's origin."""
    title: str
    """The environment as users write it ('SLURM'), for messages."""
    job_id: str
    """The scheduler's job id ('' when unknown); also the rendezvous id, so concurrent jobs do not mix."""
    num_nodes: int
    """Nodes in the job: one launcher on each."""
    node_rank: int
    """This node's index; node 0 hosts the rendezvous store."""
    endpoint_host: str
    """MASTER_ADDR if set, else a host every node derives alike (SLURM: the first host of the nodelist)."""
    endpoint_port: int
    """MASTER_PORT if set, else the environment's default for this job."""
    hosts: str
    """Where the endpoint came from, for the printed block: 'from nodelist node[01-02]'."""
    busy_port_fix: str
    """What to do when the endpoint port is taken on node 0: 'before srun, export MASTER_PORT=...'."""

    @property
    def rdzv_id(self) -> str:
        """'slurm-4242': the same on every node of the job; '' when the job id is unknown."""
        return f"{self.source}-{self.job_id}" if self.job_id else ""

    def describe(self) -> str:
        return (f"{self.title} job {self.job_id or '?'}: node {self.node_rank} of {self.num_nodes}, endpoint "
                f"{self.endpoint_host}:{self.endpoint_port} ({self.hosts})")


class ClusterEnvironment(ABC):
    """One way processes are started. Subclass it and pass an instance to
    :func:`meshrun.placement.register_environment`; the first registered environment that detects wins."""

    name: str = ""
    """Short id, stored as ``ProcessPlacement.source`` ('slurm')."""
    title: str = ""
    """As users write it, in messages ('SLURM')."""
    rank_vars: str = "RANK/WORLD_SIZE"
    """The variables to check when the rank is out of range, named in :meth:`ProcessPlacement.validate`'s error."""
    local_vars: str = "LOCAL_RANK/LOCAL_WORLD_SIZE"
    """The same for the local rank."""
    node_vars: str = "GROUP_RANK/--node-rank"
    """The same for the node rank."""

    @abstractmethod
    def detect(self, environ: Mapping[str, str]) -> bool:
        """This process runs under this environment. Reads ``environ`` only; cheap, never raises."""

    @abstractmethod
    def placement(self, environ: Mapping[str, str]) -> ProcessPlacement:
        """Where this process sits: its ranks, node and master (called only when :meth:`detect` said yes). Raises ValueError naming the variable."""

    def node_placement(self, environ: Mapping[str, str], *, command: str) -> NodePlacement | None:
        """Where ``meshrun launch`` run once per node sits, or None when this environment does not place
        launchers (they then need --nnodes and --rdzv-endpoint). ``command`` is the launch line, for suggestions.
        Raises :class:`PlacementError` when the environment's placement cannot run one launcher per node."""
        return None

    def check_master_address(self, env: ProcessPlacement, environ: Mapping[str, str], *,
                             resolve: Callable[[str], str]) -> None:
        """Refuse a derived master address that cannot work, before init waits on it (default: trust it)."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


def env_int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    """``environ[name]`` as an int, else ``default``; a ValueError naming the variable when missing or not a number."""
    value = environ.get(name)
    if value is None:
        if default is None:
            raise ValueError(f"environment variable {name} is not set")
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None
