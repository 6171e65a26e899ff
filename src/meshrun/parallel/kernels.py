"""Kernel choices that do not change the math: which attention implementation scaled_dot_product_attention uses.

torch picks the SDPA backend by a priority list (flash, memory-efficient, math, cuDNN by default). On Hopper
and newer GPUs cuDNN's fused attention is the fastest for training shapes, so ``train.attention=auto`` moves it
to the front there; any backend that cannot take a call (a shape, a dtype, dropout) still falls through to the
next one. The choice is made once per process, before the first compile: torch.compile bakes the chosen kernel
into the graph when it traces.
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager
from typing import Iterator

import torch

from meshrun.config import ConfigError, JobConfig
from meshrun.parallel.comm_overlap import ZERO_CTA

_ORDER = ("cudnn", "flash", "efficient", "math")


TRITON_MIN_CAPABILITY = (7, 0)
"""The oldest GPUs inductor's Triton kernels run on (Volta); torch.compile fails on older ones."""
BF16_MIN_CAPABILITY = (8, 0)
"""The oldest GPUs with bf16 matmuls (Ampere); older ones have none (autocast turns itself off there)."""


_TARGET_ELSEWHERE: contextvars.ContextVar[bool] = contextvars.ContextVar("meshrun_target_elsewhere", default=False)


@contextmanager
def gpus_elsewhere() -> Iterator[None]:
    """Within the block CUDA devices are the target machine's GPUs, not this host's (``meshrun plan`` and ``meshrun
    train --dry-run``, which check a job for the machine it will run on): their generation and Triton are not asked
    here, as on a machine without GPUs (:func:`cuda_capability` gives None, which ``auto`` choices take as a recent
    GPU). A login node's older GPU then neither refuses float8 nor turns bf16 or compilation off for the target."""
    token = _TARGET_ELSEWHERE.set(True)
    try:
        yield
    finally:
        _TARGET_ELSEWHERE.reset(token)


def gpu_here() -> bool:
    """Whether a CUDA device means a GPU of this host that can be asked (not inside :func:`gpus_elsewhere`)."""
    return torch.cuda.is_available() and not _TARGET_ELSEWHERE.get()


def cuda_capability(device: torch.device | str) -> tuple[int, int] | None:
    """(major, minor) of ``device``'s GPU (the current one when it has no index); None for other devices and where
    no CUDA GPU of the target can be asked (a CPU machine planning a GPU job, or :func:`gpus_elsewhere`), which
    ``auto`` choices take as a recent GPU."""
    device = torch.device(device)
    if device.type != "cuda" or not gpu_here():
        return None
    return torch.cuda.get_device_capability(device if device.index is not None else None)


def compile_enabled(choice: str, device: torch.device) -> bool:
    """train.compile: 'auto' compiles on CUDA GPUs that Triton supports (compute capability 7.0 and newer). On CPU
    the compile (tens of seconds per graph) costs more than it saves for the short runs CPUs are used for, and
    needs a C++ toolchain."""
    if choice == "true":
        return True
    capability = cuda_capability(device)
    return choice == "auto" and device.type == "cuda" and (capability is None or capability >= TRITON_MIN_CAPABILITY)


def inductor_mode(compile_mode: str, cuda_graphs: bool) -> str | None:
    """torch.compile's mode for train.compile_mode and whether the compiled graphs are recorded as CUDA graphs."""
    if compile_mode == "max-autotune":
        return "max-autotune" if cuda_graphs else "max-autotune-no-cudagraphs"
    return "reduce-overhead" if cuda_graphs else None  # reduce-overhead: inductor's CUDA graphs


def bf16_by_default(device: torch.device | str) -> bool:
    """Whether ``auto`` compute dtypes mean bf16 on ``device``: CUDA GPUs of compute capability 8.0 and newer."""
    capability = cuda_capability(device)
    return torch.device(device).type == "cuda" and (capability is None or capability >= BF16_MIN_CAPABILITY)


def require_compiled_cuda(option: str, *, cuda_why: str, compile_why: str, device: torch.device,
                          compiled: bool) -> None:
    """Refuse the switch ``option`` (set to true) on a non-CUDA device or without compilation, naming the fix."""
    if device.type != "cuda":
        raise ConfigError(f"{option}=true needs CUDA GPUs ({cuda_why}); this run is on {device}. Drop --{option}")
    if not compiled:
        raise ConfigError(f"{option}=true {compile_why}; set --train.compile=true (or auto on a GPU)")


def _backend(name: str):
    from torch.nn.attention import SDPBackend

    return {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[name]


def resolve_attention(choice: str, device: torch.device) -> str:
    """The backend ``train.attention=choice`` means on ``device``: 'default' keeps torch's own order."""
    if choice != "auto":
        return choice
    if device.type != "cuda" or not hasattr(torch.backends.cuda, "cudnn_sdp_enabled"):
        return "default"
    capability = cuda_capability(device)  # None: the target's GPU, not asked here, taken as a recent one
    return "cudnn" if capability is None or capability[0] >= 9 else "default"


def select_attention(choice: str, device: torch.device) -> str:
    """Put the chosen backend first in torch's SDPA priority list for this process; returns what was chosen.

    The other backends stay enabled behind it, so a call the chosen one cannot serve still runs.
    """
    chosen = resolve_attention(choice, device)
    if chosen == "default" or device.type != "cuda":
        return chosen
    from torch.nn.attention import sdpa_kernel

    order = [chosen, *(name for name in _ORDER if name != chosen)]
    # Entered for the life of the process (no exit): the priority must hold when compile traces, later.
    sdpa_kernel([_backend(name) for name in order], set_priority=True).__enter__()
    return chosen


def _triton_blocked(device: torch.device) -> str:
    """Why meshrun's Triton kernels cannot run on ``device`` ('' where they can)."""
    from meshrun.parallel import triton_ce

    if device.type != "cuda":
        return f"this run is on {device}"
    if not gpu_here():  # a machine checking a GPU job for another (meshrun plan, --dry-run)
        return ""  # the target's Triton is not known here: taken as present, as cuda_capability takes a recent GPU
    if not triton_ce.available():
        return "the triton package is not installed"
    capability = cuda_capability(device)
    if capability is not None and capability < TRITON_MIN_CAPABILITY:
        return f"Triton needs compute capability 7.0, this GPU has {capability[0]}.{capability[1]}"
    return ""


def _triton_loss_blocked(device: torch.device, *, compiled: bool) -> str:
    """Why meshrun's cross-entropy kernel cannot run here ('' where it can)."""
    if not compiled:
        return _triton_blocked(device) or "it runs inside the compiled step, and train.compile is off"
    return _triton_blocked(device)


def resolve_cross_entropy(choice: str, device: torch.device, *, compiled: bool) -> str:
    """The loss kernels ``train.cross_entropy=choice`` means on ``device``: 'triton' (meshrun's, parallel/triton_ce.py)
    where the step is compiled (``compiled``) on CUDA GPUs that Triton supports, 'torch' elsewhere; an explicit
    'triton' where it cannot run is an error."""
    blocked = _triton_loss_blocked(device, compiled=compiled)
    if choice == "triton" and blocked:
        raise ConfigError(f"train.cross_entropy=triton needs a compiled step on a CUDA GPU with Triton; {blocked}. "
                          "Use --train.cross_entropy=auto (or torch)")
    if choice == "auto":
        return "torch" if blocked else "triton"
    return choice


def select_cross_entropy(choice: str, device: torch.device, *, compiled: bool) -> str:
    """Make the training loss (engine.token_loss_sum) use the chosen kernels in this process, before the first
    compile traces it; returns what was chosen."""
    from meshrun.parallel import triton_ce

    chosen = resolve_cross_entropy(choice, device, compiled=compiled)
    triton_ce.use(chosen == "triton")
    return chosen


def resolve_adamw_kernel(job: JobConfig, device: torch.device) -> str:
    """The AdamW kernel this run steps with: 'triton' (meshrun's, parallel/triton_adamw.py) for
    train.adamw_kernel=auto on CUDA GPUs that Triton supports, 'torch' (torch's fused AdamW) elsewhere on GPUs,
    'foreach' with train.fused_optimizer=false or on CPU; an explicit 'triton' where it cannot run is an error."""
    t = job.train
    blocked = _triton_blocked(device) if t.fused_optimizer else "train.fused_optimizer is false"
    if t.adamw_kernel == "triton" and blocked:
        raise ConfigError(f"train.adamw_kernel=triton runs the fused AdamW on a CUDA GPU with Triton; {blocked}. "
                          "Use --train.adamw_kernel=auto (or torch)")
    if not (t.fused_optimizer and device.type == "cuda"):
        return "foreach"
    return "torch" if blocked or t.adamw_kernel == "torch" else "triton"


def torch_adamw_loop(device: torch.device) -> str:
    """What torch's AdamW runs, given neither ``foreach`` nor ``fused`` (as LocalShardAdamW is for the 'foreach'
    kernel): its for-each kernels on the devices that have them (CUDA, ...), else one tensor at a time (CPU)."""
    from torch.optim.optimizer import _get_foreach_kernels_supported_devices  # torch's own rule (private)

    return "for-each" if device.type in _get_foreach_kernels_supported_devices() else "single-tensor"


def describe_speed(job: JobConfig, device: torch.device, compute_dtype: torch.dtype | None, *,
                   cuda_graphs: bool = False, fsdp: bool = False, cast_once: bool = False, graphs_off: str = "",
                   split_backward: bool = False, comm_reorder: bool = False, p2p_channels: str = "",
                   residual_bf16: bool = False, vocab_sharded: bool = False, weight_copies: str = "",
                   cta_policy: str = "", fsdp_units: str = "", reduce_bf16: bool | None = None) -> str:
    """The start-up header's line of performance choices, as resolved for this device (``cuda_graphs``: the
    engine's resolved train.cuda_graphs; ``fsdp``: FSDP2 holds the parameters, and its mixed precision, not
    autocast, computes in bf16; ``cast_once``: a pipeline's weights are cast once per step, the engine's resolved
    parallel.pp_cast_once; ``graphs_off``: why train.cuda_graphs=auto left CUDA graphs off, from
    apply.graphs_left_off; ``split_backward``: a zero-bubble schedule, for which compiled blocks keep their linear
    layers eager; ``comm_reorder``: the resolved parallel.comm_reorder; ``p2p_channels``: NCCL's channel cap for a
    pipeline's sends and receives, where one is set; ``residual_bf16``: the resolved train.residual_dtype;
    ``vocab_sharded``: TP computes the loss on each rank's vocabulary shard, apply.use_loss_parallel;
    ``weight_copies``: how one process's linear layers hold bf16 copies of their weights (train.weight_copies),
    from StepWeights.describe, or empty; ``cta_policy``: NCCL's CTA policy where parallel.fsdp_symm_mem is on;
    ``fsdp_units``: data_parallel.describe_units of the model, where FSDP2 holds it; ``reduce_bf16``:
    parallel.grad_reduce_dtype as checks.grad_reduce_bf16 resolves it, None: bf16 only where the option says bf16)."""
    t = job.train
    if reduce_bf16 is None:
        reduce_bf16 = job.parallel.grad_reduce_dtype == "bf16"
    reduce = "bf16" if reduce_bf16 else "fp32"
    bf16 = f"bf16 parameters (FSDP2), {reduce} gradient reduction" if fsdp else "bf16 autocast"
    if reduce == "bf16" and not fsdp:
        bf16 += ", bf16 gradient all-reduce"
    if cast_once and not fsdp:
        bf16 += ", weights cast once per step"
    if weight_copies and not fsdp:
        bf16 += f", {weight_copies}"
    if residual_bf16 and not fsdp:
        bf16 += ", residual stream in bf16"
    precision = "float8 matmuls (torchao) + bf16" if t.float8 else (bf16 if compute_dtype == torch.bfloat16 else "fp32")
    compiled = "on with CUDA graphs" if cuda_graphs else "on"
    if split_backward:
        compiled += ", linear layers eager for the zero-bubble schedule"
    if t.compile_mode != "default":
        compiled += f", {t.compile_mode}"
    if comm_reorder:
        compiled += ", collectives reordered beside compute"
    capability = cuda_capability(device)
    old = f"compute capability {capability[0]}.{capability[1]}" if capability else ""
    if precision == "fp32" and t.dtype == "auto" and capability and capability < BF16_MIN_CAPABILITY:
        precision += f" (train.dtype=auto: no bf16 on {old})"
    compile_note = f"train.compile={t.compile}"
    if t.compile == "auto" and capability and capability < TRITON_MIN_CAPABILITY:
        compile_note += f": Triton needs 7.0, this GPU has {old}"
    if graphs_off and not cuda_graphs:
        compile_note += f"; CUDA graphs off: {graphs_off}"
    compiled_step = compile_enabled(t.compile, device)
    loss = ("on vocabulary shards (TP)" if vocab_sharded else "chunked with the head" if t.loss == "chunked"
            else resolve_cross_entropy(t.cross_entropy, device, compiled=compiled_step))
    parts = [f"compile {compiled if compiled_step else 'off'} ({compile_note})",
             precision, f"attention {resolve_attention(t.attention, device)}",
             f"cross-entropy {loss}",
             {"triton": "fused AdamW (Triton)", "torch": "fused AdamW (torch)",
              "foreach": f"AdamW ({torch_adamw_loop(device)})"}[resolve_adamw_kernel(job, device)],
             f"grad clip {t.grad_clip:g}" if t.grad_clip else "no grad clip",
             *([f"pipeline sends and receives on at most {p2p_channels} NCCL channels"] if p2p_channels else []),
             *([fsdp_units] if fsdp_units and fsdp else []),
             *([f"FSDP2 all-gathers on symmetric memory (NCCL_CTA_POLICY={cta_policy}"
                + (": copy engines)" if cta_policy == ZERO_CTA else ")")]
               if job.parallel.fsdp_symm_mem and fsdp else [])]
    return "speed: " + " | ".join(parts)
