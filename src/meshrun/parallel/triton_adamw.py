"""AdamW's update over many parameter tensors as one Triton kernel launch.

The update is element-wise and bound by memory: each fp32 element reads its parameter, gradient and two moments and
writes three of them back, 28 bytes. torch's fused AdamW walks the parameter list in chunks (``multi_tensor_apply``,
tens of launches a step) and, given a clipping factor (``grad_scale``), also writes every gradient back divided by
it, 4 bytes more that the trainer never reads (it zeroes the gradients next). On one H200 that kernel took 10.0 ms
of the 1b model's 110 ms training step (1.03B parameters, about 3.3 TB/s).

:func:`adamw_` does the same arithmetic in one launch over all tensors: a table of each tensor's addresses and a
table of (tensor, offset) per block of ``BLOCK`` elements, which the kernel reads to find its data, and it leaves the
gradients as they were. The table of addresses is rebuilt each step (gradients may be new tensors); the block table
is kept while the shapes stay. Each program computes its tensor's bias corrections from the tensor's step count
itself, so the host launches nothing per step but the step counts' increment and the kernel (the corrections as
about ten small tensor operations over the stacked step counts took about 0.5 ms of host time per launch on an
H200 under FSDP2, where the host bounds a small model's step; docs/benchmarks.md round 22). On the H200 the 1b
training step ran 1.020x torch's fused AdamW with it
(docs/benchmarks.md, round 20).

Given bf16 copies of the parameters (the linear layers' weights that the forward pass reads, train.weight_copies),
it also writes each updated parameter rounded to bf16 into its copy, so no separate cast reads the fp32 weights
again before the next forward pass (1.026x on the 1b step, round 21).
"""

from __future__ import annotations

import os
import struct
from typing import Sequence

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

BLOCK = 1024
"""Elements per program: on an H200, 1,024 with 4 warps ran the 1b model's update fastest of 1,024 to 8,192 with 4
to 16 warps (6.9 ms, 4.2 TB/s, in a first form of this kernel without the clipping factor; larger blocks spill
registers)."""
NUM_WARPS = 4


if triton is not None:
    @triton.jit
    def _round_bf16(x):
        """fp32 to bf16 rounded to nearest, ties to even, NaN kept NaN: torch's rounding (c10's
        round_to_nearest_even), in integer operations, which every backend runs alike (Triton's interpreter
        truncates a plain cast)."""
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16
        rounded = tl.where(x != x, 0x7FC0, rounded)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)

    @triton.jit
    def _update(param_ptr, grad_ptr, avg_ptr, sq_ptr, copy_ptr, write_copy, offs, n, lr_decay, beta1, beta2, eps,
                step_size, bc2_sqrt, inv_scale, MASKED: tl.constexpr, MAXIMIZE: tl.constexpr,
                HAS_COPIES: tl.constexpr, COPY_BF16: tl.constexpr):
        if MASKED:
            mask = offs < n
            p = tl.load(param_ptr + offs, mask=mask)
            g = tl.load(grad_ptr + offs, mask=mask).to(tl.float32)
            m = tl.load(avg_ptr + offs, mask=mask)
            v = tl.load(sq_ptr + offs, mask=mask)
        else:
            p = tl.load(param_ptr + offs)
            g = tl.load(grad_ptr + offs).to(tl.float32)
            m = tl.load(avg_ptr + offs)
            v = tl.load(sq_ptr + offs)
        g = g * inv_scale
        if MAXIMIZE:
            g = -g
        p = p - lr_decay * p
        m = beta1 * m + (1.0 - beta1) * g
        v = beta2 * v + (1.0 - beta2) * g * g
        denom = tl.sqrt(v) / bc2_sqrt + eps
        p = p - step_size * m / denom
        if MASKED:
            tl.store(param_ptr + offs, p, mask=mask)
            tl.store(avg_ptr + offs, m, mask=mask)
            tl.store(sq_ptr + offs, v, mask=mask)
        else:
            tl.store(param_ptr + offs, p)
            tl.store(avg_ptr + offs, m)
            tl.store(sq_ptr + offs, v)
        if HAS_COPIES:
            if write_copy:  # the parameter's compute-dtype copy, rounded as torch's .to() rounds
                c = _round_bf16(p) if COPY_BF16 else p.to(tl.float16)
                if MASKED:
                    tl.store(copy_ptr + offs, c, mask=mask)
                else:
                    tl.store(copy_ptr + offs, c)

    @triton.jit
    def _as_double(bits):
        """A Python float passed as the int64 of its bits (:func:`_bits`): Triton passes float arguments as fp32."""
        return bits.to(tl.int64).to(tl.float64, bitcast=True)

    @triton.jit
    def _power(base, count):
        """``base ** count`` for a count below 2 ** 25, by squaring."""
        result = base * 0.0 + 1.0
        for _ in tl.static_range(25):
            result = tl.where((count & 1) != 0, result * base, result)
            base = base * base
            count = count >> 1
        return result

    @triton.jit(do_not_specialize=["lr_bits", "beta1_bits", "beta2_bits"])
    def _adamw_kernel(block_tensor, block_start, addresses, numels, n_tensors, grad_scale_ptr, found_inf_ptr,
                      lr_bits, beta1_bits, beta2_bits, lr, beta1, beta2, eps, weight_decay,
                      GRAD_DTYPE: tl.constexpr, BLOCK: tl.constexpr, HAS_SCALE: tl.constexpr,
                      HAS_INF: tl.constexpr, MAXIMIZE: tl.constexpr, ALIGNED: tl.constexpr,
                      HAS_COPIES: tl.constexpr, COPY_DTYPE: tl.constexpr):
        if HAS_INF:
            if tl.load(found_inf_ptr) != 0:  # a non-finite gradient somewhere: no update (torch's fused skips too)
                return
        pid = tl.program_id(0)
        t = tl.load(block_tensor + pid)
        start = tl.multiple_of(tl.load(block_start + pid), BLOCK)
        n = tl.load(numels + t)
        param_addr = tl.load(addresses + t)
        grad_addr = tl.load(addresses + n_tensors + t)
        avg_addr = tl.load(addresses + 2 * n_tensors + t)
        sq_addr = tl.load(addresses + 3 * n_tensors + t)
        step_addr = tl.load(addresses + 4 * n_tensors + t)
        copy_addr = sq_addr  # unused without copies
        if HAS_COPIES:
            copy_addr = tl.load(addresses + 5 * n_tensors + t)  # 0: this tensor has no copy
        write_copy = copy_addr != 0
        if ALIGNED:  # every address 16-byte aligned (adamw_ checks): the loads can be vectorised
            param_addr = tl.multiple_of(param_addr, 16)
            grad_addr = tl.multiple_of(grad_addr, 16)
            avg_addr = tl.multiple_of(avg_addr, 16)
            sq_addr = tl.multiple_of(sq_addr, 16)
            copy_addr = tl.multiple_of(copy_addr, 16)
        param_ptr = param_addr.to(tl.pointer_type(tl.float32))
        grad_ptr = grad_addr.to(tl.pointer_type(GRAD_DTYPE))
        avg_ptr = avg_addr.to(tl.pointer_type(tl.float32))
        sq_ptr = sq_addr.to(tl.pointer_type(tl.float32))
        copy_ptr = copy_addr.to(tl.pointer_type(COPY_DTYPE))
        # as torch's fused AdamW: the bias corrections in double precision from this tensor's own step count, then
        # rounded to fp32. beta ** step by squaring, in fp64 multiplications only (no libdevice, which Triton's
        # interpreter lacks): within about 50 units in the last place of a double of torch's pow, far below fp32's
        # rounding. An fp32 step count stops counting at 2 ** 24, so 25 bits cover every count
        count = tl.load(step_addr.to(tl.pointer_type(tl.float32))).to(tl.int64)
        beta1_power = _power(_as_double(beta1_bits), count)
        beta2_power = _power(_as_double(beta2_bits), count)
        step_size = (_as_double(lr_bits) / (1.0 - beta1_power)).to(tl.float32)  # fp64: IEEE division and root
        bc2_sqrt = tl.sqrt(1.0 - beta2_power).to(tl.float32)
        lr_decay = lr * weight_decay
        inv_scale = 1.0
        if HAS_SCALE:
            inv_scale = 1.0 / tl.load(grad_scale_ptr).to(tl.float32)
        offs = start + tl.arange(0, BLOCK)
        if start + BLOCK <= n:
            _update(param_ptr, grad_ptr, avg_ptr, sq_ptr, copy_ptr, write_copy, offs, n, lr_decay, beta1, beta2, eps,
                    step_size, bc2_sqrt, inv_scale, MASKED=False, MAXIMIZE=MAXIMIZE, HAS_COPIES=HAS_COPIES,
                    COPY_BF16=COPY_DTYPE == tl.bfloat16)
        else:
            _update(param_ptr, grad_ptr, avg_ptr, sq_ptr, copy_ptr, write_copy, offs, n, lr_decay, beta1, beta2, eps,
                    step_size, bc2_sqrt, inv_scale, MASKED=True, MAXIMIZE=MAXIMIZE, HAS_COPIES=HAS_COPIES,
                    COPY_BF16=COPY_DTYPE == tl.bfloat16)


_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _block_tables(numels: tuple[int, ...], device: torch.device, block: int):
    """(tensor index, first element) of each block, and each tensor's length, on ``device``; kept per shape list."""
    key = (numels, device, block)
    if key not in _TABLES:
        if len(_TABLES) > 64:  # shapes that keep changing (not the trainer's): do not grow without bound
            _TABLES.clear()
        tensors, starts = [], []
        for i, n in enumerate(numels):
            count = (n + block - 1) // block
            tensors.extend([i] * count)
            starts.extend(range(0, count * block, block))
        _TABLES[key] = (torch.tensor(tensors, dtype=torch.int32, device=device),
                        torch.tensor(starts, dtype=torch.int64, device=device),
                        torch.tensor(numels, dtype=torch.int64, device=device))
    return _TABLES[key]


def supports(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], exp_avgs: Sequence[torch.Tensor],
             exp_avg_sqs: Sequence[torch.Tensor], state_steps: Sequence[torch.Tensor],
             copies: Sequence[torch.Tensor | None] | None = None) -> bool:
    """The kernel can take these tensors: Triton imported; contiguous fp32 parameters and moments on one CUDA device,
    gradients laid out alike in fp32 or bf16 (one dtype), fp32 step counts on that device; ``copies`` (None, or per
    parameter None or a contiguous tensor of its shape on that device, all of one 16-bit dtype)."""
    if triton is None or not params:
        return False
    device = params[0].device
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's interpreter runs kernels on CPU tensors
    if (device.type != "cuda" and not interpreting) or grads[0].dtype not in (torch.float32, torch.bfloat16):
        return False
    for p, g, m, v, s in zip(params, grads, exp_avgs, exp_avg_sqs, state_steps):
        for x in (p, m, v):
            if x.dtype != torch.float32 or x.device != device or not x.is_contiguous():
                return False
        if (g.dtype != grads[0].dtype or g.device != device or not g.is_contiguous() or g.shape != p.shape
                or s.device != device or s.dtype != torch.float32 or s.numel() != 1):
            return False
    present = [(p, c) for p, c in zip(params, copies or ()) if c is not None]
    return all(c.dtype == present[0][1].dtype and c.dtype in (torch.bfloat16, torch.float16) and c.device == device
               and c.is_contiguous() and c.shape == p.shape for p, c in present)


def adamw_(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], exp_avgs: Sequence[torch.Tensor],
           exp_avg_sqs: Sequence[torch.Tensor], state_steps: Sequence[torch.Tensor], *, lr: float, beta1: float,
           beta2: float, eps: float, weight_decay: float, maximize: bool = False,
           grad_scale: torch.Tensor | None = None, found_inf: torch.Tensor | None = None,
           copies: Sequence[torch.Tensor | None] | None = None, block: int = BLOCK,
           num_warps: int = NUM_WARPS) -> None:
    """torch's fused AdamW step (``torch._fused_adamw_``) in one launch, in place, on tensors :func:`supports` takes:
    the step counts are incremented first (and taken back where ``found_inf`` is 1, which leaves everything else
    as it was), each gradient is divided by ``grad_scale`` as it is read. Unlike torch's fused kernel, the
    gradients are not written back divided by ``grad_scale``: they are left as they were.

    ``copies``: for each parameter None or a 16-bit tensor of its shape, which gets the updated parameter rounded to
    its dtype (the linear layers' bf16 copies that the forward pass reads, parallel/step_weights.py): 2 bytes
    written per element where a separate cast would read 4 and write 2."""
    if not params:
        return
    device = params[0].device
    torch._foreach_add_(state_steps, 1)
    if found_inf is not None:
        torch._foreach_sub_(state_steps, [found_inf] * len(state_steps))
    block_tensor, block_start, numels = _block_tables(tuple(p.numel() for p in params), device, block)
    pointers = [t.data_ptr() for group in (params, grads, exp_avgs, exp_avg_sqs, state_steps) for t in group]
    present = [c for c in copies or () if c is not None]
    if present:
        pointers += [c.data_ptr() if c is not None else 0 for c in copies]
    # FSDP2's gradient shards are views into one reduce-scatter buffer, packed without padding: a shard whose
    # predecessor's length is not a multiple of 4 starts unaligned, and then no load may assume alignment (the
    # step counts are read one value each, and their addresses do not count)
    aligned = not any(pointer % 16 for pointer in pointers[:4 * len(params)] + pointers[5 * len(params):])
    addresses = torch.tensor(pointers, dtype=torch.int64, pin_memory=device.type == "cuda")
    addresses = addresses.to(device, non_blocking=True)
    unused = block_start  # any tensor: the flags below keep the kernel from reading it
    _adamw_kernel[(block_tensor.numel(),)](
        block_tensor, block_start, addresses, numels, len(params),
        grad_scale if grad_scale is not None else unused, found_inf if found_inf is not None else unused,
        _bits(lr), _bits(beta1), _bits(beta2),
        float(lr), float(beta1), float(beta2), float(eps), float(weight_decay),
        GRAD_DTYPE=tl.bfloat16 if grads[0].dtype == torch.bfloat16 else tl.float32, BLOCK=block,
        HAS_SCALE=grad_scale is not None, HAS_INF=found_inf is not None, MAXIMIZE=maximize, ALIGNED=aligned,
        HAS_COPIES=bool(present), COPY_DTYPE=tl.float16 if present and present[0].dtype == torch.float16
        else tl.bfloat16, num_warps=num_warps)


def _bits(value: float) -> int:
    """``value`` as a double's bits in an int64, which the kernel reads back as a double (``_as_double``): the bias
    corrections need lr and the betas in double precision, as torch's fused AdamW computes them."""
    return struct.unpack("<q", struct.pack("<d", float(value)))[0]
