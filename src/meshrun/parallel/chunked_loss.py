"""The output head and cross-entropy computed chunk by chunk, so the logits (B x T x V) never exist whole.

``train.loss=chunked``: the forward pass runs the head's matmul, the log-sum-exp and the gradient of the loss for a
few thousand tokens at a time, and keeps only the gradients with respect to the hidden states (N x C) and the head
weight (V x C); backward then only scales them. Peak memory for the loss drops from N x V (bf16 logits, plus their
fp32 softmax in backward) to one chunk's N_chunk x V, at the price of doing the head's backward matmuls during the
forward pass (the same FLOPs, in another order). The same idea as Liger-Kernel's fused linear cross-entropy,
written with plain torch ops.
"""

from __future__ import annotations

import torch

CHUNK_ELEMENTS = 64 * 2**20
"""Logits per chunk (64 Mi elements: 256 MiB in fp32)."""


def chunk_rows(vocab: int) -> int:
    """Tokens per chunk for a vocabulary of ``vocab``."""
    return max(1, CHUNK_ELEMENTS // vocab)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum over tokens of cross_entropy(h @ W.T, y); gradients computed in forward, chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, rows: int):
        # hidden (N, C) in the compute dtype, weight (V, C), targets (N,) int64
        w = weight.to(hidden.dtype)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], rows):
            h, y = hidden[start:start + rows], targets[start:start + rows]
            logits = (h @ w.t()).float()  # (n, V)
            lse = torch.logsumexp(logits, dim=-1)  # (n,)
            total += (lse - logits.gather(1, y[:, None]).squeeze(1)).sum()
            dlogits = torch.softmax(logits, dim=-1)  # d(sum of losses)/d(logits) = softmax - one_hot(y)
            dlogits.scatter_add_(1, y[:, None], torch.full_like(lse[:, None], -1.0))
            dlogits = dlogits.to(hidden.dtype)
            grad_hidden[start:start + rows] = dlogits @ w  # (n, C)
            grad_weight += (dlogits.t() @ h).float()  # (V, C)
        ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype))
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_total.to(grad_hidden.dtype), grad_weight * grad_total.to(grad_weight.dtype), None, \
            None


@torch.compiler.disable  # runs eagerly inside a compiled model: compiled, this Function's gradients came out zero
def chunked_token_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of per-token cross-entropy of ``hidden @ weight.T`` against ``targets``, in fp32.

    hidden (B, T, C), weight (V, C), targets (B, T). Equal to ``token_loss_sum(hidden @ weight.T, targets)`` (up to
    the order of the sums) in value and in its gradients.
    """
    flat = hidden.flatten(0, 1)  # (N, C)
    return _ChunkedLinearCrossEntropy.apply(flat, weight, targets.flatten(), chunk_rows(weight.shape[0]))
