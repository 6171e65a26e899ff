"""The c10d rendezvous, with its stores listening on one address: torch's handler and stores, bound by meshrun.

torch's c10d backend creates two TCPStore servers on the node that hosts the rendezvous: the rendezvous store
(``--rdzv-endpoint``) and, since torch 2.5, the store it shares with the workers. Both would listen on every
interface. :data:`BACKEND` is torch's own c10d rendezvous (``DynamicRendezvousHandler`` over
``C10dRendezvousBackend``) whose servers are created by :func:`meshrun.comm.store.bound_tcp_store`: on the
endpoint's address, and on this node's ``--local-addr`` (loopback for a single-host job).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (RendezvousError, RendezvousHandler, RendezvousParameters,
                                                  rendezvous_handler_registry)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend, create_backend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from meshrun.comm.store import bind_address, bound_tcp_store
from meshrun.launch import exit_barrier

BACKEND = "meshrun-c10d"
"""The name torch's launcher is given for this handler (the start-up block says c10d)."""
C10D_DEFAULT_PORT = 29400


def register() -> None:
    """Make :data:`BACKEND` known to torch's rendezvous registry (idempotent)."""
    rendezvous_handler_registry.register(BACKEND, create_bound_handler)


def create_bound_handler(params: RendezvousParameters) -> RendezvousHandler:
    """torch's c10d handler; when this node hosts the store, the servers listen on their own address only."""
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=C10D_DEFAULT_PORT)
    addr = bind_address(host) if params.get_as_bool("is_host") else None
    if addr is None:
        _, store = create_backend(params)  # a client, or torch's own server (is_host unset)
    else:
        read_timeout = params.get_as_int("read_timeout", 60)
        try:
            store = bound_tcp_store(addr, port, timeout=timedelta(seconds=read_timeout), multi_tenant=True)
        except OSError as exc:
            raise RendezvousError(f"cannot listen on {addr}:{port} ({exc.strerror}); another process holds the "
                                  "port: choose another --rdzv-endpoint port") from None
    handler = create_handler(store, _NamedBackend(store, params.run_id), params)
    # private: torch's handler has no public way to choose where the store it shares with the workers listens
    if hasattr(handler, "_create_tcp_store_server"):  # torch >= 2.5 shares a second store with the workers
        handler._create_tcp_store_server = _bound_shared_server
    ShutdownBarrier(handler, store, key=f"meshrun/shutdown/{params.run_id}",
                    hosting=params.get_as_bool("is_host", False))
    return handler


class ShutdownBarrier:
    """The node that hosts the rendezvous store leaves last.

    At the end of a job every node's launcher shuts the rendezvous down, which writes to the store. A store host
    that finished first and exited took the store with it, and the other nodes printed torch's "recvVector failed"
    with a C++ stack trace after a successful job. Installed on a handler, this makes each node count itself in
    under ``key`` once its own shutdown is done, and the host wait for every node of the last rendezvous round
    (``timeout_s`` at most: a node that died never counts itself in), less the nodes whose launchers the exit
    barrier found dead (launch/exit_barrier.py).
    """

    def __init__(self, handler: RendezvousHandler, store: dist.Store, *, key: str, hosting: bool,
                 timeout_s: float = 15.0):
        self.store, self.key, self.hosting, self.timeout_s = store, key, hosting, timeout_s
        self.nodes = 0
        """Nodes in the last rendezvous round (0 before the first)."""
        self._next, self._shutdown = handler.next_rendezvous, handler.shutdown
        handler.next_rendezvous, handler.shutdown = self.next_rendezvous, self.shutdown

    def next_rendezvous(self):
        info = self._next()
        self.nodes = info.world_size
        return info

    def shutdown(self) -> bool:
        closed = self._shutdown()
        try:
            arrived = self.store.add(self.key, 1)
            deadline = time.monotonic() + self.timeout_s
            expected = self.nodes - exit_barrier.STATE.dead_nodes  # launchers found dead never count in
            while self.hosting and arrived < expected and time.monotonic() < deadline:
                time.sleep(0.05)
                arrived = self.store.add(self.key, 0)
        except RuntimeError:  # DistError: the store is gone already, nothing left to wait for
            pass
        return closed


class _NamedBackend(C10dRendezvousBackend):
    """torch's c10d rendezvous state in the store, under the name the registry checks handlers against."""

    @property
    def name(self) -> str:
        return BACKEND


def _bound_shared_server(*args) -> dist.TCPStore:
    """The store torch's handler shares with the workers (their MASTER_ADDR is this node's --local-addr).

    torch >= 2.6 passes (master_addr, master_port); 2.5 passed one RendezvousStoreInfo.
    """
    master_addr, master_port = (args[0].master_addr, args[0].master_port) if len(args) == 1 else args
    addr = bind_address(master_addr)
    if addr is None:  # not an address of this host: torch's default, listening everywhere
        return dist.TCPStore(host_name=master_addr, port=master_port, is_master=True, multi_tenant=True)
    return bound_tcp_store(addr, master_port, timeout=timedelta(seconds=300), multi_tenant=True)


@dataclass(frozen=True)
class StoreAnswer:
    """Whether a torch store answered at an endpoint that accepts TCP connections."""

    ok: bool
    elapsed_s: float
    error: str
    """'' when ok; else what happened, in words."""
    abandoned: bool = False
    """A client thread is still blocked in torch: leave the process with os._exit."""


NOT_A_STORE = "Ping failed"
"""In torch's client error when the peer's reply to its validation is not a store's."""


def probe_store(host: str, port: int, *, timeout_s: float, attempt_s: float = 3.0) -> StoreAnswer:
    """Ask host:port one question as torch's TCPStore client; blocks at most ``timeout_s``.

    torch's client can wait far longer than its own timeout for a listener that accepts and never answers, so each
    attempt runs in a daemon thread; when the time is up the thread is abandoned, still blocked in C++, and
    :attr:`StoreAnswer.abandoned` tells the caller to leave with ``os._exit`` (an interpreter that finalizes
    around it aborts). A peer that is not a store fails each attempt with torch's "Ping failed". While probing,
    this process's stderr is muted: torch's client logs a C++ stack trace on every retry.
    """
    start = time.monotonic()
    deadline = start + timeout_s
    error = ""
    with _muted_stderr():
        while time.monotonic() < deadline:
            outcome: list[str] = []
            # a quarter of the time left at most: torch's client retries until its own timeout and then backs off
            # (a "Ping failed" from a peer that answers at once still takes this limit plus up to ~1.5 s), and
            # that answer must come before the deadline
            limit = max(0.25, min(attempt_s, (deadline - time.monotonic()) / 4))
            thread = threading.Thread(target=_ask, args=(host, port, limit, outcome), daemon=True)
            thread.start()
            thread.join(max(0.0, deadline - time.monotonic()))
            if not outcome:
                return StoreAnswer(ok=False, elapsed_s=time.monotonic() - start, abandoned=True,
                                   error=f"the connection was accepted but nothing answered the store handshake "
                                         f"within {timeout_s:.0f}s")
            if not outcome[0]:
                return StoreAnswer(ok=True, elapsed_s=time.monotonic() - start, error="")
            error = outcome[0]
            if NOT_A_STORE in error:
                return StoreAnswer(ok=False, elapsed_s=time.monotonic() - start,
                                   error="something answered, but not a torch store (wrong reply to the store "
                                         "handshake)")
    return StoreAnswer(ok=False, elapsed_s=time.monotonic() - start, error=f"no store answered: {error}")


def _ask(host: str, port: int, timeout_s: float, outcome: list[str]) -> None:
    try:
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s),
                              wait_for_workers=False)
        store.check(["meshrun/probe"])  # one round trip
        outcome.append("")
    except Exception as exc:  # noqa: BLE001 - reported in words by probe_store
        text = str(exc).strip()
        outcome.append(f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}")


@contextlib.contextmanager
def _muted_stderr():
    """File descriptor 2 to /dev/null (C++ writes there directly), restored afterwards."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
