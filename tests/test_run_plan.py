"""The run plan (train/plan.py): the config is resolved once into a plan, and the JobConfig given is never changed;
what the run records (config.toml) is the resolved config."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest

from meshrun.config import ConfigError, JobConfig, load_config
from meshrun.env import ProcessPlacement
from meshrun.train.plan import RunPlan, validated
from meshrun.train.trainer import Trainer

ONE_PROCESS = ProcessPlacement(rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0, num_nodes=1,
                               master_addr="127.0.0.1", master_port=29500, source="single")
TWO_RANKS = dataclasses.replace(ONE_PROCESS, world_size=2, local_world_size=2, source="torchrun")


def tiny_job(run_dir, *extra: str) -> JobConfig:
    return load_config(None, [f"--run.dir={run_dir}", "--train.log_every=1", "--train.eval_every=0",
                              "--data.max_bytes=100000", "--run.progress=lines", "--health.straggler_threshold=0",
                              *extra])


def test_the_plan_resolves_a_copy_and_leaves_the_config_as_given(tmp_path):
    job = tiny_job(tmp_path, "--parallel.data_parallel=fsdp", "--replicas.groups=2", "--replicas.group=1",
                   "--replicas.lighthouse=127.0.0.1:29510")
    job.train.compile = "off"  # set after loading: the plan's validation normalises its own copy
    given = copy.deepcopy(job)
    plan = RunPlan.resolve(validated(job), env=ONE_PROCESS, vocab_size=256)
    assert job == given, "resolving changed the JobConfig it was given"
    assert plan.job.train.compile == "false"
    assert (plan.job.model.dim, plan.job.model.n_kv_heads, plan.job.model.ffn_dim) == (64, 4, 256), "tiny's shape"
    assert (plan.job.parallel.dp_replicate, plan.job.parallel.dp_shard) == (1, -1), "data_parallel=fsdp applied"
    assert plan.job.checkpoint.dir == str(tmp_path / "checkpoints"), "replica groups share one checkpoint folder"
    assert plan.run_dir == tmp_path / "group_1"
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.batch = plan.batch  # type: ignore[misc]
    kept = plan.keep_global_batch(16)
    assert (kept.batch.global_batch, kept.batch.grad_accum, kept.job.train.global_batch) == (16, 2, 16)
    assert (plan.batch.global_batch, plan.job.train.global_batch, job.train.global_batch) == (8, 0, 0)


def test_a_trainer_and_its_resume_leave_the_config_unchanged_and_record_the_resolved_one(tmp_path):
    # 8 samples per step (4 x 2 accumulation), then resumed with micro-batch 2: the resume keeps the global batch 8
    # by accumulating 4 (a new plan), as it does at another world size
    first_job = tiny_job(tmp_path, "--train.micro_batch=4", "--train.grad_accum=2", "--train.steps=2")
    second_job = tiny_job(tmp_path, "--train.micro_batch=2", "--train.steps=3")
    given = copy.deepcopy((first_job, second_job))
    for job in (first_job, second_job):
        trainer = Trainer(job)
        try:
            trainer.fit()
        finally:
            trainer.close()
    assert (first_job, second_job) == given, "a Trainer changed the JobConfig it was given"
    assert (trainer.batch.grad_accum, trainer.job.train.global_batch) == (4, 8)
    written = load_config(str(Path(tmp_path) / "config.toml"), [])
    assert (written.train.global_batch, written.train.micro_batch, written.train.grad_accum) == (8, 2, 0)
    assert (written.model.dim, written.model.n_layers, written.model.seq_len) == (64, 2, 64), "the resolved shape"
    assert written == trainer.job


@pytest.mark.parametrize("options, message", [
    (("--train.loss=chunked", "--parallel.data_parallel=fsdp"), "train.loss=chunked runs for one process and DDP only"),
    (("--parallel.cp=2",), "parallel.cp=2 needs CUDA GPUs"),
    (("--train.cuda_graphs=true",), "train.cuda_graphs=true needs CUDA GPUs"),
])
def test_the_plan_refuses_a_layout_its_options_cannot_run_before_any_process_group(tmp_path, options, message):
    """Two ranks, no process group: the layout checks run in RunPlan.resolve, so every rank fails at once with the
    option named, not after a rendezvous or a model build."""
    with pytest.raises(ConfigError, match=message):
        RunPlan.resolve(validated(tiny_job(tmp_path, "--dist.device=cpu", *options)), env=TWO_RANKS, vocab_size=256)
    assert not (tmp_path / "config.toml").exists()
