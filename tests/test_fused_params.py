"""The GPT's fused q/k/v and gate/up parameters: same model as separate linears, older checkpoints load, export
writes the separate names."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from test_ckpt_support import Job, checkpointer
from torch import nn

from meshrun.ckpt.fused import fuse_rows, fuse_weights, fused_layout, split_rows, split_weights
from meshrun.ckpt.layout import step_dir_name
from meshrun.cli import main
from meshrun.env import ClusterEnv
from meshrun.models.gpt import GPT, apply_rope, gpt_config

ENV = ClusterEnv.detect({})
GQA = replace(gpt_config("tiny"), n_heads=8, n_kv_heads=2)  # 4 query heads per key/value head


class SeparateAttention(nn.Module):
    """The attention as it was before q/k/v were fused (three linears, heads in order)."""

    def __init__(self, cfg):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x, rope):
        B, T, _ = x.shape
        q, k, v = (w(x).view(B, T, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class SeparateFeedForward(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def separate_gpt(cfg) -> GPT:
    """The GPT with the blocks of before the change: its state dict has the old names (wq, wk, wv, w1, w3)."""
    model = GPT(cfg)
    for block in model.layers.values():
        block.attention, block.feed_forward = SeparateAttention(cfg), SeparateFeedForward(cfg)
    return model


def twins(cfg, seed=0) -> tuple[GPT, GPT]:
    """A fused GPT and the separate one with the same weights."""
    torch.manual_seed(seed)
    fused = GPT(cfg)
    reference = separate_gpt(cfg)
    reference.load_state_dict(split_weights(fused.state_dict(), fused_layout([fused])))
    return fused, reference


def test_rows_round_trip_and_group_layout():
    q, k, v = torch.arange(8.0).view(8, 1), torch.arange(10.0, 12.0).view(2, 1), torch.arange(20.0, 22.0).view(2, 1)
    fused = fuse_rows([q, k, v], groups=2)
    assert fused.flatten().tolist() == [0, 1, 2, 3, 10, 20, 4, 5, 6, 7, 11, 21], "per group: its q rows, k, v"
    assert all(torch.equal(a, b) for a, b in zip(split_rows(fused, [8, 2, 2], groups=2), (q, k, v)))
    assert fuse_rows([torch.tensor(3.0), torch.tensor(3.0)], groups=2).item() == 3.0, "a step count is shared"


@pytest.mark.parametrize("cfg", [gpt_config("tiny"), GQA], ids=["mha", "gqa"])
def test_fused_model_matches_separate_linears(cfg):
    """Forward and every gradient equal (fp32) to the unfused model built from the same weights."""
    fused, reference = twins(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    out, ref = fused(tokens), reference(tokens)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    (out.float().square().mean()).backward()
    (ref.float().square().mean()).backward()
    grads = split_weights({k: p.grad for k, p in fused.named_parameters()}, fused_layout([fused]))
    ref_grads = {k: p.grad for k, p in reference.named_parameters()}
    assert grads.keys() == ref_grads.keys()
    for key, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[key], rtol=1e-5, atol=1e-6, msg=key)


def test_init_keeps_each_weights_distribution():
    model = GPT(replace(gpt_config("small"), n_layers=1))
    model.init_weights()
    parts = split_weights(model.state_dict(), fused_layout([model]))
    for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
        std = parts[f"layers.0.{name}.weight"].std().item()
        assert 0.018 < std < 0.022, (name, std)


def test_kv_heads_must_divide_heads():
    with pytest.raises(ValueError, match="model.n_kv_heads=3 does not divide model.n_heads=8"):
        GPT(replace(gpt_config("tiny"), n_heads=8, n_kv_heads=3))


class SeparateJob(Job):
    """The checkpoint tests' job on the GPT of before the change."""

    def __init__(self, env, seed=0):
        super().__init__(env, seed=seed)
        fused, self.model = self.model, separate_gpt(self.model.cfg)
        self.model.load_state_dict(split_weights(fused.state_dict(), fused_layout([fused])))
        self.wrapped = self.model
        self._separate_optimizer()

    def _separate_optimizer(self):
        from meshrun.ckpt.state import ModelOptimState, SchedulerState

        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: min(1.0, (s + 1) / 4))
        self.state.update(model_optim=ModelOptimState([self.model], [self.opt]), scheduler=SchedulerState(self.sched))


def fused_snapshot(old: SeparateJob) -> dict[str, torch.Tensor]:
    """What a fused model must hold after loading ``old``'s state: weights and AdamW state, fused."""
    layout = fused_layout([GPT(old.model.cfg)])
    expected = {f"model.{k}": v for k, v in fuse_weights(old.model.state_dict(), layout).items()}
    for stat in ("exp_avg", "exp_avg_sq", "step"):
        per_param = {k: old.opt.state[p][stat] for k, p in old.model.named_parameters()}
        expected.update({f"optim.state.{k}.{stat}": v for k, v in fuse_weights(per_param, layout).items()})
    return expected


def test_old_checkpoint_resumes_into_the_fused_model(tmp_path):
    """A checkpoint with separate wq/wk/wv, w1/w3 (weights and AdamW moments) loads into the fused model exactly:
    the loaded state is the old one fused, bit for bit, and training goes on as the old model's does."""
    old = SeparateJob(ENV)
    old.train(2, data_seed=1)
    checkpointer(tmp_path / "ckpt", ENV).save(2, old.state, meta={"epoch": 0, "tokens_seen": 0})
    new = Job(ENV, seed=5)  # other weights: all must come from the checkpoint
    assert checkpointer(tmp_path / "ckpt", ENV).load(new.state) is not None
    got = new.snapshot()
    for key, value in fused_snapshot(old).items():
        assert torch.equal(got[key], value), key
    layout = fused_layout([new.model])
    assert new.counters.step == 2 and new.sched.last_epoch == old.sched.last_epoch
    old.train(1, data_seed=2)
    new.train(1, data_seed=2)
    for key, value in fuse_weights(old.model.state_dict(), layout).items():
        torch.testing.assert_close(new.model.state_dict()[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_export_writes_the_separate_names(tmp_path, capsys):
    job = Job(replace(ENV), seed=2)
    job.train(1, data_seed=1)
    folder = tmp_path / "ckpt"
    checkpointer(folder, ENV).save(1, job.state, meta={"epoch": 0, "tokens_seen": 0})
    out = tmp_path / "model.safetensors"
    assert main(["ckpt", "export", str(folder / step_dir_name(1)), "--to", str(out)]) == 0, capsys.readouterr()
    weights = load_file(str(out))
    assert "layers.0.attention.wq.weight" in weights and "layers.1.feed_forward.w3.weight" in weights
    assert not any("wqkv" in key or "w13" in key for key in weights)
    reference = separate_gpt(job.model.cfg)
    reference.load_state_dict(weights)  # strict: exactly the separate model's names and shapes
    tokens = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(reference(tokens), job.model(tokens), rtol=1e-5, atol=1e-5)
