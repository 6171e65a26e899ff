"""`meshrun doctor` and `meshrun bench` through NCCL on every GPU of this machine (run on the GPU machine)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs at least 2 CUDA GPUs")]
OPS = ("allreduce", "allgather", "reducescatter", "broadcast", "alltoall", "sendrecv")


def _torchrun(*args: str, module: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(torch.cuda.device_count()), *(["-m", "meshrun"] if module else []), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=REPO)


def test_doctor_checks_nccl_all_reduce_and_the_speed_of_every_gpu(tmp_path):
    done = _torchrun("doctor", "--timeout", "2", "--ckpt-dir", str(tmp_path / "ck"), "--ckpt-bytes", "1G",
                     "--json", str(tmp_path / "doctor.json"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "all-reduce nccl: ok" in done.stdout and "all-reduce gloo: ok" in done.stdout
    assert f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}" in done.stdout
    assert re.search(r"^(pass|warn) GPU health: ", done.stdout, re.M), done.stdout
    assert "pass GPUs per node" in done.stdout and "pass checkpoint folder" in done.stdout, done.stdout
    # one entry per GPU; a Hopper GPU does hundreds of bf16 TFLOP/s and TB/s of copies
    health = json.loads((tmp_path / "doctor.json").read_text())["health"]
    assert sorted(h["device"] for h in health) == [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    assert all(h["gemm_tflops"] > 50 and h["mem_gbps"] > 500 for h in health), health


def test_bench_measures_every_operation_in_groups_and_pairs(tmp_path):
    out = tmp_path / "bench.json"
    done = _torchrun("bench", "all", "--sizes", "1M,64M", "--iters", "5", "--groups", "world,intra,inter",
                     "--pairs", "64M", "--json", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert (result["backend"], result["dtype"]) == ("nccl", "bfloat16")
    assert result["device"] == torch.cuda.get_device_name(0)
    assert [(r["group"], r["op"]) for r in result["rows"]] == [(g, op) for g in ("world", "intra") for op in OPS
                                                               for _ in range(2)]
    assert all(row["busbw_gbps"] > 0 for row in result["rows"]) and "inter" in result["skipped_groups"]
    n = torch.cuda.device_count()
    gbps = result["pairs"]["gbps"]
    assert all((gbps[a][b] is None) == (a == b) for a in range(n) for b in range(n))
    assert result["pairs"]["slowest"][2] == min(gbps[a][b] for a in range(n) for b in range(n) if a != b)
    assert "slowest link: rank" in done.stdout


def test_bench_figures_match_a_plain_torch_loop_within_3_percent(tmp_path):
    out = tmp_path / "vs.json"
    done = _torchrun(str(REPO / "benchmarks" / "collectives_vs_torch.py"), "--sizes", "1G", "--json", str(out),
                     module=False)
    assert done.returncode == 0, done.stdout + done.stderr
    record = json.loads(out.read_text())
    ratios = {row["op"]: row["ratio"] for row in record["collectives"]}
    assert set(ratios) == set(OPS)
    assert all(0.97 <= ratio <= 1.03 for ratio in ratios.values()), done.stdout
    for dev in record["devices"]:
        assert dev["gemm_tflops"] == pytest.approx(dev["plain_gemm_tflops"], rel=0.05), done.stdout
        assert dev["mem_gbps"] == pytest.approx(dev["plain_mem_gbps"], rel=0.05), done.stdout
