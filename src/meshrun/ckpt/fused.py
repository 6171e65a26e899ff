"""Parameters stored fused: one tensor whose rows interleave several older, separate parameters.

A model module declares, with names relative to the module::

    fused_parameters = {"wqkv.weight": {"parts": ["wq.weight", "wk.weight", "wv.weight"],
                                        "rows": [n_heads * head_dim, kv_dim, kv_dim], "groups": n_kv_heads}}

The fused tensor's rows are ``groups`` groups, each holding that group's rows of every part in turn (``rows``:
each part's rows in the whole model). The built-in GPT fuses q/k/v per key/value head (groups = n_kv_heads) and gate/up per hidden
unit (groups = hidden), so a contiguous row shard (tensor parallelism) holds whole groups.

This module turns the separate tensors into the fused one (checkpoints written before a model fused them keep
loading) and back (``meshrun ckpt export`` writes the usual separate names). The description of each fused
parameter is saved beside the model (``ModelOptimState``), so export needs nothing but the checkpoint.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch
from torch import nn

FusedLayout = dict[str, dict[str, Any]]
"""Fused parameter FQN -> {"parts": FQNs of the separate parameters it replaces, in row order, "rows": their rows,
"groups": number of row groups}."""

_WRAPPERS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def fused_layout(modules: Iterable[nn.Module]) -> FusedLayout:
    """Every fused parameter the modules' ``fused_parameters`` declare, by FQN as checkpoints store it."""
    layout: FusedLayout = {}
    for root in modules:
        for name, module in root.named_modules():
            declared: Mapping[str, Mapping[str, Any]] = getattr(module, "fused_parameters", None) or {}
            prefix = clean_fqn(f"{name}." if name else "")
            for fused, how in declared.items():
                layout[prefix + fused] = {"parts": [prefix + part for part in how["parts"]],
                                          "rows": [int(r) for r in how["rows"]], "groups": int(how["groups"])}
    return layout


def clean_fqn(name: str) -> str:
    for wrapper in _WRAPPERS:
        name = name.replace(wrapper, "")
    return name.removeprefix("module.")


def fuse_rows(parts: list[torch.Tensor], groups: int) -> torch.Tensor:
    """(rows_i, ...) tensors -> (sum rows_i, ...): per group, that group's rows of each part in turn.

    A 0-d tensor (an optimizer's step count) is the same for every part: the first one is returned."""
    if parts[0].dim() == 0:
        return parts[0].clone()
    for part in parts:
        if part.shape[0] % groups:
            raise ValueError(f"a tensor of {part.shape[0]} rows cannot be fused in {groups} row groups")
    return torch.cat([p.reshape(groups, -1, *p.shape[1:]) for p in parts], dim=1).flatten(0, 1)


def split_rows(fused: torch.Tensor, rows: list[int], groups: int) -> list[torch.Tensor]:
    """The inverse of :func:`fuse_rows`: the parts, of ``rows`` rows each (in total), back as separate tensors."""
    per_group = [r // groups for r in rows]
    if any(r % groups for r in rows) or sum(rows) != fused.shape[0]:
        raise ValueError(f"a fused tensor of {fused.shape[0]} rows does not split into {rows} in {groups} groups")
    grouped = fused.reshape(groups, sum(per_group), *fused.shape[1:])
    return [p.flatten(0, 1).contiguous() for p in grouped.split(per_group, dim=1)]


def fuse_weights(weights: dict[str, torch.Tensor], layout: FusedLayout) -> dict[str, torch.Tensor]:
    """A model state dict with separate parameters (an older checkpoint) turned into the fused ones of ``layout``;
    entries already fused, or not named by ``layout``, are kept as they are."""
    out = dict(weights)
    for fused, how in layout.items():
        if fused not in out and all(part in out for part in how["parts"]):
            out[fused] = fuse_rows([out.pop(part) for part in how["parts"]], how["groups"])
    return out


def split_weights(weights: dict[str, torch.Tensor], layout: FusedLayout) -> dict[str, torch.Tensor]:
    """A whole model state dict with the fused parameters of ``layout`` replaced by their separate parts."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in weights.items():
        if key in layout:
            how = layout[key]
            out.update(zip(how["parts"], split_rows(tensor, how["rows"], how["groups"])))
        else:
            out[key] = tensor
    return out
