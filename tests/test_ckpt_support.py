"""Builders shared by the checkpoint tests (a tiny GPT, its optimizer and the trainer's state dict)."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.tensor import DTensor

from meshrun.ckpt.checkpointer import Checkpointer
from meshrun.ckpt.state import CountersState, MetricsState, ModelOptimState, RNGState, SchedulerState
from meshrun.config import CheckpointConfig
from meshrun.env import ProcessPlacement
from meshrun.models.gpt import GPT, gpt_config


class Job:
    """What a trainer holds: model, optimizer, scheduler, counters, metrics, and the checkpoint state dict."""

    def __init__(self, env: ProcessPlacement, *, seed: int = 0, dropout: float = 0.0, wrap=None):
        torch.manual_seed(seed)
        self.model = GPT(gpt_config("tiny", dropout=dropout))
        self.wrapped = wrap(self.model) if wrap is not None else self.model
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: min(1.0, (s + 1) / 4))
        self.counters = CountersState()
        self.metrics: dict[str, float] = {"loss_sum": 0.0}
        self.state = {"model_optim": ModelOptimState([self.model], [self.opt]), "scheduler": SchedulerState(self.sched),
                      "trainer": self.counters, "rng": RNGState(env, seed=seed), "metrics": MetricsState(self.metrics)}

    def train(self, steps: int, *, data_seed: int) -> None:
        """A few AdamW steps on random tokens drawn from their own generator (the global RNG is left to dropout)."""
        gen = torch.Generator().manual_seed(data_seed)
        for _ in range(steps):
            tokens = torch.randint(0, 256, (2, 17), generator=gen)
            logits = self.wrapped(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            self.opt.step()
            self.opt.zero_grad()
            self.sched.step()
            self.counters.step += 1
            self.counters.tokens_seen += tokens.numel()
            self.metrics["loss_sum"] += _global_mean(loss.detach())

    def snapshot(self) -> dict[str, torch.Tensor]:
        """Full (gathered) copies of every model and optimizer tensor, keyed like the flattened optimizer state."""
        out = {f"model.{k}": _full(v) for k, v in self.model.state_dict().items()}
        flat = get_optimizer_state_dict(self.model, self.opt,
                                        options=StateDictOptions(flatten_optimizer_state_dict=True))
        out.update({f"optim.{k}": _full(v) for k, v in flat.items() if isinstance(v, torch.Tensor)})
        return out


def _global_mean(value: torch.Tensor) -> float:
    """Metrics are kept equal on every rank (DCP stores one copy), as a trainer keeps reduced metrics."""
    if dist.is_initialized():
        value = value.clone()
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return value.item()


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def rng_draws() -> tuple[list[float], float, float]:
    return torch.rand(4).tolist(), random.random(), float(np.random.rand())


def config(**overrides) -> CheckpointConfig:
    return CheckpointConfig(**{"keep_last": 10, **overrides})


def checkpointer(folder: Path | str, env: ProcessPlacement | None = None, **overrides) -> Checkpointer:
    env = env or ProcessPlacement.detect({})
    return Checkpointer(config(**overrides), folder=folder, env=env, layout={"dp_replicate": env.world_size},
                        config_fingerprint="fp-test")


def assert_same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for key in expected:
        assert torch.equal(actual[key], expected[key]), key


def test_job_is_deterministic():
    env = ProcessPlacement.detect({})
    first, second = Job(env, seed=3), Job(env, seed=3)
    first.train(1, data_seed=1)
    second.train(1, data_seed=1)
    assert_same(first.snapshot(), second.snapshot())


def reseal(folder: Path) -> None:
    """Recompute the manifest's sizes and SHA-256s and the COMPLETE marker after a test edited ``folder``'s files,
    as someone crafting a checkpoint could: ``ckpt verify`` then passes."""
    import hashlib
    import json

    from meshrun.ckpt.folder import COMPLETE, MANIFEST
    from meshrun.ckpt.manifest import describe_files

    manifest = json.loads((folder / MANIFEST).read_text())
    names = sorted(p.name for p in folder.iterdir() if p.name not in (MANIFEST, COMPLETE))
    manifest["files"] = describe_files(folder, names)
    payload = json.dumps(manifest, indent=1).encode()
    (folder / MANIFEST).write_bytes(payload)
    (folder / COMPLETE).write_text(f"manifest-sha256 {hashlib.sha256(payload).hexdigest()}\n")
