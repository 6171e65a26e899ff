"""Which node can open a TCP connection to which: the pre-flight behind ``meshrun doctor``.

NCCL and gloo open direct connections between nodes after the rendezvous; a firewall or a wrong interface then
shows up as a hang at the first collective. Here one process per node listens on the address NCCL/gloo would
use, publishes it in the c10d store, and connects to every other node's listener with a short timeout. The
result is an N x N matrix in which each failing pair is named with the reason the kernel gave.

Also the local view for a single process: interfaces, the route to an endpoint, and whether its port answers.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from meshrun.env import ClusterEnv

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


@dataclass(frozen=True)
class Interface:
    name: str
    addrs: tuple[str, ...]
    up: bool


@dataclass(frozen=True)
class Route:
    dev: str | None
    src: str | None
    via: str | None


# ---- local facts -------------------------------------------------------------------------------------------

def interfaces() -> list[Interface]:
    """Network interfaces and their addresses, from ``ip -j addr``; names only when iproute2 is missing."""
    data = _ip_json("addr")
    if data is None:
        return [Interface(name=name, addrs=(), up=True) for _, name in socket.if_nameindex()]
    return [Interface(name=item.get("ifname", "?"),
                      addrs=tuple(a["local"] for a in item.get("addr_info", []) if "local" in a),
                      up="UP" in item.get("flags", []) or item.get("operstate") == "UP")
            for item in data]


def route_to(host: str) -> Route:
    """The interface and source address the kernel would use to reach ``host``."""
    addr = resolve(host)
    data = _ip_json("route", "get", addr)
    if data:
        return Route(dev=data[0].get("dev"), src=data[0].get("prefsrc"), via=data[0].get("gateway"))
    return Route(dev=None, src=_udp_source(addr), via=None)


def resolve(host: str) -> str:
    """IPv4 address of ``host`` (IPv6 when it has none); raises OSError naming the host."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise OSError(f"cannot resolve host {host!r}: {exc.strerror}") from None
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    return infos[0][4][0]


def advertised_address(env: ClusterEnv) -> tuple[str, str]:
    """(address, why) of the address this node's collectives would use.

    The interface named by NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME when set (as NCCL and gloo do), else the
    source address of the route to the master (what the kernel picks for the rendezvous connection).
    """
    for var in _IFNAME_VARS:
        wanted = os.environ.get(var, "").lstrip("=")
        if wanted and not wanted.startswith("^"):
            names = wanted.split(",")
            for iface in interfaces():
                if any(iface.name.startswith(name) for name in names) and iface.addrs:
                    return iface.addrs[0], f"{var}={wanted} -> {iface.name}"
    try:
        route = route_to(env.master_addr)
        if route.src:
            return route.src, f"route to master {env.master_addr}" + (f" via {route.dev}" if route.dev else "")
    except OSError:
        pass
    return resolve(socket.gethostname()), "hostname lookup"


def _ip_json(*args: str) -> list[dict] | None:
    try:
        done = subprocess.run(["ip", "-j", *args], capture_output=True, text=True, timeout=5)
        return json.loads(done.stdout) if done.returncode == 0 and done.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return None


def _udp_source(addr: str) -> str | None:
    # connect() on a datagram socket only picks the route; no packet is sent.
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((addr, 9))
            return sock.getsockname()[0]
        except OSError:
            return None


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
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused (nothing listens there, or a firewall rejects it)"
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return f"no answer within {timeout_s:g} s (a firewall drops the packets, or the route is wrong)"
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve the address ({exc.strerror})"
    reasons = {errno.EHOSTUNREACH: "no route to host", errno.ENETUNREACH: "network unreachable"}
    return reasons.get(exc.errno or 0, exc.strerror or str(exc))


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


def exchange_endpoints(store, *, env: ClusterEnv, listener: Listener | None, tag: str,
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


def gather_matrix(row: list[Probe] | None, *, env: ClusterEnv, endpoints: list[Endpoint], group=None) -> ReachMatrix:
    """Collect every node's row on every rank. A collective every rank must reach."""
    gathered: list[tuple[int, list[Probe] | None] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (env.node_rank, row), group=group)  # note: collective, every rank reaches it
    rows = {node: r for node, r in (item for item in gathered if item) if r is not None}
    return ReachMatrix(endpoints=endpoints, rows=[rows[ep.node] for ep in endpoints])


def check_reachability(*, env: ClusterEnv, store=None, group=None, timeout_s: float = 3.0,
                       wait_s: float = 60.0, tag: str = "reach") -> ReachMatrix:
    """Every node connects to every node's listener; the matrix on every rank.

    Every rank of the default group must call this (one store exchange and one all_gather_object).
    ``tag`` must differ between calls in one job. Local rank 0 of each node listens and probes.
    """
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
