"""A few bf16 training steps of a small FSDP2 model on NCCL, once per variant of apply_fsdp's options, from the same
start: for the 2-GPU tests that check a variant trains like another (symmetric memory, unit sizes)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable, Hashable

import torch
import torch.distributed as dist
from torch import nn

WIDTH = 1024
"""The models' width: blocks large enough to make real NCCL collectives."""


def nccl_fsdp_losses(rank: int, world_size: int, variants: dict[Hashable, dict[str, Any]], *,
                     make_model: Callable[[], nn.Module], steps: int = 5) -> dict[Hashable, list[float]]:
    """Each variant's losses over ``steps`` AdamW steps of ``make_model()`` (its blocks in ``.layers``) sharded by
    apply_fsdp with that variant's options, in bf16, on this rank's GPU; every variant from seed 0 and the same
    batches (rank-dependent)."""
    from torch.distributed.device_mesh import init_device_mesh

    from meshrun.parallel.data_parallel import apply_fsdp

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", timeout=timedelta(seconds=120), device_id=torch.device("cuda", rank))
    try:
        out = {}
        for key, options in variants.items():
            torch.manual_seed(0)
            model = make_model().cuda()
            apply_fsdp(model, init_device_mesh("cuda", (world_size,)), compute_dtype=torch.bfloat16,
                       reshard_after_forward=True, blocks=list(model.layers), **options)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            losses = []
            for step in range(steps):
                x = torch.randn(64, WIDTH, device="cuda", generator=torch.Generator("cuda").manual_seed(step + rank))
                loss = model(x).float().square().mean()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                losses.append(loss.item())
            out[key] = losses
        return out
    finally:
        dist.destroy_process_group()
