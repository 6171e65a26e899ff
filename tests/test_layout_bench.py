"""benchmarks/layout_bench.py: layout names to meshrun options (pure logic), and a whole run on CPU with gloo."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "layout_bench.py"


def load_script():
    spec = importlib.util.spec_from_file_location("layout_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["layout_bench"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


lb = load_script()


@pytest.mark.parametrize("name, overrides", [
    ("ddp", ["dp_replicate=-1", "dp_shard=1", "tp=1", "pp=1"]),
    ("fsdp4", ["dp_replicate=1", "dp_shard=4", "tp=1", "pp=1"]),
    ("dp2-fsdp4", ["dp_replicate=2", "dp_shard=4", "tp=1", "pp=1"]),
    ("dp2-tp2-pp2", ["dp_replicate=2", "dp_shard=1", "tp=2", "pp=2", "pp_schedule=1f1b"]),
    ("pp2-fsdp4-interleaved", ["dp_replicate=1", "dp_shard=4", "tp=1", "pp=2", "pp_schedule=interleaved1f1b"]),
])
def test_layout_names_become_mesh_degrees(name, overrides):
    layout = lb.parse_layout(name)
    assert layout.train_overrides() == [f"--parallel.{o}" for o in overrides]
    flags = layout.plan_flags()
    assert f"--tp={overrides[2].split('=')[1]}" in flags and f"--pp={overrides[3].split('=')[1]}" in flags
    assert any(f.startswith("--pp-schedule=") for f in flags) == ("pp_schedule" in overrides[-1])


def test_unknown_layout_word_is_refused_naming_it(capsys):
    with pytest.raises(SystemExit):
        lb.parse_args(["--layouts", "ddp,dp2-zp2"])
    assert "'zp2' in 'dp2-zp2' is not a layout word" in capsys.readouterr().err


def test_loss_difference_is_measured_against_the_first_layout_after_the_first_fifth():
    rows = [{"layout": "ddp", "tokens_per_s_per_gpu": 100.0, "losses": {10: 9.0, 50: 4.0, 100: 2.0}},
            {"layout": "tp2", "tokens_per_s_per_gpu": 50.0, "losses": {10: 5.0, 50: 4.2, 100: 2.02}},
            {"layout": "pp2", "error": "boom"}]
    lb.compare_losses(rows, steps=100)
    assert rows[1]["loss_max_rel_diff"] == pytest.approx(0.05)  # step 10 is in the first fifth, not counted
    assert rows[1]["vs_reference"] == pytest.approx(0.5) and rows[0]["loss_max_rel_diff"] == 0.0
    assert "loss_max_rel_diff" not in rows[2]


@pytest.mark.slow
def test_cpu_run_trains_each_layout_and_reports_plan_estimate(tmp_path):
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--size", "tiny", "--gpus", "2", "--steps", "8",
                           "--log-every", "2", "--layouts", "ddp,fsdp2", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [r["layout"] for r in rows] == ["ddp", "fsdp2"]
    for r in rows:
        assert r["tokens_per_s_per_gpu"] > 0 and sorted(r["losses"]) == ["2", "4", "6", "8"]
        assert 0 < r["plan_gib"] < 0.1  # the tiny model: megabytes, not gigabytes
    assert rows[0]["loss_max_rel_diff"] == 0.0 and rows[1]["loss_max_rel_diff"] < 0.1  # layouts draw their own init
    assert "fsdp2" in proc.stdout and "plan GiB" in proc.stdout
