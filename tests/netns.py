"""Two hosts in network namespaces for multi-host tests (import the ``two_hosts`` fixture into a test module).

host0 (10.77.0.1) and host1 (10.77.0.2) are joined by a veth pair; traffic stays inside the two namespaces, and both
see this machine's file system (a shared run folder, as on a cluster). Names carry this test process's pid, so
parallel test runs do not collide. Every process started in a namespace is SIGKILLed and the namespaces are deleted
afterwards, whatever the test did.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class Host:
    netns: str
    iface: str
    addr: str

    def launch(self, args: list[str], *, stdout=subprocess.PIPE, stderr=subprocess.PIPE) -> subprocess.Popen:
        """`meshrun launch ARGS` inside this host's namespace."""
        return self.popen([sys.executable, "-m", "meshrun", "launch", *args], stdout=stdout, stderr=stderr)

    def popen(self, command: list[str], *, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
              env: dict[str, str] | None = None) -> subprocess.Popen:
        """``command`` inside this host's namespace (`ip netns exec` execs it: the pid is the command's)."""
        return subprocess.Popen(["ip", "netns", "exec", self.netns, *command], stdout=stdout, stderr=stderr,
                                text=True, env=env)

    def pids(self) -> list[int]:
        """Every process in this namespace (only what the test started: the namespace is the test's own)."""
        out = subprocess.run(["ip", "netns", "pids", self.netns], check=False, capture_output=True, text=True).stdout
        return [int(pid) for pid in out.split() if pid.isdigit()]

    def kill_all(self) -> list[int]:
        """SIGKILL every process in the namespace, as a host that loses power; returns their pids."""
        pids = self.pids()
        for pid in pids:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        return pids


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def _remove(hosts: list[Host]) -> None:
    for host in hosts:
        host.kill_all()
        subprocess.run(["ip", "netns", "del", host.netns], check=False, capture_output=True)
        # the veth end only lingers in the root namespace when building failed before moving it
        subprocess.run(["ip", "link", "del", host.iface], check=False, capture_output=True)


@pytest.fixture
def two_hosts():
    """[host0, host1], built for one test and removed after it."""
    if shutil.which("ip") is None:
        pytest.skip("iproute2 (`ip`) is not installed")
    if os.geteuid() != 0:
        pytest.skip("creating network namespaces needs root")
    tag = f"mrl{os.getpid() % 100000}"
    hosts = [Host(f"{tag}h0", f"{tag}v0", "10.77.0.1"), Host(f"{tag}h1", f"{tag}v1", "10.77.0.2")]
    try:
        for host in hosts:
            _ip("netns", "add", host.netns)
        _ip("link", "add", hosts[0].iface, "type", "veth", "peer", "name", hosts[1].iface)
        for host in hosts:
            _ip("link", "set", host.iface, "netns", host.netns)
            _ip("-n", host.netns, "addr", "add", f"{host.addr}/24", "dev", host.iface)
            _ip("-n", host.netns, "link", "set", host.iface, "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")
    except subprocess.CalledProcessError as exc:
        _remove(hosts)
        pytest.skip(f"cannot build network namespaces here: {' '.join(exc.cmd)}: {exc.stderr.strip()}")
    try:
        yield hosts
    finally:
        _remove(hosts)
