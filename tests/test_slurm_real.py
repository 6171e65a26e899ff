"""A real two-node Slurm (tests/slurm_cluster.py): `meshrun slurm` jobs in both modes, and a job that reaches its
time limit, saves a checkpoint, and resumes from it when submitted again.

Slurm checks time limits every 30 s, so the time-limit job (--time=1) ends 60 to 90 s after it starts; the two mode
jobs and a job whose nodes run different worker counts (2 + 1) run meanwhile. Skipped, with the reason, only where Slurm cannot
start (not root, packages missing, a daemon that exits). To repeat the time-limit test:
    for i in 1 2 3 4 5; do python -m pytest tests/test_slurm_real.py -q -k time_limit || break; done
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_cluster import SlurmCluster, SlurmUnavailable, start_cluster

pytestmark = [pytest.mark.slow, pytest.mark.netns, pytest.mark.timeout(420)]

TRAIN = ["--model.name=tiny", "--data.max_bytes=200000", "--train.eval_every=0", "--train.micro_batch=2"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    try:
        started = start_cluster(tmp_path_factory.mktemp("slurm"))
    except SlurmUnavailable as exc:
        pytest.skip(f"Slurm cannot start on this machine: {exc}")
    try:
        yield started
    finally:
        started.stop()


def job_env(cluster: SlurmCluster) -> dict[str, str]:
    """The cluster's client environment, with this checkout's meshrun first (jobs inherit it: sbatch --export=ALL)."""
    return dict(cluster.env(), PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).parents[1] / "src"),
                                                                         os.environ.get("PYTHONPATH")])))


def submit(cluster: SlurmCluster, folder: Path, *args: str) -> str:
    """`meshrun slurm ... --submit` in ``folder``; returns the job id."""
    folder.mkdir(parents=True, exist_ok=True)
    env = job_env(cluster)
    done = subprocess.run([sys.executable, "-m", "meshrun", "slurm", "--script", "job.sbatch", "--submit", *args],
                          cwd=folder, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    match = re.search(r"Submitted batch job (\d+)", done.stdout)
    assert match, done.stdout + done.stderr
    return match.group(1)


def output(folder: Path, job_id: str) -> str:
    path = folder / f"slurm-{job_id}.out"
    return path.read_text(errors="replace") if path.exists() else ""


@pytest.fixture(scope="module")
def time_limit_job(cluster, tmp_path_factory):
    """A run far longer than its one-minute limit, submitted first so that the mode jobs run while it waits."""
    folder = tmp_path_factory.mktemp("timelimit")
    job = submit(cluster, folder, "--nodes", "2", "--time", "1", "--signal-lead", "0", "--no-requeue",
                 "--job-name", "limit", "train", *TRAIN, "--train.steps=100000", "--run.dir=run")
    return folder, job


def test_meshrun_slurm_jobs_in_both_modes_train_on_two_nodes(cluster, time_limit_job, uneven_job, tmp_path):
    jobs = {mode: submit(cluster, tmp_path / mode, "--nodes", "2", "--mode", mode, "--time", "5", "--job-name", mode,
                         "train", *TRAIN, "--train.steps=4", "--run.dir=run") for mode in ("per-node", "per-gpu")}
    for mode, job in jobs.items():
        state = cluster.wait_job(job, timeout=240)
        out = output(tmp_path / mode, job)
        assert state == "COMPLETED", f"{mode}: {state}\n{out}\n{cluster.logs()}"
        assert "node(s) x 1 process(es) = world size 2" in out, out
        logs = [(tmp_path / mode / "run" / "logs" / f"rank_0000{r}.log").read_text() for r in (0, 1)]
        where = sorted(re.search(r"on (n\d): node (\d) of 2", log).groups() for log in logs)
        assert where == [("n1", "0"), ("n2", "1")], logs
        assert "Traceback" not in out and "recvVector" not in out, out
    out = output(tmp_path / "per-node", jobs["per-node"])  # each node's block is prefixed; the node on n1 hosts
    assert "[node 0 n1] meshrun launch: 2 node(s)" in out and "[node 1 n2] meshrun launch: 2 node(s)" in out
    assert "[node 0 n1]   store       hosted here" in out, out


UNEVEN = """#!/bin/bash
#SBATCH --nodes=2 --ntasks-per-node=1 --cpus-per-task=2 --time=5 --output=slurm-%j.out
# each node's launcher brings its own worker count: 2 on node 0, 1 on node 1
srun -n 2 --ntasks-per-node=1 bash -c 'exec meshrun launch --nproc-per-node $((SLURM_NODEID == 0 ? 2 : 1)) "$@"' _ \\
  train {args}
"""


@pytest.fixture(scope="module")
def uneven_job(cluster, tmp_path_factory):
    """Submitted at the start too, so that it runs while the time-limit job waits for its limit."""
    folder = tmp_path_factory.mktemp("uneven")
    (folder / "uneven.sbatch").write_text(UNEVEN.format(args=" ".join([*TRAIN, "--train.steps=3", "--run.dir=run"])))
    done = subprocess.run(["sbatch", "--chdir", str(folder), str(folder / "uneven.sbatch")], env=job_env(cluster),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return folder, done.stdout.split()[-1]


def test_launchers_with_different_worker_counts_form_one_world_under_slurm(cluster, uneven_job):
    tmp_path, job = uneven_job
    state = cluster.wait_job(job, timeout=240)
    out = output(tmp_path, job)
    assert state == "COMPLETED", f"{state}\n{out}"
    assert "2 node(s) of different sizes = world size 3" in out, out
    assert "x 3 data-parallel ranks (2 node(s) of different sizes)" in out, out
    logs = [(tmp_path / "run" / "logs" / f"rank_0000{r}.log").read_text() for r in range(3)]
    placed = sorted(re.search(r"rank \d of 3 on (n\d): node \d of 2, local rank \d of (\d)", log).groups()
                    for log in logs)
    assert placed == [("n1", "2"), ("n1", "2"), ("n2", "1")], logs


def test_time_limit_ends_with_a_checkpoint_and_the_next_job_resumes(cluster, time_limit_job):
    folder, job = time_limit_job
    state = cluster.wait_job(job, timeout=240)
    out = output(folder, job)
    assert state == "TIMEOUT", f"{state}\n{out}\n{cluster.logs()}"
    saved = re.search(r"saving a final checkpoint at step (\d+)", out)
    assert saved, out
    step = int(saved.group(1))
    assert (folder / "run" / "checkpoints" / f"step_{step:07d}").is_dir(), out
    assert re.search(r"checkpoint step \d+ -> .* \(published", out), out
    again = submit(cluster, folder, "--nodes", "2", "--time", "5", "--job-name", "resume", "train", *TRAIN,
                   f"--train.steps={step + 2}", "--run.dir=run")
    state = cluster.wait_job(again, timeout=240)
    out = output(folder, again)
    assert state == "COMPLETED", f"{state}\n{out}"
    assert f"resumed at step {step} " in out, out
    assert f"step {step + 2:>6}/{step + 2}" in out or f"step {step + 2}" in out, out
