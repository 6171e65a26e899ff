"""Item: who can connect to the stores. A single-host job's stores accept no connection from another host; a
multi-host job's listen only on the address the other nodes use. Checked from a second network-namespace host."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.timeout(180)]
pytest_plugins = ["netns"]  # the two_hosts fixture (tests/netns.py)

WORKER = str(Path(__file__).with_name("store_worker.py"))


def _listeners(netns: str) -> list[tuple[str, int]]:
    """(address, port) of every TCP listener in the namespace (only this test's processes live there)."""
    out = subprocess.run(["ip", "netns", "exec", netns, "ss", "-ltnH"], capture_output=True, text=True,
                         check=True).stdout
    found = []
    for line in out.splitlines():
        local = line.split()[3]
        addr, _, port = local.rpartition(":")
        found.append((addr.strip("[]"), int(port)))
    return found


def _connects_from(netns: str, addr: str, port: int) -> bool:
    code = (f"import socket\ntry:\n socket.create_connection(({addr!r}, {port}), timeout=2).close(); print('yes')\n"
            "except OSError: print('no')")
    out = subprocess.run(["ip", "netns", "exec", netns, sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=20).stdout
    return out.strip() == "yes"


def _launch(host, args: list[str], log: Path) -> subprocess.Popen:
    """`meshrun launch ARGS` on ``host``, output to a file (a pipe nobody reads could fill)."""
    with log.open("w") as out:
        proc = host.launch(args, stdout=out, stderr=subprocess.STDOUT)
    proc.log = log
    return proc


def _wait_ready(folders: list[Path], count: int, procs: list[subprocess.Popen], timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while sum(len(list(f.glob("ready_*"))) for f in folders) < count:
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            logs = "\n".join(p.log.read_text()[-3000:] for p in procs)
            pytest.fail(f"workers did not join within {timeout}s:\n{logs}")
        time.sleep(0.2)


def _stop(folders: list[Path], procs: list[subprocess.Popen]) -> list[str]:
    for folder in folders:
        (folder / "stop").write_text("")
    for proc in procs:
        proc.wait(timeout=30)
    return [p.log.read_text() for p in procs]


def test_single_host_job_accepts_no_other_host(two_hosts, tmp_path):
    host0, host1 = two_hosts
    folder = tmp_path / "job"
    folder.mkdir()
    # no restarts: the launcher hosts the rendezvous store and the store torch shares with the workers
    procs = [_launch(host0, ["--nproc-per-node", "2", WORKER, str(folder)], tmp_path / "job.log")]
    _wait_ready([folder], 2, procs)
    listeners = _listeners(host0.netns)
    reachable = [(a, p) for a, p in listeners if _connects_from(host1.netns, host0.addr, p)]
    logs = _stop([folder], procs)
    assert len(listeners) >= 4, listeners  # rendezvous store, workers' store, a gloo socket per worker
    assert {addr for addr, _ in listeners} == {"127.0.0.1"}, listeners
    assert not reachable, f"reachable from {host1.addr}: {reachable}"
    assert "listens     rendezvous and workers' stores on loopback (127.0.0.1) only" in logs[0]


def test_multi_host_stores_listen_on_the_endpoint_address_only(two_hosts, tmp_path):
    host0, host1 = two_hosts
    folder = tmp_path / "two"
    folder.mkdir()
    # --max-restarts 1: rank 0 of the workers hosts their store (meshrun's process group), not the launcher
    args = ["--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "1", "--rdzv-endpoint", f"{host0.addr}:29400",
            "--rdzv-timeout", "60", WORKER, str(folder)]
    procs = [_launch(host, args, tmp_path / f"{host.addr}.log") for host in (host0, host1)]
    _wait_ready([folder], 2, procs)
    listeners = {host.addr: _listeners(host.netns) for host in (host0, host1)}
    _stop([folder], procs)
    assert (host0.addr, 29400) in listeners[host0.addr]
    worker_store_host = [h for h, found in listeners.items() if len(found) >= 2]  # store + gloo on rank 0's host
    assert worker_store_host, listeners
    for addr, found in listeners.items():
        assert found and {a for a, _ in found} <= {addr}, listeners  # never 0.0.0.0, ::, or loopback
