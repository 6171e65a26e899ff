"""Replica groups joined by torchft, through the real CLI: `meshrun lighthouse` and two `meshrun launch` jobs
(tests/replica_worker.py: `meshrun train` plus a per-step weight digest and one injected SIGKILL).

A group SIGKILLed while its cross-group all-reduce is in flight: the survivor discards at most that one step,
stalls at most the heartbeat timeout + 2 s, and trains alone; the killed group, started again, heals from the
survivor, and from the first step both groups ran to the end their weights are bitwise equal (1 rank per group,
and 2 ranks per group with FSDP inside).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torchft", reason="torchft is not installed (pip install 'meshrun[ft]')")

from test_fault_tolerance import stop_tree  # noqa: E402 - after the skip

WORKER = str(Path(__file__).with_name("replica_worker.py"))
HEARTBEAT_S = 2.0
TRAIN_ARGS = ["--model.name=tiny", "--train.micro_batch=2", f"--data.source={argparse.__file__}",
              "--data.max_bytes=100000", "--train.eval_every=0", "--train.log_every=1", "--run.progress=lines",
              "--replicas.groups=2", "--replicas.timeout_s=10", "--replicas.connect_timeout_s=5",
              "--health.straggler_threshold=0", "--health.check_versions=false"]


class Job:
    """A lighthouse and the replica groups of one run folder; everything still running at the end is SIGKILLed."""

    def __init__(self, tmp_path: Path, *, min_groups: int = 1, hosts: list | None = None):
        """``hosts``: network-namespace hosts (tests/netns.py), group g on hosts[g] and the lighthouse on hosts[0],
        listening on its address; else everything on this host's loopback."""
        self.tmp, self.procs, self.logs, self.hosts = tmp_path, [], [], hosts
        where = ["--host", hosts[0].addr] if hosts else []
        self.lighthouse = self._spawn(["lighthouse", *where, "--port", "0", "--heartbeat-timeout-s", str(HEARTBEAT_S),
                                       "--join-timeout-s", "1", "--min-groups", str(min_groups)], "lighthouse.log",
                                      host=hosts[0] if hosts else None)
        deadline = time.monotonic() + 30
        while not (found := re.search(r"listening on (\S+)", self.logs[0].read_text())):
            assert self.lighthouse.poll() is None and time.monotonic() < deadline, self.logs[0].read_text()
            time.sleep(0.05)
        self.address = found.group(1)

    def _spawn(self, args: list[str], log_name: str, env: dict[str, str] | None = None, host=None) -> subprocess.Popen:
        log = self.tmp / log_name
        command = [sys.executable, *args] if args[0] == WORKER else [sys.executable, "-m", "meshrun", *args]
        env = {**os.environ, **(env or {})}
        with log.open("w") as out:
            proc = (host.popen(command, stdout=out, stderr=subprocess.STDOUT, env=env) if host else
                    subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env))
        self.procs.append(proc)
        self.logs.append(log)
        return proc

    def group(self, group: int, *, nproc: int = 1, steps: int, extra: tuple[str, ...] = (), kill: str = "",
              pace_s: float = 0.0, log_name: str = "", gpu: bool = False) -> subprocess.Popen:
        """Group ``group`` under `meshrun launch --nproc-per-node nproc`, or as one plain process with nproc=0;
        ``gpu``: on GPU ``group`` alone (one GPU per group)."""
        env = {"MESHRUN_TEST_STEP_SLEEP": str(pace_s), "MESHRUN_TEST_ALONE_SLEEP": "1.0", "MESHRUN_TEST_KILL": kill,
               "OMP_NUM_THREADS": "1", **({"CUDA_VISIBLE_DEVICES": str(group)} if gpu else {})}
        launch = ["launch", "--nproc-per-node", str(nproc)] if nproc else []
        return self._spawn([*launch, WORKER, *TRAIN_ARGS, f"--train.steps={steps}",
                            f"--replicas.group={group}", f"--replicas.lighthouse={self.address}",
                            f"--run.dir={self.tmp / 'run'}", *extra], log_name or f"group_{group}.log", env,
                           host=self.hosts[group] if self.hosts else None)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                stop_tree(proc)


@pytest.fixture
def job(tmp_path):
    made: list[Job] = []

    def make(**kwargs) -> Job:
        made.append(Job(tmp_path, **kwargs))
        return made[-1]

    yield make
    for j in made:
        j.close()


def weights(run: Path, group: int, rank: int = 0) -> dict[int, dict]:
    """Step -> {sha, time} of a group's rank after each committed step (a later line for a step wins: a restart)."""
    path = run / f"group_{group}" / f"weights_rank_{rank}.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return {r["step"]: r for r in map(json.loads, lines)}


def records(run: Path, group: int, kind: str) -> list[dict]:
    lines = (run / f"group_{group}" / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, filter(None, lines)) if r.get("kind") == kind]


def wait_for(condition, what: str, job: Job, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in job.logs)
            pytest.fail(f"no {what} within {timeout}s\n{logs}")
        time.sleep(0.1)


def finish(proc: subprocess.Popen, job: Job, timeout: float = 180) -> None:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    if proc.returncode != 0:
        logs = "\n".join(f"--- {log.name}\n{log.read_text()[-4000:]}" for log in job.logs)
        pytest.fail(f"a group exited {proc.returncode}\n{logs}")


def kill_restart_heal(job_factory, tmp_path: Path, *, nproc: int, extra: tuple[str, ...] = (),
                      die_healing: bool = False, gpu: bool = False, hosts: list | None = None) -> None:
    """Both groups train; group 1 is SIGKILLed mid-all-reduce at step KILL; group 0 goes on alone; group 1 starts
    again (with ``die_healing``: first once more, SIGKILLed while it loads the survivor's state), heals, and both
    end at STEPS with equal weights and data positions at every step both ran."""
    # a group alone sleeps 1 s a step: the survivor still trains when the restarted group joins
    steps, kill, kills = (60 if die_healing else 40), 8, (2 if die_healing else 1)
    job = job_factory(hosts=hosts)
    run = tmp_path / "run"
    survivor = job.group(0, nproc=nproc, steps=steps, extra=extra, gpu=gpu)
    victim = job.group(1, nproc=nproc, steps=steps, extra=extra, kill=f"allreduce:{kill}", gpu=gpu)
    victim.wait(timeout=180)
    assert victim.returncode != 0, job.logs[-1].read_text()[-3000:]
    if die_healing:
        healing = job.group(1, nproc=nproc, steps=steps, extra=extra, kill="heal:1", log_name="group_1_healing.log",
                            gpu=gpu)
        healing.wait(timeout=180)
        assert healing.returncode != 0, job.logs[-1].read_text()[-3000:]
    restarted = job.group(1, nproc=nproc, steps=steps, extra=extra, log_name="group_1_restarted.log", gpu=gpu)
    finish(survivor, job)
    finish(restarted, job)

    # the survivor: at most the step of each kill discarded, and a stall of at most the heartbeat timeout + 2 s
    discarded = [r for r in records(run, 0, "replicas") if r.get("discarded")]
    assert len(discarded) <= kills, discarded
    mine = weights(run, 0)
    assert sorted(mine) == list(range(min(mine), steps + 1)) and min(mine) < kill  # (it may have healed at start)
    gaps = [(mine[s]["time"] - mine[s - 1]["time"] - mine[s]["paced"], s) for s in range(kill, steps + 1)]
    stall, at = max(gaps)  # the time between two commits beyond the test's own pacing
    assert stall <= HEARTBEAT_S + 2.0, f"the survivor stalled {stall:.2f} s before committing step {at}"
    live = {r["step"]: r["live_groups"] for r in records(run, 0, "train")}
    assert 1 in live.values() and live[steps] == 2, live  # alone after the kill, two again at the end

    # the restarted group healed from the survivor, and every step both ran has the same weights, bitwise
    healed = [r for r in records(run, 1, "replicas") if r.get("healed")]
    assert healed and healed[-1]["step"] > kill, healed
    for rank in range(nproc):
        a, b = weights(run, 0, rank), weights(run, 1, rank)
        shared = sorted(set(a) & set(b) - set(range(1, healed[-1]["step"] + 1)))
        assert shared and shared[-1] == steps, (sorted(a), sorted(b))
        different = [s for s in shared if a[s]["sha"] != b[s]["sha"] or a[s]["data"] != b[s]["data"]]
        assert not different, f"rank {rank}: weights or data positions differ at steps {different}"


@pytest.mark.slow
def test_group_killed_mid_allreduce_and_again_mid_heal_survivor_goes_on_and_restarted_group_heals(job, tmp_path):
    kill_restart_heal(job, tmp_path, nproc=1, die_healing=True)


@pytest.mark.slow
def test_fsdp_groups_of_two_ranks_survive_a_kill_mid_allreduce_and_heal(job, tmp_path):
    kill_restart_heal(job, tmp_path, nproc=2, extra=("--parallel.dp_shard=2", "--parallel.dp_replicate=1"))


@pytest.mark.gpu
def test_gpu_groups_nccl_across_groups_survive_a_kill_mid_allreduce_and_heal(job, tmp_path):
    """One GPU per group (CUDA_VISIBLE_DEVICES), NCCL inside torchft's cross-group process group."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    kill_restart_heal(job, tmp_path, nproc=1, gpu=True, extra=("--train.dtype=fp32",))


@pytest.mark.slow
def test_whole_job_loss_and_a_lost_lighthouse_resume_from_the_last_complete_checkpoint(job, tmp_path):
    """Plain-process groups that both must take part (min 2), checkpoints every 5 steps.
    1. Group 0, which writes the checkpoints, is SIGKILLed while writing step 15 (shards on disk, no manifest);
       group 1 cannot commit alone and stops after the quorum timeout: the whole job is lost.
    2. Started again, both resume from step 10 (the half-written 15 is never read) and repeat steps 11-15 bitwise as
       the first run computed them. Then the lighthouse is SIGKILLed: both stop within the quorum timeout with one
       line, group 0 saving the last committed step first.
    3. A new lighthouse and the same commands resume at that step: nothing lost."""
    run, checkpoints = tmp_path / "run", tmp_path / "run" / "checkpoints"
    extra = ("--checkpoint.interval_steps=5", "--replicas.min_groups=2", "--replicas.quorum_timeout_s=3")
    first = job(min_groups=2)
    saver = first.group(0, nproc=0, steps=200, extra=extra, kill="save:15")
    other = first.group(1, nproc=0, steps=200, extra=extra)
    saver.wait(timeout=180)
    other.wait(timeout=60)
    assert saver.returncode == -9 and other.returncode == 1, (saver.returncode, other.returncode)
    assert (checkpoints / "step_0000010" / "COMPLETE").exists() and not (checkpoints / "step_0000015").exists()
    assert list(checkpoints.glob(".step_0000015.tmp-*")), sorted(p.name for p in checkpoints.iterdir())
    before = {g: weights(run, g) for g in (0, 1)}
    assert all(max(before[g]) == 15 for g in (0, 1)), {g: sorted(before[g]) for g in (0, 1)}
    first.close()

    second = job(min_groups=2)
    procs = [second.group(g, nproc=0, steps=200, extra=extra, pace_s=0.1, log_name=f"resumed_{g}.log")
             for g in (0, 1)]
    wait_for(lambda: min(max(weights(run, g)) for g in (0, 1)) >= 18, "step 18 in both groups", second)
    stop_tree(second.lighthouse)
    lost_at = time.monotonic()
    for proc in procs:
        proc.wait(timeout=120)
    stopped_s = time.monotonic() - lost_at
    after = {g: weights(run, g) for g in (0, 1)}
    last = max(after[0])
    assert max(after[1]) == last and [proc.returncode for proc in procs] == [1, 1]
    assert stopped_s < 3 + 30, f"the groups took {stopped_s:.1f} s to stop"  # 3 s quorum timeout + a final save
    for g in (0, 1):
        log = (tmp_path / f"resumed_{g}.log").read_text()
        assert "resumed at step 10 " in log and "no quorum within replicas.quorum_timeout_s=3 s" in log
        assert [after[g][s]["sha"] for s in range(11, 16)] == [before[g][s]["sha"] for s in range(11, 16)]
        shared = range(11, last + 1)
        assert [after[g][s]["sha"] for s in shared] == [after[1 - g][s]["sha"] for s in shared]
    assert (checkpoints / f"step_{last:07d}" / "COMPLETE").exists()
    second.close()

    third = job(min_groups=2)
    procs = [third.group(g, nproc=0, steps=last + 2, extra=extra, log_name=f"again_{g}.log") for g in (0, 1)]
    for proc in procs:
        finish(proc, third)
    for g in (0, 1):
        assert f"resumed at step {last} " in (tmp_path / f"again_{g}.log").read_text()
        assert max(weights(run, g)) == last + 2
    manifest = json.loads((checkpoints / f"step_{last + 2:07d}" / "manifest.json").read_text())
    assert manifest["state"].get("replicas") == "ReplicaGroups", manifest["state"]  # the manager's state is saved


def test_group_that_cannot_reach_the_lighthouse_stops_with_one_line(tmp_path):
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
    address = f"127.0.0.1:{closed.getsockname()[1]}"
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "meshrun", "train", *TRAIN_ARGS, "--train.steps=2",
                           "--replicas.group=0", f"--replicas.lighthouse={address}", "--replicas.connect_timeout_s=1",
                           f"--run.dir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    closed.close()
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert errors == [f"meshrun train: error: replicas.lighthouse={address}: no lighthouse answers (Connection "
                      f"refused) after 1 s (replicas.connect_timeout_s); start one there with `meshrun lighthouse "
                      f"--port {address.rpartition(':')[2]}`, or fix the address"], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and time.monotonic() - started < 60


@pytest.mark.slow
def test_session_loop_with_two_groups_matches_one_process_over_both_shards(job, tmp_path):
    """Session.join_replicas in a user's loop: two one-process groups, each reading its own shard, end with the
    weights of one process that trains on both shards' samples each step (the mean gradient over all of them)."""
    import torch

    from meshrun.data.loader import StepBatches
    from replica_session_script import dataset

    lighthouse, steps = job(min_groups=2), 6
    script = str(Path(__file__).with_name("replica_session_script.py"))
    procs = [subprocess.Popen([sys.executable, script, str(g), lighthouse.address, str(tmp_path / f"g{g}.json"),
                               str(steps)], stdout=(tmp_path / f"s{g}.log").open("w"), stderr=subprocess.STDOUT,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}) for g in (0, 1)]
    lighthouse.procs += procs
    lighthouse.logs += [tmp_path / "s0.log", tmp_path / "s1.log"]
    for proc in procs:
        finish(proc, lighthouse, timeout=120)
    got = [json.loads((tmp_path / f"g{g}.json").read_text()) for g in (0, 1)]
    assert got[0] == got[1] and got[0]["live"] == 2  # bitwise the same weights in both groups

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    shards = [StepBatches(dataset(), dp_rank=r, dp_size=2, seed=0, micro_batch=4, grad_accum=1,
                          device=torch.device("cpu")) for r in (0, 1)]
    for _ in range(steps):
        (x0, y0), (x1, y1) = shards[0].next_step()[0], shards[1].next_step()[0]
        torch.nn.functional.mse_loss(model(torch.cat([x0, x1])), torch.cat([y0, y1])).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert torch.allclose(torch.tensor(got[0]["weight"]), model.weight, atol=1e-6)
    assert torch.allclose(torch.tensor(got[0]["bias"]), model.bias, atol=1e-6)
