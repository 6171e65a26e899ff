"""The model contract: a registered model that is not the built-in GPT (tests/mlp_lm.py) goes through
``meshrun plan`` and ``meshrun train --dry-run`` as the GPT does, and errors name the option to change."""

from __future__ import annotations

import dataclasses
import json

import pytest

import mlp_lm
from meshrun import planner
from meshrun.config import ConfigError, load_config
from meshrun.comm.mesh import ParallelDims
from meshrun.models.build import model_shape, model_spec
from meshrun.models.gpt import GPT
from meshrun.models.spec import get_model_spec
from meshrun.train.cli import main as train_main

ARCH = "mlp_lm:mlp_lm"  # module:name, as a user gives it on the command line


def test_plan_counts_the_registered_models_parameters(capsys):
    args = planner.parse_args(["--arch", ARCH, "--model", "tiny", "--nodes", "1", "--gpus-per-node", "2"])
    plan = planner.build_plan(planner.job_from_args(args), nodes=1, gpus_per_node=2)
    assert plan.spec is mlp_lm.SPEC
    assert sum(row["params_total"] for row in plan.memory) == mlp_lm.SPEC.count_params(plan.model) == 17504
    assert planner.main(["--arch", ARCH, "--nodes", "1", "--gpus-per-node", "2", "--tp", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"]["ffn_dim"] == 64 and out["world_size"] == 2


def test_train_dry_run_shards_the_registered_model(capsys):
    code = train_main([f"--model.arch={ARCH}", "--parallel.tp=2", "--parallel.dp_shard=2", "--parallel.dp_replicate=1",
                       "--dry-run", "--world-size", "4", "--gpus-per-node", "4"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "TP + FSDP" in out
    row = next(line for line in out.splitlines() if "blocks.*.up.weight" in line)
    assert "64 x 32" in row and "16 x 32" in row  # (hidden, dim) split over tp 2, then dp_shard 2


def test_gpt_goes_through_the_same_contract():
    job = load_config(None, ["--model.name=tiny"])
    spec, shape = model_spec(job), model_shape(job)
    assert spec.arch == "gpt" and spec.count_params(shape) == GPT(shape).num_params()
    job = load_config(None, [f"--model.arch={ARCH}", "--model.ffn_dim=96"])
    assert dataclasses.asdict(model_shape(job))["ffn_dim"] == 96


def test_errors_name_the_option():
    with pytest.raises(ConfigError, match=r"model.arch='nope' is not a registered model; registered: .*gpt"):
        model_spec(load_config(None, ["--model.arch=nope"]))
    with pytest.raises(ConfigError, match=r"model.name='124m' is not a named size of model.arch='mlp_lm:mlp_lm'"):
        model_shape(load_config(None, [f"--model.arch={ARCH}", "--model.name=124m"]))
    shape = model_shape(load_config(None, [f"--model.arch={ARCH}", "--model.ffn_dim=66"]))
    with pytest.raises(ConfigError, match=r"parallel.tp=4 does not divide model.ffn_dim \(MLP width\)=66"):
        ParallelDims(dp_replicate=1, dp_shard=1, tp=4, pp=1, world_size=4).validate_model(shape, get_model_spec(ARCH))
