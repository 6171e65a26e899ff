"""parallel.pp_schedule=auto: which pipeline schedule runs, decided from the layout and the device before the mesh is
built, like parallel.data_parallel (meshrun.comm.dp_choice)."""

from __future__ import annotations

import dataclasses

from meshrun.comm.axes import MESH_DIMS, resolve_degrees
from meshrun.config import ConfigError, ParallelConfig

AUTO_SCHEDULE_GPU = "interleaved1f1b"
"""On 2 H200s (1b, PP 2, 8 micro-batches, 2026-11-28) interleaved 1F1B with its sends held to 4 NCCL channels
(parallel.pp_p2p_channels=auto) ran 67,208 tokens/s per GPU against 65,452 for 1F1B in the same call (1.027x); as
the default, 67,208 against 65,633 for 1F1B and 70,641 for FSDP2 (0.951x; docs/benchmarks.md round 15): its bubble
is 1/17 of the step against 1/9, and it runs without CUDA graphs."""


def choose_pp_schedule(parallel: ParallelConfig, *, n_layers: int, on_gpu: bool, world_size: int,
                       cuda_graphs: str = "auto") -> tuple[ParallelConfig, str]:
    """Resolve ``parallel.pp_schedule=auto``: interleaved 1F1B on GPUs for a pipeline alone (no TP, FSDP or context
    parallelism, the layouts it was measured in) with a layer for each of its stages and a micro-batch count it can
    take (a multiple of pp, or 0: chosen so); 1F1B otherwise, and wherever train.cuda_graphs=true asks for graphs
    (interleaved schedules do not run as graphs). Returns the config with the schedule that runs (what config.toml
    records) and a note for the start-up header ('' unless auto chose the interleaved schedule). Degrees of -1
    count as what they resolve to on ``world_size`` ranks."""
    if parallel.pp_schedule != "auto":
        return parallel, ""
    try:
        degree = resolve_degrees({name: getattr(parallel, name) for name in MESH_DIMS}, world_size=world_size)
    except ConfigError:  # the mesh names the problem when it is built
        return dataclasses.replace(parallel, pp_schedule="1f1b"), ""
    stages = degree["pp"] * parallel.pp_virtual_stages
    interleaved = (on_gpu and degree["pp"] > 1 and degree["tp"] == 1 and degree["cp"] == 1 and degree["dp_shard"] == 1
                   and parallel.pp_virtual_stages >= 2 and n_layers >= stages and cuda_graphs != "true"
                   and parallel.pp_microbatches % degree["pp"] == 0)
    if not interleaved:
        return dataclasses.replace(parallel, pp_schedule="1f1b"), ""
    note = (f"pipeline schedule: {AUTO_SCHEDULE_GPU}, {parallel.pp_virtual_stages} stages per rank "
            "(parallel.pp_schedule=auto on GPUs); --parallel.pp_schedule=1f1b runs one stage per rank as CUDA graphs")
    return dataclasses.replace(parallel, pp_schedule=AUTO_SCHEDULE_GPU), note
