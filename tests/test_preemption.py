"""Preemption signals: a SLURM time limit (a burst of SIGTERMs) or `--signal=USR1@N` ends a run with a published
checkpoint and exit code 143, never 0 and never a half-written save; the next run resumes from it."""

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

from meshrun.ckpt.cli import main as ckpt_main
from meshrun.ckpt.preemption import EXIT_PREEMPTED, install_sigterm_handler

STEPS = 40
# tiny model on one stdlib file: steps are fast, but 40 of them leave seconds after the first checkpoint (step 2)
TRAIN_ARGS = ["--model.name=tiny", f"--train.steps={STEPS}", "--train.micro_batch=2",
              f"--data.source={argparse.__file__}", "--data.max_bytes=100000", "--train.eval_every=0",
              "--train.log_every=1", "--checkpoint.interval_steps=2", "--run.progress=lines"]
FIRST = "step_0000002"


# ---------------------------------------------------------------- a rank whose peer ends first while it stops


class _PeerEndedFirst:
    """A trainer on rank 1 that got Ctrl-C and, before its checkpoint, lost its peer mid-collective (the other node's
    agent got the second Ctrl-C first and ended its worker at once)."""

    def __init__(self, job, *, stopping: bool):
        from types import SimpleNamespace

        from meshrun.ckpt.preemption import PreemptionFlag

        flag = PreemptionFlag()
        if stopping:
            flag.set("SIGINT")
        self.env, self.step = SimpleNamespace(rank=1), 4
        self.ckpt, self.folder = SimpleNamespace(preemption=flag), SimpleNamespace(opened=False)

    def fit(self):
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                           "[127.0.0.1]:17538")

    def close(self):
        pass


@pytest.mark.parametrize("stopping", [True, False])
def test_a_peer_ending_first_during_a_stop_is_the_stop_not_a_traceback(tmp_path, monkeypatch, capsys, stopping):
    from meshrun.config import load_config
    from meshrun.train import cli, trainer

    monkeypatch.setattr(trainer, "Trainer", lambda job: _PeerEndedFirst(job, stopping=stopping))
    code = cli.run(load_config(None, [f"--run.dir={tmp_path / 'run'}"]))
    err = capsys.readouterr().err
    if stopping:
        assert code == 130 and "Traceback" not in err, err
        assert err.strip().splitlines() == [
            f"meshrun train: rank 1 ({os.uname().nodename}) at step 4: stopping for Ctrl-C (SIGINT) when another rank "
            "ended first (no checkpoint of the current step); exit code 130."], err
    else:  # no stop under way: a peer's failure is this run's failure, with the hint and the traceback
        assert code == 1 and "a collective failed: another rank probably died" in err and "Traceback" in err, err


# ---------------------------------------------------------------- what the launcher records after a second Ctrl-C

def _killed_run(tmp_path, *, ckpt_records, complete, summary_time=None):
    """A run folder as a second Ctrl-C left it: rank 0 logged steps 10..395 and ``ckpt_records`` (step, final, time);
    ``complete``: the steps whose checkpoint directory holds COMPLETE; a summary.json written at ``summary_time``."""
    run_dir = tmp_path / "cc3"
    (run_dir / "checkpoints").mkdir(parents=True)
    records = [{"time": 1000.0, "kind": "start", "step": 0, "world_size": 2, "layout": "DDP"}]
    records += [{"time": 1000.0 + step, "kind": "train", "step": step, "loss": 3.0, "tokens_seen": step * 64}
                for step in range(10, 400, 5)]
    records += [{"time": time, "kind": "checkpoint", "step": step, "final": final}
                for step, final, time in ckpt_records]
    records.sort(key=lambda r: r["time"])
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    for step in complete:
        folder = run_dir / "checkpoints" / f"step_{step:07d}"
        folder.mkdir()
        (folder / "COMPLETE").write_text("")
    if summary_time is not None:
        (run_dir / "summary.json").write_text(json.dumps({"time": summary_time, "status": "stopped early",
                                                          "exit_reason": "stopped by SIGINT at step 390"}))
    return run_dir


def _runs_row(run_dir, capsys):
    from meshrun.report.runs import main as runs_main

    assert runs_main([str(run_dir.parent), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    return row


def test_train_folders_reads_run_dir_as_the_workers_do(tmp_path):
    from meshrun.launch.args import Target
    from meshrun.launch.run_record import train_folders

    toml = tmp_path / "job.toml"
    toml.write_text('[run]\ndir = "runs/from_toml"\n[checkpoint]\ndir = "/data/ckpt"\n')
    folders = train_folders(Target("meshrun", "train", ("--fresh", "--run.dir", "runs/cc3", "--train.steps=5")))
    assert (folders.run_dir, folders.checkpoints) == (Path("runs/cc3"), "runs/cc3/checkpoints")
    folders = train_folders(Target("meshrun", "train", ("--config", str(toml), "--profile")))
    assert (folders.run_dir, folders.checkpoints) == (Path("runs/from_toml"), "/data/ckpt")
    assert train_folders(Target("meshrun", "train", ())).run_dir == Path("runs/default")
    assert train_folders(Target("meshrun", "train", ("--no.such_option=1",))) is None, "the workers refuse it"
    assert train_folders(Target("script", "train.py", ("--run.dir", "x"))) is None


def test_a_second_ctrl_c_leaves_an_interrupted_summary_with_the_newest_published_checkpoint(tmp_path, capsys):
    """The workers were killed (SIGKILL) and wrote no summary.json: the launcher writes it, so that `meshrun runs`
    says interrupted, not running. An async save of step 390 recorded when staged, yet never published, is not
    the last checkpoint: the newest complete one (380) is."""
    from meshrun.launch.run_record import TrainFolders, record_killed_run

    run_dir = _killed_run(tmp_path, ckpt_records=[(380, False, 1380.0), (390, False, 1390.0)], complete=[380])
    killed = record_killed_run(TrainFolders(run_dir, str(run_dir / "checkpoints")), since=1200.0)
    assert killed.summary_written and killed.stop_checkpoint is None
    assert killed.outcome() == ("stopped at once by a second Ctrl-C (no checkpoint of step 395; the newest complete "
                                "one is step 380)")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["last_checkpoint_step"] == 380, summary
    assert summary["exit_reason"] == ("stopped at once by a second Ctrl-C at step 395 (no checkpoint of that step; "
                                      "newest checkpoint step 380)"), summary
    row = _runs_row(run_dir, capsys)
    assert (row["status"], row["last_checkpoint_step"], row["steps"]) == ("interrupted", 380, 395), row


@pytest.mark.parametrize("worker_wrote", [True, False], ids=["worker wrote summary", "no summary"])
def test_a_second_ctrl_c_after_the_stop_checkpoint_says_it_was_published(tmp_path, capsys, worker_wrote):
    """The second Ctrl-C came after the workers had published their stop checkpoint (step 390, final, recorded
    during this launch): the launcher's line says so, not 'no checkpoint of the current step'. A summary rank 0
    wrote during this launch is kept; without one the launcher writes 'stopped early' itself."""
    from meshrun.launch.run_record import TrainFolders, record_killed_run

    run_dir = _killed_run(tmp_path, ckpt_records=[(380, False, 1380.0), (390, True, 1396.0)], complete=[380, 390],
                          summary_time=1397.0 if worker_wrote else None)
    killed = record_killed_run(TrainFolders(run_dir, str(run_dir / "checkpoints")), since=1200.0)
    assert killed.stop_checkpoint == 390 and killed.summary_written is not worker_wrote
    assert killed.outcome() == ("stopped at once by a second Ctrl-C, after the workers had published the checkpoint "
                                "of step 390")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "stopped early" and summary["exit_reason"].startswith("stopped by SIGINT at step 390")
    if worker_wrote:
        assert summary["time"] == 1397.0, "the worker's own summary is kept"
    row = _runs_row(run_dir, capsys)
    assert (row["status"], row["last_checkpoint_step"]) == ("stopped early", 390), row


def test_a_summary_of_an_earlier_launch_is_replaced_and_no_run_folder_means_nothing_written(tmp_path):
    """A summary.json older than this launch is an earlier run's end: replaced. A final checkpoint recorded before
    this launch is not this launch's stop save. A target with no run folder here writes nothing."""
    from meshrun.launch.run_record import TrainFolders, record_killed_run

    run_dir = _killed_run(tmp_path, ckpt_records=[(200, True, 1200.0)], complete=[200], summary_time=1201.0)
    killed = record_killed_run(TrainFolders(run_dir, str(run_dir / "checkpoints")), since=1300.0)
    assert killed.summary_written and killed.stop_checkpoint is None
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "interrupted"
    nowhere = record_killed_run(TrainFolders(tmp_path / "none", str(tmp_path / "none" / "checkpoints")), since=0.0)
    assert nowhere.run_dir is None and not (tmp_path / "none").exists()
    assert record_killed_run(None, since=0.0).outcome() == ("stopped at once by a second Ctrl-C (workers killed; a "
                                                            "save still under way is not kept)")


# ---------------------------------------------------------------- the handler alone (one process, no training)

@pytest.fixture
def default_handlers():
    """SIGTERM and SIGUSR1 at their defaults during the test, whatever an earlier test in this process left."""
    saved = {signum: signal.signal(signum, signal.SIG_DFL) for signum in (signal.SIGTERM, signal.SIGUSR1)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def test_a_burst_of_signals_within_the_grace_window_only_sets_the_flag(default_handlers):
    flag = install_sigterm_handler(grace_s=30.0)
    try:
        for signum in (signal.SIGTERM, signal.SIGTERM, signal.SIGUSR1, signal.SIGTERM):  # slurmstepd + launcher
            os.kill(os.getpid(), signum)
        assert flag.is_set() and flag.signal_name == "SIGTERM" and flag.ignored == 3
    finally:
        flag.restore()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL and signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL


def test_sigusr1_sets_the_flag_and_a_repeat_after_the_window_runs_the_previous_handler(default_handlers):
    seen: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    try:
        flag = install_sigterm_handler(grace_s=0.0)  # every repeat is 'after the window'
        os.kill(os.getpid(), signal.SIGUSR1)
        assert flag.is_set() and flag.signal_name == "SIGUSR1" and seen == []
        os.kill(os.getpid(), signal.SIGUSR1)  # restores the recording handler and re-sends the signal to it
        assert seen == [signal.SIGUSR1] and flag.ignored == 0
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, "the repeat restored every handler"
    finally:
        signal.signal(signal.SIGUSR1, previous)


# ---------------------------------------------------------------- through the real CLI

def start(cmd: list[str], run_dir: Path, log: Path) -> subprocess.Popen:
    with log.open("w") as out:
        return subprocess.Popen([sys.executable, "-m", "meshrun", *cmd, *TRAIN_ARGS, f"--run.dir={run_dir}"],
                                stdout=out, stderr=subprocess.STDOUT, text=True)


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            pass
    return found


def wait_for_checkpoint(proc: subprocess.Popen, run_dir: Path, log: Path) -> None:
    deadline = time.monotonic() + 30
    while not (run_dir / "checkpoints" / FIRST / "COMPLETE").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"no checkpoint {FIRST} (exit {proc.poll()}); output:\n{log.read_text()[-6000:]}")
        time.sleep(0.02)


def finish(proc: subprocess.Popen, log: Path, timeout: float = 35) -> str:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in [*children(proc.pid), proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
        pytest.fail(f"not finished within {timeout}s; output:\n{log.read_text()[-6000:]}")
    return log.read_text()


def running(pid: int) -> bool:
    """The process exists and is not a zombie (one that exits while we look counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def ctrl_c_twice(proc: subprocess.Popen, log: Path, timeout: float) -> tuple[str, float]:
    """Ctrl-C, and again as soon as a worker says it got the first, as a user pressing it again: the output, and the
    seconds until the process ended. (A fixed 50 ms between them flaked on a loaded machine: two SIGINTs that reach
    a Python process before its main thread runs again call its handler once, so the launcher saw one Ctrl-C.)"""
    acknowledged = "again to stop at once"
    before = log.read_text().count(acknowledged)
    os.kill(proc.pid, signal.SIGINT)
    deadline = time.monotonic() + 10
    while log.read_text().count(acknowledged) == before and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGINT)
    started = time.monotonic()
    out = finish(proc, log, timeout=timeout)
    return out, time.monotonic() - started


def complete_steps(run_dir: Path) -> list[int]:
    folder = run_dir / "checkpoints"
    return sorted(int(p.name.removeprefix("step_")) for p in folder.glob("step_*") if (p / "COMPLETE").exists())


def assert_stopped_with_a_checkpoint(proc: subprocess.Popen, out: str, run_dir: Path, signal_name: str, *,
                                     label: str | None = None, code: int = EXIT_PREEMPTED) -> int:
    """``label``: how the messages name the signal (``signal_name`` unless given)."""
    label = label or signal_name
    assert proc.returncode == code, out[-6000:]
    newest = complete_steps(run_dir)[-1]
    assert 2 <= newest < STEPS, f"newest checkpoint {newest}: the signal came after the end; make the run longer"
    assert f"stopping at step {newest} after {label} (checkpoint saved)" in out, out[-6000:]
    assert f"meshrun train: stopped at step {newest} of {STEPS} by {label}" in out, out[-6000:]
    assert not list((run_dir / "checkpoints").glob("*.tmp*")), "a save was left half-written"
    assert ckpt_main(["verify", str(run_dir / "checkpoints" / f"step_{newest:07d}")]) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "stopped early" and summary["exit_reason"].startswith(f"stopped by {signal_name}")
    assert summary["last_checkpoint_step"] == newest and summary["steps"] <= newest
    return newest


@pytest.mark.slow
def test_time_limit_burst_of_sigterms_under_launch_saves_exits_143_and_resumes(tmp_path):
    """slurmstepd's SIGTERM, SIGCONT, SIGTERM reach the launcher and both workers; the launcher forwards one more:
    each worker sees 3-4 SIGTERMs within about 10 ms, yet saves, publishes and exits 143."""
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    proc = start(["launch", "--nproc-per-node", "2", "train"], run_dir, log)
    wait_for_checkpoint(proc, run_dir, log)
    workers = children(proc.pid)
    assert len(workers) == 2, f"expected the launcher's 2 workers, found {workers}"
    for signum in (signal.SIGTERM, signal.SIGCONT, signal.SIGTERM, signal.SIGTERM):
        for pid in (proc.pid, *workers):
            os.kill(pid, signum)
        time.sleep(0.003)
    out = finish(proc, log)
    newest = assert_stopped_with_a_checkpoint(proc, out, run_dir, "SIGTERM")
    assert f"exit code {EXIT_PREEMPTED}" in out and "forwarded to the workers" in out, out[-6000:]

    resumed_log = tmp_path / "resumed.log"
    resumed = start(["launch", "--nproc-per-node", "2", "train"], run_dir, resumed_log)
    out = finish(resumed, resumed_log)
    assert resumed.returncode == 0, out[-6000:]
    assert f"resumed at step {newest} " in out and complete_steps(run_dir)[-1] == STEPS, out[-6000:]
    summary = json.loads((run_dir / "summary.json").read_text())  # the whole run: both starts, one restart
    assert (summary["status"], summary["steps"], summary["restarts"]) == ("finished", STEPS, 1)


@pytest.mark.slow
def test_sigusr1_stops_a_direct_run_with_a_checkpoint_and_exit_143(tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    proc = start(["train"], run_dir, log)
    wait_for_checkpoint(proc, run_dir, log)
    os.kill(proc.pid, signal.SIGUSR1)
    out = finish(proc, log)
    assert "User defined signal" not in out
    assert_stopped_with_a_checkpoint(proc, out, run_dir, "SIGUSR1")


@pytest.mark.slow
def test_sigusr1_to_the_launcher_reaches_the_worker(tmp_path):
    """`--signal=B:USR1@N` with an sbatch script that forwards it to `meshrun launch` only: torch's agent does not
    handle SIGUSR1 (it would kill the launcher); meshrun's launcher forwards it to the workers."""
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    proc = start(["launch", "--nproc-per-node", "1", "train"], run_dir, log)
    wait_for_checkpoint(proc, run_dir, log)
    os.kill(proc.pid, signal.SIGUSR1)
    out = finish(proc, log)
    assert_stopped_with_a_checkpoint(proc, out, run_dir, "SIGUSR1")


@pytest.mark.slow
@pytest.mark.parametrize("launch", [False, True], ids=["one process", "launch with 2 ranks"])
def test_ctrl_c_saves_and_exits_130_and_a_second_ctrl_c_stops_at_once(tmp_path, launch):
    """The first Ctrl-C is a stop request: one line, a final checkpoint, exit 130, no traceback from any rank. A
    second Ctrl-C ends the run at once, again without a traceback (one process here; under launch, where the launcher
    kills its workers, in the next test). A terminal sends
    SIGINT to the foreground process (torch starts each worker in a session of its own, so under launch only the
    launcher gets it, as here)."""
    command = ["launch", "--nproc-per-node", "2", "train"] if launch else ["train"]
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    proc = start(command, run_dir, log)
    wait_for_checkpoint(proc, run_dir, log)
    os.kill(proc.pid, signal.SIGINT)
    out = finish(proc, log)
    assert_stopped_with_a_checkpoint(proc, out, run_dir, "SIGINT", label="Ctrl-C (SIGINT)", code=130)
    assert "run the same command to resume" in out and "press Ctrl-C again to stop at once" in out, out[-6000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-6000:]
    if launch:
        assert "meshrun launch: Ctrl-C (SIGINT)" in out and "exit code 130" in out, out[-6000:]
        return

    second_log = tmp_path / "second.log"
    resumed = start(command, run_dir, second_log)
    deadline = time.monotonic() + 30
    while "resumed at step" not in second_log.read_text():
        assert resumed.poll() is None and time.monotonic() < deadline, second_log.read_text()[-6000:]
        time.sleep(0.02)
    out, _ = ctrl_c_twice(resumed, second_log, timeout=15)
    assert resumed.returncode in (130, -signal.SIGINT), out[-6000:]  # -2: the system ended it (the shell says 130)
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-6000:]


@pytest.mark.slow
def test_a_second_ctrl_c_under_launch_stops_both_ranks_at_once(tmp_path):
    """Under `meshrun launch` with 2 ranks, two Ctrl-C in a row: the launcher kills its workers (each in a session of
    its own) instead of waiting for their save, exits 130 within seconds and says so, and no worker is left."""
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    proc = start(["launch", "--nproc-per-node", "2", "train"], run_dir, log)
    wait_for_checkpoint(proc, run_dir, log)  # training runs on both ranks
    workers = [pid for agent in children(proc.pid) for pid in [agent, *children(agent)]]
    assert len(workers) >= 2, f"expected the launcher's 2 workers among its children, found {workers}"
    out, seconds = ctrl_c_twice(proc, log, timeout=30)
    assert proc.returncode == 130 and seconds < 15, out[-6000:]
    assert "stopped at once by a second Ctrl-C" in out and "Traceback" not in out, out[-6000:]
    left = [pid for pid in workers if running(pid)]
    assert not left, f"workers still running after the second Ctrl-C: {left}"
    assert_the_run_folder_says_how_it_ended(run_dir, out)


def assert_the_run_folder_says_how_it_ended(run_dir: Path, out: str) -> None:
    """After a second Ctrl-C the run folder holds summary.json (the launcher writes it for the workers it killed),
    `meshrun runs` shows the run as ended rather than running, and the launcher's last line names what was kept."""
    summary = json.loads((run_dir / "summary.json").read_text())
    newest = complete_steps(run_dir)[-1]
    assert summary["last_checkpoint_step"] == newest, (summary, out[-6000:])
    last = [line for line in out.splitlines() if "meshrun launch: Ctrl-C (SIGINT)" in line][-1]
    if summary["status"] == "interrupted":  # killed before the stop checkpoint: the usual case
        assert summary["exit_reason"].startswith("stopped at once by a second Ctrl-C at step"), summary
        assert f"the newest complete one is step {newest})" in last, last
    else:  # the workers had published their stop checkpoint before the second Ctrl-C came
        assert summary["status"] == "stopped early", summary
        assert f"after the workers had published the checkpoint of step {newest}" in last, last
    runs = subprocess.run([sys.executable, "-m", "meshrun", "runs", str(run_dir), "--json"], capture_output=True,
                          text=True, timeout=60)
    (row,) = json.loads(runs.stdout)
    assert row["status"] in ("interrupted", "stopped early") and row["last_checkpoint_step"] == newest, row


@pytest.mark.slow
def test_ctrl_c_under_simulated_nodes_saves_exits_130_and_a_second_ctrl_c_stops_at_once(tmp_path):
    """`meshrun launch --simulate-nodes 2`: a terminal's Ctrl-C reaches the parent only (each agent runs in a session
    of its own); it forwards it once to every agent, which forwards it to its workers: a checkpoint, exit 130, no
    traceback, the same as under a plain launch. Started again, it resumes; two Ctrl-C in a row stop it at once."""
    command = ["launch", "--simulate-nodes", "2", "--nproc-per-node", "1", "train"]
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    proc = start(command, run_dir, log)
    wait_for_checkpoint(proc, run_dir, log)
    os.kill(proc.pid, signal.SIGINT)
    out = finish(proc, log, timeout=60)
    newest = assert_stopped_with_a_checkpoint(proc, out, run_dir, "SIGINT", label="Ctrl-C (SIGINT)", code=130)
    assert "run the same command to resume" in out and "Traceback" not in out, out[-6000:]
    assert "meshrun launch: Ctrl-C (SIGINT): forwarded to every agent" in out and "exit code 130." in out, out[-6000:]

    second_log = tmp_path / "second.log"
    resumed = start(command, run_dir, second_log)
    deadline = time.monotonic() + 60
    while f"resumed at step {newest} " not in second_log.read_text():
        assert resumed.poll() is None and time.monotonic() < deadline, second_log.read_text()[-6000:]
        time.sleep(0.02)
    out, seconds = ctrl_c_twice(resumed, second_log, timeout=30)
    assert resumed.returncode == 130 and seconds < 15, out[-6000:]
    assert "stopped at once by a second Ctrl-C" in out and "Traceback" not in out, out[-6000:]
    assert_the_run_folder_says_how_it_ended(run_dir, out)
