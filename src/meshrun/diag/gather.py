"""One fact per node gathered onto every rank, for the checks of ``meshrun doctor``. (The per-rank rows of floats
of a running job are :mod:`meshrun.watch.gather`.)"""

from __future__ import annotations

from typing import TypeVar

import torch.distributed as dist

T = TypeVar("T")


def gather_node_facts(mine: T | None) -> list[T]:
    """Every node leader's ``mine`` (other ranks pass None), sorted by their ``node`` attribute, on every rank.

    A collective on the default group: every rank must call it, in the same order.
    """
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)  # note: collective, every rank must reach it
    return sorted((g for g in gathered if g is not None), key=lambda g: g.node)
