"""Train your own model on your own dataset with meshrun's pieces (no meshrun trainer involved).

    python examples/custom_model.py                                  # one process
    meshrun launch --nproc-per-node 2 examples/custom_model.py       # two ranks, DDP, same global batch

Both runs see the same global batches in the same order, so they print the same losses (up to float rounding).
"""

import argparse
import json

import torch
from torch import nn
from torch.utils.data import TensorDataset

import meshrun


def make_dataset(n: int = 4096, dim: int = 16, classes: int = 4, seed: int = 0) -> TensorDataset:
    """Labels from a fixed random 'teacher' network, so there is something to learn."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    teacher = torch.randn(dim, classes, generator=g)
    return TensorDataset(x, (x @ teacher).argmax(dim=1))


class Classifier(nn.Module):
    def __init__(self, dim: int = 16, hidden: int = 64, classes: int = 4):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--global-batch", type=int, default=128)
    parser.add_argument("--out", help="write losses and accuracy as JSON (rank 0)")
    args = parser.parse_args()

    session = meshrun.Session(seed=0)
    dataset = make_dataset()
    torch.manual_seed(0)  # same initial weights on every rank
    model = session.prepare_model(Classifier())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = session.step_batches(dataset, micro_batch=args.micro_batch, global_batch=args.global_batch)
    session.print(f"world size {session.world_size}, global batch {batches.global_batch} = {args.micro_batch} x "
                  f"{session.world_size} ranks x {batches.grad_accum} accumulation")
    losses = []
    for step in range(args.steps):
        loss_sum = correct = count = 0.0
        for i, (x, y) in enumerate(batches.next_step()):
            with session.sync_gradients(model, last=i == batches.grad_accum - 1):
                logits = model(x)
                loss = nn.functional.cross_entropy(logits, y, reduction="sum")
                (loss / (len(y) * batches.grad_accum)).backward()
            loss_sum += loss.item()
            correct += (logits.argmax(1) == y).sum().item()
            count += len(y)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        totals = session.sum_metrics(loss_sum=loss_sum, correct=correct, count=count)  # exact over ranks
        losses.append(totals["loss_sum"] / totals["count"])
        if step % 10 == 0 or step == args.steps - 1:
            session.print(f"step {step:3d} loss {losses[-1]:.4f} accuracy {totals['correct'] / totals['count']:.3f}")
    if args.out and session.env.is_rank_zero:
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "accuracy": totals["correct"] / totals["count"],
                       "world_size": session.world_size}, f)
    session.close()


if __name__ == "__main__":
    main()
