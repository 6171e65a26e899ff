"""Two hosts in network namespaces, each running `meshrun launch` with only --nnodes/--nproc-per-node/--rdzv-endpoint.

host0 (10.77.0.1) and host1 (10.77.0.2) are joined by a veth pair; traffic stays inside the two namespaces. Inside
them the hostname still resolves to 127.0.0.1, which is what breaks a plain torchrun here (no node hosts the
c10d store, and workers would be told MASTER_ADDR=localhost): meshrun must work it out from the routes.
"""

from __future__ import annotations

import json
import subprocess
import time

import pytest

pytestmark = [pytest.mark.netns, pytest.mark.slow]
pytest_plugins = ["netns"]  # the two_hosts fixture (tests/netns.py)

TRAIN_ARGS = ["--model.name=tiny", "--train.steps=5", "--data.max_bytes=200000", "--train.eval_every=0"]


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
