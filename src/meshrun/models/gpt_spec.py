"""The built-in GPT as a ModelSpec: how to build it, initialise it, split it into stages, shard it with TP, which
buffer context parallelism shards along the sequence (the RoPE table) and where the chunked loss finds the output
head's input and weight.

Kept apart from gpt.py, which holds no distributed code. The tensor-parallel plan is Megatron-style, on DTensor:

Per block: wq/wk/wv and w1/w3 are column-parallel (each rank computes its share of the heads and of the MLP
width), wo and w2 are row-parallel (each rank's partial product is summed by one all-reduce, or by a
reduce-scatter under sequence parallelism). That is two all-reduces forward and two backward per block. The
attention already reshapes with ``view(B, T, -1, head_dim)``, so it sees n_heads / tp heads unchanged.

The token embedding is row-parallel over the vocabulary (each rank looks up its rows, the partial results are
summed) and the output head column-parallel over the vocabulary. Both shard their weight along the vocabulary
rows (``Shard(0)``), so tied embeddings stay tied: after the plan runs, ``parallelize`` points ``output.weight`` at
the same DTensor parameter as ``tok_embeddings.weight`` (meshrun.parallel.tied, as for every model).

With ``loss_parallel`` the logits stay sharded over the vocabulary (``Shard(-1)``) and the cross-entropy is
computed on each rank's slice without gathering (B, T, V) logits (meshrun.parallel.vocab_loss). Otherwise the
logits are gathered (``Replicate``).

With ``sequence_parallel`` the residual stream between blocks is sharded along the sequence (B, T/tp, C): norms
and dropout run on 1/tp of the tokens and the all-reduces become all-gather + reduce-scatter (same volume).
"""

from __future__ import annotations

import torch
from torch import nn

from meshrun.models.gpt import GPT, SIZES
from meshrun.models.spec import ModelSpec, register_model


def gpt_tp_plan(model: nn.Module, tp_mesh, *, sequence_parallel: bool, loss_parallel: bool) -> None:
    """Shard ``model`` (a GPT, or a pipeline stage of one) over ``tp_mesh`` in place."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    from meshrun.parallel.tp import replicate_params

    seq = Shard(1) if sequence_parallel else Replicate()  # layout of the residual stream between blocks
    top: dict[str, object] = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if model.norm is not None and sequence_parallel:
        top["norm"] = SequenceParallel()
    if model.output is not None:
        top["output"] = ColwiseParallel(input_layouts=seq,
                                        output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                        use_local_output=not loss_parallel)
    if top:
        parallelize_module(model, tp_mesh, top)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, _block_plan(sequence_parallel))
        if not sequence_parallel:
            replicate_params(block.attention_norm, tp_mesh)
            replicate_params(block.ffn_norm, tp_mesh)
    if model.norm is not None and not sequence_parallel:
        replicate_params(model.norm, tp_mesh)
    # tied embeddings: both plans placed their copy as Shard(0) over the vocabulary; parallelize shares it again


def _block_plan(sequence_parallel: bool) -> dict[str, object]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    plan: dict[str, object] = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
    }
    if not sequence_parallel:
        # the block input once as a replicated DTensor for the three (two) column-parallel projections that read it,
        # so that backward all-reduces its gradient once, not once per projection (5 all-reduces per block -> 2)
        plan.update({
            "attention": PrepareModuleInput(input_layouts=(Replicate(), None),
                                            desired_input_layouts=(Replicate(), None)),
            "attention.wo": RowwiseParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w2": RowwiseParallel(),
        })
        return plan
    plan.update({
        "attention_norm": SequenceParallel(),
        # gather the sequence before the column-parallel projections; the rope table (2nd arg) stays as is
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    })
    return plan


def tie_gpt_weights(model: nn.Module) -> None:
    """Point the output head at the token embedding again (to_empty and TP each create a new parameter)."""
    if model.cfg.tie_embeddings and model.tok_embeddings is not None and model.output is not None:
        model.output.weight = model.tok_embeddings.weight


def gpt_sequence_buffers(model: nn.Module) -> list[tuple[torch.Tensor, int]]:
    """The RoPE table (T, hs/2, 2), indexed by position along dim 0: context parallelism shards it with the tokens,
    so each rank rotates its queries and keys by the positions of its own part of the sequence."""
    return [(model.rope, 0)]


def gpt_hidden_states(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The final norm's output (B, T, C), the input of the output head (train.loss=chunked applies the head)."""
    return model(tokens, head=False)


def gpt_head_weight(model: nn.Module) -> torch.Tensor:
    """The output head's weight (V, C) (the token embedding's when tied)."""
    return model.output.weight


def _init(model: nn.Module, device) -> None:
    model.init_weights(buffer_device=device)


GPT_SPEC = register_model(ModelSpec(
    arch="gpt", build=GPT, sizes=SIZES, init_weights=_init, blocks="layers", first_stage=("tok_embeddings",),
    last_stage=("norm", "output"), tp_plan=gpt_tp_plan, tie_weights=tie_gpt_weights,
    sequence_buffers=gpt_sequence_buffers, hidden_states=gpt_hidden_states, head_weight=gpt_head_weight))
