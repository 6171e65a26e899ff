"""Context parallelism (parallel.cp): each sequence split over the cp ranks of a replica, attention run as a ring.

torch's ``torch.distributed.tensor.experimental.context_parallel`` does the work, as in torchtitan:

* on entry it shards, in place, the buffers it is given along their sequence dimension: the micro-batch's inputs
  and targets (B, T) -> (B, T/cp), and the model's sequence buffers (the RoPE table, ModelSpec.sequence_buffers)
  -> T/cp positions. For causal attention it balances the work: the sequence is cut into 2 x cp chunks and rank r
  keeps chunks r and 2cp-1-r, the same for tokens, targets and positions, so every token keeps its own position;
* inside, ``F.scaled_dot_product_attention`` is the ring: each rank's K/V shards travel round the cp group (an
  all-gather by default), forward and backward, so attention sees the whole sequence;
* on exit the model's buffers are restored.

Only SDPA's CUDA kernels (flash, memory-efficient, cuDNN) have a ring implementation (torch 2.8 to 2.13), so CP
runs on CUDA GPUs; on CPU torch refuses the call (``aten._scaled_dot_product_flash_attention_for_cpu`` has no
sharding strategy), and :func:`check_context_parallel` says so at start-up.

The loss stays exact: each cp rank returns the loss sum and token count of its part of the sequence, and the
trainer's world-wide SUM adds the parts. Gradients too: each micro-batch is scaled by its local token count, and
FSDP averages over dp_shard x cp (the flattened "dp_shard_cp" mesh), which is the mean over the whole sequences.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from meshrun.config import ConfigError
from meshrun.models.spec import ModelSpec

RING_KERNELS = ("flash", "efficient", "cudnn")
"""SDPA kernels torch's ring attention dispatches (parallel.cp needs one of them)."""


def check_context_parallel(*, cp: int, device: torch.device, spec: ModelSpec, attention: str,
                           fp32: bool = False) -> None:
    """Refuse parallel.cp > 1 where it cannot run, naming what to change. ``fp32``: the run computes in fp32."""
    if cp == 1:
        return
    if device.type != "cuda":
        raise ConfigError(
            f"parallel.cp={cp} needs CUDA GPUs: torch's ring attention runs SDPA's CUDA kernels "
            f"({', '.join(RING_KERNELS)}), and this run is on {device.type}. Use --parallel.cp=1 here")
    if attention not in (*RING_KERNELS, "auto", "default"):
        raise ConfigError(f"parallel.cp={cp} with train.attention={attention}: ring attention runs the "
                          f"{', '.join(RING_KERNELS)} kernels only; use --train.attention=auto")
    if fp32:
        raise ConfigError(
            f"parallel.cp={cp} with fp32 compute: fp32 attention runs SDPA's efficient kernel, whose ring merge "
            "fails inside torch (a shape mismatch merging a partial block, seen on torch 2.11 with H100s); train in "
            "bf16 (--train.dtype=auto or bf16)")
    if spec.sequence_buffers is None:
        raise ConfigError(
            f"parallel.cp={cp}: model.arch={spec.arch!r} does not say which buffers are indexed by position "
            "(ModelSpec.sequence_buffers, e.g. a RoPE table; [] for none), so its positions cannot be split with "
            "the sequence; use --parallel.cp=1")


class SequenceShards:
    """Enters torch's context parallelism for one micro-batch: ``with shards(model, inputs, targets) as (i, t)``
    gives this rank's part of the inputs and targets (B, T/cp), with the model's position buffers sharded to
    match, and SDPA running as a ring over ``cp_mesh``.

    Collective: every rank of the cp group must enter it for the same micro-batch (the ring's exchanges happen in
    each attention call inside it, forward and backward).
    """

    def __init__(self, cp_mesh, spec: ModelSpec):
        self.cp_mesh, self.spec = cp_mesh, spec

    @contextlib.contextmanager
    def __call__(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor):
        from torch.distributed.tensor.experimental import context_parallel

        # copies: the context resizes its buffers in place, and a micro-batch may be a view of the step's batch
        inputs, targets = inputs.clone(), targets.clone()  # (B, T)
        extra = self.spec.sequence_buffers(model) if self.spec.sequence_buffers else []
        for buffer, dim in extra:
            if buffer.shape[dim] != inputs.shape[1]:
                raise ConfigError(
                    f"parallel.cp={self.cp_mesh.size()}: the batch has sequences of {inputs.shape[1]} tokens but the "
                    f"model's position buffer has {buffer.shape[dim]} positions; context parallelism shards both "
                    "the same way, so train on sequences of model.seq_len tokens")
        buffers = [inputs, targets, *(buffer for buffer, _ in extra)]
        dims = [1, 1, *(dim for _, dim in extra)]
        with context_parallel(self.cp_mesh, buffers=buffers, buffer_seq_dims=dims,
                              no_restore_buffers={inputs, targets}):
            yield inputs, targets  # (B, T/cp) each: this rank's tokens, in the load-balanced order
