"""What losing a worker costs: today's restart path beside replica groups (docs/fault_tolerance.md's table).

    PYTHONPATH=src python benchmarks/node_loss.py [--repeats 2] [--pace 0.1]

Both paths run the same tiny GPT on 2 processes (gloo, CPU), steps paced to ``--pace`` s, with
tests/replica_worker.py as the training script (it records when each step committed, and injects the kill):

- restart: `meshrun launch --nproc-per-node 2 --max-restarts 1`, checkpoint every 10 steps; one worker SIGKILLed
  at step 15 (killed in its forward pass); torch's agent restarts the group, which resumes from step 10.
- replica groups: 2 groups x 1 process and a `meshrun lighthouse`; group 1 SIGKILLed at step 15 while group 0 is
  inside the cross-group all-reduce; group 0 goes on alone.

Printed per run: steps redone (or discarded), seconds without a committed step, and seconds from the kill until the
survivor is past the step it had reached.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = str(ROOT / "tests" / "replica_worker.py")
TRAIN = ["--model.name=tiny", "--train.micro_batch=2", f"--data.source={argparse.__file__}", "--data.max_bytes=100000",
         "--train.eval_every=0", "--train.log_every=1", "--run.progress=lines", "--health.straggler_threshold=0",
         "--health.check_versions=false", "--train.steps=40"]
KILL_STEP = 15


def spawn(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    with log.open("w") as out:
        return subprocess.Popen([sys.executable, *args], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1", **env})


def commits(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def measure(lines: list[dict], reached: int | None = None) -> tuple[int, float, float]:
    """(steps redone, longest time without a commit beyond the pacing, seconds from the last commit before the loss
    until a step past it commits). ``reached``: the survivor's last step before the loss; by default where the step
    sequence goes back (a resume)."""
    back = [i for i, (a, b) in enumerate(zip(lines, lines[1:])) if b["step"] <= a["step"]]
    last = back[0] if reached is None else next(i for i, r in enumerate(lines) if r["step"] == reached)
    reached = lines[last]["step"]
    after = lines[last + 1:]
    redone = sum(1 for r in after if r["step"] <= reached)
    gap = max(b["time"] - a["time"] - b.get("paced", 0.0) for a, b in zip(lines[last:], after))
    past = next(r for r in after if r["step"] > reached)["time"] - lines[last]["time"]
    return redone, gap, past


def restart_path(tmp: Path, pace: float) -> tuple[int, float, float]:
    run = tmp / "restart"
    env = {"MESHRUN_TEST_STEP_SLEEP": str(pace), "MESHRUN_TEST_KILL": f"forward:{KILL_STEP}"}
    proc = spawn(["-m", "meshrun", "launch", "--nproc-per-node", "2", "--max-restarts", "1", WORKER, *TRAIN,
                  "--checkpoint.interval_steps=10", f"--run.dir={run}"], tmp / "restart.log", env)
    if proc.wait(timeout=600):
        raise SystemExit(f"the restart run failed: {(tmp / 'restart.log').read_text()[-3000:]}")
    return measure(commits(run / "weights_rank_0.jsonl"))


def replica_path(tmp: Path, pace: float, heartbeat_s: float) -> tuple[int, float, float]:
    run = tmp / f"replicas_{heartbeat_s:g}"
    lighthouse = spawn(["-m", "meshrun", "lighthouse", "--port", "0", "--heartbeat-timeout-s", str(heartbeat_s),
                        "--join-timeout-s", "1"], tmp / "lighthouse.log", {})
    while not (found := re.search(r"listening on (\S+)", (tmp / "lighthouse.log").read_text())):
        time.sleep(0.05)
    args = [WORKER, *TRAIN, "--replicas.groups=2", f"--replicas.lighthouse={found.group(1)}", f"--run.dir={run}"]
    env = {"MESHRUN_TEST_STEP_SLEEP": str(pace), "MESHRUN_TEST_ALONE_SLEEP": str(pace)}
    groups = [spawn([*args, f"--replicas.group={g}"], tmp / f"group_{g}.log",
                    {**env, "MESHRUN_TEST_KILL": f"allreduce:{KILL_STEP}" if g else ""}) for g in (0, 1)]
    try:
        if groups[0].wait(timeout=600):
            raise SystemExit(f"the surviving group failed: {(tmp / 'group_0.log').read_text()[-3000:]}")
    finally:
        lighthouse.terminate()
        lighthouse.wait()
    lines = commits(run / "group_0" / "weights_rank_0.jsonl")
    discarded = sum(1 for line in (run / "group_0" / "metrics.jsonl").read_text().splitlines()
                    if '"discarded": true' in line)
    _, gap, past = measure(lines, KILL_STEP - 1)  # nothing is redone: a discarded step never committed
    return discarded, gap, past


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--pace", type=float, default=0.1)
    args = parser.parse_args()
    print("path | steps redone | s without a step | s until past the pre-kill step")
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            print("restart (checkpoint every 10) | %d | %.1f | %.1f" % restart_path(Path(tmp), args.pace), flush=True)
        for heartbeat in (2.0, 5.0):
            with tempfile.TemporaryDirectory() as tmp:
                print(f"replica groups (heartbeat {heartbeat:g} s) | %d | %.1f | %.1f"
                      % replica_path(Path(tmp), args.pace, heartbeat), flush=True)


if __name__ == "__main__":
    main()
