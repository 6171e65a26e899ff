"""An elastic 2-host job loses a host and finishes on the other: c10d rendezvous between two network-namespace
hosts (tests/netns.py), `--nnodes 1:2`, a shared run folder; host1 is SIGKILLed (launcher and worker, as a host
that loses power) after a checkpoint, and host0's agent re-forms the job alone and resumes at world size 1 with the
same global batch.

Rendezvous timing (torch's c10d dynamic rendezvous), bounded here through --rdzv-conf:
- host1's heartbeats stop when it dies; it counts as dead after keep_alive_interval x keep_alive_max_attempt
  (5 s x 3 by default, 2 s x 3 here). Until then host0 waits for the next round.
- with fewer than max nodes, the round completes last_call_timeout after min nodes joined (30 s by default, 5 s
  here). Both hosts start together, so both join the first round well within it. Had one been late, the agent of
  the other would restart its worker group to admit it, and the test would still pass.
- join_timeout is --rdzv-timeout (60 s here), which bounds each rendezvous round.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.netns, pytest.mark.slow]
pytest_plugins = ["netns"]  # the two_hosts fixture (tests/netns.py)

STEPS = 20
GLOBAL_BATCH = 4  # 2 ranks x 2 samples, then 1 rank x 2 samples x 2 accumulation
SEQ = 256  # model small
TRAIN_ARGS = ["--model.name=small", f"--train.steps={STEPS}", "--train.micro_batch=2",
              f"--train.global_batch={GLOBAL_BATCH}", f"--data.source={argparse.__file__}", "--data.max_bytes=100000",
              "--train.eval_every=0", "--train.log_every=1", "--checkpoint.interval_steps=5", "--run.progress=lines"]
RDZV_CONF = "last_call_timeout=5,keep_alive_interval=2,keep_alive_max_attempt=3"


def wait_for(condition, procs: list[subprocess.Popen], logs: list[Path], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if any(proc.poll() is not None for proc in procs) or time.monotonic() > deadline:
            pytest.fail(f"no {what} within {timeout}s (exit codes {[p.poll() for p in procs]});\n"
                        + "\n".join(f"--- {log.name}:\n{log.read_text()[-5000:]}" for log in logs))
        time.sleep(0.05)


def complete_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.name.removeprefix("step_")) for p in (run_dir / "checkpoints").glob("step_*")
                  if (p / "COMPLETE").exists())


def train_records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, filter(None, lines)) if r.get("kind") == "train"]


def test_elastic_job_loses_a_host_and_finishes_on_the_other_at_world_size_one(two_hosts, tmp_path, monkeypatch):
    # The keeper hosts the rendezvous store (the endpoint must outlive the job). The lost host has the lower
    # address, which c10d ranks first: it holds global rank 0 (the workers' store, metrics.jsonl, the checkpoint
    # coordinator), the harder host to lose.
    lost, keeper = two_hosts
    # Both "hosts" share this machine's cores: one intra-op thread each, or they oversubscribe the cores (here
    # 4 s instead of 0.5 s a step). The launchers pass it on to the workers.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    run_dir = tmp_path / "run"  # both namespaces see this machine's file system: shared storage
    args = ["--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "3", "--rdzv-endpoint",
            f"{keeper.addr}:29400", "--rdzv-timeout", "60", "--rdzv-conf", RDZV_CONF,
            "train", *TRAIN_ARGS, f"--run.dir={run_dir}"]
    logs = {host: tmp_path / f"{name}.log" for host, name in ((keeper, "keeper"), (lost, "lost"))}
    procs = {}
    for host, log in logs.items():  # the keeper first: it serves the store the other one probes for
        with log.open("w") as out:  # a file, not a pipe: nobody reads while the job runs
            procs[host] = host.launch(args, stdout=out, stderr=subprocess.STDOUT)

    wait_for(lambda: complete_steps(run_dir) != [], list(procs.values()), list(logs.values()), 150, "checkpoint")
    assert lost.kill_all(), "the lost host had no processes to kill"
    newest = complete_steps(run_dir)[-1]  # no save completes after the kill: it needs every rank
    assert newest < STEPS, f"the job finished before the host was lost (newest checkpoint {newest})"
    try:
        code = procs[keeper].wait(timeout=150)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the keeper did not finish within 150s after losing a host:\n{logs[keeper].read_text()[-6000:]}")
    out, lost_out = logs[keeper].read_text(), logs[lost].read_text()
    assert code == 0, f"keeper:\n{out[-6000:]}\nlost host:\n{lost_out[-3000:]}"
    assert procs[lost].wait(timeout=10) == -9

    # first both hosts trained together, then the keeper re-formed the job alone and resumed from the checkpoint
    header = r"meshrun train \| torchrun: (\d) node\(s\) x 1 process\(es\) = world size (\d)"
    assert ("2", "2") in re.findall(header, out + lost_out), (out + lost_out)[-6000:]
    after_loss = out[out.rindex("meshrun train | "):]
    assert after_loss.startswith("meshrun train | torchrun: 1 node(s) x 1 process(es) = world size 1"), after_loss
    assert f"resumed at step {newest} " in after_loss
    assert (f"global batch {GLOBAL_BATCH} = 2 per rank (B_local) x 1 data-parallel ranks (1 node(s) x 1 per node) x "
            "2 accumulation") in after_loss

    records = train_records(run_dir)
    last_attempt = max(i for i, r in enumerate(records) if r["step"] == newest + 1)
    assert [r["step"] for r in records[last_attempt:]] == list(range(newest + 1, STEPS + 1))
    # throughput per device: world size 2 before the loss, 1 after
    assert {round(r["tokens_per_s"] / r["tokens_per_s_per_device"]) for r in records[:newest]} == {2}
    assert {round(r["tokens_per_s"] / r["tokens_per_s_per_device"]) for r in records[last_attempt:]} == {1}
    assert records[-1]["tokens_seen"] == STEPS * GLOBAL_BATCH * SEQ  # the global batch was kept

    final = json.loads((run_dir / "checkpoints" / f"step_{STEPS:07d}" / "manifest.json").read_text())
    assert final["layout"]["world_size"] == 1 and final["layout"]["global_batch"] == GLOBAL_BATCH, final["layout"]
