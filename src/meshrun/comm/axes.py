"""The parallel axes, listed once: the mesh (comm/mesh.py), rank coordinates and groups, the planner and the layout
a checkpoint records are all derived from :data:`AXES`.

Adding an axis (expert parallelism, say) is one :class:`Axis` entry here, a ``parallel.<name>`` degree in config.py,
and its apply step in parallel/apply.py; docs/architecture.md lists the files.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from meshrun.config import ConfigError


@dataclass(frozen=True)
class Axis:
    """One parallel axis: a mesh dimension, its ``parallel.<name>`` degree and what it splits."""

    name: str
    splits: str
    """What the axis divides among its ranks, for messages and ``meshrun plan``."""


AXES: tuple[Axis, ...] = (
    Axis("pp", "the model's layers into pipeline stages"),
    Axis("dp_replicate", "the batch over whole replicas"),
    Axis("dp_shard", "the batch, and the parameters (FSDP2)"),
    Axis("cp", "each sequence (ring attention)"),
    Axis("tp", "each layer's weights (tensor parallelism)"),
)
"""The parallel axes, outermost first: the one list that the mesh, the coordinates, the planner and the checkpoint's
layout record are derived from. Adding an axis is one entry here plus its apply step (parallel/apply.py)."""
MESH_DIMS = tuple(axis.name for axis in AXES)
"""Mesh dimension names, outermost first."""
FLAT_DIMS = {"dp": ("dp_replicate", "dp_shard"), "dp_shard_cp": ("dp_shard", "cp")}
"""Flattened dimensions and the mesh dimensions they join."""

RankCoords = NamedTuple("RankCoords", [(name, int) for name in MESH_DIMS])  # type: ignore[misc]  # fields from AXES
RankCoords.__doc__ = "A rank's coordinates on the mesh, one field per axis in mesh order."


def resolve_degrees(degrees: dict[str, int], *, world_size: int) -> dict[str, int]:
    """Replace at most one -1 degree with world_size over the others; refuse 0, other negatives, two -1s.

    dp_replicate=-1 (its default) with dp_shard=-1 asks FSDP2 to shard over the ranks the other axes leave: the
    replicas become 1, as `--parallel.dp_shard=-1` alone reads."""
    if world_size < 1:
        raise ConfigError(f"world size must be >= 1, got {world_size}")
    for name, value in degrees.items():
        if value == 0 or value < -1:
            raise ConfigError(f"parallel.{name}={value} is not a degree; use a positive number or -1 to infer it")
    unknown = [name for name, value in degrees.items() if value == -1]
    if "dp_replicate" in unknown and "dp_shard" in unknown:
        degrees, unknown = {**degrees, "dp_replicate": 1}, [n for n in unknown if n != "dp_replicate"]
    if len(unknown) > 1:
        names = [f"parallel.{n}" for n in unknown]
        listed = f"{names[0]} and {names[1]} are both" if len(names) == 2 else f"{', '.join(names)} are all"
        raise ConfigError(f"{listed} -1; at most one degree can be inferred from the world size {world_size}: give "
                          f"{' and '.join(names[1:])} a number (e.g. --{names[1]}=1)")
    if unknown:
        known = math.prod(v for v in degrees.values() if v != -1)
        if world_size % known:
            listed = " x ".join(f"{n}={v}" for n, v in degrees.items() if v != -1)
            explicit = " or ".join(f"parallel.{n}={v}" for n, v in degrees.items() if v > 1) or listed
            raise ConfigError(f"parallel.{unknown[0]}=-1 cannot be inferred: world size {world_size} is not "
                              f"divisible by {listed} = {known}; run a multiple of {known} processes or change {explicit}")
        degrees = {**degrees, unknown[0]: world_size // known}
    return degrees
