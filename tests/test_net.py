"""Routes, interfaces and reachability (loopback and this machine's own addresses only)."""

from __future__ import annotations

import errno
import shutil
import socket
import subprocess
import time

import pytest

from meshrun.launch import net
from meshrun.launch.args import parse_launch_args
from meshrun.launch.launcher import unreachable_message
from meshrun.launch.rendezvous import make_plan


def _own_ipv4() -> dict[str, str]:
    """{address: interface} from `ip -o -4 addr` (a different output format from the JSON meshrun parses)."""
    try:
        out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    found = {}
    for line in out.splitlines():
        fields = line.split()
        if "inet" in fields:
            found[fields[fields.index("inet") + 1].split("/")[0]] = fields[1]
    return found


def test_route_to_loopback():
    route = net.route_to("127.0.0.1")
    assert (route.dest, route.source, route.iface, route.dest_is_local) == ("127.0.0.1", "127.0.0.1", "lo", True)
    assert net.route_to("localhost").dest == "127.0.0.1"  # IPv4 preferred, as TCPStore does


def test_route_to_an_own_address_reports_the_nic_that_owns_it():
    own = {addr: iface for addr, iface in _own_ipv4().items() if iface != "lo"}
    if not own:
        pytest.skip("iproute2 (`ip`) is not installed" if shutil.which("ip") is None
                    else "this machine has no non-loopback IPv4 address")
    for addr, iface in own.items():
        route = net.route_to(addr)
        # The kernel routes to an own address via lo; peers reach it through `iface`.
        assert (route.source, route.iface, route.dest_is_local) == (addr, iface, True)


def test_foreign_address_is_not_local():
    assert not net.is_local_address("198.51.100.7")  # TEST-NET-2, never assigned to a host
    assert net.is_local_address("127.0.0.1")


def test_ioctl_fallback_agrees_with_iproute2():
    from_ip = {addr for addrs in net.interface_addresses().values() for addr in addrs}
    from_ioctl = net._ioctl_ipv4_addresses()
    assert from_ioctl["lo"] == ["127.0.0.1"]
    assert all(addr in from_ip for addrs in from_ioctl.values() for addr in addrs)


@pytest.mark.parametrize("text,expected", [("10.0.0.5:29400", ("10.0.0.5", 29400)), ("node01", ("node01", 7)),
                                           ("[fd00::2]:29400", ("fd00::2", 29400)), ("fd00::2", ("fd00::2", 7))])
def test_parse_endpoint(text, expected):
    assert net.parse_endpoint(text, default_port=7) == expected


def test_unresolvable_host_names_the_host():
    with pytest.raises(net.EndpointError, match="'no-such-host.invalid'"):
        net.resolve("no-such-host.invalid")


def test_probe_reports_refused_within_its_timeout_and_succeeds_on_a_listener():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed_port = sock.getsockname()[1]  # bound but not listening: connections are refused
        start = time.monotonic()
        result = net.probe_tcp("127.0.0.1", closed_port, timeout_s=1.5, interval_s=0.2)
        assert not result.ok and result.error == "connection refused" and result.attempts >= 2
        assert time.monotonic() - start < 3.0
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        result = net.probe_tcp("127.0.0.1", listener.getsockname()[1], timeout_s=5)
        assert result.ok and result.attempts == 1
        assert net.port_accepts("127.0.0.1", listener.getsockname()[1])


def _probe_with_errors(monkeypatch, first: OSError) -> net.ProbeResult:
    """Probe with a connect that fails with ``first``, then times out on every later attempt."""
    errors = iter([first])

    def connect(address, timeout=None):
        raise next(errors, TimeoutError("timed out"))

    monkeypatch.setattr(net.socket, "create_connection", connect)
    return net.probe_tcp("127.0.0.1", 29400, timeout_s=0.3, interval_s=0.05)


@pytest.mark.parametrize(("first", "error", "advice"), [
    (OSError(errno.EHOSTUNREACH, "No route to host"), "no route to host", "share a network (`ip route`)"),
    (OSError(errno.ENETUNREACH, "Network is unreachable"), "network unreachable", "share a network (`ip route`)"),
    (ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"), "connection refused",
     "nothing listens on port 29400 there yet"),
])
def test_probe_reports_the_most_specific_error_seen_not_the_last_timeout(monkeypatch, first, error, advice):
    argv = ["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29400", "--rdzv-conf", "is_host=0", "s.py"]
    plan = make_plan(parse_launch_args(argv), environ={})  # a joining node: the launcher probes before it starts
    result = _probe_with_errors(monkeypatch, first)
    assert not result.ok and result.attempts >= 2 and result.error == error
    message = unreachable_message(plan, result)
    assert f"127.0.0.1:29400: {error} (" in message and advice in message and "firewall" not in message


def test_more_specific_ranks_route_over_refused_over_kernel_text_over_timeout():
    assert net.more_specific("no route to host", "connection refused") == "no route to host"
    assert net.more_specific("connection refused", "timed out") == "connection refused"
    assert net.more_specific("timed out", "Permission denied") == "Permission denied"
    assert net.more_specific("Permission denied", "connection refused") == "connection refused"
    assert net.more_specific("no route to host", "network unreachable") == "network unreachable"  # a tie: the newer


def test_free_port_is_below_the_ephemeral_range_so_outgoing_connections_cannot_take_it():
    low, _ = net._ephemeral_range()
    ports = {net.free_port() for _ in range(20)}
    assert all(10000 <= p < low for p in ports) and len(ports) > 1  # random, not one port every call
    first = net.free_port(count=4)
    socks = [socket.socket() for _ in range(4)]
    try:
        for offset, sock in enumerate(socks):
            sock.bind(("127.0.0.1", first + offset))  # all four consecutive ports were free
    finally:
        for sock in socks:
            sock.close()


def test_free_port_skips_a_port_in_use(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", net.free_port()))
        taken = held.getsockname()[1]

        class Draws:  # the first draw is the held port
            def __init__(self):
                self.values = iter([taken, taken, taken + 1])

            def randrange(self, *_):
                return next(self.values)

        monkeypatch.setattr(net.random, "Random", Draws)
        assert net.free_port() == taken + 1
