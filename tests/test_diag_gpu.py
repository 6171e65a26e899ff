"""`meshrun doctor` and `meshrun bench` through NCCL on every GPU of this machine (run on the GPU machine)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs at least 2 CUDA GPUs")]


def _torchrun(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(torch.cuda.device_count()), "-m", "meshrun", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)


def test_doctor_checks_nccl_all_reduce_on_every_gpu():
    done = _torchrun("doctor", "--timeout", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "all-reduce nccl: ok" in done.stdout and "all-reduce gloo: ok" in done.stdout
    assert f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}" in done.stdout


def test_bench_measures_nccl_bandwidth(tmp_path):
    out = tmp_path / "bench.json"
    done = _torchrun("bench", "all", "--sizes", "1M,64M", "--iters", "5", "--json", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert (result["backend"], result["dtype"]) == ("nccl", "bfloat16")
    assert result["device"] == torch.cuda.get_device_name(0)
    assert len(result["rows"]) == 6 and all(row["busbw_gbps"] > 0 for row in result["rows"])
