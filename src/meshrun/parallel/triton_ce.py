"""Cross-entropy of bf16 logits: one pass over the logits forward (a Triton kernel) and one backward.

The training step's loss is the sum over tokens of ``cross_entropy(logits.float(), targets)``, logits ``(N, V)``
straight from the output head's bf16 matmul: the largest activation of a small model (16 x 1024 tokens x 50,304
words is 1.6 GB). Compiled, inductor fuses the fp32 upcast into its reductions, but its kernels for rows this long
read the logits well below the GPU's memory bandwidth (on an H200, 124m's logits: 1.10 ms forward, 0.99 ms
backward). This does the least the math needs:

- forward, a Triton kernel: one read of each row, a running maximum and sum of exponentials (online softmax, one
  exponential per element), then the log-sum-exp and the target's logit; it writes one loss and one log-sum-exp per
  row (0.41 ms);
- backward, element by element in torch ops, ``(exp(x - lse) - one_hot(target)) * grad`` in the logits' dtype:
  compiled, one pointwise pass that reads the logits and writes the gradient over them, with no reduction (torch's
  log-softmax backward sums each row of its incoming gradient first).

Rows whose target is ``ignore_index`` (-100, as ``F.cross_entropy``) have loss 0 and a zero gradient.

The forward is a ``torch.library.triton_op`` operator, so ``torch.compile`` traces its kernel into the step's graph
(no graph break, CUDA graphs allowed); on CPU it runs the same math in plain torch. Without Triton it is a plain
``torch.library.custom_op`` with that torch math.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.library import triton_op, wrap_triton

from meshrun.parallel.vocab_loss import IGNORE_INDEX

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the operators fall back to torch
    triton = None

FORWARD = {"BLOCK": 4096, "num_warps": 4}
"""The forward kernel's sizes: one program per row, ``BLOCK`` logits per iteration of its loop (the fastest of 4 to
32 warps and blocks of 1,024 to 16,384 on an H200 for 124m's logits)."""
_IN_USE = [False]
"""Whether engine.token_loss_sum runs these kernels on CUDA tensors (train.cross_entropy,
kernels.select_cross_entropy)."""


def available() -> bool:
    """Triton can be imported (torch's CUDA builds depend on it; its CPU builds do not)."""
    return triton is not None


def use(enabled: bool) -> None:
    """Route the training loss through these kernels (for CUDA logits) or through F.cross_entropy; process-wide."""
    _IN_USE[0] = bool(enabled)


def in_use(logits: torch.Tensor) -> bool:
    """The training loss of ``logits`` runs here: chosen, traced by torch.compile (run eagerly, the backward's
    element-wise ops would each write an N x V tensor: an evaluation's loss, or a step with compile off, keeps
    torch's), on a CUDA GPU, and a plain tensor (a DTensor's loss keeps torch's, whose ops DTensor shards)."""
    return (_IN_USE[0] and torch.compiler.is_compiling() and logits.is_cuda
            and not isinstance(logits, DTensor))


if triton is not None:
    @triton.jit
    def _forward_kernel(x_ptr, x_stride, y_ptr, loss_ptr, lse_ptr, n_cols, ignore_index, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * x_stride
        m = float("-inf")  # running maximum of the row
        s = 0.0  # running sum of exp(x - m)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(x_row + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, 0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
            m = m_new
        lse = m + tl.log(s)
        y = tl.load(y_ptr + row)
        valid = y != ignore_index
        # a target outside [0, V) is not checked (F.cross_entropy's device assertion is): clamped, it reads its own row
        x_y = tl.load(x_row + tl.minimum(tl.maximum(tl.where(valid, y, 0), 0), n_cols - 1)).to(tl.float32)
        tl.store(loss_ptr + row, tl.where(valid, lse - x_y, 0.0))
        tl.store(lse_ptr + row, lse)


def _rows_reference(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int):
    """The forward's math in torch: (per-row loss, per-row log-sum-exp), fp32."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    valid = targets != ignore_index
    picked = x.gather(-1, torch.where(valid, targets, 0).unsqueeze(-1)).squeeze(-1)
    return torch.where(valid, lse - picked, torch.zeros_like(lse)), lse


def _backward_gradient(grad, logits, targets, lse, ignore_index: int) -> torch.Tensor:
    """The gradient in the logits, element by element: ``(exp(x - lse) - one_hot(target)) * grad``. Compiled, inductor
    makes it one pointwise pass that reads the logits and writes the gradient over them (nothing reads the logits
    after the loss's backward): no N x V tensor more than torch's own cross-entropy keeps."""
    words = torch.arange(logits.shape[-1], device=logits.device)  # (V,)
    scale = torch.where(targets != ignore_index, grad.float(), 0.0)  # (N,)
    hit = (words.unsqueeze(0) == targets.unsqueeze(-1)).float()  # (N, V) one-hot of the target
    return ((torch.exp(logits.float() - lse.unsqueeze(-1)) - hit) * scale.unsqueeze(-1)).to(logits.dtype)


def _cross_entropy_rows(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor,
                                                                                                   torch.Tensor]:
    """Per-row cross-entropy of ``logits`` (N, V), last dimension contiguous, and ``targets`` (N,): (loss (N,),
    log-sum-exp (N,)), both fp32."""
    if triton is None or logits.device.type != "cuda":
        return _rows_reference(logits, targets, ignore_index)
    n, v = logits.shape
    loss = torch.empty(n, dtype=torch.float32, device=logits.device)
    lse = torch.empty(n, dtype=torch.float32, device=logits.device)
    block = FORWARD["BLOCK"]
    wrap_triton(_forward_kernel)[(n,)](logits, logits.stride(0), targets, loss, lse, v, ignore_index, BLOCK=block,
                                       num_warps=FORWARD["num_warps"])
    return loss, lse


def _register_operator(name: str, fn):
    """``fn`` as the operator ``name``: a ``triton_op`` where Triton can be imported, so that torch.compile traces
    its kernel; otherwise a plain custom operator with the same math (torch's ``triton_op`` looks for Triton kernels in
    ``fn`` when it is defined, and without Triton logs "Triton not available" in every process that imports this)."""
    if triton is not None:
        return triton_op(name, fn, mutates_args=())
    operator = torch.library.custom_op(name, fn, mutates_args=())
    operator.register_fake(fn)  # as triton_op: the torch path runs on fake tensors for tracing
    return operator


cross_entropy_rows = _register_operator("meshrun::cross_entropy_rows", _cross_entropy_rows)


def _setup_context(ctx, inputs, output):
    logits, targets, ignore_index = inputs
    _, lse = output
    ctx.save_for_backward(logits, targets, lse)
    ctx.ignore_index = ignore_index
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_loss, _grad_lse):
    logits, targets, lse = ctx.saved_tensors
    return _backward_gradient(grad_loss, logits, targets, lse, ctx.ignore_index), None, None


cross_entropy_rows.register_autograd(_backward, setup_context=_setup_context)


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """``F.cross_entropy(logits.float(), targets, reduction="sum")`` for logits (..., V), targets (...) in [0, V) or
    ``ignore_index``. Other targets are not checked on GPUs (meshrun's batcher checks every batch's tokens against
    model.vocab_size)."""
    rows = logits.reshape(-1, logits.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    loss, _ = cross_entropy_rows(rows, targets.reshape(-1), ignore_index)
    return loss.sum()
