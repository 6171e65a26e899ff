"""`meshrun launch` end to end on this machine: real torch elastic agents, gloo workers, loopback only."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshrun.launch.net import free_port

pytestmark = pytest.mark.slow

# A script written for torchrun, unchanged: it reads torchrun's variables itself and uses env:// init.
TORCHRUN_SCRIPT = '''
import json, os, sys
import torch
import torch.distributed as dist

rank, world, local_rank = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
dist.init_process_group("gloo")
value = torch.tensor([float(rank + 1)])
dist.all_reduce(value)
result = {"rank": rank, "world": world, "local_rank": local_rank, "group_rank": int(os.environ["GROUP_RANK"]),
          "sum": value.item(), "marker": os.environ.get("MESHRUN_TEST_MARKER"),
          "nvls": os.environ.get("NCCL_NVLS_ENABLE"), "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME")}
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump(result, f)
dist.destroy_process_group()
sys.exit(int(os.environ.get("EXIT_CODE_ON_GROUP_RANK_1", "0")) if result["group_rank"] == 1 else 0)
'''


def launch(args: list[str], *, cwd: Path, env: dict[str, str] | None = None, timeout: float = 180):
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "meshrun", "launch", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})
    return proc, time.monotonic() - start


def results(out: Path) -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted(out.glob("rank*.json"))]


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "ddp_script.py"
    path.write_text(TORCHRUN_SCRIPT)
    return path


@pytest.mark.parametrize("nproc_flag", [["--nproc-per-node", "2"], ["--nproc_per_node=2"]])
def test_torchrun_script_runs_unchanged_and_sees_the_callers_environment(tmp_path, script, nproc_flag):
    out = tmp_path / "out"
    out.mkdir()
    proc, _ = launch([*nproc_flag, str(script), str(out)], cwd=tmp_path,
                     env={"MESHRUN_TEST_MARKER": "xyz", "NCCL_NVLS_ENABLE": "0"})
    assert proc.returncode == 0, proc.stderr
    got = results(out)
    # all_reduce of rank+1 over 2 ranks = 1 + 2, on both ranks
    assert [(r["rank"], r["local_rank"], r["world"], r["sum"]) for r in got] == [(0, 0, 2, 3.0), (1, 1, 2, 3.0)]
    assert all(r["marker"] == "xyz" and r["nvls"] == "0" for r in got)
    assert all(r["gloo_ifname"] is None for r in got)  # single host: no socket interface pinned
    assert "meshrun launch: 1 node(s) x 2 proc(s) = 2 workers" in proc.stderr


def test_simulated_nodes_get_distinct_group_ranks_and_failures_reach_the_exit_code(tmp_path, script):
    out = tmp_path / "out"
    out.mkdir()
    proc, _ = launch(["--simulate-nodes", "2", "--nproc-per-node", "1", str(script), str(out)], cwd=tmp_path,
                     env={"EXIT_CODE_ON_GROUP_RANK_1": "3"})
    got = results(out)
    assert sorted(r["group_rank"] for r in got) == [0, 1], proc.stderr
    assert all(r["world"] == 2 and r["sum"] == 3.0 for r in got)
    assert proc.returncode == 3, proc.stderr  # the worker on simulated node 1 exits 3 after its all_reduce
    assert "[agent 0] meshrun launch: 2 node(s)" in proc.stderr and "[agent 1]" in proc.stderr


RESTART_SCRIPT = '''
import json, os, sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
restart, group_rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["GROUP_RANK"])
if restart == 0 and group_rank == 1:
    sys.exit(3)  # node 1 fails the first attempt; node 0 is left in the all_reduce until its agent restarts it
value = torch.ones(1)
dist.all_reduce(value)
with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump({"group_rank": group_rank, "restart": restart, "sum": value.item()}, f)
dist.destroy_process_group()
'''


def test_simulated_nodes_restart_the_job_together(tmp_path):
    script, out = tmp_path / "restart_script.py", tmp_path / "out"
    script.write_text(RESTART_SCRIPT)
    out.mkdir()
    proc, _ = launch(["--simulate-nodes", "2", "--max-restarts", "1", "--rdzv-timeout", "60", str(script), str(out)],
                     cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    got = results(out)
    assert [(r["group_rank"], r["sum"]) for r in got] == [(0, 2.0), (1, 2.0)]
    # Node 1 failed once, so its workers run attempt 1. Node 0 restarts either because its worker failed
    # (count 1) or because its agent saw node 1 waiting first (a membership restart, which torch does not count).
    assert got[1]["restart"] == 1 and got[0]["restart"] in (0, 1)


def test_unreachable_endpoint_fails_within_the_timeout_naming_it(tmp_path, script):
    with socket.socket() as sock:  # bound, never listening: connections to it are refused
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        # is_host=0 makes this node a joiner, as on a host that does not own the endpoint address.
        proc, elapsed = launch(["--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-conf", "is_host=0",
                                "--rdzv-timeout", "3", str(script), str(tmp_path)], cwd=tmp_path)
    assert proc.returncode == 1
    first = proc.stderr.splitlines()[-1]
    assert first.startswith("meshrun launch: ") and f"rendezvous endpoint 127.0.0.1:{port}: connection refused" in first
    assert "127.0.0.1 on lo" in first and "start `meshrun launch` on 127.0.0.1 first" in first
    assert elapsed < 3 + 20  # the probe's 3 s plus interpreter start-up, never torch's 600 s


def test_missing_nodes_fail_the_rendezvous_within_the_timeout(tmp_path, script):
    port = free_port()
    proc, elapsed = launch(["--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-timeout", "4",
                            str(script), str(tmp_path)], cwd=tmp_path)
    assert proc.returncode == 1
    assert f"rendezvous at 127.0.0.1:{port} did not gather --nnodes 2 nodes within 4s" in proc.stderr
    assert elapsed < 4 + 25
