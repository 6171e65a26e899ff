"""The learning-rate schedule (train.lr_schedule), and what a resume with another train.steps does to it.

* ``cosine``: linear warm-up, then a cosine from train.lr down to train.min_lr at train.steps. Its value at a step
  depends on train.steps, so resuming with more steps moves every later step's rate: the rate jumps up;
* ``wsd`` (warmup-stable-decay, as in MiniCPM and DeepSeek LLM): linear warm-up, train.lr until the last
  train.decay_fraction of train.steps, then a linear decay to train.min_lr. Until the decay starts the rate does
  not depend on train.steps, so a run resumed from a checkpoint taken before its decay extends without a jump.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from meshrun.config import TrainConfig


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, steps: int, schedule: str = "cosine",
          decay_fraction: float = 0.2) -> float:
    """The learning rate of optimizer step ``step`` (counted from 0)."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "wsd":
        decay_steps = max(1, round(decay_fraction * steps))
        decay_start = max(warmup_steps, steps - decay_steps)
        if step < decay_start:
            return lr
        progress = min(1.0, (step - decay_start) / max(1, steps - decay_start))
        return lr + (min_lr - lr) * progress
    progress = min(1.0, (step - warmup_steps) / max(1, steps - warmup_steps))
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))


def _lr_of(train: dict[str, Any] | TrainConfig, step: int) -> float:
    get = train.get if isinstance(train, dict) else lambda key, default=None: getattr(train, key, default)
    return lr_at(step, lr=get("lr"), min_lr=get("min_lr"), warmup_steps=get("warmup_steps"), steps=get("steps"),
                 schedule=get("lr_schedule", "cosine") or "cosine", decay_fraction=get("decay_fraction", 0.2) or 0.2)


def build_scheduler(optimizer: torch.optim.Optimizer, train: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR whose factor times train.lr is :func:`lr_at` (train.lr 0 keeps the rate at 0)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _lr_of(train, step) / train.lr if train.lr else 0.0)


def describe_lr_change(saved: dict[str, Any] | None, train: TrainConfig, step: int) -> str | None:
    """One line when resuming at ``step`` under ``train`` changes the learning rate the checkpoint's own schedule
    (``saved``: its train section) would have used next, by more than 1%; None otherwise or when unknown."""
    if not saved or not all(key in saved for key in ("lr", "min_lr", "warmup_steps", "steps")):
        return None
    before, after = _lr_of(saved, step), _lr_of(train, step)
    if abs(after - before) <= 0.01 * max(abs(before), 1e-12):
        return None
    schedule = getattr(train, "lr_schedule", "cosine")
    if saved["steps"] != train.steps:
        why = (f"train.steps {saved['steps']} -> {train.steps}: the {schedule} schedule is recomputed over "
               f"{train.steps} steps")
    else:
        why = "the learning-rate options changed"
    fix = (" (the checkpoint was taken during its decay; resume from one taken before it, see checkpoint.keep_every)"
           if schedule == "wsd" else "; --train.lr_schedule=wsd extends a run without a jump")
    return f"learning rate at step {step} jumps from {before:.2e} to {after:.2e}: {why}{fix}"
