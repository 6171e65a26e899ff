"""Communication beside compute: parallel.comm_reorder (inductor reorders the collectives inside compiled graphs) and
parallel.pp_p2p_channels (NCCL's channels for a pipeline's sends and receives): where each is on, the errors for
bad input, and (slow) that a TP 2 run with the reordering trains exactly like one without.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshrun.comm.mesh import ParallelDims
from meshrun.config import ConfigError
from meshrun.config_load import load_config
from meshrun.models.gpt import gpt_config
from meshrun.models.spec import get_model_spec
from meshrun.parallel.checks import AUTO_P2P_CHANNELS, check_layout, p2p_channels, use_comm_reorder
from meshrun.parallel.comm_overlap import P2P_VAR, REORDER_PASSES, enable_comm_reorder, set_p2p_channels
from meshrun.parallel.kernels import describe_speed


def _job_dims(*overrides: str, world_size: int = 2):
    job = load_config(None, ["--model.name=tiny", "--parallel.dp_replicate=1", *overrides])
    dims = ParallelDims.from_config(job.parallel, world_size=world_size, model=gpt_config("tiny", n_layers=4),
                                    spec=get_model_spec("gpt"))
    return job, dims


@pytest.mark.parametrize(("overrides", "device", "expected"), [
    (("--parallel.tp=2",), "cuda", True),  # the default for TP on GPUs, where it was measured faster
    (("--parallel.tp=2",), "cpu", False),  # not compiled on CPU by default, and not measured there
    (("--parallel.tp=2", "--parallel.sequence_parallel=true", "--parallel.async_tp=true"), "cuda", False),
    (("--parallel.tp=2", "--train.compile=false"), "cuda", False),  # nothing compiled to reorder
    (("--parallel.pp=2",), "cuda", False),  # no collectives inside the compiled blocks
    (("--parallel.tp=2", "--parallel.comm_reorder=false"), "cuda", False),
    (("--parallel.pp=2", "--parallel.comm_reorder=true", "--train.compile=true"), "cpu", True),
])
def test_comm_reorder_is_on_by_default_for_compiled_tp_on_gpus(overrides, device, expected):
    job, dims = _job_dims(*overrides)
    assert use_comm_reorder(job, dims, torch.device(device)) is expected


@pytest.mark.parametrize(("layout_error", "bad_value", "value_error"), [
    (("--parallel.comm_reorder=true", r"^parallel.comm_reorder=true .* set --train.compile=true"),
     "--parallel.comm_reorder=sometimes", "parallel.comm_reorder='sometimes' is not one of auto, true, false"),
    (("--parallel.pp_p2p_channels=4", r"^parallel.pp_p2p_channels=4 .* drop --parallel.pp_p2p_channels"),
     "--parallel.pp_p2p_channels=-1", "parallel.pp_p2p_channels must be >= 0"),
])
def test_bad_input_names_the_option_and_the_fix(layout_error, bad_value, value_error):
    """comm_reorder=true on an uncompiled TP 2 run and pp_p2p_channels without a pipeline are refused with the fix;
    so are values out of range."""
    option, message = layout_error
    job, dims = _job_dims("--parallel.tp=2", option)
    with pytest.raises(ConfigError, match=message):
        check_layout(job, get_model_spec("gpt"), gpt_config("tiny", n_layers=4), dims, device=torch.device("cpu"),
                     compute_dtype=None)
    with pytest.raises(ConfigError, match=value_error):
        load_config(None, [bad_value])


def test_enable_comm_reorder_sets_passes_this_torch_knows(monkeypatch):
    """The passes are named by string; a torch that renamed one would fail inside the first compile, so check the
    names against this torch's inductor here."""
    import torch._inductor.comms as comms
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(inductor_config, "reorder_for_compute_comm_overlap", False)
    monkeypatch.setattr(inductor_config, "reorder_for_compute_comm_overlap_passes", [])
    enable_comm_reorder()
    assert inductor_config.reorder_for_compute_comm_overlap is True
    assert inductor_config.reorder_for_compute_comm_overlap_passes == list(REORDER_PASSES)
    assert all(callable(getattr(comms, name, None)) for name in REORDER_PASSES)


@pytest.mark.parametrize(("overrides", "cuda", "expected"), [
    (("--parallel.pp=2", "--parallel.pp_schedule=interleaved1f1b"), True, AUTO_P2P_CHANNELS),
    (("--parallel.pp=2", "--parallel.pp_schedule=interleaved1f1b"), False, 0),  # gloo: nothing to cap
    (("--parallel.pp=2",), True, 0),  # 1F1B: NCCL's own choice (not measured faster with fewer)
    (("--parallel.pp=2", "--parallel.pp_p2p_channels=2"), True, 2),
])
def test_p2p_channels_default_to_four_for_interleaved_schedules_on_gpus(overrides, cuda, expected):
    job, dims = _job_dims(*overrides)
    assert p2p_channels(job, dims, cuda=cuda) == expected


def test_set_p2p_channels_keeps_the_users_variable_under_auto():
    environ: dict[str, str] = {}
    assert set_p2p_channels(environ, 4, explicit=False) == "4" and environ == {P2P_VAR: "4"}
    environ = {P2P_VAR: "8"}
    assert set_p2p_channels(environ, 4, explicit=False) == "8"  # auto: the user's environment wins
    assert set_p2p_channels(environ, 2, explicit=True) == "2"  # the option given wins
    assert set_p2p_channels({}, 0, explicit=False) == ""  # NCCL chooses


def test_the_speed_line_names_both():
    job, _ = _job_dims("--parallel.tp=2")
    line = describe_speed(job, torch.device("cpu"), None, comm_reorder=True, p2p_channels="4")
    assert "compile off, collectives reordered" not in line  # describes the compiled graphs only
    line = describe_speed(load_config(None, ["--train.compile=true"]), torch.device("cpu"), None, comm_reorder=True,
                          p2p_channels="4")
    assert "compile on, collectives reordered beside compute" in line, line
    assert line.endswith("pipeline sends and receives on at most 4 NCCL channels"), line


# ---- through the trainer: TP 2 on 2 gloo ranks, compiled ------------------------------------------------------------

def _train(run_dir: Path, *overrides: str) -> tuple[list[float], str]:
    cmd = [sys.executable, "-m", "meshrun", "launch", "--nproc-per-node", "2", "train", "--model.name=tiny",
           "--parallel.tp=2", "--parallel.dp_replicate=1", "--train.compile=true", "--train.steps=6",
           "--train.log_every=1", "--train.eval_every=0", "--checkpoint.final=false", "--data.max_bytes=100000",
           "--run.progress=lines", f"--run.dir={run_dir}", *overrides]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    speed = next(line for line in out.stdout.splitlines() + out.stderr.splitlines() if "speed:" in line)
    return [r["loss"] for r in records if r.get("kind") == "train"], speed


@pytest.mark.slow
def test_tp_with_reordered_collectives_trains_exactly_like_inductors_order(tmp_path):
    """The reordering moves whole kernels and computes nothing differently: TP 2, compiled, 6 steps, every loss
    equal to 1e-6 of the run in inductor's own order (both fp32 on CPU); the header says which ran."""
    plain, plain_speed = _train(tmp_path / "plain", "--parallel.comm_reorder=false")
    reordered, speed = _train(tmp_path / "reordered", "--parallel.comm_reorder=true")
    assert "collectives reordered beside compute" in speed and "reordered" not in plain_speed, (speed, plain_speed)
    assert len(plain) == 6 and plain[-1] < plain[0], plain
    assert reordered == pytest.approx(plain, abs=1e-6), (plain, reordered)
