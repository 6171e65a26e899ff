"""The fast path on a GPU keeps the math (run on the GPU machine: ``pytest -m gpu tests/test_speed_gpu.py``).

* A training step makes no host-device synchronisation: with ``torch.cuda.set_sync_debug_mode("error")`` any
  synchronising call inside ``Trainer.train_step`` raises (metrics are read only at log steps).
* float8 matmuls (torchao) track bf16: over 200 steps of the small model every logged loss after step 20 is within
  0.1 of the bf16 run's and the last within 0.05 (float8 rounding is noise of about 0.01-0.03 here; a broken
  scaling diverges by more than 0.5 within a few steps).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--model.name=small", "--train.log_every=10", "--train.eval_every=0", "--checkpoint.final=false",
         "--data.max_bytes=2000000", "--run.progress=lines"]


def test_train_step_makes_no_host_sync(tmp_path):
    from meshrun.config import load_config
    from meshrun.train.trainer import Trainer

    job = load_config(None, [*SMALL, "--train.steps=20", "--health.check_versions=false", f"--run.dir={tmp_path}"])
    assert job.train.compile == "auto"  # the default: on, on a GPU
    trainer = Trainer(job)
    try:
        for _ in range(3):  # compile and allocator warm-up
            trainer.train_step()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(5):
                trainer.train_step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
    finally:
        trainer.close()


def _train(run_dir: Path, *extra: str) -> list[float]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "meshrun", "train", *SMALL, "--train.steps=200", f"--run.dir={run_dir}", *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r["kind"] == "train"]


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao (the .[float8] extra) not installed")
@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                    reason="float8 matmuls need compute capability 8.9 or newer")
def test_float8_tracks_bf16_over_200_steps(tmp_path):
    bf16 = _train(tmp_path / "bf16")
    fp8 = _train(tmp_path / "fp8", "--train.float8=true")
    assert len(bf16) == len(fp8) == 20
    diffs = [abs(a - b) for a, b in zip(bf16[2:], fp8[2:])]
    assert max(diffs) < 0.1, list(zip(bf16, fp8))
    assert abs(bf16[-1] - fp8[-1]) < 0.05, (bf16[-1], fp8[-1])
    assert fp8[-1] < fp8[0] - 1.0  # it trained
