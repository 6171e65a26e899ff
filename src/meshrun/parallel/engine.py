"""How one optimizer step's forward and backward run under a parallel layout.

The trainer only talks to an :class:`Engine`. Each layout (single process, DDP, FSDP2/HSDP, TP, PP and their
compositions) provides one; all of them present the same contract so that the training loop reads the same for all:

* ``model_parts``: the modules that hold this rank's parameters (one for most layouts; one per local stage
  under pipeline parallelism). The optimizer and the checkpointer take their parameters/state from these.
* ``forward_backward(batches)``: run every micro-batch of one optimizer step, accumulating gradients, with the
  gradient reduction across data-parallel ranks happening once, on the last micro-batch. Returns the *sum* of the
  token losses on this rank and the number of target tokens, both as tensors, so the caller can aggregate exactly
  (sum over ranks of loss sums / sum over ranks of tokens).
* ``eval_loss(inputs, targets)``: the same sums for one validation batch, without gradients.
* ``clip_grad_norm(max_norm)``: the global gradient norm (over every shard, mesh and pipeline stage; the same value
  on every rank), clipping to it.
* ``dp_rank`` / ``dp_size``: which data shard this rank reads; tensor- and pipeline-parallel peers read the same.

Loss sums are non-zero on exactly one rank per data-parallel replica (with TP/PP: TP rank 0 of the last pipeline
stage; every other rank returns zeros), so a world-wide SUM all-reduce of (loss_sum, tokens) is exact.
The engines for sharded, tensor- and pipeline-parallel layouts live beside this module and are built by
:func:`meshrun.parallel.apply.build_engine`.

Gradients are scaled so that, after the data-parallel reduction, they equal the gradient of the mean token loss
over the whole global batch: every micro-batch loss is ``sum / (tokens_per_microbatch * grad_accum)`` and the
data-parallel reduction averages over ranks. This matches a single process that sees the same global batch.
"""

from __future__ import annotations

import math

import contextlib
from typing import Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from meshrun.models.spec import ModelStructure
from meshrun.parallel import triton_ce
from meshrun.parallel.chunked_loss import chunked_token_loss_sum
from meshrun.parallel.grad_norm import fp32_norm
from meshrun.parallel.step_weights import StepWeights
from meshrun.parallel.vocab_loss import sharded_loss_function

Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs (B, T) int64, targets (B, T) int64)


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of per-token cross-entropy, in fp32. logits (B, T, V), targets (B, T). In a compiled step on CUDA GPUs
    meshrun's Triton kernel computes the forward by default (train.cross_entropy, parallel/triton_ce.py)."""
    if triton_ce.in_use(logits):
        return triton_ce.cross_entropy_sum(logits, targets)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1), reduction="sum")


def with_aux_loss(summed: torch.Tensor, aux: torch.Tensor | None, tokens: int) -> torch.Tensor:
    """``summed`` (a micro-batch's token-loss sum) carrying the gradient of ``aux`` (the model's auxiliary loss term,
    ModelStructure.aux_loss), its value unchanged: the engines divide by the tokens of the step, so ``aux x tokens``
    adds ``aux / micro-batches`` to the objective, and the reported loss stays the cross-entropy (as Megatron-LM's
    MoE auxiliary-loss scaler does)."""
    if aux is None:
        return summed
    term = aux.float() * tokens
    zero = term - term.detach()  # 0 in value; d(zero)/d(aux) = tokens
    if isinstance(summed, DTensor) and not isinstance(zero, DTensor):  # a replicated DTensor loss
        zero = DTensor.from_local(zero, summed.device_mesh, summed.placements, run_check=False)
    elif isinstance(zero, DTensor) and not isinstance(summed, DTensor):  # a TP model's term, the loss on local shards
        zero = zero.full_tensor()
    return summed + zero


def count_tensor(count: int, device: torch.device) -> torch.Tensor:
    """A count as a 0-d fp32 tensor on ``device``, made by a fill kernel: ``torch.tensor(x, device=cuda)`` would
    copy from host memory and synchronise the stream, stalling the host once per step."""
    return torch.full((), float(count), dtype=torch.float32, device=device)


def loss_function(compiled: bool, *, vocab_sharded: bool = False):
    """``token_loss_sum``, compiled when the model is: inductor then fuses the fp32 upcast into the cross-entropy,
    so the logits (B x T x V, the largest activation) never exist in fp32, in forward or backward. For layouts
    whose model is compiled block by block (FSDP, TP, PP), where the head and loss would otherwise run eagerly.
    ``vocab_sharded``: TP's logits stay sharded over the vocabulary, and the loss runs on each rank's shard
    (parallel/vocab_loss.py)."""
    if vocab_sharded:
        return sharded_loss_function(compiled, whole=token_loss_sum)
    return torch.compile(token_loss_sum, dynamic=False) if compiled else token_loss_sum


def new_replay_generation(cuda_graphs: bool) -> None:
    """With CUDA graphs (train.cuda_graphs): the last step's graph outputs may now be overwritten. Called once per
    optimizer step (and per evaluation), not per micro-batch: a parameter's first gradient of a step becomes its
    .grad without a copy, so a later micro-batch replaying the same graph would overwrite it; within one generation
    each micro-batch gets graphs of its own (pytorch#169545)."""
    if cuda_graphs:
        torch.compiler.cudagraph_mark_step_begin()


class Engine(Protocol):
    model_parts: list[nn.Module]
    timed_modules: list[nn.Module]
    """Modules whose forward is this rank's own work: the trainer's straggler timer hooks them."""
    dp_rank: int
    dp_size: int

    def forward_backward(self, batches: Sequence[Batch]) -> tuple[torch.Tensor, torch.Tensor]: ...

    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor: ...


class LossStep(nn.Module):
    """The model and its loss as one module: compiled whole, torch.compile fuses the output head, the fp32 upcast
    and the cross-entropy, so the logits (B x T x V, the largest activation) are not written out in fp32.

    ``structure`` gives the loss hooks: with ``chunked`` its ``hidden_states`` and ``head_weight``, and its
    ``aux_loss`` when the model has an auxiliary term (see :func:`with_aux_loss`)."""

    def __init__(self, model: nn.Module, autocast_dtype: torch.dtype | None = None, *,
                 structure: ModelStructure | None = None, chunked: bool = False):
        super().__init__()
        self.model, self.autocast_dtype = model, autocast_dtype
        structure = structure or ModelStructure()
        self.chunked = chunked
        """train.loss=chunked: the head and the loss run chunk by chunk (parallel/chunked_loss.py)."""
        if chunked and (structure.hidden_states is None or structure.head_weight is None):
            raise ValueError("LossStep(chunked=True) needs the model's hidden_states and head_weight hooks")
        self.hidden_states, self.head_weight = structure.hidden_states, structure.head_weight
        self.aux_loss = structure.aux_loss

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with autocast(inputs.device.type, self.autocast_dtype):
            if self.chunked:
                hidden = self.hidden_states(self.model, inputs)  # (B, T, C)
                summed = chunked_token_loss_sum(hidden, self.head_weight(self.model), targets)
            else:
                logits = self.model(inputs)  # (B, T, V)
        if not self.chunked:
            summed = token_loss_sum(logits, targets)
        return with_aux_loss(summed, self.aux_loss(self.model) if self.aux_loss else None, targets.numel())


def autocast(device_type: str, dtype: torch.dtype | None, *, cache: bool = True):
    """``torch.autocast`` to ``dtype``, or nothing for plain fp32 (dtype None); ``cache``: autocast's cache of weight
    casts within the block (torch's ``cache_enabled``)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype, cache_enabled=cache)


def _is_compiled(module: nn.Module) -> bool:
    # private: what torch.compile(module) returns (OptimizedModule) has no public type or test in 2.8 to 2.13
    return hasattr(module, "_orig_mod")


class LocalEngine:
    """One model replica per rank: a single process, or DDP.

    ``step`` is the module that maps (inputs, targets) to the loss sum: a :class:`LossStep` over ``model``, possibly
    compiled and/or DDP-wrapped (default: a plain LossStep). With DDP the gradient all-reduce is skipped
    (``no_sync``) on every micro-batch but the last; where DDP holds the linear layers' bf16 copies
    (``step_weights.reduced_by_ddp``) every micro-batch is all-reduced and added in fp32 instead.
    """

    def __init__(self, model: nn.Module, *, step: nn.Module | None = None, autocast_dtype: torch.dtype | None = None,
                 dp_rank: int = 0, dp_size: int = 1, cuda_graphs: bool = False,
                 step_weights: StepWeights | None = None):
        self.model = model
        self.step_weights = step_weights
        """train.weight_copies: the linear layers hold compute-dtype copies of their weights during each step."""
        self.cuda_graphs = cuda_graphs
        """The step is compiled with CUDA graphs: each optimizer step starts a new replay generation."""
        self.step = step if step is not None else LossStep(model, autocast_dtype)
        self.model_parts = [model]
        # Under DDP the (compiled) LossStep it wraps; a compiled DDP is timed from outside (its inner modules run
        # inside the compiled region, where hooks would break the graph).
        inner = self.step if _is_compiled(self.step) else getattr(self.step, "module", self.step)
        self.timed_modules = [inner]
        """Modules whose forward is this rank's own work (no collective inside): the trainer's straggler timer
        hooks them. Outside any compiled region, so the hooks do not break the graph."""
        self.autocast_dtype = autocast_dtype
        self.dp_rank, self.dp_size = dp_rank, dp_size
        """Which data shard this rank reads, out of how many (the sampler's rank and world size)."""

    def forward_backward(self, batches: Sequence[Batch]) -> tuple[torch.Tensor, torch.Tensor]:
        loss_sum = torch.zeros((), dtype=torch.float32, device=batches[0][0].device)
        tokens = 0
        new_replay_generation(self.cuda_graphs)
        copies = self.step_weights
        held = copies.held(micro_batches=len(batches)) if copies is not None else contextlib.nullcontext()
        # DDP holding bf16 copies all-reduces every micro-batch: under no_sync it would add them in bf16
        every = copies is not None and copies.reduced_by_ddp
        with held:
            for i, (inputs, targets) in enumerate(batches):
                last = i == len(batches) - 1
                sync = (contextlib.nullcontext() if last or every or not hasattr(self.step, "no_sync")
                        else self.step.no_sync())
                with sync:
                    summed = self.step(inputs, targets)
                    (summed / (targets.numel() * len(batches))).backward()
                if every:
                    copies.hand_over()  # this micro-batch's averaged gradients, added in fp32 to the others'
                loss_sum += summed.detach()
                tokens += targets.numel()
        return loss_sum, count_tensor(tokens, loss_sum.device)

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with autocast(inputs.device.type, self.autocast_dtype):
            logits = self.model(inputs)
        return token_loss_sum(logits, targets), count_tensor(targets.numel(), inputs.device)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip to ``max_norm`` and return the norm before clipping; ``inf`` returns the norm without touching the
        gradients (one read of them, not a read and a write)."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        total = fp32_norm(grads)
        if not math.isinf(max_norm):
            torch.nn.utils.clip_grads_with_norm_(self.model.parameters(), max_norm, total)
        return total
