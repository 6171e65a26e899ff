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


# ---- the Session examples with optional extras (skipped, with the reason, where the extra is not installed) -----

def run_example(name: str, launch: bool, *argv: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, *(["-m", "meshrun", "launch", "--nproc-per-node", "2"] if launch else []),
           str(ROOT / "examples" / name), *argv]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@pytest.mark.slow
def test_digits_example_fsdp_matches_single_process(tmp_path):
    pytest.importorskip("sklearn", reason="scikit-learn is not installed (pip install -e '.[examples]')")
    run_example("digits_classifier.py", False, "--steps", "20", "--out", str(tmp_path / "one.json"))
    run_example("digits_classifier.py", True, "--layout", "fsdp", "--steps", "20", "--out", str(tmp_path / "two.json"))
    one, two = (json.loads((tmp_path / f).read_text()) for f in ("one.json", "two.json"))
    assert (one["world_size"], two["world_size"]) == (1, 2)
    assert one["losses"][-1] < one["losses"][0] - 1.0 and one["accuracy"] > 0.7, "the example should learn"
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-5)
    assert two["accuracy"] == one["accuracy"]  # summed correct / summed total: exact


@pytest.mark.slow
def test_hf_example_tp_fsdp_resume_at_another_world_size_and_export(tmp_path):
    pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")
    ckpt = str(tmp_path / "ckpt")
    run_example("hf_llama.py", False, "--steps", "6", "--out", str(tmp_path / "one.json"))
    run_example("hf_llama.py", True, "--layout", "tp", "--steps", "6", "--out", str(tmp_path / "tp.json"))
    # FSDP2 on 2 ranks saves step 4; one process resumes it for steps 5-6
    run_example("hf_llama.py", True, "--layout", "fsdp", "--steps", "4", "--save-every", "4", "--ckpt", ckpt)
    run_example("hf_llama.py", False, "--steps", "6", "--ckpt", ckpt, "--out", str(tmp_path / "resumed.json"))
    one, tp, resumed = (json.loads((tmp_path / f).read_text()) for f in ("one.json", "tp.json", "resumed.json"))
    assert one["losses"][-1] < one["losses"][0] - 0.5, "the example should learn"
    assert tp["losses"] == pytest.approx(one["losses"], rel=1e-5)
    assert resumed["start"] == 4 and resumed["losses"] == pytest.approx(one["losses"][4:], rel=1e-5)
    out = subprocess.run([sys.executable, "-m", "meshrun", "ckpt", "export", f"{ckpt}/step_0000006", "--to",
                          str(tmp_path / "llama.safetensors")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "21 tensors" in out.stdout, out.stdout + out.stderr
