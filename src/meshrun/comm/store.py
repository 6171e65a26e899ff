"""A torch TCPStore server that listens on one address instead of every interface.

torch's TCPStore server has no bind-address option: both its backends (libuv and the classic one) listen on
``::``/``0.0.0.0``, so any host that reaches the machine can talk to the store, unauthenticated. What torch does
accept is ``master_listen_fd``, a socket already bound and listening. :func:`bound_tcp_store` binds that socket to
the one address peers use (loopback for a single-host job), and hands it to torch's own TCPStore.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist


def listen_socket(addr: str, port: int) -> socket.socket:
    """A TCP socket bound to ``addr``:``port`` (0: a free port) and listening. Raises OSError (e.g. in use)."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


def bound_tcp_store(addr: str, port: int, *, timeout: timedelta, multi_tenant: bool = False,
                    world_size: int | None = None, wait_for_workers: bool = False) -> dist.TCPStore:
    """torch's TCPStore server, listening only on ``addr`` (an IP address of this host).

    The store owns the socket's file descriptor from then on (it closes it when it is destroyed).
    """
    sock = listen_socket(addr, port)
    bound_port = sock.getsockname()[1]
    kwargs = dict(world_size=world_size, is_master=True, timeout=timeout, wait_for_workers=wait_for_workers,
                  multi_tenant=multi_tenant, master_listen_fd=sock.fileno())
    try:
        store = dist.TCPStore(addr, bound_port, **kwargs)
    except (RuntimeError, ValueError):  # a torch whose libuv backend refuses a listening fd: the classic one takes it
        store = dist.TCPStore(addr, bound_port, use_libuv=False, **kwargs)
    sock.detach()  # the store closes the descriptor; the Python object must not
    return store


def bind_address(host: str) -> str | None:
    """The address to listen on for clients that connect to ``host``; None when it is not an address of this host
    (then torch's own server, listening everywhere, is the only choice)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return None
    infos.sort(key=lambda info: info[0] != socket.AF_INET)  # IPv4 first, as TCPStore's client does
    addr = infos[0][4][0]
    try:
        listen_socket(addr, 0).close()
    except OSError:
        return None
    return addr
