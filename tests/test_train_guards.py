"""Guards in the training loop: non-finite gradient steps never reach the weights (train.nonfinite), and a
checkpoint save is given checkpoint.timeout_s before the hang watchdog calls it a hang."""

from __future__ import annotations

import math

import pytest
import torch

from dist_utils import run_distributed
from meshrun.config import load_config
from meshrun.train.nonfinite import NonFiniteError, NonFiniteGuard
from meshrun.train.trainer import Trainer

BAD_STEP = 3


def tiny_trainer(run_dir, *extra: str) -> Trainer:
    return Trainer(load_config(None, [f"--run.dir={run_dir}", "--train.steps=6", "--train.log_every=2",
                                      "--train.eval_every=0", "--data.max_bytes=200000", "--checkpoint.final=false",
                                      "--run.progress=lines", *extra]))


def poison_gradients_at(trainer: Trainer, step: int) -> list[dict[str, torch.Tensor]]:
    """Make the gradients of optimizer step ``step`` NaN; returns the weights after every step, for the test."""
    forward_backward, train_step, weights = trainer.engine.forward_backward, trainer.train_step, []

    def poisoned(batches):
        out = forward_backward(batches)
        if trainer.step + 1 == step:
            next(p for p in trainer.engine.model_parts[0].parameters()).grad.fill_(math.nan)
        return out

    def recorded():
        out = train_step()
        weights.append({k: v.detach().clone() for k, v in trainer.engine.model_parts[0].state_dict().items()})
        return out

    trainer.engine.forward_backward, trainer.train_step = poisoned, recorded
    return weights


def test_a_nan_step_leaves_the_weights_untouched_and_is_named(tmp_path, capsys):
    trainer = tiny_trainer(tmp_path)
    weights = poison_gradients_at(trainer, BAD_STEP)
    trainer.fit()
    trainer.close()
    before, after = weights[BAD_STEP - 2], weights[BAD_STEP - 1]
    assert all(torch.equal(before[k], after[k]) for k in before)  # the NaN step changed nothing
    assert not all(torch.equal(after[k], weights[-1][k]) for k in after)  # later steps trained on
    assert all(torch.isfinite(v).all() for v in weights[-1].values())
    out = capsys.readouterr().out
    assert f"step {BAD_STEP}: the gradient norm is not finite" in out and "train.nonfinite=skip" in out
    assert "every rank's loss stayed finite" in out  # only the gradients were poisoned


def test_stop_mode_ends_the_run_naming_the_step(tmp_path):
    trainer = tiny_trainer(tmp_path, "--train.nonfinite=stop")
    poison_gradients_at(trainer, BAD_STEP)
    with pytest.raises(NonFiniteError, match=rf"train.nonfinite=stop: step {BAD_STEP}: .*weights are those before "):
        trainer.fit()
    trainer.close()
    assert trainer.step == 4  # stopped at the first log step after the bad one


def test_fused_optimizer_skips_on_the_device():
    param = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.AdamW([param], lr=0.1, fused=True)
    guard = NonFiniteGuard("skip", device=torch.device("cpu"), rank=0, fused_optimizer=True)
    param.grad = torch.ones(4)
    assert guard.allow_step(1, torch.tensor(math.inf), torch.tensor(1.0), optimizer)  # the kernel decides
    optimizer.step()
    assert torch.equal(param.detach(), torch.ones(4)) and int(optimizer.state[param]["step"]) == 0
    guard.allow_step(2, torch.tensor(2.0), torch.tensor(1.0), optimizer)
    optimizer.step()
    assert not torch.equal(param.detach(), torch.ones(4))  # a finite step updates
    assert "step 1: the gradient norm is not finite" in guard.check(2, world_size=1)
    assert guard.check(2, world_size=1) is None  # reported once


def record_beats(trainer) -> list[tuple[str, float | None]]:
    """Swap the trainer's hang watchdog for a recorder of its heartbeats: (phase, timeout_s) each."""
    beats = []

    class Recorder:
        def beat(self, step, phase, *, timeout_s=None):
            beats.append((phase, timeout_s))

    trainer.health.watchdog = Recorder()
    return beats


def test_checkpoint_save_gets_the_checkpoint_timeout_before_a_hang_is_reported(tmp_path):
    trainer = tiny_trainer(tmp_path, "--checkpoint.timeout_s=3600", "--health.hang_timeout_s=60")
    beats = record_beats(trainer)
    trainer.train_step()
    trainer.save_checkpoint()
    trainer.ckpt.wait()
    trainer.close()
    assert ("checkpoint", 3600.0) in beats


def test_the_first_evaluation_gets_the_compile_allowance_before_a_hang_is_reported(tmp_path):
    """The first evaluation compiles the evaluation graphs (minutes with max-autotune), like the first step: both get
    the 1800 s allowance; later evaluations and steps the plain hang limit."""
    trainer = tiny_trainer(tmp_path, "--health.hang_timeout_s=60")
    beats = record_beats(trainer)
    trainer.train_step()
    trainer.evaluate()
    trainer.train_step()
    trainer.evaluate()
    trainer.close()
    assert [b for b in beats if b[0] in ("forward_backward", "evaluate")] == [
        ("forward_backward", 1800.0), ("evaluate", 1800.0), ("forward_backward", None), ("evaluate", None)]


def _nan_loss_worker(rank, world_size, run_dir):
    trainer = tiny_trainer(run_dir)
    step_fn = trainer.engine.step

    def nan_on_rank_1(inputs, targets):
        out = step_fn(inputs, targets)
        return out * math.nan if rank == 1 and trainer.step + 1 == BAD_STEP else out

    trainer.engine.step = nan_on_rank_1
    trainer.fit()
    trainer.close()
    weights = trainer.engine.model_parts[0].state_dict()
    return (run_dir / "logs" / f"rank_{rank:05d}.log").read_text(), all(torch.isfinite(v).all() for v in weights.values())


@pytest.mark.slow
def test_the_rank_whose_loss_went_nan_is_named(tmp_path):
    # rank 1's loss is NaN at step 3; DDP's all-reduce spreads the NaN gradients to rank 0, which must skip too
    (log0, finite0), (_, finite1) = run_distributed(_nan_loss_worker, 2, tmp_path)
    assert "the loss first went non-finite on rank 1 (host" in log0 and f"at step {BAD_STEP}" in log0, log0[-2000:]
    assert finite0 and finite1


def test_config_toml_is_rewritten_with_the_batch_a_resume_kept(tmp_path):
    # 8 samples per step (4 x 2 accumulation), then resumed with micro-batch 2: the checkpoint's global batch 8 is
    # kept by accumulating 4; config.toml must say so, or re-running it would train another batch
    first = tiny_trainer(tmp_path, "--train.micro_batch=4", "--train.grad_accum=2", "--train.steps=2",
                         "--checkpoint.final=true")
    first.fit()
    first.close()
    second = tiny_trainer(tmp_path, "--train.micro_batch=2", "--train.steps=3")
    assert (second.step, second.batch.grad_accum, second.batch.global_batch) == (2, 4, 8)
    second.close()
    written = load_config(str(tmp_path / "config.toml"), [])
    assert (written.train.global_batch, written.train.micro_batch) == (8, 2)


def test_without_clipping_the_guard_reads_the_norm_and_leaves_gradients_alone():
    from meshrun.parallel.engine import LocalEngine
    from meshrun.parallel.grad_norm import clip_grad_norm

    model = torch.nn.Linear(4, 3)
    for p in model.parameters():
        p.grad = torch.full_like(p, 5.0)
    grads = [p.grad.clone() for p in model.parameters()]
    expected = torch.sqrt(sum((g ** 2).sum() for g in grads))
    assert LocalEngine(model).clip_grad_norm(math.inf) == pytest.approx(float(expected))
    assert clip_grad_norm(model.parameters(), math.inf) == pytest.approx(float(expected))
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))  # not scaled, not rewritten


def test_the_engine_is_built_with_the_trainers_batch_plan(tmp_path, monkeypatch):
    import meshrun.parallel.apply as apply

    def resolved_again(*args, **kwargs):
        raise AssertionError("build_engine resolved the batch again instead of taking the trainer's")

    monkeypatch.setattr(apply, "resolve_batch", resolved_again)
    trainer = tiny_trainer(tmp_path, "--train.micro_batch=4", "--train.grad_accum=2")
    assert (trainer.batch.micro_batch, trainer.batch.grad_accum, trainer.batch.global_batch) == (4, 2, 8)
    trainer.close()


def test_a_closed_trainer_gives_back_the_signal_handlers(tmp_path):
    # checkpoint.final=true catches SIGTERM/SIGUSR1 while the trainer lives; after close() the process's own
    # handlers are back (a notebook or test process must not keep a closed trainer's handler)
    import signal

    def mine(signum, frame):
        pass

    before = signal.signal(signal.SIGTERM, mine)
    try:
        trainer = tiny_trainer(tmp_path, "--checkpoint.final=true")
        assert signal.getsignal(signal.SIGTERM) is not mine
        trainer.close()
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, before)
