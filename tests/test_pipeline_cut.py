"""Pipeline stages cut by estimated cost (parallel.pp_balance): the cut itself, where it shows, and a checkpoint
saved under the even cut resuming under the cost cut through the trainer (CPU, gloo, fp32)."""

from __future__ import annotations

import re

import pytest
import torch

from dist_utils import run_distributed
from meshrun.comm.mesh import ParallelDims
from meshrun.config import ConfigError, load_config
from meshrun.models.gpt import SIZES
from meshrun.models.spec import get_model_spec
from meshrun.parallel.stage_cut import balanced_counts, edge_costs, even_counts, resolve_cut

GPT = get_model_spec("gpt")


def test_even_counts_put_the_extra_blocks_first():
    assert even_counts(10, 4) == [3, 3, 2, 2]
    assert balanced_counts(10, 4) == [3, 3, 2, 2]  # no work outside the blocks: the cost cut is the even cut


def test_balanced_counts_take_blocks_off_the_costly_last_stage():
    assert balanced_counts(18, 2, last=1.72) == [10, 8]  # costs 10 / 9.72 against 9 / 10.72 evenly
    assert balanced_counts(12, 4, last=4.47) == [4, 4, 3, 1]  # the last stage keeps one block however costly
    assert balanced_counts(8, 4, first=2.0) == [1, 3, 2, 2]
    assert balanced_counts(4, 4, last=10.0) == [1, 1, 1, 1]
    assert balanced_counts(5, 1, last=3.0) == [5]


def test_the_head_of_the_1b_model_weighs_about_1_7_blocks():
    first, last = edge_costs(GPT, SIZES["1b"])
    assert first == 0.0 and 1.6 < last < 1.8
    counts, shares = resolve_cut(GPT, SIZES["1b"], 2, "cost")
    assert counts == [10, 8] and max(shares) < 0.51
    counts, shares = resolve_cut(GPT, SIZES["1b"], 2, "blocks")
    assert counts == [9, 9] and max(shares) > 0.54


def _dims(*overrides: str) -> ParallelDims:
    job = load_config(None, ["--model.name=1b", "--parallel.pp=2", "--parallel.dp_replicate=1", *overrides])
    return ParallelDims.from_config(job.parallel, world_size=2, model=SIZES["1b"], spec=GPT)


def test_the_layout_line_names_the_cut_and_the_option_restores_the_even_cut():
    assert _dims().pp_layers == (10, 8)
    assert "blocks 10+8 (est. cost 51%/49%)" in _dims().describe()
    assert _dims("--parallel.pp_balance=blocks").pp_layers == (9, 9)
    with pytest.raises(ConfigError, match="parallel.pp_balance"):
        load_config(None, ["--parallel.pp_balance=flops"])


def test_plan_shows_the_cut(capsys):
    from meshrun.planner.cli import main as plan_main

    assert plan_main(["--model", "1b", "--pp", "2", "--gpus-per-node", "2", "--pp-schedule", "1f1b"]) == 0
    out = capsys.readouterr().out
    assert "stages cut by cost" in out and "blocks 10+8" in out


def test_train_dry_run_resolves_the_micro_batches_and_shows_the_cut(capsys):
    from meshrun.parallel.dryrun import dry_run

    job = load_config(None, ["--model.name=1b", "--parallel.pp=2", "--parallel.dp_replicate=1",
                             "--parallel.pp_schedule=1f1b", "--train.micro_batch=2", "--train.grad_accum=3"])
    assert dry_run(job, world_size=2, gpus_per_node=2, ranks=[1]) == 0  # pp_microbatches=0: 6 samples of 2048
    out = capsys.readouterr().out                                          # tokens, 3 micro-batches of 4096
    assert "3 micro-batches, blocks 10+8" in out and re.search(r"layers\s+10-17", out)  # rich may wrap the line


# ---- a checkpoint moves from the even cut to the cost cut ---------------------------------------------------------
# 4 blocks and a 4096-row vocabulary (byte data only pads it): the output head weighs about 5 blocks, so the cost
# cut is 3+1 against the even 2+2, and layers.2 changes stage on resume.

COMMON = ("--data.max_bytes=100000", "--train.global_batch=8", "--train.micro_batch=4", "--model.n_layers=4",
          "--model.vocab_size=4096", "--parallel.pp=2", "--parallel.dp_replicate=1",
          "--checkpoint.interval_steps=3", "--health.check_versions=false")


def _cut_worker(rank, world_size, run_dir, steps, extra):
    from test_resume import job
    from meshrun.train.trainer import Trainer

    trainer = Trainer(job(run_dir, steps=steps, extra=extra))
    try:
        result = trainer.fit()
    finally:
        trainer.close()
        trainer.ckpt.preemption.restore()
    return result.losses, trainer.dims.pp_layers, sorted(trainer.engine.model_parts[0].state_dict())


@pytest.mark.slow
def test_even_cut_checkpoint_resumes_under_the_cost_cut(tmp_path):
    even = run_distributed(_cut_worker, 2, tmp_path / "even", 6, (*COMMON, "--parallel.pp_balance=blocks"))
    step3 = tmp_path / "even" / "checkpoints" / "step_0000003"
    cost = run_distributed(_cut_worker, 2, tmp_path / "cost", 6, (*COMMON, f"--checkpoint.resume={step3}"))
    assert even[0][1] == (2, 2) and cost[0][1] == (3, 1)
    assert any(k.startswith("layers.2.") for k in cost[0][2]) and not any(k.startswith("layers.2.") for k in even[0][2])
    assert len(cost[0][0]) == 3  # steps 4 to 6
    # same names, other owners: DCP moved layers.2 from stage 1 to stage 0, and training goes on as without the move
    torch.testing.assert_close(torch.tensor(cost[0][0]), torch.tensor(even[0][0][3:]), rtol=1e-4, atol=0)
