"""DDP training equals a single process with the same global batch (CPU, gloo, fp32).

Tolerance: losses rtol 1e-5, parameters atol 2e-5 after 20 AdamW steps. The runs differ only in the order of
floating-point sums (gradient all-reduce vs local accumulation), which stays far below these bounds; a wrong
shard, a missing gradient sync or a wrong loss scaling moves losses by >1e-3 within a few steps.
"""

import functools

import pytest
import torch

from dist_utils import each_run, results_of, run_distributed
from meshrun.config import load_config
from meshrun.train.trainer import Trainer

STEPS = 20


def job(tmp, *, micro_batch, grad_accum):
    return load_config(None, [f"--run.dir={tmp}", f"--train.steps={STEPS}", "--train.log_every=1",
                              f"--train.micro_batch={micro_batch}", f"--train.grad_accum={grad_accum}",
                              "--train.eval_every=10", "--train.eval_samples=32", "--data.max_bytes=300000",
                              "--train.warmup_steps=5", "--run.progress=lines"])


def train(tmp, micro_batch, grad_accum):
    trainer = Trainer(job(tmp, micro_batch=micro_batch, grad_accum=grad_accum))
    result = trainer.fit()
    trainer.close()
    state = {k: v.detach().clone() for k, v in trainer.engine.model_parts[0].state_dict().items()}
    return result.losses, result.val_loss, state


def _ddp_worker(rank, world_size, tmp):
    """Both tests' DDP runs, (micro-batch, accumulation) (8, 1) and (4, 2), one after another on the same 2 ranks
    (starting them took about as long as a run), each in its own folder."""
    return each_run({(mb, accum): functools.partial(train, tmp / f"ddp_{mb}x{accum}", mb, accum)
                     for mb, accum in ((8, 1), (4, 2))})


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory) -> list[dict]:
    return run_distributed(_ddp_worker, 2, tmp_path_factory.mktemp("ddp"), threads=1)


def assert_same_run(reference, other):
    ref_losses, ref_val, ref_state = reference
    losses, val, state = other
    assert len(losses) == len(ref_losses) == STEPS
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    assert val == pytest.approx(ref_val, rel=1e-5)
    for name, tensor in ref_state.items():
        torch.testing.assert_close(state[name], tensor, rtol=0, atol=2e-5, msg=f"parameter {name} differs")


@pytest.mark.slow
def test_ddp_two_ranks_equals_single_process_with_accumulation(tmp_path, ddp_runs):
    # global batch 16 both ways: 1 process x 8 x 2 accumulation == 2 ranks x 8 x 1
    reference = train(tmp_path / "single", 8, 2)
    assert reference[0][-1] < reference[0][0] - 0.5, "the model should learn something in 20 steps"
    results = results_of(ddp_runs, (8, 1))
    assert_same_run(reference, results[0])
    # every rank ends with identical weights (DDP keeps replicas in sync)
    for name, tensor in results[0][2].items():
        assert torch.equal(tensor, results[1][2][name]), name


@pytest.mark.slow
def test_ddp_with_accumulation_equals_single_process(tmp_path, ddp_runs):
    # global batch 16: 1 x 4 x 4 accumulation == 2 ranks x 4 x 2 accumulation (no_sync on the first micro-batch)
    reference = train(tmp_path / "single", 4, 4)
    results = results_of(ddp_runs, (4, 2))
    assert_same_run(reference, results[0])
