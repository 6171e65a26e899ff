"""Two hosts in network namespaces, each running `meshrun launch` with only --nnodes/--nproc-per-node/--rdzv-endpoint.

host0 (10.77.0.1) and host1 (10.77.0.2) are joined by a veth pair; traffic stays inside the two namespaces. Inside
them the hostname still resolves to 127.0.0.1, which is what breaks a plain torchrun here (no node hosts the
c10d store, and workers would be told MASTER_ADDR=localhost): meshrun must work it out from the routes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

pytestmark = [pytest.mark.netns, pytest.mark.slow]

TRAIN_ARGS = ["--model.name=tiny", "--train.steps=5", "--data.max_bytes=200000", "--train.eval_every=0"]


@dataclass(frozen=True)
class Host:
    netns: str
    iface: str
    addr: str

    def launch(self, args: list[str]) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", self.netns, sys.executable, "-m", "meshrun", "launch", *args],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def _remove(hosts: list[Host]) -> None:
    for host in hosts:
        pids = subprocess.run(["ip", "netns", "pids", host.netns], capture_output=True, text=True).stdout.split()
        for pid in pids:  # only processes this test started live in its namespaces
            try:
                os.kill(int(pid), 9)
            except (ProcessLookupError, ValueError):
                pass
        subprocess.run(["ip", "netns", "del", host.netns], capture_output=True)
        subprocess.run(["ip", "link", "del", host.iface], capture_output=True)  # if it never left the root ns


@pytest.fixture
def two_hosts():
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


def _finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        return -9, err
    return proc.returncode, err


def test_two_hosts_train_together_from_the_endpoint_alone(two_hosts, tmp_path):
    host0, host1 = two_hosts
    run_dir = tmp_path / "run"
    args = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"{host0.addr}:29400", "--rdzv-timeout", "60",
            "train", *TRAIN_ARGS, f"--run.dir={run_dir}"]
    procs = [host0.launch(args), host1.launch(args)]
    (code0, err0), (code1, err1) = [_finish(proc, timeout=240) for proc in procs]
    assert code0 == 0 and code1 == 0, f"host0:\n{err0}\nhost1:\n{err1}"
    assert f"hosted here: {host0.addr} is this host's address" in err0
    assert f"this node   {host0.addr} on {host0.iface}" in err0
    assert f"joined: {host0.addr} is another host" in err1
    assert f"GLOO_SOCKET_IFNAME={host1.iface} NCCL_SOCKET_IFNAME={host1.iface}" in err1
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    last = [r for r in records if r.get("kind") == "train"][-1]
    assert last["step"] == 5
    # one worker per host formed one job of two devices
    assert round(last["tokens_per_s"] / last["tokens_per_s_per_device"]) == 2
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == ["rank_00000.log", "rank_00001.log"]


def test_closed_endpoint_port_fails_fast_naming_the_endpoint(two_hosts, tmp_path):
    host0, host1 = two_hosts
    start = time.monotonic()
    code, err = _finish(host1.launch(["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint",
                                      f"{host0.addr}:29411", "--rdzv-timeout", "4", "train", *TRAIN_ARGS]), timeout=60)
    elapsed = time.monotonic() - start
    assert code == 1, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("meshrun launch: ") and f"({host1.addr} on {host1.iface}) cannot reach" in last
    assert f"rendezvous endpoint {host0.addr}:29411: connection refused" in last
    assert elapsed < 4 + 20  # the probe's timeout plus interpreter start-up
