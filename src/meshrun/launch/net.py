"""Routes, interfaces and reachability: what a node needs to know before it joins a rendezvous.

Only loopback and the addresses a user names are ever contacted. Route lookups use a UDP ``connect``, which asks
the kernel for the route and the source address without sending a packet.
"""

from __future__ import annotations

import errno
import fcntl
import ipaddress
import json
import random
import shutil
import socket
import struct
import subprocess
import time
from dataclasses import dataclass

LOCAL_ADDR_VAR = "MESHRUN_LOCAL_ADDR"
"""Set by ``meshrun launch`` for its workers: the address it chose for this node (``--local-addr``, or the source
address of the route to the rendezvous host). Per-node servers (the Prometheus endpoint) bind to it."""


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(host: str = "127.0.0.1", count: int = 1) -> int:
    """A port (the first of ``count`` consecutive ones) that is free on ``host`` now, for a server started later.

    Chosen below the kernel's ephemeral range: a port the kernel hands out for ``bind(0)`` may also be taken, before
    the server binds it, by any outgoing connection on the machine (gloo opens many), which fails the server with
    EADDRINUSE. Below that range only another explicit bind can take it. Falls back to ``bind(0)``."""
    low, _ = _ephemeral_range()
    floor = 10000
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    rng = random.Random()  # own generator: tests seed the global one, and every caller would get the same port
    for _ in range(200 if low - count > floor + 1000 else 0):
        first = rng.randrange(floor, low - count)
        socks = []
        try:
            for offset in range(count):
                sock = socket.socket(family, socket.SOCK_STREAM)
                socks.append(sock)
                sock.bind((host, first + offset))
            return first
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class EndpointError(ValueError):
    """An endpoint that cannot be parsed or resolved. The first line names it and the fix."""


@dataclass(frozen=True)
class Route:
    """How this host reaches one destination address."""

    dest: str
    """The destination, as an IP address."""
    source: str
    """The local address the kernel picks for traffic to ``dest`` (what peers see as this host)."""
    iface: str | None
    """The interface that owns ``source``; None when it cannot be found."""
    dest_is_local: bool
    """``dest`` is one of this host's own addresses (loopback included)."""


@dataclass(frozen=True)
class ProbeResult:
    """The outcome of waiting for a TCP port to accept connections."""

    ok: bool
    """A connection was accepted."""
    attempts: int
    """Connection attempts made."""
    elapsed_s: float
    """Seconds spent."""
    error: str
    """The most specific failure seen, in words ('no route to host', 'connection refused', 'timed out'); '' when ok."""


def parse_endpoint(endpoint: str, *, default_port: int) -> tuple[str, int]:
    """'host:port', '[v6]:port', 'host' -> (host, port)."""
    text = endpoint.strip()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    else:  # a bare host, or a bare IPv6 address
        host, port_text = text, ""
    if not host:
        raise EndpointError(f"rendezvous endpoint {endpoint!r} has no host; write HOST:PORT, e.g. 10.0.0.5:29400.")
    try:
        port = int(port_text) if port_text else default_port
    except ValueError:
        raise EndpointError(f"rendezvous endpoint {endpoint!r}: port {port_text!r} is not a number; "
                            "write HOST:PORT, e.g. 10.0.0.5:29400.") from None
    if not 0 <= port <= 65535:
        raise EndpointError(f"rendezvous endpoint {endpoint!r}: port {port} is outside 0..65535.")
    return host, port


def resolve(host: str) -> str:
    """The IP address ``host`` names (IPv4 preferred, as torch's TCPStore does)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise EndpointError(f"cannot resolve rendezvous host {host!r} on {socket.gethostname()} ({exc.strerror}); "
                            "use its IP address or fix name resolution (/etc/hosts, DNS).") from None
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    return infos[0][4][0]


def is_loopback(ip: str) -> bool:
    """True for a loopback address (127.0.0.0/8, ::1) and for the name 'localhost'; False for other names."""
    try:
        return ipaddress.ip_address(ip).is_loopback
    except ValueError:
        return ip == "localhost"


def is_local_address(ip: str) -> bool:
    """True when ``ip`` belongs to this host: binding to it succeeds only for an own address."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((ip, 0))
        except OSError:
            return False
    return True


def source_address(dest_ip: str) -> str:
    """The local address the kernel uses for traffic to ``dest_ip`` (route lookup only; no packet is sent)."""
    family = socket.AF_INET6 if ":" in dest_ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((dest_ip, 9))
        except OSError as exc:
            raise EndpointError(f"no route from {socket.gethostname()} to {dest_ip} ({exc.strerror}); "
                                "check the address and this host's routes (`ip route`).") from None
        return sock.getsockname()[0]


def interface_addresses() -> dict[str, list[str]]:
    """{interface: [addresses]} from ``ip -j addr``, or IPv4 primaries via ioctl where iproute2 is missing."""
    if shutil.which("ip"):
        try:
            out = subprocess.run(["ip", "-j", "addr"], capture_output=True, text=True, timeout=10, check=True)
            return {link["ifname"]: [a["local"] for a in link.get("addr_info", []) if "local" in a]
                    for link in json.loads(out.stdout) if "ifname" in link}
        except (OSError, subprocess.SubprocessError, ValueError, KeyError):
            pass
    return _ioctl_ipv4_addresses()


def _ioctl_ipv4_addresses() -> dict[str, list[str]]:
    siocgifaddr = 0x8915  # Linux <linux/sockios.h>
    found: dict[str, list[str]] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(sock.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            found[name] = [socket.inet_ntoa(packed[20:24])]
    return found


def interface_of(ip: str) -> str | None:
    """The interface that owns ``ip`` (for the route's source address this is the NIC peers talk to)."""
    wanted = ipaddress.ip_address(ip)
    for name, addresses in interface_addresses().items():
        if any(ipaddress.ip_address(a.split("%")[0]) == wanted for a in addresses):
            return name
    return None


def route_to(host: str) -> Route:
    """Resolve ``host`` and find the source address and interface this host uses to reach it.

    For one of this host's own addresses the kernel routes via ``lo``; the interface reported is the one owning
    the address (e.g. eth0), because that is the NIC the other nodes reach this host through.
    """
    dest = resolve(host)
    source = source_address(dest)
    return Route(dest=dest, source=source, iface=interface_of(source), dest_is_local=is_local_address(dest))


def port_accepts(host: str, port: int, *, timeout_s: float = 1.0) -> bool:
    """True when something accepts TCP connections on host:port right now."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def probe_tcp(host: str, port: int, *, timeout_s: float, interval_s: float = 1.0) -> ProbeResult:
    """Try to connect to host:port until it accepts or ``timeout_s`` has passed. Blocks at most ``timeout_s``."""
    start = time.monotonic()
    deadline = start + timeout_s
    attempts, error = 0, "timed out"
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return ProbeResult(ok=False, attempts=attempts, elapsed_s=time.monotonic() - start, error=error)
        attempts += 1
        try:
            with socket.create_connection((host, port), timeout=min(5.0, remaining)):
                return ProbeResult(ok=True, attempts=attempts, elapsed_s=time.monotonic() - start, error="")
        except OSError as exc:
            error = more_specific(error, describe_socket_error(exc))
        time.sleep(max(0.0, min(interval_s, deadline - time.monotonic())))


_SPECIFICITY = {"no route to host": 3, "network unreachable": 3, "connection refused": 2, "timed out": 0}
"""How much a failure says about its cause; an error named only by the kernel's text ranks between (1)."""


def more_specific(seen: str, new: str) -> str:
    """The failure that says more about the cause; ``new`` on a tie.

    A connect to an absent host fails with 'no route to host' only once ARP gives up (about 3 s); the last attempt,
    cut short by the time left, then just times out, and its error alone would send the user to check firewalls.
    """
    return new if _SPECIFICITY.get(new, 1) >= _SPECIFICITY.get(seen, 1) else seen


def describe_socket_error(exc: OSError) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, (TimeoutError, socket.timeout)):
        return "timed out"
    names = {errno.EHOSTUNREACH: "no route to host", errno.ENETUNREACH: "network unreachable"}
    return names.get(exc.errno or 0, exc.strerror or type(exc).__name__)
