"""The random streams a rank starts from: shared by the trainer (``meshrun train``) and ``meshrun.Session``."""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_rank_streams(base_seed: int, rank: int) -> None:
    """Per-rank streams: seed = base seed + rank (dropout and augmentation differ per rank, reproducibly).

    Sets Python's ``random``, NumPy's global generator and torch (CPU and every CUDA device)."""
    seed = base_seed + rank
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
