"""Exact resume through the trainer: same world size (bitwise, dropout included) and resharded (4 -> 2, 2 -> 3 ranks)
with the global data order continued, nothing repeated or skipped (CPU, gloo, fp32)."""

import json
import logging
import os
import signal
from collections import Counter

import numpy as np
import pytest
import torch

from dist_utils import run_distributed
from meshrun.config import load_config
from meshrun.train.trainer import Trainer

SEQ = 16
SAMPLES = 96  # one epoch


def token_file(tmp):
    """Sample i is the window [i, i, ..., i]: its first token names it."""
    path = tmp / "tokens.bin"
    np.repeat(np.arange(SAMPLES + 1, dtype=np.uint16), SEQ)[: SAMPLES * SEQ + 1].tofile(path)
    return path


def job(run_dir, *, steps, extra=()):
    return load_config(None, [f"--run.dir={run_dir}", f"--train.steps={steps}", "--train.log_every=1",
                              "--train.eval_every=0", "--train.warmup_steps=2", "--run.progress=lines",
                              "--checkpoint.interval_steps=4", "--health.straggler_threshold=0", *extra])


class Crash(Exception):
    """Stands for a worker dying: no final checkpoint, nothing flushed."""


def train(run_dir, steps, extra=(), crash_after=None):
    """Train (resuming from run_dir's checkpoints if any); return losses, final weights and the samples seen.
    With ``crash_after``, the job dies right after that step (its checkpoint, if due, is written)."""
    trainer = Trainer(job(run_dir, steps=steps, extra=extra))
    seen = []
    next_step = trainer.data.next_step

    def recording():
        if trainer.step == crash_after:
            raise Crash
        batches = next_step()
        seen.extend(int(x[0]) for inputs, _ in batches for x in inputs)
        return batches

    trainer.data.next_step = recording
    try:
        result = trainer.fit()
    except Crash:
        return None, None, seen
    finally:
        trainer.close()
        trainer.ckpt.preemption.restore()  # in-process (the single-rank reference): leave SIGTERM as it was
    state = {k: v.detach().clone() for k, v in trainer.engine.model_parts[0].state_dict().items()}
    return result.losses, state, seen


def _worker(rank, world_size, run_dir, steps, extra, crash_after=None):
    return train(run_dir, steps, extra, crash_after)


DROPOUT = ("--model.dropout=0.1", "--data.max_bytes=200000", "--train.micro_batch=4")


def test_sigterm_saves_a_checkpoint_marked_final_and_stops(tmp_path):
    """One process: SIGTERM during step 3 (as a scheduler sends before it kills) saves step 3, final, and stops."""
    meshrun_log = logging.getLogger("meshrun")
    saved_logging = meshrun_log, list(meshrun_log.handlers), meshrun_log.propagate, meshrun_log.level
    trainer = Trainer(job(tmp_path, steps=8, extra=("--data.max_bytes=100000", "--train.micro_batch=2")))
    next_step = trainer.data.next_step

    def signalled():
        if trainer.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return next_step()

    trainer.data.next_step = signalled
    try:
        result = trainer.fit()
    finally:
        trainer.close()
        trainer.ckpt.preemption.restore()
        _restore_logging(*saved_logging)
    saved = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert result.step == 3 and saved == ["step_0000003"]
    assert json.loads((tmp_path / "checkpoints" / "step_0000003" / "manifest.json").read_text())["final"] is True



def _restore_logging(logger, handlers, propagate, level):
    """Undo the trainer's logging setup (a file handler, propagate off), so later tests in this process see logs."""
    for handler in logger.handlers:
        if handler not in handlers:
            handler.close()
    logger.handlers[:], logger.propagate = handlers, propagate
    logger.setLevel(level)


@pytest.mark.slow
def test_same_world_size_resume_is_bitwise_with_dropout(tmp_path):
    full = run_distributed(_worker, 2, tmp_path / "full", 8, DROPOUT, threads=1)
    run_distributed(_worker, 2, tmp_path / "cut", 8, DROPOUT, 5, threads=1)  # dies during step 6; newest checkpoint: 4
    resumed = run_distributed(_worker, 2, tmp_path / "cut", 8, DROPOUT, threads=1)
    assert (tmp_path / "cut" / "checkpoints" / "step_0000004" / "COMPLETE").exists()
    assert resumed[0][0] == full[0][0][4:], "losses after the resume must equal the uninterrupted run's"
    for name, tensor in full[0][1].items():
        assert torch.equal(resumed[0][1][name], tensor), f"{name} is not bitwise equal after resume"


@pytest.mark.slow
@pytest.mark.parametrize("before, after", [(4, 2), (2, 3)])
def test_resharded_resume_continues_the_global_order(tmp_path, before, after):
    data = (f"--data.source={token_file(tmp_path)}", "--data.val_fraction=0", f"--model.seq_len={SEQ}",
            f"--model.vocab_size={SAMPLES + 8}", "--train.global_batch=12")
    micro = lambda world: f"--train.micro_batch={12 // world}"  # noqa: E731 - one accumulation step
    steps = SAMPLES // 12  # exactly one epoch
    first = run_distributed(_worker, before, tmp_path / "run", steps, (*data, micro(before)), 4, threads=1)
    second = run_distributed(_worker, after, tmp_path / "run", steps, (*data, micro(after)), threads=1)
    seen = Counter(i for rank in first for i in rank[2][: 4 * 12 // before])  # steps 1-4, saved at step 4
    seen.update(i for rank in second for i in rank[2])
    assert sorted(seen) == list(range(SAMPLES)) and set(seen.values()) == {1}, "each sample exactly once"
    reference = train(tmp_path / "single", steps, (*data, "--train.micro_batch=12"))
    torch.testing.assert_close(torch.tensor(second[0][0]), torch.tensor(reference[0][4:]), rtol=1e-4, atol=0)
    for name, tensor in reference[1].items():
        torch.testing.assert_close(second[0][1][name], tensor, rtol=0, atol=1e-4, msg=name)
