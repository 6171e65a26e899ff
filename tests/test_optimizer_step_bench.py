"""benchmarks/optimizer_step_bench.py on CPU: both AdamW rows, and meshrun's leaves no DTensorSpec behind."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_times_both_rows_and_counts_leftover_dtensor_specs():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, "-m", "meshrun", "launch", "--nproc-per-node", "2",
           str(ROOT / "benchmarks/optimizer_step_bench.py"), "--size", "tiny", "--n-layers", "4",
           "--steps", "3", "--repeat", "2", "--kernel", "fused"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    rows = {r["impl"]: r for r in (json.loads(line) for line in out.stdout.splitlines() if line.startswith("{"))}
    assert set(rows) == {"torch-adamw", "meshrun-local-shard-adamw"}
    for row in rows.values():
        assert row["ranks"] == 2 and row["kernel"] == "fused" and row["param_tensors"] == 4 * 9 + 2  # embedding, 4 blocks of 9, final norm
        assert 0 < row["host_ms_min_max"][0] <= row["host_ms"] <= row["host_ms_min_max"][1]
    assert rows["meshrun-local-shard-adamw"]["dtensor_specs_left_per_step"] == 0
