"""Pairwise TCP reachability: real sockets on loopback, and (root only) two network-namespace hosts."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
import torch.distributed as dist

from dist_utils import free_port, run_distributed
from meshrun.diag import reach
from meshrun.env import ProcessPlacement


def test_probe_reports_ok_and_refused_with_the_reason():
    listener = reach.Listener("127.0.0.1")
    try:
        assert reach.probe("127.0.0.1", listener.port, timeout_s=2).ok
    finally:
        listener.close()
    closed = reach.probe("127.0.0.1", listener.port, timeout_s=2)
    assert not closed.ok and closed.error.startswith("connection refused")


def test_errors_are_described_in_words():
    assert reach.describe_error(socket.timeout(), 3.0).startswith("no answer within 3 s")
    assert reach.describe_error(OSError(113, "No route to host"), 3.0) == "no route to host"


def test_failures_name_each_pair_with_addresses():
    eps = [reach.Endpoint(node=n, host=h, addr=f"10.0.0.{n + 1}", port=41000 + n) for n, h in enumerate("abc")]
    ok, refused = reach.Probe(True, None, 0.2), reach.Probe(False, "connection refused", 0.1)
    matrix = reach.ReachMatrix(endpoints=eps, rows=[[ok, ok, ok], [ok, ok, refused], [ok, ok, ok]])
    assert not matrix.ok
    assert matrix.failures() == ["host b (node 1, 10.0.0.2) cannot reach host c (node 2, 10.0.0.3:41002): "
                                 "connection refused"]


def test_socket_ifname_picks_that_interface(monkeypatch):
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "lo")
    env = ProcessPlacement.detect({})
    addr, why = reach.advertised_address(env)
    assert addr == "127.0.0.1" and "NCCL_SOCKET_IFNAME=lo" in why


def _as_node(rank: int, world_size: int) -> ProcessPlacement:
    # every rank plays one node, so the matrix is world_size x world_size
    return ProcessPlacement(rank=rank, local_rank=0, world_size=world_size, local_world_size=1, node_rank=rank,
                      num_nodes=world_size, master_addr="127.0.0.1", master_port=0, source="torchrun")


def _reach_worker(rank: int, world_size: int):
    env = _as_node(rank, world_size)
    healthy = reach.check_reachability(env=env, timeout_s=2.0, wait_s=30.0, tag="healthy")
    # the same steps by hand, with node 2's listener closed after it was published
    store = dist.distributed_c10d._get_default_store()
    listener = reach.Listener(reach.advertised_address(env)[0])
    endpoints = reach.exchange_endpoints(store, env=env, listener=listener, tag="broken", timeout_s=30.0)
    if rank == 2:
        listener.close()
    dist.barrier()
    row = reach.probe_row(endpoints, timeout_s=2.0)
    broken = reach.gather_matrix(row, env=env, endpoints=endpoints)
    listener.close()
    return healthy, broken


@pytest.mark.slow
def test_three_nodes_on_loopback_name_the_pair_whose_listener_is_closed():
    results = run_distributed(_reach_worker, 3, timeout=120)
    healthy, broken = results[0]
    assert healthy.ok and len(healthy.rows) == 3 and all(len(row) == 3 for row in healthy.rows)
    assert all(r == results[0] for r in results[1:])  # every rank holds the same gathered matrices
    port = broken.endpoints[2].port
    assert broken.failures() == [
        f"host {socket.gethostname()} (node {src}, 127.0.0.1) cannot reach host {socket.gethostname()} "
        f"(node 2, 127.0.0.1:{port}): connection refused (nothing listens there, or a firewall rejects it)"
        for src in range(3)]


# ---- two hosts in network namespaces -------------------------------------------------------------------------

def _netns_skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if not shutil.which("ip") or not shutil.which("torchrun"):
        return "needs iproute2 and torchrun"
    probe_name = f"mrprobe{os.getpid()}"
    done = subprocess.run(["ip", "netns", "add", probe_name], capture_output=True, text=True)
    if done.returncode != 0:
        return f"cannot create a network namespace here: {done.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe_name], capture_output=True)
    return None


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


@pytest.fixture
def two_hosts():
    """Namespaces A (198.51.100.1) and B (198.51.100.2) joined by a veth pair; B also has a side interface
    (203.0.113.2) that A has no route to. Removed afterwards."""
    reason = _netns_skip_reason()
    if reason:
        pytest.skip(reason)
    a, b = f"mra{os.getpid()}", f"mrb{os.getpid()}"
    try:
        _sh("ip", "netns", "add", a)
        _sh("ip", "netns", "add", b)
        _sh("ip", "link", "add", "mrveth0", "netns", a, "type", "veth", "peer", "name", "mrveth1", "netns", b)
        for ns, dev, addr in ((a, "mrveth0", "198.51.100.1/24"), (b, "mrveth1", "198.51.100.2/24")):
            _sh("ip", "-n", ns, "addr", "add", addr, "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        # a second interface in B only (a veth pair with both ends in B: the dummy module may be missing)
        _sh("ip", "-n", b, "link", "add", "mrside0", "type", "veth", "peer", "name", "mrside1")
        _sh("ip", "-n", b, "addr", "add", "203.0.113.2/24", "dev", "mrside0")
        for dev in ("mrside0", "mrside1"):
            _sh("ip", "-n", b, "link", "set", dev, "up")
        yield a, b
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _doctor_in(ns: str, node: int, port: int, extra_env: dict[str, str], *, setup: str = "",
               extra_args: tuple[str, ...] = ()) -> subprocess.Popen:
    """torchrun + doctor in namespace ``ns``, with its own host name (mrnode<N>) and mount namespace, so that
    ``setup`` can mount folders only this host sees, as a separate machine would."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_", "GLOO_"))} | extra_env
    cmd = ["ip", "netns", "exec", ns, "unshare", "--mount", "--uts", "--propagation", "private", "sh", "-c",
           f"hostname mrnode{node} && {setup} exec \"$@\"", "sh",
           "torchrun", "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node",
           "1", "--master-addr", "198.51.100.1", "--master-port", str(port), "-m", "meshrun", "doctor",
           "--timeout", "2", "--wait", "60", *extra_args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=Path(__file__).resolve().parents[1])


def _rows(report: str) -> dict[str, str]:
    """doctor's check rows by 'status check', e.g. 'fail dataset'."""
    return {line.split(":", 1)[0].strip(): line for line in report.splitlines()
            if line.startswith(("pass ", "warn ", "fail "))}


@pytest.mark.slow
@pytest.mark.netns
def test_doctor_across_namespaces_names_the_node_with_each_injected_fault(two_hosts, tmp_path):
    """Node 1 (host mrnode1) has: an NCCL_SOCKET_IFNAME that node 0 cannot route to (NCCL would hang), gloo given
    NCCL's '^lo' syntax, a clock 5 s ahead (the test hook), a smaller copy of the dataset and its own checkpoint
    folder (private tmpfs mounts over both paths)."""
    if subprocess.run(["unshare", "--mount", "--uts", "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare cannot create mount and UTS namespaces here")
    a, b = two_hosts
    port = free_port()
    data, ckpt = tmp_path / "data", tmp_path / "ckpt"
    data.mkdir()
    (data / "shard0.bin").write_bytes(b"x" * 4096)
    args = ("--data", str(data), "--ckpt-dir", str(ckpt), "--ckpt-bytes", "1M", "--no-gpu-health")
    private = (f"mount -t tmpfs none {data} && head -c 1000 /dev/zero > {data}/shard0.bin && "
               f"mkdir -p {ckpt} && mount -t tmpfs none {ckpt} &&")
    procs = [_doctor_in(a, 0, port, {"GLOO_SOCKET_IFNAME": "mrveth0"}, extra_args=args),
             _doctor_in(b, 1, port, {"GLOO_SOCKET_IFNAME": "^lo", "NCCL_SOCKET_IFNAME": "mrside0",
                                     "MESHRUN_FAKE_CLOCK_OFFSET_S": "5"}, setup=private, extra_args=args)]
    outputs = [proc.communicate(timeout=180)[0] for proc in procs]
    report = outputs[0]
    assert procs[0].returncode != 0, report
    assert "host" in report and "(node 1, 203.0.113.2:" in report, report
    failing = [line for line in report.splitlines() if "cannot reach" in line]
    assert len(failing) == 1, report  # node 1 reaches itself on its dummy address; node 0 cannot
    assert failing[0].strip().startswith("- host mrnode0 (node 0, 198.51.100.1) cannot reach"), report
    assert "network unreachable" in failing[0] or "no route to host" in failing[0], report
    assert "NCCL_SOCKET_IFNAME=mrside0" in report, report
    assert "communication variables on node 1: GLOO_SOCKET_IFNAME=^lo, " in report, report  # as set, not the stand-in
    rows = _rows(report)
    assert "node 1 (host mrnode1): GLOO_SOCKET_IFNAME=^lo uses NCCL's '^' syntax" in rows["fail socket interface"]
    assert "node 1 (host mrnode1): its route to node 0 (198.51.100.1) leaves through mrveth1, which " \
           "NCCL_SOCKET_IFNAME=mrside0 excludes" in rows["fail socket interface"], report
    assert "mrnode0" not in rows["fail socket interface"], report
    assert "node 1 (host mrnode1) is +5.0" in rows["warn clock skew"], report
    assert "mrnode0" not in rows["warn clock skew"], report
    assert "node 1 (host mrnode1): 1000 B in 1 file(s); the others: 4.0 KiB in 1 file(s)" in rows["fail dataset"]
    shared = rows["fail checkpoint folder"]
    assert "is not the same folder on every node: node 0 (host mrnode0) see the files of node(s) 0; " \
           "node 1 (host mrnode1) see the files of node(s) 1" in shared, report
    steps = report.split("what to run next", 1)[1]  # upstream first: interfaces before storage, failures first
    assert steps.index("socket interface") < steps.index("checkpoint folder") < steps.index("dataset") \
        < steps.index("clock skew"), report
