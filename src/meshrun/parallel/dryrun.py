"""Dry run: build the mesh and apply a layout for any world size on one machine, without GPUs or other ranks.

torch's fake process group (backend "fake", from torch.testing._internal.distributed.fake_pg) accepts every
collective and returns at once, so one process can pretend to be rank r of a 512-rank job: the DeviceMesh, the TP
plan, FSDP2 sharding and the pipeline split all run exactly as in the real job, on the meta device (no memory).
What comes out is each simulated rank's parameter shards: shapes, placements and bytes.

``meshrun train --dry-run --world-size N`` calls :func:`dry_run`, which first runs the checks a real start runs before
its process group exists (:func:`meshrun.parallel.checks.resolve_layout`, as ``meshrun plan`` does), for the target
machine's device; ``meshrun plan ... --dry-run`` calls :func:`simulate_rank` for the ranks it shows.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from meshrun.config import ConfigError, JobConfig
from meshrun.comm.mesh import ParallelDims, RankCoords
from meshrun.models.build import model_shape, model_spec
from meshrun.models.shape import ModelShape
from meshrun.parallel.options import parallel_options
from meshrun.parallel.pipeline import effective_model_config, stage_ids
from meshrun.parallel.stage_cut import stage_ranges
from meshrun.units import format_bytes, format_ranks


@dataclass(frozen=True)
class ParamShard:
    name: str
    """Parameter name with the layer index replaced by '*' when the row stands for several layers."""
    layers: int
    """How many layers' parameters the row stands for (1 for parameters outside the blocks)."""
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    placements: str
    local_bytes: int
    """Bytes of this rank's shards of all the parameters the row stands for (fp32)."""


@dataclass(frozen=True)
class RankLayout:
    rank: int
    coords: RankCoords
    stages: list[int]
    layers: list[int]
    engine: str
    params: list[ParamShard]

    @property
    def local_params(self) -> int:
        return sum(p.local_bytes for p in self.params) // 4

    @property
    def local_bytes(self) -> int:
        return sum(p.local_bytes for p in self.params)


def simulate_rank(job: JobConfig, model_cfg: ModelShape, dims: ParallelDims, rank: int) -> RankLayout:
    """Pretend to be ``rank``: fake process group, real mesh, real parallelisation on the meta device."""
    # private: the fake backend is torch test tooling with no public home; importing it also registers "fake"
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from meshrun.parallel.apply import build_parts, layout_name

    if dist.is_initialized():
        raise RuntimeError("simulate_rank needs a process without a process group (it starts a fake one)")
    job = dataclasses.replace(job, train=dataclasses.replace(job.train, compile="false"))  # nothing runs: no compile
    cfg = effective_model_config(model_cfg, pp=dims.pp)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=dims.world_size)
    try:
        dims.build_mesh("cpu")
        coords = dims.coords(rank)
        ids = stage_ids(coords.pp, pp=dims.pp, virtual_stages=dims.pp_virtual_stages) if dims.pp > 1 else [0]
        parts = build_parts(cfg, dims, ids, spec=model_spec(job), options=parallel_options(job, compute_dtype=None))
        params = _shards(parts, blocks_attr=model_spec(job).blocks)
    finally:
        dist.destroy_process_group()
    ranges = stage_ranges(dims, cfg.n_layers)
    layers = [i for s in ids for i in ranges[s]]
    return RankLayout(rank=rank, coords=coords, stages=ids, layers=layers, engine=layout_name(dims), params=params)


def _shards(parts, *, blocks_attr: str) -> list[ParamShard]:
    """One row per distinct parameter name, layers folded into '*'."""
    from torch.distributed.tensor import DTensor

    rows: dict[str, dict] = {}
    for part in parts:
        for name, param in part.named_parameters():
            key = re.sub(rf"^{re.escape(blocks_attr)}\.\d+\.", f"{blocks_attr}.*.", name)
            local = param.to_local() if isinstance(param, DTensor) else param
            placements = _placements(param) if isinstance(param, DTensor) else "whole"
            row = rows.setdefault(key, {"layers": 0, "global": tuple(param.shape), "local": tuple(local.shape),
                                        "placements": placements, "bytes": 0})
            row["layers"] += 1
            row["bytes"] += local.numel() * 4
    return [ParamShard(name=k, layers=v["layers"], global_shape=v["global"], local_shape=v["local"],
                       placements=v["placements"], local_bytes=v["bytes"]) for k, v in rows.items()]


def _placements(param) -> str:
    """'dp_shard: S(0), tp: S(0)': placements named by their mesh dimension, those of one rank left out (the rank
    holds the whole tensor along them); FSDP2's shard of a tensor-parallel shard (torch's _StridedShard) reads
    'S(0) of the tp shard'."""
    mesh = param.device_mesh
    names = mesh.mesh_dim_names or tuple(str(i) for i in range(mesh.ndim))
    parts = []
    for i, (name, placement) in enumerate(zip(names, param.placements)):
        if mesh.shape[i] == 1:
            continue
        strided = type(placement).__name__ == "_StridedShard"
        parts.append(f"{name}: S({placement.dim}) of the tp shard" if strided else f"{name}: {placement}")
    return ", ".join(parts) or "whole on every rank"


def default_ranks(dims: ParallelDims) -> list[int]:
    """Rank 0 and the last rank (first and last pipeline stage, first and last TP shard)."""
    return sorted({0, dims.world_size - 1})


def target_device(job: JobConfig, *, gpus_per_node: int) -> torch.device:
    """The device the dry run checks ``job`` for: the target machine's, not this one's. CUDA GPUs, as ``meshrun
    plan`` assumes, unless dist.device=cpu or ``--gpus-per-node 0`` (nodes without GPUs) asks for CPU processes."""
    if job.dist.device == "cpu" or (job.dist.device == "auto" and gpus_per_node == 0):
        return torch.device("cpu")
    if gpus_per_node == 0:
        raise ConfigError("--gpus-per-node 0 describes nodes without GPUs, and dist.device=cuda asks for GPUs: give "
                          "the GPUs per node, or set --dist.device=cpu")
    return torch.device("cuda")


def describe_target(device: torch.device, *, gpus_per_node: int) -> str:
    """What the dry run assumed about the target machine, and how to assume the other device."""
    if device.type == "cuda":
        return (f"CUDA GPUs of a recent generation, {gpus_per_node} per node (--gpus-per-node; --dist.device=cpu "
                "checks CPU processes)")
    per_node = f", {gpus_per_node} per node" if gpus_per_node else ""
    return f"CPU processes{per_node} (dist.device=cpu or --gpus-per-node 0)"


def dry_run(job: JobConfig, *, world_size: int, gpus_per_node: int = 8, ranks: list[int] | None = None) -> int:
    """``meshrun train --dry-run``: check ``job``'s layout for ``world_size`` ranks on the target machine
    (:func:`target_device`) as a real start does before its process group exists
    (:func:`meshrun.parallel.checks.resolve_layout`, the same checks as RunPlan.resolve and ``meshrun plan``), then
    print each simulated rank's parameter shards. Returns the exit code (2 for a configuration error, printed with
    the option to change)."""
    from rich.console import Console

    from meshrun.parallel.apply import describe_layout
    from meshrun.parallel.checks import resolve_layout
    from meshrun.parallel.kernels import gpus_elsewhere

    console = Console(width=None if sys.stdout.isatty() else 160)
    try:
        if world_size <= 0:
            raise ConfigError("--world-size N is needed with --dry-run (the number of ranks to simulate)")
        device = target_device(job, gpus_per_node=gpus_per_node)
        model_cfg, spec = model_shape(job), model_spec(job)
        with gpus_elsewhere():  # the target's GPUs, whatever this host has
            checked = resolve_layout(job, spec, model_cfg, world_size=world_size, gpus_per_node=gpus_per_node,
                                     device=device)
            dims = checked.dims
            layouts = [simulate_rank(checked.job, model_cfg, dims, r) for r in (ranks or default_ranks(dims))]
    except (ConfigError, ValueError) as exc:
        print(f"meshrun train: error: {exc}", file=sys.stderr)
        return 2
    console.print(f"dry run: {describe_layout(dims)}")
    console.print(f"checked for {describe_target(device, gpus_per_node=gpus_per_node)}; fake process group, meta "
                  "device")
    if checked.note:
        console.print(checked.note)
    for layout in layouts:
        print_rank_layout(console, layout, dims, gpus_per_node=gpus_per_node)
    return 0


def print_rank_layout(console, layout: RankLayout, dims: ParallelDims, *, gpus_per_node: int) -> None:
    from rich.table import Table

    c = layout.coords
    node, local = divmod(layout.rank, gpus_per_node) if gpus_per_node else (0, layout.rank)
    layers = f"layers {format_ranks(layout.layers)}" if layout.layers else "no layers"
    coords = ", ".join(f"{name} {index}" for name, index in c._asdict().items())
    title = (f"rank {layout.rank} (node {node}, local {local}): {coords} | {layout.engine} | stage(s) {layout.stages}, {layers} | "
             f"{layout.local_params / 1e6:,.2f}M params = {format_bytes(layout.local_bytes)} fp32 on this rank")
    table = Table(title=title, title_justify="left")
    for column in ("parameter", "x layers", "global shape", "local shard", "placements", "local MiB"):
        table.add_column(column, justify="right" if column in ("x layers", "local MiB") else "left")
    for p in layout.params:
        table.add_row(p.name, str(p.layers), _shape(p.global_shape), _shape(p.local_shape), p.placements,
                      f"{p.local_bytes / 2**20:,.2f}")
    console.print(table)


def _shape(shape: tuple[int, ...]) -> str:
    return " x ".join(f"{d:,}" for d in shape)


