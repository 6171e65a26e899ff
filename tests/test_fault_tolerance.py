"""Fault injection through the real launcher: a worker SIGKILLed after a checkpoint is restarted by torch's elastic
agent (`meshrun launch --max-restarts`), the trainer resumes from the newest complete checkpoint, and the run ends
with parameters bitwise equal to an uninterrupted run of the same config (same world size, CPU, fp32, gloo).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from meshrun.ckpt.cli import main as ckpt_main
from meshrun.train.metrics import format_record

STEPS = 20
# small model, 2 samples per rank: about 0.5 s a step on 2 busy cores, so steps 10..20 leave seconds to kill in.
# One stdlib file as the corpus: workers start without walking the stdlib tree.
TRAIN_ARGS = ["--model.name=small", f"--train.steps={STEPS}", "--train.micro_batch=2",
              f"--data.source={argparse.__file__}", "--data.max_bytes=100000", "--train.eval_every=0",
              "--train.log_every=1", "--checkpoint.interval_steps=5", "--run.progress=lines"]
KILL_AFTER = "step_0000010"


@pytest.fixture
def launch():
    """Start `meshrun launch --nproc-per-node 2 [ARGS] train ...` for a run folder, output to a log file (a pipe
    nobody reads could fill). Whatever still runs when the test ends is SIGKILLed, launcher and workers."""
    started: list[subprocess.Popen] = []

    def start(run_dir: Path, log: Path, *launch_args: str) -> subprocess.Popen:
        with log.open("w") as out:
            started.append(subprocess.Popen(
                [sys.executable, "-m", "meshrun", "launch", "--nproc-per-node", "2", *launch_args, "train",
                 *TRAIN_ARGS, f"--run.dir={run_dir}"], stdout=out, stderr=subprocess.STDOUT, text=True))
        return started[-1]

    yield start
    for proc in started:
        if proc.poll() is None:
            stop_tree(proc)


def finish(proc: subprocess.Popen, log: Path, timeout: float) -> tuple[int, str]:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"meshrun launch did not finish within {timeout}s; output:\n{log.read_text()[-6000:]}")
    return proc.returncode, log.read_text()


def stop_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and the workers its agent started (its children), never anything else."""
    children = [pid for pid in _pids() if _parent(pid) == proc.pid]
    for pid in [proc.pid, *children]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def worker_pids(run_dir: Path) -> list[int]:
    """Training workers of this run: `python -m meshrun train ... --run.dir=<run_dir>`, not the launcher."""
    marker = f"--run.dir={run_dir}"
    found = []
    for pid in _pids():
        args = _cmdline(pid)
        if marker in args and "train" in args and "launch" not in args:
            found.append(pid)
    return found


def _pids() -> list[int]:
    return [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:  # gone meanwhile
        return []


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def complete_steps(run_dir: Path) -> list[int]:
    folder = run_dir / "checkpoints"
    return sorted(int(p.name.removeprefix("step_")) for p in folder.glob("step_*") if (p / "COMPLETE").exists())


def wait_for(condition, proc: subprocess.Popen, log: Path, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            pytest.fail(f"meshrun launch exited ({proc.returncode}) before {what}; output:\n{log.read_text()[-6000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {timeout}s; output:\n{log.read_text()[-6000:]}")
        time.sleep(0.05)


def train_records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, filter(None, lines)) if r.get("kind") == "train"]


def exported_weights(run_dir: Path, out: Path) -> dict:
    """`meshrun ckpt export` of the run's final checkpoint, read back with safetensors."""
    assert ckpt_main(["export", str(run_dir / "checkpoints" / f"step_{STEPS:07d}"), "--to", str(out)]) == 0
    return load_file(str(out))


@pytest.mark.slow
def test_sigkilled_worker_is_restarted_and_ends_bitwise_equal_to_an_uninterrupted_run(launch, tmp_path):
    cut, full = tmp_path / "cut", tmp_path / "full"
    cut_log, full_log = tmp_path / "cut.log", tmp_path / "full.log"

    proc = launch(cut, cut_log, "--max-restarts", "2")
    wait_for(lambda: (cut / "checkpoints" / KILL_AFTER / "COMPLETE").exists(), proc, cut_log, 150,
             f"checkpoint {KILL_AFTER}")
    victims = worker_pids(cut)
    assert len(victims) == 2, f"expected the 2 workers of {cut}, found pids {victims}"
    os.kill(victims[0], signal.SIGKILL)
    newest = complete_steps(cut)[-1]  # a save needs every rank, so none can complete after the kill
    assert newest < STEPS, f"the run finished before the kill (newest checkpoint {newest}); make steps slower"
    code, out = finish(proc, cut_log, timeout=150)
    assert code == 0, out[-6000:]
    code, full_out = finish(launch(full, full_log), full_log, timeout=150)
    assert code == 0, full_out[-6000:]

    # torch's agent saw the killed worker and restarted the group; the new workers resumed from the checkpoint
    assert "failed (exitcode: -9) local_rank: " in out and f"(pid: {victims[0]})" in out, out[-6000:]
    assert "meshrun launch: [default] Worker group FAILED. 2/2 attempts left; will restart worker group" in out
    assert out.count("meshrun train | torchrun: 1 node(s) x 2 process(es) = world size 2") == 2
    assert f"resumed at step {newest} " in out and "resumed at step" not in full_out
    records, reference = train_records(cut), train_records(full)
    assert [r["step"] for r in reference] == list(range(1, STEPS + 1))
    resumed_at = max(i for i, r in enumerate(records) if r["step"] == newest + 1)  # the last attempt's first step
    assert [r["step"] for r in records[:resumed_at]] == list(range(1, resumed_at + 1)) and resumed_at >= newest
    assert [r["step"] for r in records[resumed_at:]] == list(range(newest + 1, STEPS + 1))
    # every loss after the resume is the uninterrupted run's, exactly: the same fp32 operations in the same order
    assert [r["loss"] for r in records[resumed_at:]] == [r["loss"] for r in reference[newest:]]

    got = exported_weights(cut, tmp_path / "cut.safetensors")
    want = exported_weights(full, tmp_path / "full.safetensors")
    assert got.keys() == want.keys() and len(want) > 10
    different = [name for name in want if not (got[name].dtype == want[name].dtype and got[name].equal(want[name]))]
    assert not different, f"parameters differ from the uninterrupted run: {different}"


def test_eta_after_a_resume_counts_only_the_steps_run_since():
    record = {"kind": "train", "step": 12, "loss": 3.0, "lr": 1e-3, "tokens_per_s": 1.0, "tokens_per_s_per_device": 1.0}
    # resumed at step 10, two steps in 20 s here: 8 steps left take 80 s (not 20 s / 12 x 8)
    assert "ETA 1m20s" in format_record(record, 20, time.perf_counter() - 20.0, start_step=10)
    assert "ETA 0m13s" in format_record(record, 20, time.perf_counter() - 20.0)  # a fresh run: 20 s / 12 x 8
