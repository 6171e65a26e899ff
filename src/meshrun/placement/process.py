"""The one object that holds where this process sits (its placement): ranks, nodes and the master address.

Every other module asks a :class:`ProcessPlacement` for ranks, nodes and the master address; none of them reads
``RANK``/``LOCAL_RANK``/``SLURM_*`` itself. Where the values come from is the business of the cluster environments
in :mod:`meshrun.placement` (torchrun / ``meshrun launch``, SLURM, Open MPI, a single process, and any registered
with ``register_environment``), tried in order by :meth:`ProcessPlacement.detect`.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Callable, Mapping

from meshrun.placement.base import ClusterEnvironment
from meshrun.placement.registry import detect_environment, environment_named

DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class ProcessPlacement:
    """Where this process sits within the job: its ranks, its node and the master."""

    rank: int
    """Global rank, 0..world_size-1."""
    local_rank: int
    """Index of this process on its node; selects the GPU."""
    world_size: int
    """Number of processes in the job."""
    local_world_size: int
    """Number of processes on this node."""
    node_rank: int
    """Index of this node, 0..num_nodes-1."""
    num_nodes: int
    """Number of nodes in the job."""
    master_addr: str
    """Host that serves the rendezvous store."""
    master_port: int
    """TCP port of the rendezvous store."""
    source: str
    """Name of the cluster environment that gave the placement: 'torchrun', 'slurm', 'openmpi', 'single', or yours."""

    @property
    def is_distributed(self) -> bool:
        return self.source != "single"

    @property
    def is_rank_zero(self) -> bool:
        return self.rank == 0

    @property
    def restart_count(self) -> int:
        """How often torchrun's agent restarted this worker group (0 on first start)."""
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    @property
    def nodes_differ(self) -> bool:
        """The nodes run different numbers of processes (8 + 4 + 4): the world is not nodes x this node's count."""
        return self.world_size != self.num_nodes * self.local_world_size

    def describe_nodes(self) -> str:
        """'2 node(s) x 8 process(es) = world size 16', or for nodes that differ
        '3 node(s) of different sizes = world size 16 (8 process(es) on this node)'."""
        if self.nodes_differ:
            return (f"{self.num_nodes} node(s) of different sizes = world size {self.world_size} "
                    f"({self.local_world_size} process(es) on this node)")
        return f"{self.num_nodes} node(s) x {self.local_world_size} process(es) = world size {self.world_size}"

    def validate(self) -> None:
        """Raise a ValueError naming the variables to check when the placement is inconsistent."""
        names = environment_named(self.source) or ClusterEnvironment  # its defaults: torchrun's variables
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"{self.source}: rank {self.rank} is outside world size {self.world_size}; "
                             f"check {names.rank_vars}.")
        if not 0 <= self.local_rank < self.local_world_size:
            raise ValueError(f"{self.source}: local rank {self.local_rank} is outside local world size "
                             f"{self.local_world_size}; check {names.local_vars}.")
        if not 0 <= self.node_rank < self.num_nodes:
            raise ValueError(f"{self.source}: node rank {self.node_rank} is outside {self.num_nodes} nodes; "
                             f"check {names.node_vars}.")

    @classmethod
    def detect(cls, environ: Mapping[str, str] | None = None) -> "ProcessPlacement":
        """Read the placement from ``environ`` (default: ``os.environ``) through the first cluster environment of
        :data:`meshrun.placement.registry.ENVIRONMENTS` that detects this process."""
        environ = os.environ if environ is None else environ
        env = detect_environment(environ).placement(environ)
        env.validate()
        return env

    def check_master_address(self, environ: Mapping[str, str] | None = None, *,
                             resolve: Callable[[str], str] | None = None) -> None:
        """Refuse a derived master address that cannot work (SLURM on several nodes: a master host that resolves
        to loopback here), before init waits on it. The cluster environment that gave the placement decides; raises
        a ValueError naming what resolved to what, and the fix. Blocks for at most one name lookup.
        """
        environment = environment_named(self.source)
        if environment is not None:
            environment.check_master_address(self, os.environ if environ is None else environ,
                                             resolve=resolve or resolve_ipv4_first)

    def export(self) -> dict[str, str]:
        """The torchrun variables that ``init_process_group(init_method='env://')`` needs."""
        return {"RANK": str(self.rank), "LOCAL_RANK": str(self.local_rank), "WORLD_SIZE": str(self.world_size),
                "LOCAL_WORLD_SIZE": str(self.local_world_size), "GROUP_RANK": str(self.node_rank),
                "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port)}


def resolve_ipv4_first(host: str) -> str:
    """The address ``host`` names, IPv4 preferred (as torch's TCPStore); raises OSError when it has none."""
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    return infos[0][4][0]
