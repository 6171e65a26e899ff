"""The choices :func:`meshrun.parallel.apply.parallelize` applies besides the degrees, resolved once and frozen.

The trainer resolves them from its config (:func:`parallel_options`); ``Session.prepare_model`` from its own
arguments. Either way parallelize reads these fields and nothing else of a configuration.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshrun.config import ActivationCheckpointMode, JobConfig
from meshrun.parallel.data_parallel import WHOLE_MODEL


@dataclass(frozen=True)
class ParallelOptions:
    """What parallelize applies, beyond the degrees of the mesh (defaults: those of ``[parallel]`` and ``[train]``)."""

    compute_dtype: torch.dtype | None = None
    """FSDP2's parameter dtype in forward and backward (None or fp32: the parameters' own); gradients reduce in
    fp32."""
    compiled: bool = False
    """Compile each repeated block in place (parameter names keep no ``_orig_mod.``)."""
    cuda_graphs: bool = False
    """Compile the blocks with inductor's CUDA graphs (mode reduce-overhead): train.cuda_graphs for TP and PP."""
    compile_mode: str = "default"
    """default or max-autotune (train.compile_mode)."""
    activation_checkpoint: ActivationCheckpointMode = "none"
    """Activation checkpointing of each block: none, selective or full (parallel.activation_checkpoint)."""
    sequence_parallel: bool = False
    """With TP, shard the residual stream along the sequence between blocks (parallel.sequence_parallel)."""
    float8: bool = False
    """Swap the blocks' linear layers for torchao's Float8Linear (train.float8)."""
    reduce_dtype: torch.dtype = torch.float32
    """The dtype data parallelism sums gradients in (parallel.grad_reduce_dtype): DDP's comm hook, FSDP2's
    reduce dtype."""
    fsdp_reshard_after_forward: str = "auto"
    """auto, true or false (parallel.fsdp_reshard_after_forward)."""
    fsdp_unit_blocks: int = 0
    """Consecutive blocks per FSDP2 unit (parallel.fsdp_unit_blocks; 0: auto, see apply.unit_blocks and
    comm.dp_choice.auto_unit_blocks; -1
    (data_parallel.WHOLE_MODEL): the whole model one unit, compiled as one graph)."""
    fsdp_prefetch: int = 0
    """FSDP2 units each unit gathers ahead (parallel.fsdp_prefetch; 0: FSDP2's own order)."""
    fsdp_symm_mem: bool = False
    """FSDP2's all-gathers through symmetric memory (parallel.fsdp_symm_mem; see data_parallel.use_symm_mem)."""
    device: torch.device | None = None
    """Where the parameters will live ('auto' resharding weighs them against this GPU's memory; None: unknown)."""
    layout: str = ""
    """How errors name the layout (e.g. "layout='fsdp'" for Session); '': the degrees' own name."""
    split_backward: bool = False
    """The pipeline schedule computes weight gradients apart from input gradients (interleavedzb): compiled blocks
    keep their weights out of the graphs (see apply.keep_weights_eager)."""
    residual_in_compute_dtype: bool = False
    """Under autocast, cast each block's input (the residual stream) to the autocast dtype (train.residual_dtype=bf16;
    see apply.cast_block_inputs)."""


def parallel_options(job: JobConfig, *, compute_dtype: torch.dtype | None, compiled: bool = False,
                     device: torch.device | None = None, cuda_graphs: bool = False,
                     split_backward: bool = False, residual_bf16: bool = False,
                     whole_model: bool = False, reduce_bf16: bool | None = None) -> ParallelOptions:
    """The trainer's options: its ``[parallel]`` and ``[train]`` choices, with the resolved dtype and compilation
    (``split_backward``: a zero-bubble pipeline schedule runs; ``residual_bf16``: train.residual_dtype as
    checks.bf16_stream resolves it; ``whole_model``: FSDP2 holds the whole model as one unit, as
    checks.whole_model_unit resolves parallel.fsdp_unit_blocks; ``reduce_bf16``: parallel.grad_reduce_dtype as
    checks.grad_reduce_bf16 resolves it, None: bf16 only where the option says bf16)."""
    p = job.parallel
    reduce = p.grad_reduce_dtype if reduce_bf16 is None else "bf16" if reduce_bf16 else "fp32"
    return ParallelOptions(compute_dtype=compute_dtype, compiled=compiled, cuda_graphs=cuda_graphs and compiled,
                           compile_mode=job.train.compile_mode,
                           activation_checkpoint=p.activation_checkpoint, sequence_parallel=p.sequence_parallel,
                           float8=job.train.float8, reduce_dtype=reduce_dtype(reduce),
                           fsdp_reshard_after_forward=p.fsdp_reshard_after_forward,
                           fsdp_unit_blocks=WHOLE_MODEL if whole_model else p.fsdp_unit_blocks,
                           fsdp_prefetch=p.fsdp_prefetch, fsdp_symm_mem=p.fsdp_symm_mem,
                           device=device, split_backward=split_backward,
                           residual_in_compute_dtype=residual_bf16)


def reduce_dtype(choice: str) -> torch.dtype:
    """parallel.grad_reduce_dtype as a torch dtype ('auto' unresolved: fp32)."""
    return torch.bfloat16 if choice == "bf16" else torch.float32
