"""Which node can open a TCP connection to which: the pre-flight behind ``meshrun doctor``.

NCCL and gloo open direct connections between nodes after the rendezvous; a firewall or a wrong interface then
shows up as a hang at the first collective. Here one process per node listens on the address NCCL/gloo would
use, publishes it in the c10d store, and connects to every other node's listener with a short timeout. The
result is an N x N matrix in which each failing pair is named with the reason the kernel gave.

Also the local view for a single process: interfaces, the route to an endpoint, and whether its port answers.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from meshrun.env import ProcessPlacement
from meshrun.launch import net

_IFNAME_VARS = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")


@dataclass(frozen=True)
class Endpoint:
    """Where one node listens."""

    node: int
    host: str
    addr: str
    port: int

    def label(self, *, port: bool = False) -> str:
        where = f"{self.addr}:{self.port}" if port else self.addr
        return f"host {self.host} (node {self.node}, {where})"


@dataclass(frozen=True)
class Probe:
    """One connection attempt: ``ok``, or the kernel's reason in words."""

    ok: bool
    error: str | None
    ms: float


# ---- local facts (routes and interfaces come from meshrun.launch.net) ---------------------------------------

def advertised_address(env: ProcessPlacement) -> tuple[str, str]:
    """(address, why) of the address this node's collectives would use.

    The interface named by NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME when set (as NCCL and gloo do), else the
    source address of the route to the master (what the kernel picks for the rendezvous connection).
    """
    for var in _IFNAME_VARS:
        wanted = os.environ.get(var, "").lstrip("=")
        if wanted and not wanted.startswith("^"):
            prefixes = wanted.split(",")
            for name, addrs in net.interface_addresses().items():
                if any(name.startswith(prefix) for prefix in prefixes) and addrs:
                    return addrs[0], f"{var}={wanted} -> {name}"
    try:
        route = net.route_to(env.master_addr)
        return route.source, f"route to master {env.master_addr}" + (f" via {route.iface}" if route.iface else "")
    except net.EndpointError:
        return net.resolve(socket.gethostname()), "hostname lookup"


# ---- listening and probing ---------------------------------------------------------------------------------

class Listener:
    """A TCP listener on ``addr`` (any free port) whose daemon thread accepts and closes connections."""

    def __init__(self, addr: str):
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((addr, 0))
        self.sock.listen(128)
        self.addr, self.port = addr, self.sock.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, name="meshrun-doctor-listener", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            conn.close()

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def probe(addr: str, port: int, *, timeout_s: float) -> Probe:
    """Try one TCP connection; the error is the kernel's reason in words."""
    start = time.perf_counter()
    try:
        with socket.create_connection((addr, port), timeout=timeout_s):
            return Probe(ok=True, error=None, ms=(time.perf_counter() - start) * 1e3)
    except OSError as exc:
        return Probe(ok=False, error=describe_error(exc, timeout_s), ms=(time.perf_counter() - start) * 1e3)


def describe_error(exc: OSError, timeout_s: float) -> str:
    """The kernel's reason in words (meshrun.launch.net's), with what it usually means."""
    words = net.describe_socket_error(exc)
    hints = {"connection refused": "connection refused (nothing listens there, or a firewall rejects it)",
             "timed out": f"no answer within {timeout_s:g} s (a firewall drops the packets, or the route is wrong)"}
    return hints.get(words, words)


def probe_row(endpoints: list[Endpoint], *, timeout_s: float) -> list[Probe]:
    """Probe every endpoint concurrently (so one black-holed host costs one timeout, not N)."""
    with ThreadPoolExecutor(max_workers=max(1, min(32, len(endpoints)))) as pool:
        return list(pool.map(lambda ep: probe(ep.addr, ep.port, timeout_s=timeout_s), endpoints))


# ---- across nodes --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ReachMatrix:
    """``rows[i][j]`` is node i's attempt to connect to node j's listener."""

    endpoints: list[Endpoint]
    rows: list[list[Probe]]

    def failures(self) -> list[str]:
        """One line per failing pair: 'host b (node 1, 10.0.0.2) cannot reach host c (node 2, 10.0.0.3:41234): ...'."""
        lines = []
        for src, row in zip(self.endpoints, self.rows):
            for dst, result in zip(self.endpoints, row):
                if not result.ok:
                    lines.append(f"{src.label()} cannot reach {dst.label(port=True)}: {result.error}")
        return lines

    @property
    def ok(self) -> bool:
        return all(result.ok for row in self.rows for result in row)


def exchange_endpoints(store, *, env: ProcessPlacement, listener: Listener | None, tag: str,
                       timeout_s: float) -> list[Endpoint]:
    """Publish this node's listener (local rank 0 only) and wait for every node's; all ranks call this.

    Blocks at most ``timeout_s``; raises naming the nodes that never published.
    """
    key = lambda node: f"meshrun/{tag}/node{node}"  # noqa: E731 - a local naming rule
    if listener is not None:
        store.set(key(env.node_rank), json.dumps([socket.gethostname(), listener.addr, listener.port]))
    keys = [key(node) for node in range(env.num_nodes)]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except Exception as exc:  # noqa: BLE001 - store errors differ by torch version; re-raised with the nodes named
        missing = [node for node in range(env.num_nodes) if not store.check([key(node)])]
        raise TimeoutError(f"nodes {missing} did not publish their listener within {timeout_s:g} s; is "
                           f"`meshrun doctor` running on every node (local rank 0 of each)?") from exc
    endpoints = []
    for node, item in enumerate(keys):
        host, addr, port = json.loads(store.get(item))
        endpoints.append(Endpoint(node=node, host=host, addr=addr, port=int(port)))
    return endpoints


def gather_matrix(row: list[Probe] | None, *, env: ProcessPlacement, endpoints: list[Endpoint],
                  group=None) -> ReachMatrix:
    """Collect every node's row on every rank. A collective every rank must reach."""
    gathered: list[tuple[int, list[Probe] | None] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (env.node_rank, row), group=group)  # note: collective, every rank reaches it
    rows = {node: r for node, r in (item for item in gathered if item) if r is not None}
    return ReachMatrix(endpoints=endpoints, rows=[rows[ep.node] for ep in endpoints])


def check_reachability(*, env: ProcessPlacement, store=None, group=None, timeout_s: float = 3.0,
                       wait_s: float = 60.0, tag: str = "reach") -> ReachMatrix:
    """Every node connects to every node's listener; the matrix on every rank.

    Every rank of the default group must call this (one store exchange and one all_gather_object).
    ``tag`` must differ between calls in one job. Local rank 0 of each node listens and probes.
    """
    # private: torch has no public accessor for the default group's store (2.8 to 2.13)
    store = store if store is not None else dist.distributed_c10d._get_default_store()
    listener = Listener(advertised_address(env)[0]) if env.local_rank == 0 else None
    try:
        endpoints = exchange_endpoints(store, env=env, listener=listener, tag=tag, timeout_s=wait_s)
        row = probe_row(endpoints, timeout_s=timeout_s) if listener is not None else None
        # the gather also means every node has finished probing, so closing the listener after it is safe
        matrix = gather_matrix(row, env=env, endpoints=endpoints, group=group)
    finally:
        if listener is not None:
            listener.close()
    return matrix
