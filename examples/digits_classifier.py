"""An image classifier (not a language model) on scikit-learn's handwritten digits (8x8 images, 10 classes; the
data ships with the package), trained through meshrun.Session with DDP or FSDP2.

Needs the optional extra: ``pip install -e ".[examples]"`` (scikit-learn). For example:

    python examples/digits_classifier.py                                                  # one process
    meshrun launch --nproc-per-node 2 examples/digits_classifier.py --layout ddp
    meshrun launch --nproc-per-node 2 examples/digits_classifier.py --layout fsdp        # one word changed

Every layout sees the same global batches in the same order, so all print the same losses (up to float rounding).
Accuracy is exact at any world size: correct predictions summed over ranks / samples summed over ranks. FSDP2
shards each residual block (``blocks``, found by Session) and then the rest.
"""

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import meshrun

try:
    from sklearn.datasets import load_digits
except ImportError:  # pragma: no cover - the message is the point
    raise SystemExit('this example needs scikit-learn: pip install -e ".[examples]"') from None


def digits() -> tuple[TensorDataset, TensorDataset]:
    """(train, test): 1797 images scaled to [0, 1]; every 5th image is held out."""
    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8)
    y = torch.tensor(data.target, dtype=torch.int64)
    test = torch.arange(len(y)) % 5 == 0
    return TensorDataset(x[~test], y[~test]), TensorDataset(x[test], y[test])


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class DigitsNet(nn.Module):
    """A small conv stem, then residual MLP blocks, then a linear classifier."""

    def __init__(self, width: int = 64, depth: int = 3):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.GELU(), nn.Flatten(), nn.Linear(16 * 64, width))
        self.blocks = nn.ModuleList([Block(width) for _ in range(depth)])
        self.head = nn.Linear(width, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        h = self.stem(images)  # (B, width)
        for block in self.blocks:
            h = block(h)
        return self.head(h)  # (B, 10)


@torch.no_grad()
def accuracy(session: meshrun.Session, model: nn.Module, test: TensorDataset) -> float:
    """Each data-parallel rank scores its strided share; summed correct / summed total (one all-reduce)."""
    x, y = test.tensors
    mine = slice(session.dp_rank, None, session.dp_size)
    correct = (model(x[mine].to(session.device)).argmax(1) == y[mine].to(session.device)).sum()
    totals = session.sum_metrics(correct=correct, total=len(y[mine]))
    return totals["correct"] / totals["total"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", default="ddp", help="ddp or fsdp (one process: ignored)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--out", help="write losses and accuracy as JSON (rank 0)")
    args = parser.parse_args()

    session = meshrun.Session(seed=0)
    train, test = digits()
    model = session.prepare_model(DigitsNet(), layout=args.layout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = session.step_batches(train, micro_batch=args.global_batch // session.dp_size,
                                   global_batch=args.global_batch)
    session.print(f"{session.layout.name}: {session.world_size} rank(s), global batch {batches.global_batch}, "
                  f"repeated blocks: {session.layout.blocks or '-'}")
    losses = []
    for step in range(1, args.steps + 1):
        (x, y), = batches.next_step()
        loss = F.cross_entropy(model(x), y, reduction="sum")
        (loss / len(y)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        totals = session.sum_metrics(loss_sum=loss.detach(), count=len(y))  # exact over ranks
        losses.append(totals["loss_sum"] / totals["count"])
        if step % 20 == 0 or step == args.steps:
            session.print(f"step {step:3d} loss {losses[-1]:.4f} test accuracy {accuracy(session, model, test):.3f}")
    final = accuracy(session, model, test)
    if args.out and session.env.is_rank_zero:
        Path(args.out).write_text(json.dumps({"losses": losses, "accuracy": final,
                                              "world_size": session.world_size}))
    session.close()


if __name__ == "__main__":
    main()
