"""Tied embeddings (model.tie_embeddings) across layouts: a pipeline trains them untied, and a checkpoint says how
they were trained, so that a resume continues exactly.

* a checkpoint trained untied under a pipeline resumes untied in one process or under DDP, with the losses of the
  uninterrupted pipeline run (rtol 1e-4: the layouts differ only in the order of floating-point reductions);
  ``ckpt export`` writes ``tie_embeddings`` false for it;
* a tied checkpoint resumed under a pipeline unties them at that step: the output head starts from the embedding's
  values and optimizer state, as a single process that unties them in memory does (the reference, exactly);
* a tied model refuses an untied checkpoint rather than keep one of the two matrices;
* a loading refusal that only some ranks meet (a pipeline's last stage alone holds the output head) is raised on
  every rank, and `meshrun train` prints a checkpoint error that only this rank raised from this rank;
* where the checksums decide the model, the ranks check that the checkpoint folder is shared before they hash it
  (node-local folders are refused as the load refuses them, nothing hashed), and the load does not check it again.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed
from test_ckpt_support import config as ckpt_config

from meshrun.ckpt.checkpointer import Checkpointer
from meshrun.ckpt.errors import CheckpointError
from meshrun.ckpt.reader import export_model
from meshrun.ckpt.run_config import saved_embeddings_tied, trained_config
from meshrun.ckpt.state import ModelOptimState
from meshrun.env import ProcessPlacement
from meshrun.models.gpt import GPT, gpt_config
from meshrun.train import cli

TIES = {"output.weight": "tok_embeddings.weight"}
COMMON = ("--data.max_bytes=200000", "--train.global_batch=8", "--checkpoint.keep_last=5",
          "--health.check_versions=false", "--run.print_config=false")
PP2 = ("--parallel.pp=2", "--parallel.dp_replicate=1", "--parallel.dp_shard=1", "--train.micro_batch=8")
DDP2 = ("--parallel.dp_replicate=2", "--parallel.dp_shard=1", "--train.micro_batch=4")
FSDP2 = ("--parallel.dp_shard=2", "--parallel.dp_replicate=1", "--train.micro_batch=4")
ONE = ("--train.micro_batch=4",)


# ---- what a checkpoint says ------------------------------------------------------------------------------------

def _manifest(tied: bool, pp: int) -> dict:
    return {"layout": {"pp": pp}, "meta": {"config": {"model": {"tie_embeddings": tied, "dim": 64}}}}


def test_a_checkpoint_says_whether_its_embeddings_were_trained_tied():
    assert saved_embeddings_tied(_manifest(True, 1)) is True
    assert saved_embeddings_tied(_manifest(False, 2)) is False  # this meshrun records the pipeline's untying
    assert saved_embeddings_tied(_manifest(True, 2)) is False, "an older meshrun recorded the option: pp unties"
    assert saved_embeddings_tied({"layout": {"pp": 2}, "meta": {}}) is None  # no config: unknown
    assert trained_config(_manifest(True, 2))["model"] == {"tie_embeddings": False, "dim": 64}


def _saved(folder: Path, model: GPT, *, layout: dict, tied_option: bool) -> tuple[Path, torch.optim.AdamW]:
    """``model`` trained 2 AdamW steps and saved as step 2 in ``folder`` (config: ``tied_option``, the manifest's
    layout ``layout``); the checkpoint and the optimizer."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _steps(model, opt, 2, seed=0)
    ckpt = Checkpointer(ckpt_config(), folder=folder, env=ProcessPlacement.detect({}), layout=layout,
                        config_fingerprint="fp-test")
    config = {"model": {**dataclasses.asdict(model.cfg), "tie_embeddings": tied_option}}
    ckpt.save(2, {"model_optim": ModelOptimState([model], [opt])}, meta={"config": config})
    return folder / "step_0000002", opt


def _steps(model: GPT, opt: torch.optim.Optimizer, steps: int, *, seed: int) -> list[float]:
    gen, losses = torch.Generator().manual_seed(seed), []
    for _ in range(steps):
        tokens = torch.randint(0, 256, (2, 17), generator=gen)
        loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _untied(seed: int = 1) -> GPT:
    torch.manual_seed(seed)
    return GPT(dataclasses.replace(gpt_config("tiny"), tie_embeddings=False))


def test_export_writes_the_tie_state_the_weights_were_trained_with(tmp_path):
    """An older meshrun's pipeline checkpoint says tie_embeddings=true (the option) with untied weights: the exported
    model config says false, as the weights are."""
    path, _ = _saved(tmp_path / "ck", _untied(), layout={"pp": 2}, tied_option=True)
    export_model(path, tmp_path / "model.safetensors")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert json.loads(f.metadata()["model_config"])["tie_embeddings"] is False
        assert json.loads(f.metadata()["meshrun_config"])["model"]["tie_embeddings"] is False
        assert not torch.equal(f.get_tensor("output.weight"), f.get_tensor("tok_embeddings.weight"))


def test_sample_with_a_runs_config_builds_the_model_as_the_checkpoint_trained_it(tmp_path):
    """A pipeline run's config.toml says tie_embeddings=true (the option as given); `meshrun sample --config` must
    still build the untied model its checkpoint holds, or one matrix would silently replace the other."""
    from meshrun.config import load_config
    from meshrun.sample import find_config

    path, _ = _saved(tmp_path / "ck", _untied(), layout={"pp": 2}, tied_option=True)
    config = tmp_path / "config.toml"
    config.write_text(load_config(None, ["--model.name=tiny"]).to_toml())
    assert load_config(config).model.tie_embeddings is True
    assert find_config(path, str(config)).model.tie_embeddings is False


def test_a_tied_checkpoint_loads_untied_as_untying_at_that_step(tmp_path):
    """The reference unties in memory: the output head a copy of the embedding, its AdamW state a copy of the tied
    parameter's. Loading the tied checkpoint into an untied model must give the same next steps, bitwise."""
    torch.manual_seed(0)
    tied = GPT(gpt_config("tiny"))
    _, tied_opt = _saved(tmp_path / "ck", tied, layout={"pp": 1}, tied_option=True)
    reference = _untied()
    reference.load_state_dict(tied.state_dict())  # both names hold the tied matrix
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    ref_opt.load_state_dict(_untied_adamw_state(tied, tied_opt, reference))

    model = _untied(seed=2)  # other weights: all must come from the checkpoint
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = ModelOptimState([model], [opt], ties=TIES)
    Checkpointer(ckpt_config(), folder=tmp_path / "ck", env=ProcessPlacement.detect({}), layout={},
                 config_fingerprint="fp-test").load({"model_optim": state})
    assert model.output.weight is not model.tok_embeddings.weight
    assert torch.equal(model.output.weight, model.tok_embeddings.weight)
    head, embedding = opt.state[model.output.weight], opt.state[model.tok_embeddings.weight]
    assert torch.equal(head["exp_avg"], embedding["exp_avg"]) and head["exp_avg"] is not embedding["exp_avg"]
    assert _steps(model, opt, 3, seed=5) == _steps(reference, ref_opt, 3, seed=5)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name


def _untied_adamw_state(tied: GPT, opt: torch.optim.AdamW, untied: GPT) -> dict:
    """An AdamW state dict for ``untied`` holding ``tied``'s optimizer state (``opt``'s): the output head gets a copy
    of the tied parameter's."""
    by_name = {name: opt.state[p] for name, p in tied.named_parameters()}
    state = {}
    for index, (name, _) in enumerate(untied.named_parameters()):
        source = by_name[TIES.get(name, name)]
        state[index] = {k: v.clone() for k, v in source.items()}
    return {"state": state, "param_groups": [{**opt.param_groups[0], "params": list(range(len(state)))}]}


def test_a_tied_model_refuses_an_untied_checkpoint(tmp_path):
    path, _ = _saved(tmp_path / "ck", _untied(), layout={"pp": 1}, tied_option=False)
    torch.manual_seed(0)
    tied = GPT(gpt_config("tiny"))
    state = ModelOptimState([tied], [torch.optim.AdamW(tied.parameters(), lr=1e-2)], ties=TIES)
    ckpt = Checkpointer(ckpt_config(), folder=path.parent, env=ProcessPlacement.detect({}), layout={},
                        config_fingerprint="fp-test")
    with pytest.raises(CheckpointError, match=r"trained output\.weight and tok_embeddings\.weight as two "
                                              r"parameters.*--model\.tie_embeddings=false") as caught:
        ckpt.load({"model_optim": state})
    assert caught.value.same_on_every_rank


# ---- a refusal only some ranks meet --------------------------------------------------------------------------

def _rank_one_needs_more(rank: int, world_size: int, folder: str) -> str:
    """Both ranks load the step saved by both; rank 1's state asks for a key the checkpoint lacks (as a pipeline's
    last stage alone asks for the output head's optimizer state)."""
    env = ProcessPlacement.detect()
    ckpt = Checkpointer(ckpt_config(), folder=folder, env=env, layout={}, config_fingerprint="fp-test")
    ckpt.save(1, {"weights": {"a": torch.ones(2)}})
    wanted = {"a": torch.zeros(2), **({"head": torch.zeros(2)} if rank == 1 else {})}
    try:
        ckpt.load({"weights": wanted})
    except CheckpointError as exc:
        return f"{exc.same_on_every_rank} {exc}"
    finally:
        ckpt.close()
    return "loaded"


def test_a_refusal_of_one_rank_is_raised_on_every_rank_naming_it(tmp_path):
    said = run_distributed(_rank_one_needs_more, 2, str(tmp_path / "ck"), timeout=120)
    assert said[0] == said[1], said
    assert said[0].startswith("True rank 1: ") and "has no entry for 1 key(s) this run needs, e.g. ['weights.head']" \
        in said[0], said


def _run_as(rank: int, monkeypatch, tmp_path: Path, error: CheckpointError) -> int:
    """`meshrun train` as local rank ``rank`` of 2 on one node, its trainer failing with ``error``."""
    env = ProcessPlacement(rank=rank, local_rank=rank, world_size=2, local_world_size=2, node_rank=0, num_nodes=1,
                           master_addr="127.0.0.1", master_port=29500, source="torchrun")
    for name, value in env.export().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(cli, "NODE_LEADER_GRACE_S", 0.0)

    def failing(job):
        raise error

    monkeypatch.setattr("meshrun.train.trainer.Trainer", failing)
    from meshrun.config import load_config

    return cli.run(load_config(None, [f"--run.dir={tmp_path / 'run'}"]))


def test_a_checkpoint_error_of_this_rank_alone_is_said_by_it(monkeypatch, tmp_path, capsys):
    assert _run_as(1, monkeypatch, tmp_path, CheckpointError("step_0000020: has no entry for 4 key(s)")) == 1
    assert capsys.readouterr().err == "meshrun train: error: rank 1: step_0000020: has no entry for 4 key(s)\n"
    agreed = CheckpointError("checkpoint x is damaged", same_on_every_rank=True)
    assert _run_as(1, monkeypatch, tmp_path, agreed) == 1
    assert capsys.readouterr().err == "", "every rank raises it: the node's local rank 0 says it"
    assert _run_as(0, monkeypatch, tmp_path, agreed) == 1
    assert capsys.readouterr().err == "meshrun train: error: checkpoint x is damaged\n"


# ---- the checkpoint folder, checked before checksums decide the model -------------------------------------------

def _node_local_resume(rank: int, world_size: int, root: str) -> tuple[str, list[str]]:
    """Rank ``rank`` choosing its model with checkpoint.dir=ck, a folder of its own node at the same path (here: the
    relative path from each rank's own working directory, ``root``/node<rank>); what it raised, and the checkpoint
    files it hashed."""
    from meshrun.ckpt import collectives, loading
    from meshrun.config import load_config
    from meshrun.train.plan import RunPlan, validated
    from meshrun.train.resuming import embeddings_as_saved

    os.chdir(Path(root) / f"node{rank}")
    collectives.SHARED_CHECK_WAIT_S = 0.3
    hashed: list[str] = []
    real = loading.check_checksums

    def counting(folder, manifest, names, **kwargs):
        hashed.extend(names)
        return real(folder, manifest, names, **kwargs)

    loading.check_checksums = counting
    env = ProcessPlacement.detect()
    job = load_config(None, ["--run.dir=run", "--checkpoint.dir=ck", *COMMON, *DDP2])
    try:
        embeddings_as_saved(RunPlan.resolve(validated(job), env=env, vocab_size=256), env)
    except CheckpointError as exc:
        return f"{exc.same_on_every_rank} {exc}", hashed
    return "no refusal", hashed


def test_node_local_folders_are_refused_before_checksums_decide_the_model(tmp_path):
    """Node 0's folder holds an untied step 4 under a tied step 8, so that the checksums decide the model; node 1's is
    empty. The ranks refuse it as the load does, as a folder not shared by all ranks, before hashing files that rank 1
    cannot see (each checkpoint would be reported damaged, and the load's refusal would come only after)."""
    folder = tmp_path / "node0" / "ck"
    ckpt = Checkpointer(ckpt_config(), folder=folder, env=ProcessPlacement.detect({}), layout={"pp": 1},
                        config_fingerprint="fp-test")
    for step, tied in ((4, False), (8, True)):
        ckpt.save(step, {"weights": {"a": torch.full((64,), float(step))}},
                  meta={"config": {"model": {"tie_embeddings": tied}}})
    (tmp_path / "node1" / "ck").mkdir(parents=True)
    said = run_distributed(_node_local_resume, 2, str(tmp_path), timeout=120)
    for refusal, hashed in said:
        assert refusal.startswith("True checkpoint.dir=ck is not on storage shared by all ranks: rank 1"), refusal
        assert hashed == []


def test_the_folder_is_checked_once_before_checksums_decide_the_model(tmp_path, monkeypatch):
    """One start whose checksums decide the model (a damaged tied step 8 over an untied step 4) checks the folder
    before hashing, and its load does not check it again."""
    from test_resume_tie_fallback import UNTIED, _newest_damaged_over, _trainer

    from meshrun.ckpt import collectives, loading
    from meshrun.ckpt.folder import step_dir_name

    run = tmp_path / "run"
    _newest_damaged_over(run, UNTIED, "")
    events: list[str] = []
    real_look, real_hash = collectives._sees, loading.check_checksums

    def looking(store, probe, nonce, wait_s):  # once in each check of the folder
        events.append("folder check")
        return real_look(store, probe, nonce, wait_s)

    def hashing(folder, manifest, names, **kwargs):
        events.append(Path(folder).name)
        return real_hash(folder, manifest, names, **kwargs)

    monkeypatch.setattr(collectives, "_sees", looking)
    monkeypatch.setattr(loading, "check_checksums", hashing)
    with _trainer(run, 12) as trainer:
        assert trainer.resumed["step"] == 4 and trainer.job.model.tie_embeddings is False
        trainer.ckpt.save(5, trainer.app_state)  # a save after the load: the folder is not checked again
    assert events == ["folder check", step_dir_name(8), step_dir_name(4)], events


# ---- through the trainer ---------------------------------------------------------------------------------------

def _close(resumed: list[float], reference: list[float]) -> None:
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(reference), rtol=1e-4, atol=0)


def _saved_config(step_dir: Path) -> dict:
    return json.loads((step_dir / "manifest.json").read_text())["meta"]["config"]


@pytest.mark.slow
def test_a_pipeline_checkpoint_resumes_untied_without_a_pipeline(tmp_path):
    """PP 2 to step 4, then: PP 2 on to step 8 (the reference), one process (resume=auto in a copy of the run) and
    DDP 2 (resume=step 4) on to step 8, both with the reference's losses; they train untied and record it."""
    from test_resume import _worker, train

    pp, one = tmp_path / "pp", tmp_path / "one"
    run_distributed(_worker, 2, pp, 4, (*COMMON, *PP2))
    step4 = pp / "checkpoints" / "step_0000004"
    assert _saved_config(step4)["model"]["tie_embeddings"] is False  # what the pipeline trained
    shutil.copytree(pp, one)
    full = run_distributed(_worker, 2, pp, 8, (*COMMON, *PP2))[0][0]
    assert len(full) == 4
    _close(train(one, 8, (*COMMON, *ONE))[0], full)
    assert "tie_embeddings = false" in (one / "config.toml").read_text()
    assert _saved_config(one / "checkpoints" / "step_0000008")["model"]["tie_embeddings"] is False
    assert ("the checkpoint to resume (step 4) has untied embeddings (trained under parallel.pp=2): building them "
            "untied here too" in (one / "logs" / "rank_00000.log").read_text())
    ddp = run_distributed(_worker, 2, tmp_path / "ddp", 8, (*COMMON, *DDP2, f"--checkpoint.resume={step4}"))
    _close(ddp[0][0], full)


@pytest.mark.slow
def test_a_tied_checkpoint_resumes_under_a_pipeline_untying_at_that_step(tmp_path):
    """FSDP 2 (tied) to step 4, then PP 2 on to step 8: the losses of one process that resumes step 4 with
    model.tie_embeddings=false (which test_a_tied_checkpoint_loads_untied_as_untying_at_that_step holds to untying
    in memory), and the resume says what it did."""
    from test_resume import _worker, train

    fsdp = tmp_path / "fsdp"
    run_distributed(_worker, 2, fsdp, 4, (*COMMON, *FSDP2))
    step4 = fsdp / "checkpoints" / "step_0000004"
    assert _saved_config(step4)["model"]["tie_embeddings"] is True
    resume = f"--checkpoint.resume={step4}"
    pp = run_distributed(_worker, 2, tmp_path / "pp", 8, (*COMMON, *PP2, resume))[0][0]
    reference = train(tmp_path / "one", 8, (*COMMON, *ONE, "--model.tie_embeddings=false", resume))[0]
    assert len(pp) == 4
    _close(pp, reference)
    assert ("has tied embeddings; parallel.pp=2 trains them untied from here"
            in (tmp_path / "pp" / "logs" / "rank_00000.log").read_text())
