"""Activation checkpointing of the transformer blocks: recompute activations in backward instead of storing them.

* ``none``: store everything (fastest, most memory).
* ``selective``: store the outputs of matrix multiplies and attention, recompute the cheap elementwise ops (norms,
  RoPE, SiLU, products) in backward. Saves the activations that cost little to recompute.
* ``full``: store only each block's input; recompute the whole block in backward (about one extra forward).

The block's ``forward`` is wrapped in place instead of wrapping the module, so parameter names stay exactly as in
the unwrapped model (no ``_checkpoint_wrapped_module.`` in checkpoints).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from meshrun.config import ACTIVATION_CHECKPOINT_MODES


def _saved_ops() -> set:
    """Ops whose outputs selective checkpointing keeps (names differ between torch versions and backends)."""
    aten = torch.ops.aten
    names = ("mm", "bmm", "addmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    return {getattr(aten, name).default for name in names if hasattr(aten, name)}


def _selective_policy(saved: set, ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(model: nn.Module, mode: str, *, blocks: list[nn.Module]) -> None:
    """Checkpoint every block of ``model`` (``blocks``: the model's repeated blocks) in place according to ``mode``."""
    if mode not in ACTIVATION_CHECKPOINT_MODES:
        raise ValueError(f"parallel.activation_checkpoint={mode!r} is not one of "
                         f"{', '.join(ACTIVATION_CHECKPOINT_MODES)}")
    if mode == "none":
        return
    context_fn = None
    if mode == "selective":
        policy = functools.partial(_selective_policy, _saved_ops())
        context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
    for block in blocks:
        block.forward = _checkpointed(block.forward, context_fn)


def _checkpointed(forward, context_fn):
    kwargs = {"context_fn": context_fn} if context_fn is not None else {}

    def run(*args):
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)

    return run
