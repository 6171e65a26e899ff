"""The engine for layouts without pipeline parallelism whose parameters are DTensors: FSDP2, HSDP, TP and their
combinations (FSDP x TP, HSDP x TP, replicate x TP).

Same contract as :class:`meshrun.parallel.engine.LocalEngine`. Differences:

* gradient reduction over dp happens once per optimizer step: FSDP's ``set_requires_gradient_sync(False)`` on
  every micro-batch but the last (gradients accumulate unsharded and are reduce-scattered once);
* with TP every rank of a TP group computes the same loss, so only TP rank 0 returns the sums (others return
  zeros) and a world-wide SUM of (loss_sum, tokens) counts each sample once;
* with ``loss_parallel`` the logits stay sharded over the vocabulary and the cross-entropy runs on each rank's
  shard (parallel/vocab_loss.py: three all-reduces of one value per token; ``loss_fn`` is its compiled form);
* with context parallelism (``sequence_shards``) each micro-batch runs, forward and backward, inside torch's
  context parallelism (parallel/context_parallel.py): this rank computes the loss of its part of every sequence
  and reports that part's sum and token count (the cp ranks' parts add up to the whole);
* a model's auxiliary loss term (``aux_loss``) is added to each micro-batch's objective, not to the reported sums.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from meshrun.parallel.context_parallel import SequenceShards
from meshrun.parallel.engine import (Batch, autocast, count_tensor, loss_function, new_replay_generation,
                                     token_loss_sum, with_aux_loss)
from meshrun.parallel.grad_norm import clip_grad_norm


class ShardedEngine:
    def __init__(self, model: nn.Module, *, dp_rank: int, dp_size: int, reports_loss: bool, fsdp: bool,
                 loss_parallel: bool, autocast_dtype: torch.dtype | None, loss_fn=token_loss_sum,
                 sequence_shards: SequenceShards | None = None, aux_loss=None, cuda_graphs: bool = False):
        self.model = model
        self.cuda_graphs = cuda_graphs
        """The blocks are compiled with CUDA graphs (TP alone): each optimizer step starts a new replay generation."""
        self.model_parts = [model]
        self.timed_modules: list[nn.Module] = [model]  # build_engine narrows it to the blocks where it can
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.reports_loss = reports_loss
        """True on the one rank per data-parallel replica that returns non-zero loss sums."""
        self.fsdp = fsdp
        self.autocast_dtype = autocast_dtype
        self.loss_fn = loss_fn
        """(logits, targets) -> token-loss sum: ``token_loss_sum``, or its compiled form (engine.loss_function); with
        ``loss_parallel`` the vocabulary-sharded form (vocab_loss.sharded_loss_function)."""
        self.eval_loss_fn = loss_function(False, vocab_sharded=loss_parallel)
        """The same loss for evaluation, not compiled (another batch shape would compile another graph)."""
        self.sequence_shards = sequence_shards
        """Context parallelism: splits each micro-batch's sequences over the cp ranks (None without CP)."""
        self.aux_loss = aux_loss
        """model -> the auxiliary loss term of the last forward (ModelStructure.aux_loss), or None."""

    def _sequence(self, inputs: torch.Tensor, targets: torch.Tensor):
        """This rank's part of the sequences (all of them without CP), as a context the step runs inside."""
        if self.sequence_shards is None:
            return contextlib.nullcontext((inputs, targets))
        return self.sequence_shards(self.model, inputs, targets)

    def forward_backward(self, batches: Sequence[Batch]) -> tuple[torch.Tensor, torch.Tensor]:
        device = batches[0][0].device
        loss_sum = torch.zeros((), dtype=torch.float32, device=device)
        tokens = 0
        new_replay_generation(self.cuda_graphs)
        for i, (inputs, targets) in enumerate(batches):
            if self.fsdp:  # reduce-scatter gradients only after the last micro-batch
                self.model.set_requires_gradient_sync(i == len(batches) - 1)
            with self._sequence(inputs, targets) as (inputs, targets):  # (B, T/cp) under CP
                with autocast(device.type, self.autocast_dtype):
                    logits = self.model(inputs)  # (B, T, V), or a vocabulary-sharded DTensor with loss_parallel
                summed = self.loss_fn(logits, targets)
                aux = self.aux_loss(self.model) if self.aux_loss is not None else None
                objective = with_aux_loss(summed, aux, targets.numel())
                (objective / (targets.numel() * len(batches))).backward()
            loss_sum += _local(summed.detach())
            tokens += targets.numel()
        return self._reported(loss_sum, tokens)

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        new_replay_generation(self.cuda_graphs)
        with self._sequence(inputs, targets) as (inputs, targets):
            with autocast(inputs.device.type, self.autocast_dtype):
                logits = self.model(inputs)
            summed = _local(self.eval_loss_fn(logits, targets))
        return self._reported(summed, targets.numel())

    def _reported(self, loss_sum: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.reports_loss:
            loss_sum = torch.zeros_like(loss_sum)
            tokens = 0
        return loss_sum, count_tensor(tokens, loss_sum.device)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        return clip_grad_norm(self.model.parameters(), max_norm)


def _local(value: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor scalar (a loss computed by torch's loss_parallel()) as a plain tensor."""
    return value.full_tensor() if isinstance(value, DTensor) else value
