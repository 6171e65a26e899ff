"""The Python-API example trains a user-defined model the same way as 1 process and as 2 ranks under meshrun launch
(same global batch: losses within rtol 1e-5, the difference being the order of float sums in the all-reduce)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "custom_model.py"


def run(cmd, out):
    proc = subprocess.run(cmd + [str(EXAMPLE), "--steps", "15", "--out", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text())


@pytest.mark.slow
def test_custom_model_example_matches_single_process_under_launch(tmp_path):
    single = run([sys.executable], tmp_path / "single.json")
    launched = run([sys.executable, "-m", "meshrun", "launch", "--nproc-per-node", "2"], tmp_path / "two.json")
    assert (single["world_size"], launched["world_size"]) == (1, 2)
    assert single["losses"][-1] < single["losses"][0] - 0.2, "the example should learn"
    assert launched["losses"] == pytest.approx(single["losses"], rel=1e-5)
    assert launched["accuracy"] == pytest.approx(single["accuracy"], abs=1e-9)
