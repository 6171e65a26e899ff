"""The one place that reads the process layout from the environment.

Every other module asks a :class:`ClusterEnv` for ranks, nodes and the master address; none of them reads
``RANK``/``LOCAL_RANK``/``SLURM_*`` itself. Three sources are understood, tried in this order:

* torchrun / ``meshrun launch`` (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``)
* SLURM ``srun`` with one task per GPU (``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NTASKS``, ...)
* a plain single process
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from dataclasses import dataclass
from typing import Callable, Mapping

DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class ClusterEnv:
    """Process layout of this process within the job."""

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
    """Where the layout came from: 'torchrun', 'slurm' or 'single'."""

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
        """Raise a ValueError naming the variable when the layout is inconsistent."""
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"{self.source}: rank {self.rank} is outside world size {self.world_size}; "
                             "check RANK/WORLD_SIZE (or SLURM_PROCID/SLURM_NTASKS).")
        if not 0 <= self.local_rank < self.local_world_size:
            raise ValueError(f"{self.source}: local rank {self.local_rank} is outside local world size "
                             f"{self.local_world_size}; check LOCAL_RANK/LOCAL_WORLD_SIZE.")
        if not 0 <= self.node_rank < self.num_nodes:
            raise ValueError(f"{self.source}: node rank {self.node_rank} is outside {self.num_nodes} nodes; "
                             "check GROUP_RANK/--node-rank (or SLURM_NODEID/SLURM_NNODES).")

    @classmethod
    def detect(cls, environ: Mapping[str, str] | None = None) -> "ClusterEnv":
        """Read the layout from ``environ`` (default: ``os.environ``)."""
        environ = os.environ if environ is None else environ
        if "RANK" in environ and "WORLD_SIZE" in environ:
            env = _from_torchrun(environ)
        elif "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ and environ.get("SLURM_NTASKS") != "1":
            env = _from_slurm(environ)
        else:
            env = ClusterEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0, num_nodes=1,
                             master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
                             master_port=int(environ.get("MASTER_PORT", DEFAULT_MASTER_PORT)), source="single")
        env.validate()
        return env

    def check_master_address(self, environ: Mapping[str, str] | None = None, *,
                             resolve: Callable[[str], str] | None = None) -> None:
        """SLURM direct mode on several nodes: refuse a master host that resolves to loopback on this node.

        Debian and Ubuntu map a host's own name to 127.0.1.1 in /etc/hosts; on the first node the derived master
        then names loopback, and gloo advertises that address to the other nodes, which connect to their own
        127.0.1.1 and wait until the init timeout. Raises a ValueError naming what resolved to what, and the fix.
        A MASTER_ADDR the user set is trusted. Blocks for one name lookup.
        """
        environ = os.environ if environ is None else environ
        if self.source != "slurm" or self.num_nodes < 2 or environ.get("MASTER_ADDR"):
            return
        try:
            address = (resolve or resolve_ipv4_first)(self.master_addr)
        except OSError:
            return  # an unknown name fails at init, with the address in the message
        if not ipaddress.ip_address(address).is_loopback:
            return
        raise ValueError(
            f"SLURM: the master host {self.master_addr!r} (first host of the job's nodelist) resolves to {address} "
            f"on {socket.gethostname()} (node {self.node_rank}), a loopback address: the other {self.num_nodes - 1} "
            "node(s) cannot reach it there, and gloo would advertise it to them. This is usually the "
            f"'127.0.1.1 <hostname>' line of Debian/Ubuntu's /etc/hosts. Fix: map {self.master_addr} to its "
            "routable address in /etc/hosts, or before srun set MASTER_ADDR to an address of it that every node "
            "reaches and GLOO_SOCKET_IFNAME (NCCL_SOCKET_IFNAME) to the interface that carries it.")

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


def _int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = environ.get(name)
    if value is None:
        if default is None:
            raise ValueError(f"environment variable {name} is not set")
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def _from_torchrun(environ: Mapping[str, str]) -> ClusterEnv:
    world_size = _int(environ, "WORLD_SIZE")
    local_world_size = _int(environ, "LOCAL_WORLD_SIZE", 1)
    # torchrun sets GROUP_RANK to the agent's rank, which is the node rank for one agent per node.
    node_rank = _int(environ, "GROUP_RANK", _int(environ, "NODE_RANK", 0))
    num_nodes = _int(environ, "GROUP_WORLD_SIZE", max(1, world_size // max(1, local_world_size)))
    return ClusterEnv(rank=_int(environ, "RANK"), local_rank=_int(environ, "LOCAL_RANK", 0), world_size=world_size,
                      local_world_size=local_world_size, node_rank=node_rank, num_nodes=num_nodes,
                      master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
                      master_port=_int(environ, "MASTER_PORT", DEFAULT_MASTER_PORT), source="torchrun")


def _from_slurm(environ: Mapping[str, str]) -> ClusterEnv:
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist:
        raise ValueError("SLURM: SLURM_JOB_NODELIST is not set, so the master address is unknown; "
                         "run under srun or set MASTER_ADDR.")
    world_size = _int(environ, "SLURM_NTASKS")
    num_nodes = _int(environ, "SLURM_NNODES", _int(environ, "SLURM_JOB_NUM_NODES", 1))
    node_rank = _int(environ, "SLURM_NODEID", 0)
    local_world_size = _slurm_local_world_size(environ, node_rank=node_rank, world_size=world_size,
                                               num_nodes=num_nodes)
    master = environ.get("MASTER_ADDR") or expand_nodelist(nodelist)[0]
    port = _int(environ, "MASTER_PORT", _slurm_default_port(environ))
    return ClusterEnv(rank=_int(environ, "SLURM_PROCID"), local_rank=_int(environ, "SLURM_LOCALID", 0),
                      world_size=world_size, local_world_size=local_world_size, node_rank=node_rank,
                      num_nodes=num_nodes, master_addr=master, master_port=port, source="slurm")


def _slurm_local_world_size(environ: Mapping[str, str], *, node_rank: int, world_size: int, num_nodes: int) -> int:
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
    return _int(environ, "SLURM_NTASKS_PER_NODE", max(1, world_size // max(1, num_nodes)))


SLURM_PORT_BASE = 15000
SLURM_PORT_SPAN = 16384
"""Ports derived from a job id lie in 15000..31383, below Linux's ephemeral range (32768 and up)."""


def slurm_port(job_id: str) -> int:
    """The rendezvous port of SLURM job ``job_id``, the same on every node: the whole id modulo 16384, so that jobs
    sharing a first node collide only when their ids differ by a multiple of 16384 (the last four digits, as
    Lightning uses, collide every 10000 jobs). ``meshrun launch`` refuses a busy port on node 0 by name."""
    digits = job_id.split("_")[0]  # array tasks ('123_4') carry their own SLURM_JOB_ID; keep the number
    return SLURM_PORT_BASE + int(digits) % SLURM_PORT_SPAN if digits.isdigit() else DEFAULT_MASTER_PORT


def _slurm_default_port(environ: Mapping[str, str]) -> int:
    return slurm_port(environ.get("SLURM_JOB_ID", ""))


def expand_tasks_per_node(value: str) -> list[int]:
    """SLURM's compressed per-node task counts, one entry per node; [] when absent.

    >>> expand_tasks_per_node("2(x3),1")
    [2, 2, 2, 1]
    """
    counts: list[int] = []
    for item in filter(None, (part.strip() for part in (value or "").split(","))):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item)
        if not match:
            raise ValueError(f"SLURM task counts {value!r}: cannot read {item!r} (expected N or N(xM))")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand SLURM's compressed host list.

    >>> expand_nodelist("node[01-03,07],gpu5")
    ['node01', 'node02', 'node03', 'node07', 'gpu5']
    """
    hosts: list[str] = []
    for item in _split_top_level(nodelist):
        hosts.extend(_expand_item(item))
    if not hosts:
        raise ValueError(f"SLURM nodelist {nodelist!r} names no host")
    return hosts


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are outside brackets."""
    items, depth, current = [], 0, []
    for char in text:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"SLURM nodelist {text!r} has an unmatched ']'")
        if char == "," and depth == 0:
            items.append("".join(current))
            current = []
        else:
            current.append(char)
    if depth != 0:
        raise ValueError(f"SLURM nodelist {text!r} has an unmatched '['")
    items.append("".join(current))
    return [item.strip() for item in items if item.strip()]


def _expand_item(item: str) -> list[str]:
    """Expand one host pattern, which may hold several bracket groups: 'r[1-2]n[01-02]'."""
    match = re.search(r"\[([^\]]*)\]", item)
    if not match:
        return [item]
    head, tail = item[:match.start()], item[match.end():]
    expanded = []
    for part in match.group(1).split(","):
        if "-" in part:
            lo, hi = part.split("-", 1)
            width = len(lo)
            for number in range(int(lo), int(hi) + 1):
                expanded.extend(_expand_item(f"{head}{number:0{width}d}{tail}"))
        else:
            expanded.extend(_expand_item(f"{head}{part}{tail}"))
    return expanded
