"""Cross-entropy over vocabulary-sharded logits, on each rank's local shard, compiled.

Under tensor parallelism the output head is column-parallel: each TP rank holds the logits of its slice of the
vocabulary, ``(B, T, V / tp)``, as a DTensor sharded on its last dimension. ``loss_parallel()`` from
``torch.distributed.tensor.parallel`` computes the cross-entropy on that DTensor op by op, eagerly: each op reads and
writes the whole ``B x T x V / tp`` logits (the largest activation, in fp32 for the softmax) and dispatches through
DTensor. This module computes the same loss on the local shard with three all-reduces of one value per token (the
row maximum, the sum of exponentials, the target's logit), and its backward with none: the gradient of a rank's
logits is ``softmax - one_hot`` of its own slice, from the saved maximum and sum. Compiled, the forward is a couple
of fused passes over the local logits and the backward one, and the fp32 logits never exist whole.

Tokens whose target is ``ignore_index`` (-100, as ``F.cross_entropy``) add nothing to the loss and get no gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol  # traceable all-reduce (torch.compile)
from torch.distributed.tensor import DTensor, Shard

IGNORE_INDEX = -100


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Sum over tokens of ``-log softmax(logits)[target]``; ``logits`` (N, V_local) is this rank's vocabulary slice
    starting at ``offset``; the result is the same on every rank of ``group``."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, offset: int, group: dist.ProcessGroup):
        x = logits.float()
        peak = funcol.all_reduce(x.amax(dim=-1).detach(), "max", group)  # (N,): a stabiliser, no gradient
        shifted = x - peak.unsqueeze(-1)
        total = funcol.all_reduce(shifted.exp().sum(dim=-1), "sum", group)  # (N,) sum of exp over the vocabulary
        local = targets - offset
        here = (local >= 0) & (local < x.shape[-1])  # the target falls in this rank's slice
        index = local.clamp(0, x.shape[-1] - 1).unsqueeze(-1)
        picked = torch.where(here, shifted.gather(-1, index).squeeze(-1), torch.zeros_like(total))
        picked = funcol.all_reduce(picked, "sum", group)  # the target's shifted logit, from the rank that holds it
        valid = targets != IGNORE_INDEX
        ctx.save_for_backward(logits, peak, total, index, here & valid, valid)
        return torch.where(valid, total.log() - picked, torch.zeros_like(total)).sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, peak, total, index, hit, valid = ctx.saved_tensors
        probs = (logits.float() - peak.unsqueeze(-1)).exp() / total.unsqueeze(-1)
        probs = probs.scatter_add(-1, index, -hit.to(probs.dtype).unsqueeze(-1))  # minus the one-hot target
        probs = probs * (valid.to(probs.dtype) * grad).unsqueeze(-1)
        return probs.to(logits.dtype), None, None, None


def local_cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor, offset: int,
                            group: dist.ProcessGroup) -> torch.Tensor:
    """The token-loss sum of a rank's vocabulary slice of the logits (..., V_local), targets (...) in the whole
    vocabulary; differentiable in ``logits``; the same value on every rank of ``group``."""
    return _VocabParallelCrossEntropy.apply(logits.flatten(0, -2), targets.flatten(), offset, group)


def vocab_offset(logits: DTensor) -> int:
    """Where this rank's slice of a DTensor sharded on its last dimension starts in the vocabulary (torch.chunk's
    split, as DTensor's Shard: every slice but the last ceil(V / n) wide)."""
    mesh = logits.device_mesh
    width = -(-logits.shape[-1] // mesh.size())
    return mesh.get_local_rank() * width


def vocab_sharded(logits: torch.Tensor) -> bool:
    """A DTensor sharded on its last dimension over one mesh dimension (a column-parallel head's logits)."""
    return isinstance(logits, DTensor) and logits.device_mesh.ndim == 1 \
        and logits.placements == (Shard(logits.ndim - 1),)


def sharded_loss_function(compiled: bool, whole):
    """(logits, targets) -> token-loss sum. Logits sharded on the vocabulary (``vocab_sharded``) give a plain tensor,
    the same on every TP rank, computed on the local shard; ``compiled`` compiles that computation (inductor fuses
    the fp32 upcast, the exponentials and the reductions, forward and backward). Other logits (a model whose TP
    plan gathers them, e.g. a Hugging Face plan's ``colwise_rep`` head) go through ``whole`` (the engine's
    ``token_loss_sum``) inside torch's ``loss_parallel()``, as before."""
    local_sum = torch.compile(local_cross_entropy_sum, dynamic=False) if compiled else local_cross_entropy_sum

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if vocab_sharded(logits):
            return local_sum(logits.to_local(), targets, vocab_offset(logits), logits.device_mesh.get_group())
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            return whole(logits, targets)

    return loss
