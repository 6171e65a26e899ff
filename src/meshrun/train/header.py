"""The trainer's start: the header rank 0 prints before the first step, and metrics.jsonl's ``start`` record."""

from __future__ import annotations

import logging
import os
import socket
from typing import TYPE_CHECKING, Any

from meshrun.models.spec import count_unique_params
from meshrun.parallel.apply import describe_layout, graphs_left_off, splits_backward, use_loss_parallel
from meshrun.parallel.checks import bf16_stream, grad_reduce_bf16, parallelisms, use_comm_reorder, uses_fsdp
from meshrun.parallel.comm_overlap import CTA_VAR, P2P_VAR
from meshrun.parallel.data_parallel import WHOLE_MODEL, describe_units
from meshrun.parallel.kernels import describe_speed
from meshrun.train import runlog
from meshrun.train.run_folder import describe_resume

if TYPE_CHECKING:
    from meshrun.comm.mesh import ParallelDims
    from meshrun.train.trainer import Trainer

log = logging.getLogger("meshrun")


def start_record(trainer: Trainer) -> dict[str, Any]:
    """metrics.jsonl's ``start`` record: layout, batch and model as this process group trains them."""
    env, b = trainer.env, trainer.batch
    formula = (f"{b.global_batch} = {b.micro_batch} (B_local) x {b.dp_size // max(1, env.num_nodes)} (G) x "
               f"{env.num_nodes} (N) x {b.grad_accum} (A)")
    return runlog.start_record(step=trainer.step, restart=env.restart_count, world_size=env.world_size,
                               nodes=env.num_nodes, layout=describe_layout(trainer.dims),
                               parallel=parallel_record(trainer.dims), batch_formula=formula,
                               global_batch=b.global_batch, tokens_per_step=b.tokens_per_step,
                               model=trainer.job.model.name, params=trainer.spec.count_params(trainer.model_cfg),
                               device=str(trainer.device))


def parallel_record(dims: ParallelDims) -> dict[str, Any]:
    """The start record's ``parallel`` entry: the layout as data rather than the header's line. ``parallelisms``
    names what applies the degrees, in the line's order (``PP``, ``TP``, ``CP``, then ``DDP``, ``FSDP``, ``HSDP``
    or ``FSDP-replicate``; none in a single process), beside each mesh degree, the pipeline schedule and the world
    size: {"parallelisms": ["PP", "TP", "HSDP"], "pp": 2, "dp_replicate": 2, "dp_shard": 4, "cp": 1, "tp": 4,
    "pp_schedule": "1f1b", "world_size": 64}."""
    return {"parallelisms": parallelisms(dims) if dims.world_size > 1 else [], **dims.degrees(), "pp_schedule": dims.pp_schedule,
            "world_size": dims.world_size}


def print_header(trainer: Trainer) -> None:
    """Rank 0's start-up lines (and each rank's placement in its own log): where it runs, the layout, the model,
    the data, the batch formula, what a resume changed, and the config when run.print_config."""
    env, b, m, sampler = trainer.env, trainer.batch, trainer.model_cfg, trainer.data.sampler
    log.info("rank %d of %d on %s: node %d of %d, local rank %d of %d (%s)", env.rank, env.world_size,
             socket.gethostname(), env.node_rank, env.num_nodes, env.local_rank, env.local_world_size, env.source)
    params = count_unique_params(trainer.engine.model_parts, local=True)  # its shards (FSDP2, TP), its stage (PP)
    per_node = (f"{env.num_nodes} node(s) of different sizes" if env.nodes_differ
                else f"{env.num_nodes} node(s) x {b.dp_size // max(1, env.num_nodes)} per node")
    lines = [
        f"meshrun train | {env.source}: {env.describe_nodes()} | {trainer.ctx.backend or 'no process group'} on "
        f"{trainer.device}",
        f"model {trainer.job.model.arch} {trainer.job.model.name}: {params / 1e6:.2f}M parameters on this rank, "
        f"{m.n_layers} layers, dim {m.dim}, {m.n_heads} heads, seq {m.seq_len}, vocab {m.vocab_size}",
        f"data: {trainer.corpus.description}; fingerprint {trainer.corpus.fingerprint[:12]}",
        f"global batch {b.global_batch} = {b.micro_batch} per rank (B_local) x {b.dp_size} data-parallel ranks "
        f"({per_node}) x {b.grad_accum} accumulation (A)",
        f"tokens per step will be: {b.tokens_per_step:,} ({b.global_batch} x {m.seq_len}); epoch = "
        f"{sampler.steps_per_epoch:,} steps ({len(sampler.dataset) - sampler.usable} tail samples dropped per epoch)",
        f"config: {trainer.run_dir / 'config.toml'}",
        *([trainer.replicas.describe()] if trainer.replicas is not None else []),
    ]
    copies = getattr(trainer.engine, "step_weights", None)
    lines[1:1] = [f"layout: {describe_layout(trainer.dims)}", *([trainer.layout_note] if trainer.layout_note else []),
                  describe_speed(trainer.job, trainer.device, trainer.compute_dtype,
                                 cuda_graphs=getattr(trainer.engine, "cuda_graphs", False),
                                 fsdp=uses_fsdp(trainer.dims),
                                 reduce_bf16=grad_reduce_bf16(trainer.job, trainer.dims, trainer.compute_dtype,
                                                              trainer.device, grad_accum=b.grad_accum),
                                 cast_once=copies is not None and trainer.dims.pp > 1,
                                 weight_copies=copies.describe(written=trainer.optimizer.triton,
                                                               micro_batches=b.grad_accum)
                                 if copies is not None and trainer.dims.pp == 1 else "",
                                 split_backward=splits_backward(trainer.dims),
                                 comm_reorder=use_comm_reorder(trainer.job, trainer.dims, trainer.device),
                                 p2p_channels=os.environ.get(P2P_VAR, "")
                                 if trainer.dims.pp > 1 and trainer.device.type == "cuda" else "",
                                 # auto's whole-model unit always runs as graphs: only -1 asked for leaves them off
                                 graphs_off=graphs_left_off(trainer.job, trainer.dims, trainer.device,
                                                            whole_fsdp=trainer.job.parallel.fsdp_unit_blocks
                                                            == WHOLE_MODEL),
                                 residual_bf16=bf16_stream(trainer.job, trainer.dims, trainer.compute_dtype),
                                 vocab_sharded=use_loss_parallel(trainer.dims),
                                 cta_policy=os.environ.get(CTA_VAR, ""),
                                 fsdp_units=describe_units(trainer.engine.model_parts))]
    lines.append(describe_resume(trainer.resumed, run_dir=trainer.run_dir, moved_to=trainer.folder.moved_to,
                                 where=f"epoch {trainer.data.position.epoch}, {trainer.data.position.consumed:,} "
                                       "samples into it"))
    for section, values in trainer.job.to_dict().items() if trainer.job.run.print_config else ():
        lines.append(f"  [{section}] " + " ".join(f"{k}={v}" for k, v in values.items()))
    trainer.sink.print("\n".join(lines))
