"""A user's own loop with Session and replica groups: `python replica_session_script.py GROUP LIGHTHOUSE OUT STEPS`.

Writes the final weights and the live groups of the last step to OUT (JSON)."""

from __future__ import annotations

import json
import sys

import torch
from torch.utils.data import TensorDataset

import meshrun
from meshrun.config import ReplicaConfig


def dataset() -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=gen)
    return TensorDataset(x, x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1)


def main(group: int, lighthouse: str, out: str, steps: int) -> None:
    session = meshrun.Session(seed=0, replicas=ReplicaConfig(groups=2, group=group, lighthouse=lighthouse,
                                                              min_groups=2, timeout_s=10))
    model = session.prepare_model(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = session.step_batches(dataset(), micro_batch=4)
    ft = session.join_replicas(0, model=model, optimizer=optimizer, batches=batches)
    while ft.step < steps:
        ft.start_step()
        for x, y in batches.next_step():
            torch.nn.functional.mse_loss(model(x), y).backward()
        if not ft.average_gradients():
            continue  # a group failed during the step: it runs again
        optimizer.step()
        optimizer.zero_grad()
    with open(out, "w") as f:
        json.dump({"weight": model.weight.tolist(), "bias": model.bias.tolist(), "live": ft.live_groups}, f)
    session.close()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]))
