"""train.loss=chunked: the output head and cross-entropy computed chunk by chunk equal the full loss, in value and
gradients, and training with it follows the same trajectory (CPU, fp32; tolerances: 1e-5 relative on sums of
thousands of terms, whose order differs)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshrun.config import ConfigError, load_config
from meshrun.parallel import chunked_loss
from meshrun.parallel.chunked_loss import chunked_token_loss_sum
from meshrun.train.trainer import Trainer


def test_chunked_loss_and_gradients_equal_the_full_loss(monkeypatch):
    monkeypatch.setattr(chunked_loss, "CHUNK_ELEMENTS", 7 * 50)  # 7 tokens per chunk: 6 chunks, the last partial
    torch.manual_seed(0)
    hidden = torch.randn(2, 20, 16, requires_grad=True)  # (B, T, C)
    weight = torch.randn(50, 16, requires_grad=True)  # (V, C)
    targets = torch.randint(0, 50, (2, 20))
    full = F.cross_entropy((hidden @ weight.t()).flatten(0, 1), targets.flatten(), reduction="sum")
    full_grads = torch.autograd.grad(2.5 * full, (hidden, weight))
    chunked = chunked_token_loss_sum(hidden, weight, targets)
    chunked_grads = torch.autograd.grad(2.5 * chunked, (hidden, weight))
    torch.testing.assert_close(chunked, full, rtol=1e-5, atol=0)
    for got, want in zip(chunked_grads, full_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _losses_and_weights(tmp_path, loss: str):
    job = load_config(None, ["--model.name=tiny", "--train.steps=8", "--train.log_every=1", "--train.eval_every=0",
                             "--data.max_bytes=200000", "--checkpoint.final=false", f"--train.loss={loss}",
                             f"--run.dir={tmp_path / loss}"])
    trainer = Trainer(job)
    try:
        result = trainer.fit()
    finally:
        trainer.close()
        if trainer.ckpt.preemption is not None:  # in-process: leave SIGTERM as it was
            trainer.ckpt.preemption.restore()
    return result.losses, trainer.engine.model_parts[0].state_dict()


def test_training_with_the_chunked_loss_follows_the_full_loss(tmp_path, monkeypatch):
    monkeypatch.setattr(chunked_loss, "CHUNK_ELEMENTS", 100 * 256)  # 100 tokens a chunk: 6 per 8 x 64 micro-batch
    full_losses, full_state = _losses_and_weights(tmp_path, "full")
    chunked_losses, chunked_state = _losses_and_weights(tmp_path, "chunked")
    torch.testing.assert_close(torch.tensor(chunked_losses), torch.tensor(full_losses), rtol=1e-5, atol=0)
    for name, value in full_state.items():
        torch.testing.assert_close(chunked_state[name], value, rtol=0, atol=1e-5, msg=name)


def test_chunked_loss_is_refused_where_it_does_not_run():
    with pytest.raises(ConfigError, match="train.loss='whole' is not one of full, chunked"):
        load_config(None, ["--train.loss=whole"])
