"""Run folders as a user meets them: a refused or no-op invocation leaves the run as it was, checkpoints carry their
config, the header names the run it resumes, --fresh moves an earlier run aside, a longer resume names the
learning-rate jump, and errors are one line (one process, CPU, the tiny model; plus pure logic)."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from meshrun.ckpt.cli import main as ckpt_main
from meshrun.ckpt.run_config import describe_changes
from meshrun.config import JobConfig
from meshrun.config_checks import ConfigError
from meshrun.env import ProcessPlacement
from meshrun.train.cli import _clean_error, _say
from meshrun.train.cli import main as train_main
from meshrun.train.plan import RunPlan, validated
from meshrun.train.resuming import keep_global_batch, kept_batch_fix
from meshrun.train.schedule import describe_lr_change, lr_at

ARGS = ["--model.name=tiny", "--train.micro_batch=2", f"--data.source={json.__file__}", "--data.max_bytes=60000",
        "--train.eval_every=0", "--train.log_every=2", "--train.warmup_steps=2", "--run.progress=lines",
        "--health.straggler_threshold=0"]


@pytest.fixture(autouse=True)
def meshrun_logging():
    """Undo the trainer's logging set-up (its handlers, propagate off) after each test."""
    logger = logging.getLogger("meshrun")
    saved = list(logger.handlers), logger.propagate, logger.level
    yield
    for handler in logger.handlers:
        if handler not in saved[0]:
            handler.close()
    logger.handlers[:], logger.propagate = saved[0], saved[1]
    logger.setLevel(saved[2])


def train(run_dir: Path, steps: int, *extra: str) -> int:
    return train_main([*ARGS, f"--run.dir={run_dir}", f"--train.steps={steps}", *extra])


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A run of 4 steps with its final checkpoint (step 4)."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    assert train(run_dir, 4) == 0
    logger = logging.getLogger("meshrun")
    for handler in list(logger.handlers):  # the module fixture outlives the per-test logging fixture
        handler.close()
        logger.removeHandler(handler)
    return run_dir


def copy_of(run_dir: Path, tmp_path: Path) -> Path:
    target = tmp_path / "run"
    shutil.copytree(run_dir, target)
    return target


def snapshot(folder: Path) -> dict[str, tuple[str, int]]:
    """Every file under ``folder``: content hash and modification time."""
    return {str(p.relative_to(folder)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_refused_and_noop_invocations_leave_the_run_folder_as_it_was(trained, tmp_path, capsys):
    run_dir = copy_of(trained, tmp_path)
    before = snapshot(run_dir)
    assert train(run_dir, 4) == 0, "nothing to train is not an error"
    assert f"nothing to train: resumed at step 4 >= train.steps=4; {run_dir} is left as it was" in capsys.readouterr().out
    assert train(run_dir, 8, "--model.dim=128") == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("meshrun train: error:")]
    assert "Traceback" not in err and len(lines) == 1, err
    assert ("the checkpoint of step 4 holds another model than this run builds (model.dim 64 -> 128"
            in lines[0]), lines[0]
    assert "--model.dim=64" in lines[0] and "another --run.dir" in lines[0]
    assert snapshot(run_dir) == before, "config.toml, metrics.jsonl, logs and summary.json must be untouched"


def test_refused_and_noop_invocations_in_a_new_run_dir_leave_no_folder_behind(trained, tmp_path, capsys):
    """run.dir did not exist: a resume refused (a changed model) or nothing to train (both from the trained run's
    checkpoint.dir) removes the folders this invocation created, and nothing else."""
    run_dir = tmp_path / "new" / "runs" / "a"
    elsewhere = ["--checkpoint.dir", str(trained / "checkpoints")]
    assert train(run_dir, 8, *elsewhere, "--model.dim=128") == 1
    assert "holds another model than this run builds (model.dim 64 -> 128" in capsys.readouterr().err
    assert not (tmp_path / "new").exists() and tmp_path.is_dir()
    assert train(run_dir, 4, *elsewhere) == 0
    assert "nothing to train" in capsys.readouterr().out
    assert not (tmp_path / "new").exists()
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "notes.txt").write_text("mine")
    assert train(run_dir, 8, *elsewhere, "--model.dim=128") == 1
    assert sorted(p.name for p in (tmp_path / "new").iterdir()) == ["notes.txt"]  # only what it created is gone


@pytest.mark.parametrize("options, message", [
    (("--run.profile_steps=6", "--run.profile_ranks=5"),
     "run.profile_ranks='5' names rank 5, but the world size is 1 (ranks 0..0)"),
    (("--run.tracker=mlflow",), "run.tracker=mlflow needs the mlflow package: pip install 'meshrun[mlflow]'"),
    (("--run.prometheus_port=9464",), "run.prometheus_port needs prometheus-client: pip install 'meshrun[prometheus]'"),
])
def test_options_refused_against_the_world_leave_the_run_folder_as_it_was(trained, tmp_path, capsys, monkeypatch,
                                                                          options, message):
    """Refused with the plan, before the run folder is written; they were refused after config.toml (and a start
    record) were written, so a finished run read 'running', and a new folder was left behind."""
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if mlflow and prometheus-client were not installed
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    run_dir = copy_of(trained, tmp_path)
    before = snapshot(run_dir)
    assert train(run_dir, 8, *options) == 2
    err = capsys.readouterr().err
    assert f"meshrun train: error: {message}" in err and "Traceback" not in err, err
    assert snapshot(run_dir) == before, "config.toml, metrics.jsonl, logs and summary.json must be untouched"
    assert train(tmp_path / "new" / "a", 8, *options) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


def test_sample_and_export_read_the_config_the_checkpoint_carries(trained, tmp_path, capsys):
    from meshrun.sample import main as sample_main
    from safetensors import safe_open

    run_dir = copy_of(trained, tmp_path)
    config = run_dir / "config.toml"
    config.write_text(config.read_text().replace("dim = 64", "dim = 128"))  # a later invocation rewrote it
    assert sample_main([str(run_dir), "--tokens", "4", "--temperature", "0"]) == 0, capsys.readouterr().err
    out = tmp_path / "model.safetensors"
    assert ckpt_main(["export", str(run_dir / "checkpoints" / "step_0000004"), "--to", str(out)]) == 0
    with safe_open(str(out), "pt") as handle:
        metadata = handle.metadata()
    assert json.loads(metadata["model_config"])["dim"] == 64
    assert json.loads(metadata["meshrun_config"])["train"]["steps"] == 4


def test_sample_takes_a_checkpoints_manifest_as_its_folder_and_refuses_bad_sampling_options(trained, capsys):
    from meshrun.sample import main as sample_main

    manifest = trained / "checkpoints" / "step_0000004" / "manifest.json"
    assert sample_main([str(manifest), "--tokens", "2", "--temperature", "0"]) == 0, capsys.readouterr().err
    assert "step_0000004 (step 4)" in capsys.readouterr().err
    for argv, message in ((["--temperature", "-1"], "--temperature -1: give 0 (greedy) or more"),
                          (["--top-k", "-3"], "--top-k -3: give 0 (all tokens) or a number"),
                          (["--tokens", "0"], "--tokens 0: give 1 or more")):
        assert sample_main([str(trained), *argv]) == 2
        assert capsys.readouterr().err.startswith(f"meshrun sample: error: {message}")
    assert sample_main([str(trained / "config.toml")]) == 2
    assert "config.toml: a file, not a folder; give a checkpoint directory" in capsys.readouterr().err


def test_ckpt_verify_accepts_a_run_folder_and_checks_its_newest(trained, capsys):
    assert ckpt_main(["verify", str(trained)]) == 0
    assert capsys.readouterr().out.startswith(f"OK {trained / 'checkpoints' / 'step_0000004'}: step 4,")


def test_resume_with_more_steps_names_the_lr_jump_and_the_run(trained, tmp_path, capsys):
    run_dir = copy_of(trained, tmp_path)
    assert train(run_dir, 8, "--train.weight_decay=0.05") == 0
    captured = capsys.readouterr()
    assert ("learning rate at step 4 jumps from 3.00e-04 to 2.32e-03: train.steps 4 -> 8: the cosine schedule is "
            "recomputed over 8 steps; --train.lr_schedule=wsd") in captured.err, captured.err
    assert "the configuration changed since (train.weight_decay 0.1 -> 0.05)" in captured.err, captured.err
    assert f"resumed at step 4 (epoch 0, 8 samples into it) of the run in {run_dir}, from its checkpoint of " \
        in captured.out
    assert "saved by 1 rank(s); --fresh starts a new run instead" in captured.out


def test_fresh_moves_the_earlier_run_aside(trained, tmp_path, capsys):
    run_dir = copy_of(trained, tmp_path)
    assert train(run_dir, 2, "--fresh") == 0
    assert f"new run in {run_dir}; the earlier run was moved to {run_dir}.1" in capsys.readouterr().out
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_0000002"]
    assert (tmp_path / "run.1" / "checkpoints" / "step_0000004" / "COMPLETE").is_file()
    assert snapshot(tmp_path / "run.1") == snapshot(trained), "the earlier run is moved whole, not changed"


def test_every_checkpoint_damaged_is_refused_and_leaves_the_run_as_it_was(trained, tmp_path, capsys):
    """The only checkpoint fails its checks: no fallback is promised, the resume is refused in one line (not a new run
    mixing its records with the earlier run's), the folder is left as it was, and --fresh then moves it aside."""
    run_dir = copy_of(trained, tmp_path)
    shard = run_dir / "checkpoints" / "step_0000004" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-1])
    before = snapshot(run_dir)
    assert train(run_dir, 8) == 1
    captured = capsys.readouterr()
    assert "falling back" not in captured.err and "new run in" not in captured.out, captured
    assert "step_0000004/__0_0.distcp: size" in captured.err
    assert "no earlier complete checkpoint is left" in captured.err
    lines = [line for line in captured.err.splitlines() if line.startswith("meshrun train: error:")]
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    assert lines[0].startswith(f"meshrun train: error: checkpoint.resume=auto: the complete checkpoints in "
                               f"{run_dir / 'checkpoints'} are all damaged (step_0000004; each named above)"), lines[0]
    assert "--fresh (the earlier run is moved aside)" in lines[0]
    assert snapshot(run_dir) == before, "config.toml, metrics.jsonl, logs and summary.json must be untouched"
    assert train(run_dir, 2, "--fresh") == 0
    assert f"new run in {run_dir}; the earlier run was moved to {run_dir}.1" in capsys.readouterr().out
    assert snapshot(tmp_path / "run.1") == before


def test_a_kept_global_batch_is_said_only_when_its_split_changes(tmp_path, capsys):
    """A run with accumulation 2 (global batch 4) resumed without train.grad_accum keeps the checkpoint's batch; on the
    same ranks with the same accumulation nothing changes, so no line says so, nor after 'nothing to train'."""
    run_dir = tmp_path / "run"
    assert train(run_dir, 2, "--train.grad_accum=2") == 0
    capsys.readouterr()
    for steps, said in ((4, "resumed at step 2"), (4, "nothing to train")):
        assert train(run_dir, steps) == 0
        captured = capsys.readouterr()
        assert said in captured.out and "keeping the checkpoint's global batch" not in captured.err, captured.err
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r.get("kind") == "train"] == [2, 4]
    assert "global_batch = 4" in (run_dir / "config.toml").read_text()


def test_async_saves_make_the_last_steps_save_the_final_synchronous_one(tmp_path, capsys):
    """checkpoint.interval_steps falling on the last step with async_save: that save is the final one (published
    before the run ends, manifest and record final), the earlier ones are written in the background."""
    run_dir = tmp_path / "run"
    assert train(run_dir, 4, "--checkpoint.async_save=true", "--checkpoint.interval_steps=2") == 0
    out = capsys.readouterr().out
    assert "checkpoint step 2 -> " in out and "(staged; writing in the background" in out.split("checkpoint step 2")[1]
    assert "(published" in out.split("checkpoint step 4")[1].splitlines()[0], out
    manifests = {step: json.loads((run_dir / "checkpoints" / f"step_000000{step}" / "manifest.json").read_text())
                 for step in (2, 4)}
    assert (manifests[2]["final"], manifests[2]["async_save"]) == (False, True)
    assert (manifests[4]["final"], manifests[4]["async_save"]) == (True, False)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["final"]) for r in records if r.get("kind") == "checkpoint"] == [(2, False), (4, True)]


def test_an_empty_data_file_is_one_line_naming_the_option(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert train_main([*ARGS, f"--data.source={empty}", f"--run.dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"meshrun train: error: data.source='{empty}': the dataset has 0 samples")
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------- pure logic

def test_wsd_extends_without_a_jump_and_cosine_names_it():
    train = JobConfig().train
    train.steps, train.warmup_steps, train.lr, train.min_lr = 200, 10, 1e-3, 1e-4
    saved = {"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 10, "steps": 100}
    line = describe_lr_change(saved, train, 100)
    assert line.startswith("learning rate at step 100 jumps from 1.00e-04 to 5.87e-04: train.steps 100 -> 200")
    train.lr_schedule = "wsd"
    stable = {**saved, "lr_schedule": "wsd"}
    assert describe_lr_change(stable, train, 50) is None, "the stable phase does not depend on train.steps"
    assert lr_at(50, lr=1e-3, min_lr=1e-4, warmup_steps=10, steps=100, schedule="wsd") == 1e-3
    assert lr_at(100, lr=1e-3, min_lr=1e-4, warmup_steps=10, steps=100, schedule="wsd") == pytest.approx(1e-4)
    assert lr_at(90, lr=1e-3, min_lr=1e-4, warmup_steps=10, steps=100, schedule="wsd") == pytest.approx(5.5e-4)


def test_changed_options_are_named():
    before, after = JobConfig().to_dict(), JobConfig().to_dict()
    after["model"]["dim"], after["train"]["lr"], after["train"]["steps"] = 128, 1e-3, 999
    assert describe_changes(before, after) == "model.dim 0 -> 128, train.lr 0.003 -> 0.001"


def _one_rank_trainer(job: JobConfig) -> tuple[SimpleNamespace, list[str]]:
    """What keep_global_batch reads of a trainer, for one process planning ``job``; and its checkpoint notes."""
    env = ProcessPlacement(rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0, num_nodes=1,
                           master_addr="127.0.0.1", master_port=29500, source="single")
    plan = RunPlan.resolve(validated(job), env=env, vocab_size=256)
    notes: list[str] = []
    data = SimpleNamespace(position=0, seek=lambda position: None)
    trainer = SimpleNamespace(plan=plan, app_state={}, data=data, build_data=lambda: (data, []),
                              ckpt=SimpleNamespace(layout={}, notes=notes), replicas=None)
    return trainer, notes


def test_world_size_change_names_the_checkpoints_data_parallel_ranks():
    """2 ranks saved global batch 16 (micro 8, no accumulation); 1 rank resumes it: 2 -> 1 ranks, 1 -> 2 steps."""
    job = JobConfig()
    trainer, notes = _one_rank_trainer(job)
    plan = trainer.plan
    keep_global_batch(trainer, {"global_batch": 16, "dp_replicate": 2, "dp_shard": 1, "grad_accum": 1})
    assert notes == ["keeping the checkpoint's global batch 16: 2 -> 1 data-parallel ranks, accumulation 1 -> 2"]
    assert (trainer.plan.job.train.global_batch, trainer.plan.batch.grad_accum) == (16, 2)
    assert (job.train.global_batch, plan.job.train.global_batch) == (0, 0), "a new plan; no config changed in place"


def test_a_kept_global_batch_with_the_checkpoints_split_says_nothing():
    """1 rank resumes a checkpoint of global batch 16 from 1 rank with accumulation 2 (this run's options alone give
    8): the batch is kept, and the split is the checkpoint's own, so no line or note says it."""
    trainer, notes = _one_rank_trainer(JobConfig())
    keep_global_batch(trainer, {"global_batch": 16, "dp_replicate": 1, "dp_shard": 1, "grad_accum": 2})
    assert notes == []
    assert (trainer.plan.batch.global_batch, trainer.plan.batch.grad_accum) == (16, 2)
    assert trainer.ckpt.layout == {"global_batch": 16, "grad_accum": 2}


def test_a_kept_global_batch_that_does_not_split_names_the_micro_batch_that_does():
    """A TP 2 run (global batch 8 on one data-parallel rank) resumed as DDP on 2 ranks of 8 samples: 8 does not split
    into 2 x 8, so the error names the micro-batch that fits (4) instead of a global batch the user never set."""
    job = JobConfig()
    env = ProcessPlacement(rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0, num_nodes=1,
                     master_addr="127.0.0.1", master_port=29500, source="single")
    plan = RunPlan.resolve(validated(job), env=env, vocab_size=256)
    trainer = SimpleNamespace(plan=plan, ckpt=SimpleNamespace(layout={}, notes=[]))
    with pytest.raises(ConfigError, match=r"^train.micro_batch=8: the checkpoint's global batch 4 \(2 data-parallel "
                       r"ranks then\), kept .* not divisible by 8 x 1 data-parallel ranks now; resume with "
                       r"--train.micro_batch=4 \(4 x 1 ranks, no accumulation\), or start a new run with "
                       r"--fresh$") as refused:
        keep_global_batch(trainer, {"global_batch": 4, "dp_replicate": 2, "dp_shard": 1, "grad_accum": 1})
    assert refused.value.same_on_node, "every rank refuses alike: each node's first rank says it, not every rank"
    assert kept_batch_fix(8, micro_batch=8, dp_size=2, saved_dp=1).endswith("resume with --train.micro_batch=4 "
                                                                            "(4 x 2 ranks, no accumulation), or start "
                                                                            "a new run with --fresh")
    # 16 samples from 1 rank resumed on 4 ranks of 8: 4 x 4 ranks, nothing accumulated (it said "accumulating the rest")
    assert kept_batch_fix(16, micro_batch=8, dp_size=4, saved_dp=1).endswith(
        "resume with --train.micro_batch=4 (4 x 4 ranks, no accumulation), or start a new run with --fresh")
    assert kept_batch_fix(24, micro_batch=8, dp_size=2, saved_dp=1).endswith(
        "resume with --train.micro_batch=6 (6 x 2 ranks x 2 accumulated micro-batches), or start a new run with "
        "--fresh")
    assert kept_batch_fix(12, micro_batch=8, dp_size=1, saved_dp=2).count("--train.micro_batch=6") == 1
    trainer.plan.job.train.global_batch = 8
    with pytest.raises(ConfigError, match=r"^train.global_batch=8 differs from the checkpoint's 4") as refused:
        keep_global_batch(trainer, {"global_batch": 4, "dp_replicate": 2, "dp_shard": 1, "grad_accum": 1})
    assert refused.value.same_on_node
    assert "nor by 4 ranks with any micro-batch; resume on a layout whose data-parallel ranks divide 6" in \
        kept_batch_fix(6, micro_batch=8, dp_size=4, saved_dp=2)


def test_errors_that_say_it_all_have_no_traceback_and_keep_their_exit_code(capsys):
    from meshrun.ckpt.errors import CheckpointError
    from meshrun.diag.fingerprint import FingerprintMismatch

    assert _clean_error(CheckpointError("x"))[1:] == (1, False), "raised by this rank alone unless known otherwise"
    assert _clean_error(CheckpointError("x", same_on_every_rank=True))[1:] == (1, True)
    assert _clean_error(FingerprintMismatch("node b runs other code"))[:2] == ("node b runs other code", 1)
    full = _clean_error(OSError(errno.ENOSPC, "No space left on device", "/ckpt/x"))
    assert full[0].startswith("/ckpt/x: no space left on the device") and full[1] == 1
    assert _clean_error(RuntimeError("a bug")) is None, "an unexpected error keeps its traceback"
    _say("meshrun train: error: run.dir='/proc/x': cannot create /proc/x", rank=1)
    assert capsys.readouterr().err == "meshrun train: error: rank 1: run.dir='/proc/x': cannot create /proc/x\n"


def test_a_rendezvous_error_without_a_cause_does_not_say_none():
    from meshrun.launch.launcher import _with_cause

    assert _with_cause(RuntimeError("closed")) == "closed"
    try:
        try:
            raise ConnectionRefusedError("refused")
        except ConnectionRefusedError as inner:
            raise RuntimeError("rendezvous failed") from inner
    except RuntimeError as exc:
        assert _with_cause(exc) == "rendezvous failed (cause: ConnectionRefusedError: refused)"
    bind = OSError(98, "Address already in use")
    exc = RuntimeError("cannot listen on 127.0.0.1:29577 (Address already in use); choose another port")
    exc.__context__ = bind
    assert _with_cause(exc) == str(exc), "a cause the message already gives is not repeated"


def test_fresh_on_an_elastic_restart_resumes_the_new_run_and_refuses_a_shared_checkpoint_dir(tmp_path, monkeypatch):
    from meshrun.config import ConfigError
    from meshrun.env import ProcessPlacement
    from meshrun.train.run_folder import RunFolder

    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    job = JobConfig()
    job.run.dir, job.run.fresh = str(tmp_path / "run"), True
    coord = SimpleNamespace(barrier=lambda what: None)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # torchrun's agent restarted the fresh run's workers
    folder = RunFolder(job, ProcessPlacement.detect())
    assert folder.start_fresh(job, coord) is False and not (tmp_path / "run.1").exists()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert folder.start_fresh(job, coord) is True and (tmp_path / "run.1" / "checkpoints").is_dir()
    assert list((tmp_path / "run").iterdir()) == []
    (tmp_path / "elsewhere" / "step_0000010").mkdir(parents=True)
    (tmp_path / "elsewhere" / "step_0000010" / "COMPLETE").write_text("")
    job.checkpoint.dir = str(tmp_path / "elsewhere")
    with pytest.raises(ConfigError, match=r"run.fresh: checkpoint.dir=.*elsewhere holds checkpoints up to step 10"):
        folder.start_fresh(job, coord)
