"""Global gradient norm and clipping over DTensor shards, plain tensors and pipeline stages.

Gradients of one rank can live on different meshes (FSDP x TP parameters on the 2-D mesh, norms without sequence
parallelism on the dp mesh only, plain tensors under DDP), and each pipeline stage holds only its own layers. The
norm is computed per mesh (DTensor reduces over that mesh), the per-mesh norms are combined, and then the stages
are combined over the pp group. Every rank gets the same norm; clipping scales every local gradient by it.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


@torch.no_grad()
def total_grad_norm(params: Iterable[torch.Tensor], *, norm_type: float = 2.0,
                    pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The norm of all gradients of the model (all shards, all stages); a plain fp32 scalar tensor.

    Collective: with DTensor gradients every rank of their mesh, and with ``pp_group`` every pipeline rank, must
    call this.
    """
    by_mesh: dict[object, list[torch.Tensor]] = {}
    device = None
    for p in params:
        if p.grad is None:
            continue
        key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
        by_mesh.setdefault(key, []).append(p.grad)
        device = p.grad.device
    parts = []
    for grads in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type)
        parts.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).float())
    if device is None:
        device = torch.device("cpu")
    if not parts:
        total = torch.zeros((), device=device)
    elif math.isinf(norm_type):
        total = torch.stack(parts).max()
    else:
        total = torch.stack(parts).pow(norm_type).sum()
    if pp_group is not None:
        # note: a collective every pipeline rank must reach
        op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
        dist.all_reduce(total, op=op, group=pp_group)
    return total if math.isinf(norm_type) else total.pow(1.0 / norm_type)


@torch.no_grad()
def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float, *, norm_type: float = 2.0,
                   pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Scale gradients so their global norm is at most ``max_norm``; returns the norm before clipping."""
    params = [p for p in params if p.grad is not None]
    total = total_grad_norm(params, norm_type=norm_type, pp_group=pp_group)
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)  # no host sync: multiply by 1.0 when under the limit
    for p in params:
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        grad.mul_(coef.to(grad.device, grad.dtype))
    return total
