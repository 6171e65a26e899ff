"""Tied weights: one parameter under several names, kept one parameter through every layout.

A tied model holds one tensor under two or more names, most often a language model whose output head reuses the
token embedding (``lm_head.weight is embed_tokens.weight``: Hugging Face's ``tie_word_embeddings``, the
``model.tie_embeddings`` shape option). The steps of a layout replace parameters module by module, and each would untie
them without a word: tensor parallelism gives every module its own DTensor, ``to_empty`` its own tensor, a
pipeline stage holds one name and not the other, FSDP2 shards each of its units on its own.

So every layout records the shared parameters first (:func:`find_shared`, names grouped by tensor) and, after the
steps that replace parameters, :meth:`SharedParams.restore` points every name of a group at one parameter again
when their placements match (type, shape, dtype, device, and for DTensors the mesh and placements), and otherwise
refuses with a ConfigError naming both parameters. ``layout`` in the methods is how the message names the
layout ("layout='tp'", "TP + FSDP"). Placements that cannot be shared are also refused before they
are made: two names in different FSDP2 units (:meth:`SharedParams.check_units`) or on different pipeline stages
(the ``where`` callable of :meth:`SharedParams.split_by`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Hashable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from meshrun.config import ConfigError

if TYPE_CHECKING:
    from meshrun.models.shape import ModelShape
    from meshrun.models.spec import ModelSpec


@dataclass(frozen=True)
class SharedParams:
    """The parameters of a model held under more than one name, as recorded before a layout is applied."""

    groups: tuple[tuple[str, ...], ...]
    """Each shared parameter's names, in ``named_parameters`` order (the first name keeps the parameter)."""

    def __bool__(self) -> bool:
        return bool(self.groups)

    def restore(self, model: nn.Module, *, layout: str, after: str, reshare: bool = True,
                fix: str = "untie them") -> None:
        """Make every name of a group that ``model`` holds one parameter again, or raise a ConfigError.

        ``after`` says what ran ("tensor parallelism", ...) and ``fix`` the way out, for the message. With
        ``reshare=False`` (after FSDP2, which swaps its parameters on the modules it knows, so a parameter set from
        outside would go stale) a group found split is refused instead of shared."""
        for names in self.groups:
            held = [n for n in names if _holds(model, n)]
            if len(held) < 2:
                continue
            first = model.get_parameter(held[0])
            for name in held[1:]:
                param = model.get_parameter(name)
                if param is first:
                    continue
                if not reshare or _placement(param) != _placement(first):
                    raise ConfigError(
                        f"{layout}: {held[0]} and {name} are one tied parameter, but after {after} they "
                        f"are two ({held[0]}: {_describe(first)}; {name}: {_describe(param)}); {fix}")
                owner, _, attr = name.rpartition(".")
                setattr(model.get_submodule(owner), attr, first)

    def split_by(self, where: Callable[[str], Hashable], *, layout: str, what: str, fix: str) -> None:
        """Refuse a group whose names ``where`` puts in two places (``what`` names the places: 'FSDP2 units',
        'pipeline stages'); ``fix`` is the way out."""
        for names in self.groups:
            places = {}
            for name in names:
                places.setdefault(where(name), name)
            if len(places) > 1:
                (p1, a), (p2, b) = list(places.items())[:2]
                raise ConfigError(f"{layout}: {a} and {b} are one tied parameter, but {what} {p1} and "
                                  f"{p2} would each hold its own copy and train them apart; {fix}")

    def check_units(self, model: nn.Module, units: list[list[nn.Module]], *, layout: str) -> None:
        """Refuse a tied parameter whose names FSDP2 would shard in two units (each unit shards its parameters on
        its own): ``units`` are the block groups given to ``fully_shard`` before the root."""
        if not self:
            return
        prefixes = {id(m): name for name, m in model.named_modules()}
        owners = [(prefixes[id(block)] + ".", f"unit {i} ({prefixes[id(unit[0])]})")
                  for i, unit in enumerate(units) for block in unit]

        def unit_of(param: str) -> str:
            return next((unit for prefix, unit in owners if param.startswith(prefix)), "the root unit")

        self.split_by(unit_of, layout=layout, what="FSDP2", fix="shard them in one unit: pass blocks='' (the whole "
                      "model one FSDP2 unit) or name blocks= that hold both, or untie them")


TP_FIX = ("give both modules the same tensor-parallel style (e.g. 'embedding_rowwise' for the embedding and "
          "'colwise_rep' for the head: both split the vocabulary rows), or leave both out of the plan, or untie them")
"""The way out when tensor parallelism placed the two names of a tied parameter differently."""


def find_shared(model: nn.Module) -> SharedParams:
    """The parameters ``model`` holds under two or more names (tied weights); empty when none."""
    by_tensor: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(param), []).append(name)
    return SharedParams(tuple(tuple(names) for names in by_tensor.values() if len(names) > 1))


def tie_partners(spec: ModelSpec, shape: ModelShape) -> dict[str, str]:
    """Each name of a parameter that ``spec``'s model ties when built with ``model.tie_embeddings`` on -> the first
    name of its group, the one a tied run's checkpoint holds its optimizer state under ({"output.weight":
    "tok_embeddings.weight"}); {} when the model ties nothing. Built on the meta device: no memory."""
    with torch.device("meta"):
        model = spec.build(dataclasses.replace(shape, tie_embeddings=True))
    return {name: names[0] for names in find_shared(model).groups for name in names[1:]}


def _holds(model: nn.Module, name: str) -> bool:
    """Whether ``model`` holds parameter ``name`` (a pipeline stage holds only its own modules)."""
    try:
        model.get_parameter(name)
    except AttributeError:
        return False
    return True


def _placement(param: torch.Tensor) -> tuple:
    """What two parameters must share to be one: kind, shape, dtype, device, and a DTensor's mesh and placements."""
    if isinstance(param, DTensor):
        return ("DTensor", param.shape, param.dtype, param.device_mesh, tuple(param.placements))
    return ("Tensor", param.shape, param.dtype, param.device)


def _describe(param: torch.Tensor) -> str:
    if isinstance(param, DTensor):
        return f"DTensor {tuple(param.shape)} {', '.join(repr(p) for p in param.placements)}"
    return f"tensor {tuple(param.shape)} on {param.device}"
