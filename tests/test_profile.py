"""run.profile_steps / --profile: options, the profiler's schedule in one process, and traces from 2 launched ranks."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from meshrun.config import ConfigError, load_config
from meshrun.train.cli import main as train_main
from meshrun.train.profiling import IntervalMachine, SlowdownWatch, StepProfiler, build_profiler
from meshrun.train.trainer import Trainer
from meshrun.watch.step_trace import run_step_time, trace_files

# ---- options (pure logic) -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("override, option", [
    ("--run.profile_steps=5-3", "run.profile_steps='5-3'"),
    ("--run.profile_steps=abc", "run.profile_steps='abc'"),
    ("--run.profile_steps=0-2", "run.profile_steps='0-2'"),
    ("--run.profile_steps=3-", "run.profile_steps='3-'"),
    ("--run.profile_steps=8-12", "run.profile_steps='8-12' ends after train.steps=10"),
    ("--run.profile_ranks=x", "run.profile_ranks='x'"),
    ("--run.profile_ranks=0,", "run.profile_ranks='0,'"),
    ("--run.profile_on_slowdown=1", "run.profile_on_slowdown=1.0 is out of range"),
    ("--run.profile_on_slowdown=-0.1", "run.profile_on_slowdown=-0.1 is out of range"),
])
def test_bad_profile_options_name_the_option(override, option):
    with pytest.raises(ConfigError) as info:
        load_config(None, ["--train.steps=10", override])
    assert str(info.value).startswith(option)


def test_good_profile_options_parse():
    run = load_config(None, ["--run.profile_steps=20-22", "--run.profile_ranks=0, 3"]).run
    assert run.profile_window() == (20, 22) and run.profiled_ranks() == {0, 3}
    run = load_config(None, ["--run.profile_steps=7", "--run.profile_ranks=all"]).run
    assert run.profile_window() == (7, 7) and run.profiled_ranks() is None
    assert load_config(None, []).run.profile_window() is None  # off by default


@pytest.mark.parametrize("steps, window", [(300, "10-12"), (12, "10-12"), (6, "4-6"), (2, "1-2"), (1, "1-1")])
def test_profile_flag_picks_steps_after_warm_up_within_the_run(capsys, steps, window):
    assert train_main(["--profile", f"--train.steps={steps}", "--print-config"]) == 0
    assert f'profile_steps = "{window}"' in capsys.readouterr().out


def test_profile_flag_keeps_explicit_steps(capsys):
    assert train_main(["--profile", "--run.profile_steps=30-31", "--print-config"]) == 0
    assert 'profile_steps = "30-31"' in capsys.readouterr().out


def test_ranks_beyond_the_world_and_windows_before_a_resume_are_caught_before_training(tmp_path):
    run, said = load_config(None, ["--run.profile_steps=3-4", "--run.profile_ranks=0,2"]).run, []
    where = dict(device=torch.device("cpu"), run_dir=tmp_path, say=said.append)
    with pytest.raises(ConfigError, match=r"run.profile_ranks='0,2' names rank 2, but the world size is 2"):
        build_profiler(run, rank=0, world_size=2, start_step=0, **where)
    assert build_profiler(run, rank=1, world_size=3, start_step=0, **where) is None  # not listed: no profiler
    assert build_profiler(run, rank=0, world_size=3, start_step=4, **where) is None  # resumed after the window
    assert said == [f"profile: steps 3-4 on rank(s) 0,2 -> {tmp_path}/profile/rank_<N>.json (top ops in "
                    "rank_<N>_summary.txt); open a trace in https://ui.perfetto.dev or chrome://tracing",
                    "profile: steps 3-4 were already done when this run resumed from step 4; nothing recorded "
                    "(choose later steps in run.profile_steps)"]


# ---- the schedule, in one process ------------------------------------------------------------------------------------


def _profile_loop(folder: Path, *, first: int, last: int, start_step: int, stop_after: int) -> list[str]:
    """Steps start_step+1..stop_after of a stand-in loop; returns the trace's step spans."""
    announced = []
    profiler = StepProfiler(first=first, last=last, start_step=start_step, rank=0, device=torch.device("cpu"),
                            folder=folder, announce=lambda: announced.append(True))
    profiler.start()
    try:
        for step in range(start_step + 1, stop_after + 1):
            torch.mm(torch.ones(8, 8), torch.ones(8, 8))
            profiler.step(step)
    finally:
        profiler.close()
    events = json.loads((folder / "rank_00000.json").read_text())["traceEvents"]
    assert announced == [True]
    return sorted(e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#"))


@pytest.mark.filterwarnings("ignore:Profiler won't be using warmup")
def test_schedule_records_the_window_and_what_a_resumed_run_has_left_of_it(tmp_path):
    # ProfilerStep#k counts the profiler's steps from 0 in this process: step s of a fresh run is #(s - 1)
    assert _profile_loop(tmp_path / "a", first=3, last=4, start_step=0, stop_after=6) == ["ProfilerStep#2",
                                                                                          "ProfilerStep#3"]
    # resumed at step 3 inside the window 3..5: steps 4 and 5 are the process's first two
    assert _profile_loop(tmp_path / "b", first=3, last=5, start_step=3, stop_after=6) == ["ProfilerStep#0",
                                                                                          "ProfilerStep#1"]


def test_a_stop_inside_the_window_writes_what_was_recorded(tmp_path):
    # stopped (SIGTERM or an error) after step 3 of the window 2..5: close() writes steps 2 and 3, and the one begun
    recorded = _profile_loop(tmp_path, first=2, last=5, start_step=0, stop_after=3)
    assert recorded[:2] == ["ProfilerStep#1", "ProfilerStep#2"]
    assert "aten::mm" in (tmp_path / "rank_00000_summary.txt").read_text()


# ---- run.profile_on_slowdown ---------------------------------------------------------------------------------------


def _watch(tmp_path, *, fraction=0.1, ranks=None, rank=0, window=None) -> SlowdownWatch:
    return SlowdownWatch(fraction, ranks=ranks, rank=rank, run_dir=tmp_path, device=torch.device("cpu"),
                         profile_steps=window)


def _feed(watch: SlowdownWatch, times, *, every=5, last_step=100):
    """Intervals of ``every`` steps with these step times; what each one returned."""
    return [watch.observe(step=every * (i + 1), interval_steps=every, step_s=t, last_step=last_step)
            for i, t in enumerate(times)]


def test_a_slowdown_is_judged_against_the_median_of_earlier_intervals_after_the_first(tmp_path):
    # the first interval (compilation: 5 s) is no reference; two earlier ones are needed; then 0.1112 s is 10% fewer
    # tokens/s than 0.1 s (fires), and only the first slowdown of the run is said
    found = _feed(_watch(tmp_path), [5.0, 0.1, 0.2, 0.1, 0.1112, 0.3])
    assert found[:4] == [None] * 4, "the first interval and too few references never count"
    line, record = found[4]
    assert found[5] is None, "once per run"
    assert line.startswith("slowdown: steps 21-25 took 111.2 ms each, 10% fewer tokens/s than the median of the run's "
                           "earlier intervals (100.0 ms); recording steps 27-28 on rank(s) all -> ")
    assert f"{tmp_path}/profile/slowdown_27-28/rank_<N>.json" in line
    assert record == {"kind": "slowdown", "step": 25, "steps": 5, "step_s": 0.1112, "median_step_s": 0.1,
                      "profile_steps": [27, 28]}
    assert _feed(_watch(tmp_path), [5.0, 0.1, 0.1, 0.1109])[3] is None, "under the fraction: no slowdown"


def test_a_slowdown_is_said_but_not_recorded_where_it_cannot_be(tmp_path):
    # too few steps left after it, and run.profile_steps still to come (one torch profiler at a time)
    line, record = _feed(_watch(tmp_path), [1.0, 0.1, 0.1, 0.2], last_step=21)[3]
    assert line.endswith("; too few steps left to record (run.profile_on_slowdown)") and record["profile_steps"] is None
    line, record = _feed(_watch(tmp_path, window=(40, 42)), [1.0, 0.1, 0.1, 0.2])[3]
    assert "not recorded: run.profile_steps is still to come" in line and record["profile_steps"] is None
    # the intervals holding the profiled steps, or the step after them (which writes the trace), are no slowdown
    assert _feed(_watch(tmp_path, window=(14, 15)), [1.0, 0.1, 0.1, 0.5], every=4)[3] is None  # steps 13-16
    assert _feed(_watch(tmp_path, window=(14, 15)), [1.0, 0.1, 0.1, 0.1, 0.5], every=4)[4] is not None  # 17-20


def _node(util, clock=1755, throttle="power cap"):
    return [{"kind": "system", "node": 0, "cpu_util_pct": 13.0,
             "gpus": [{"index": 0, "util_pct": util, "sm_clock_mhz": clock, "throttle": throttle},
                      {"index": 1, "util_pct": util - 2, "sm_clock_mhz": clock + 30}]}]


@pytest.mark.parametrize("util, share, says", [
    (91.0, 0.01, "the GPUs idled more than before: they waited on their hosts"),
    (99.0, 0.01, "the GPUs were as busy as before: slower kernels (clocks, heat) or longer collectives"),
    (60.0, 0.5, "the ranks waited for data"),
])
def test_a_slowdown_says_what_the_machine_did_in_it(tmp_path, util, share, says):
    # the earlier intervals' GPUs were 99% busy (the mean of two GPUs); the slow interval's figures say where to look
    watch = _watch(tmp_path)
    for step, step_s, busy in ((5, 1.0, 50.0), (10, 0.1, 100.0), (15, 0.1, 100.0)):
        assert watch.observe(step=step, interval_steps=5, step_s=step_s, last_step=100,
                             machine=IntervalMachine.of(_node(busy), 0.01)) is None
    line, record = watch.observe(step=20, interval_steps=5, step_s=0.2, last_step=100,
                                 machine=IntervalMachine.of(_node(util + 1), share))
    assert f"(100.0 ms); GPUs busy {util:.0f}% (99% before), lowest SM clock 1755 MHz (power cap), CPU 13%, data " \
           f"wait {share:.0%} of a step: {says}" in line
    assert record["gpu_util_pct"] == util and record["usual_gpu_util_pct"] == 99.0 and record["data_share"] == share
    cpu_only = IntervalMachine.of([{"kind": "system", "node": 0, "cpu_util_pct": 80.0}], 0.0)
    assert cpu_only.describe(None) == "CPU 80%, data wait 0% of a step: the trace will tell"


def test_only_the_listed_ranks_record_a_slowdown_and_they_write_what_it_was(tmp_path):
    unlisted = _watch(tmp_path, ranks=frozenset({0}), rank=1)
    line = _feed(unlisted, [1.0, 0.1, 0.1, 0.2])[3][0]
    assert "on rank(s) 0 ->" in line and unlisted.start(20) is None
    listed = _watch(tmp_path, ranks=frozenset({0}), rank=0)
    _feed(listed, [1.0, 0.1, 0.1, 0.2])
    profiler = listed.start(20)
    try:
        for step in (21, 22, 23):
            torch.mm(torch.ones(8, 8), torch.ones(8, 8))
            profiler.step(step)
    finally:
        profiler.close()
    folder = tmp_path / "profile" / "slowdown_22-23"
    steps = {e["name"] for e in json.loads((folder / "rank_00000.json").read_text())["traceEvents"]
             if e.get("name", "").startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#1", "ProfilerStep#2"}, "steps 22-23, after step 21's warm-up"
    assert json.loads((folder / "slowdown.json").read_text())["step_s"] == 0.2
    assert listed.start(24) is None, "one recording"


SLOW_STEP_S = 3.0
"""The wait for data of each of steps 10-12 in :func:`_slowing_run`. A step of the tiny model takes 10-50 ms here,
and up to 1.6 s with 2 gloo ranks on 2 cores loaded by CI's other tests (steps 4-6 of one CI run, where 1.5 s of
waiting made steps 10-12 only 25% slower than the median before them; a rank that sleeps also frees a core for the
other): 0.8 s and 1.5 s were not enough there."""


def _slowing_run(rank: int, world_size: int, run_dir: Path, *extra: str) -> str:
    """15 steps of the tiny model, logged every 3; rank ``world_size - 1`` waits SLOW_STEP_S for the data of each of
    steps 10-12, so that interval, the first one judged (against 4-6 and 7-9), runs far more than 30% under their
    median. Returns rank 0's log."""
    job = load_config(None, [f"--run.dir={run_dir}", "--train.steps=15", "--train.log_every=3", "--train.eval_every=0",
                             "--data.max_bytes=100000", "--run.progress=lines", "--health.straggler_threshold=0",
                             "--checkpoint.final=false", "--run.profile_on_slowdown=0.3", *extra])
    trainer = Trainer(job)
    next_step = trainer.data.next_step

    def slowed():
        if rank == world_size - 1 and 9 <= trainer.step <= 11:  # steps 10-12
            time.sleep(SLOW_STEP_S)
        return next_step()

    trainer.data.next_step = slowed
    try:
        trainer.fit()
    finally:
        trainer.close()
    return (run_dir / "logs" / f"rank_{rank:05d}.log").read_text()


def _slowdown_records(run_dir: Path) -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["kind"] == "slowdown"]


def test_a_run_that_slows_down_records_its_slow_steps_where_meshrun_trace_finds_them(tmp_path, capsys):
    _slowing_run(0, 1, tmp_path)
    out = capsys.readouterr().out
    assert "slowdown: steps 10-12 took" in out and "recording steps 14-15 on rank(s) 0" in out, out[-2000:]
    assert "of a step: the ranks waited for data (data.num_workers, the storage)" in out, out[-2000:]
    slow = _slowdown_records(tmp_path)
    assert len(slow) == 1 and slow[0]["profile_steps"] == [14, 15]
    # 1.5 s of the slow steps' time was the wait for data; their compute took 0.3 s of it on CI's loaded cores
    assert slow[0]["data_share"] > 0.5, slow[0]
    assert slow[0]["step_s"] > SLOW_STEP_S and slow[0]["median_step_s"] < 0.7 * slow[0]["step_s"]
    traces = trace_files([str(tmp_path)])
    assert traces == [tmp_path / "profile" / "slowdown_14-15" / "rank_00000.json"]
    steps = {e["name"] for e in json.loads(traces[0].read_text())["traceEvents"]
             if e.get("name", "").startswith("ProfilerStep#")}
    assert len(steps) == 2, steps
    assert run_step_time(traces[0]) is None, "a CPU trace has no GPU timeline"


def test_the_report_names_a_runs_slowdown_and_where_its_traces_are(tmp_path):
    from meshrun.report.load import Run
    from meshrun.report.page import layout_block

    run = Run(path=tmp_path, name="a", records=[
        {"kind": "start", "step": 0, "layout": "DDP (1 rank)", "world_size": 1},
        {"kind": "slowdown", "step": 12, "steps": 3, "step_s": 0.9, "median_step_s": 0.1, "profile_steps": [14, 15]},
        {"kind": "slowdown", "step": 29, "steps": 3, "step_s": 0.5, "median_step_s": 0.1, "profile_steps": None}])
    block = layout_block(run)
    assert (f"slowdown: steps 10-12 took 900.0 ms each against a median of 100.0 ms; traces in {tmp_path}/profile/"
            "slowdown_14-15/") in block
    assert "slowdown: steps 27-29 took 500.0 ms each against a median of 100.0 ms; not profiled" in block


@pytest.mark.slow
def test_one_slow_rank_makes_every_listed_rank_record(tmp_path):
    # rank 1 alone waits for data; rank 0 waits for rank 1 in the collectives, and both judge rank 0's step time
    # (gathered at the log step), so both record the same steps without a collective of their own
    from dist_utils import run_distributed

    logs = run_distributed(_slowing_run, 2, tmp_path, "--run.profile_ranks=all")
    assert "recording steps 14-15 on rank(s) all" in logs[0], logs[0][-3000:]
    assert [r["profile_steps"] for r in _slowdown_records(tmp_path)] == [[14, 15]]
    folder = tmp_path / "profile" / "slowdown_14-15"
    assert sorted(p.name for p in folder.glob("rank_*.json")) == ["rank_00000.json", "rank_00001.json"]


# ---- two ranks through the real launcher -----------------------------------------------------------------------------

# tiny model, one stdlib file as the corpus (workers start without walking the stdlib tree), nothing but training
TRAIN_ARGS = ["--model.name=tiny", "--train.steps=6", "--train.micro_batch=2", f"--data.source={argparse.__file__}",
              "--data.max_bytes=100000", "--train.eval_every=0", "--train.log_every=2", "--checkpoint.final=false",
              "--run.progress=lines", "--run.profile_steps=3-4"]


def _launch_train(run_dir: Path, *extra: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "meshrun", "launch", "--nproc-per-node", "2", "train", *TRAIN_ARGS,
                           f"--run.dir={run_dir}", *extra], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout


@pytest.mark.slow
def test_every_listed_rank_writes_a_trace_and_an_op_table(tmp_path):
    out = _launch_train(tmp_path, "--run.profile_ranks=all")
    folder = tmp_path / "profile"
    assert f"profile: steps 3-4 on rank(s) all -> {folder}/rank_<N>.json" in out and "ui.perfetto.dev" in out
    for rank in (0, 1):
        events = json.loads((folder / f"rank_{rank:05d}.json").read_text())["traceEvents"]
        assert any(e.get("name", "").startswith("aten::") for e in events)
        assert {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")} == {"ProfilerStep#2",
                                                                                               "ProfilerStep#3"}
        assert "aten::" in (folder / f"rank_{rank:05d}_summary.txt").read_text()


@pytest.mark.slow
def test_ranks_not_listed_write_nothing(tmp_path):
    out = _launch_train(tmp_path, "--run.profile_ranks=0")
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == ["rank_00000.json", "rank_00000_summary.txt"]
    assert "on rank(s) 0 ->" in out
