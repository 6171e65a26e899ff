"""run.profile_steps / --profile: options, the profiler's schedule in one process, and traces from 2 launched ranks."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshrun.config import ConfigError, load_config
from meshrun.train.cli import main as train_main
from meshrun.train.profiling import StepProfiler, build_profiler

# ---- options (pure logic) -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("override, option", [
    ("--run.profile_steps=5-3", "run.profile_steps='5-3'"),
    ("--run.profile_steps=abc", "run.profile_steps='abc'"),
    ("--run.profile_steps=0-2", "run.profile_steps='0-2'"),
    ("--run.profile_steps=3-", "run.profile_steps='3-'"),
    ("--run.profile_steps=8-12", "run.profile_steps='8-12' ends after train.steps=10"),
    ("--run.profile_ranks=x", "run.profile_ranks='x'"),
    ("--run.profile_ranks=0,", "run.profile_ranks='0,'"),
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
