"""Item: a rank that hangs inside forward/backward is named, the ranks waiting for it in a collective are told
apart, the verdict is printed on rank 0 and in the launcher's summary, and the job ends after the hang timeout.
Through the real launcher: 2 CPU ranks, rank 1 stuck in the model's forward at step 4 (tests/faults/hang_worker.py).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

HANG_TIMEOUT_S = 3
WORKER = str(Path(__file__).with_name("hang_worker.py"))
TRAIN_ARGS = ["--model.name=tiny", "--train.steps=30", "--train.micro_batch=2", f"--data.source={argparse.__file__}",
              "--data.max_bytes=100000", "--train.eval_every=0", "--train.log_every=1", "--checkpoint.final=false",
              "--dist.device=cpu", f"--health.hang_timeout_s={HANG_TIMEOUT_S}"]


def test_rank_stuck_outside_a_collective_is_named_and_the_job_ends(tmp_path):
    log = tmp_path / "launch.log"
    start = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.run([sys.executable, "-m", "meshrun", "launch", "--nproc-per-node", "2", WORKER, *TRAIN_ARGS,
                               f"--run.dir={tmp_path / 'run'}"], stdout=out, stderr=subprocess.STDOUT, timeout=150)
    wall = time.monotonic() - start
    text = log.read_text()
    lines = [line for line in text.splitlines() if line.strip()]
    assert proc.returncode == 124, text[-4000:]
    summary = lines[-1]
    assert summary.startswith("meshrun launch: the hang watchdog ended the job"), text[-4000:]
    verdict = re.search(r"hang: rank 1 \(host [^)]+\) is stuck at step 3 'forward_backward' outside any collective, "
                        r"(\d+) s in forward \(hang_worker\.py:\d+\); rank 0 is waiting for it in a collective",
                        summary)
    assert verdict, summary
    # time to diagnosis: the hang timeout plus at most two watchdog publications (0.75 s each) and a store read
    assert HANG_TIMEOUT_S <= int(verdict.group(1)) <= HANG_TIMEOUT_S + 3, summary
    # rank 0 printed the verdict itself (not only in its log file), once, before the launcher's summary
    assert sum(line.startswith("hang: rank 1") and "ending the job" in line for line in lines[:-1]) == 1, text[-4000:]
    assert wall < 120
