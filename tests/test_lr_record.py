"""The ``lr`` of a ``train`` record is the rate its step trained with, not the next step's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from meshrun.train.schedule import lr_at


@pytest.mark.slow  # a process of its own: about 12 s
def test_each_train_record_names_the_rate_of_its_own_step(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "meshrun", "train", "--model.name=tiny", "--train.steps=6", "--train.warmup_steps=4",
           "--train.lr=0.004", "--train.min_lr=0.0004", "--train.log_every=1", "--train.eval_every=0",
           "--checkpoint.final=false", "--dist.device=cpu", f"--data.source={pytest.__file__}", f"--run.dir={run}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    logged = {r["step"]: r["lr"] for r in records if r.get("kind") == "train"}
    assert sorted(logged) == [1, 2, 3, 4, 5, 6]
    for step, rate in logged.items():  # step N (from 1) is optimizer step N - 1 (from 0)
        assert rate == pytest.approx(lr_at(step - 1, lr=0.004, min_lr=0.0004, warmup_steps=4, steps=6), rel=1e-6)
    assert logged[1] == pytest.approx(0.001) and logged[4] == pytest.approx(0.004)  # warm-up: 1/4, then the peak
