"""``meshrun plan``: an offline look at a parallel layout before any GPU is allocated.

Given nodes, GPUs per node, a model and the parallel degrees, it prints: the world size; the global batch in the
terms B_global = B_local x (data-parallel ranks) x A; every rank's node, local rank and mesh coordinates with the
members of its TP / DP / PP groups (the same arithmetic as :class:`meshrun.comm.mesh.ParallelDims`, so the
table is what the job will build); per-GPU memory for parameters, gradients, optimizer state and activations;
tensor-parallel shard sizes; the pipeline bubble; communication volume per optimizer step for each dimension and
whether it crosses nodes; and warnings for layouts that put TP or heavy traffic on the network. ``--json`` prints
the same as JSON; ``--dry-run`` also applies the layout on a fake process group (see meshrun.parallel.dryrun).

All numbers are estimates from formulas (see docs/plan.md), not measurements.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass, field
from typing import Any

from meshrun.config import (ACTIVATION_CHECKPOINT_MODES, PIPELINE_SCHEDULES, TRAIN_DTYPES, BatchPlan, ConfigError,
                            JobConfig, load_config, resolve_batch)
from meshrun.comm.mesh import ParallelDims
from meshrun.models.shape import ModelShape
from meshrun.models.spec import ModelSpec
from meshrun.units import format_bytes, format_ranks
from meshrun.plan_time import DEFAULT_PEAK_TFLOPS, estimate_lines, measured_tokens_per_s, parse_count, time_estimate

GiB = 2**30
ADAM_STATE_BYTES = 8  # two fp32 moments per parameter
MASTER_BYTES = 4  # fp32 parameters (FSDP's sharded master copy, or the DDP/TP parameters)
GRAD_BYTES = 4  # fp32 gradients (FSDP reduces in fp32)

EPILOG = """\
examples:
  meshrun plan --nodes 4 --gpus-per-node 8 --model 124m --micro-batch 8 --grad-accum 2
  meshrun plan --nodes 8 --gpus-per-node 8 --model 1b --tp 4 --pp 2 --dp-replicate -1
  meshrun plan --nodes 64 --hidden 12288 --heads 96 --ffn 49152 --layers 96 --tp 8 --pp 8 --json
  meshrun plan --config job.toml --nodes 2 --gpus-per-node 8 --dry-run
  meshrun plan --nodes 16 --tp 8 --pp 4 --model 1b --params 100B --tokens 1T --tokens-per-s 45000
  meshrun plan --arch my_models:mlp_lm --model small --tp 2      (a model registered with meshrun.register_model)
"""


# ---- arguments -----------------------------------------------------------------------------------------------------

def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="meshrun plan", description=__doc__.split("\n\n")[0], epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="TOML job config to start from (its [model], [parallel], [train] sections)")
    p.add_argument("--nodes", type=int, default=1, help="number of nodes (default 1)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs (processes) per node (default 8)")
    m = p.add_argument_group("model (a registered model and its named size, then any of these overrides)")
    m.add_argument("--arch", help="registered model (model.arch; 'module:name' imports module first; default gpt)")
    m.add_argument("--model", help="named size of the model (gpt: tiny, small, 124m, 350m, 1b; default 124m, "
                   "or the config's)")
    for flag, what in (("hidden", "hidden size (model.dim)"), ("layers", "transformer blocks"),
                       ("heads", "attention heads"), ("kv-heads", "key/value heads (GQA)"),
                       ("vocab", "vocabulary size"), ("seq", "sequence length"), ("ffn", "MLP hidden width")):
        m.add_argument(f"--{flag}", type=int, help=what)
    m.add_argument("--untied", action="store_true", help="untied input/output embeddings")
    d = p.add_argument_group("layout (-1 infers a degree from the world size)")
    for flag in ("dp-replicate", "dp-shard", "tp", "pp"):
        d.add_argument(f"--{flag}", type=int, help=f"parallel.{flag.replace('-', '_')}")
    d.add_argument("--pp-schedule", choices=PIPELINE_SCHEDULES)
    d.add_argument("--pp-microbatches", type=int, help="pipeline micro-batches per step (0: 2 x pp)")
    d.add_argument("--pp-virtual-stages", type=int, help="stages per rank for interleaved1f1b")
    d.add_argument("--sequence-parallel", action="store_true", default=None, help="shard norms along the sequence")
    d.add_argument("--activation-checkpoint", choices=ACTIVATION_CHECKPOINT_MODES)
    d.add_argument("--allow-tp-across-nodes", action="store_true", default=None)
    b = p.add_argument_group("batch")
    b.add_argument("--micro-batch", type=int, help="samples per micro-batch per data-parallel rank (B_local)")
    b.add_argument("--grad-accum", type=int, help="micro-batches per optimizer step (A)")
    b.add_argument("--global-batch", type=int, help="samples per optimizer step (derives A)")
    b.add_argument("--dtype", choices=[d for d in TRAIN_DTYPES if d != "auto"], default="bf16", help="compute dtype (default bf16)")
    t = p.add_argument_group("time for a token budget (6 x N x tokens FLOPs)")
    t.add_argument("--tokens", help="token budget, e.g. 1T or 300B: prints the wall-clock estimate")
    t.add_argument("--params", help="N for the FLOP count, e.g. 100B (default: the model's parameters)")
    t.add_argument("--mfu", type=float, default=0.4, help="assumed model FLOPs utilisation (default 0.4)")
    t.add_argument("--peak-tflops", type=float, default=0.0,
                   help="dense bf16 peak per GPU in TFLOP/s (default 989, an H100)")
    t.add_argument("--tokens-per-s", type=float, help="throughput of the whole job, measured or expected")
    t.add_argument("--from-run", help="take --tokens-per-s from this run directory's summary.json")
    o = p.add_argument_group("output")
    o.add_argument("--gpu-mem-gib", type=float, default=80.0, help="GPU memory for the fit check (default 80)")
    o.add_argument("--ranks", default="auto", help="rank table rows: auto (<= 64 ranks, else first two and last "
                   "node), all, or a number N (the first N ranks)")
    o.add_argument("--json", action="store_true", help="print JSON instead of tables")
    o.add_argument("--dry-run", action="store_true", help="also apply the layout on a fake process group")
    o.add_argument("--dry-run-ranks", default="", help="comma-separated ranks to simulate (default: first, last)")
    return p.parse_args(argv)


def job_from_args(args: argparse.Namespace) -> JobConfig:
    """The config file (if any), then every flag that was given."""
    overrides = []
    flags = {"model.arch": args.arch, "model.name": args.model, "model.dim": args.hidden,
             "model.n_layers": args.layers,
             "model.n_heads": args.heads, "model.n_kv_heads": args.kv_heads, "model.vocab_size": args.vocab,
             "model.seq_len": args.seq, "model.ffn_dim": args.ffn,
             "model.tie_embeddings": False if args.untied else None,
             "parallel.dp_replicate": args.dp_replicate, "parallel.dp_shard": args.dp_shard,
             "parallel.tp": args.tp, "parallel.pp": args.pp, "parallel.pp_schedule": args.pp_schedule,
             "parallel.pp_microbatches": args.pp_microbatches, "parallel.pp_virtual_stages": args.pp_virtual_stages,
             "parallel.sequence_parallel": args.sequence_parallel,
             "parallel.activation_checkpoint": args.activation_checkpoint,
             "parallel.allow_tp_across_nodes": args.allow_tp_across_nodes,
             "train.micro_batch": args.micro_batch, "train.grad_accum": args.grad_accum,
             "train.global_batch": args.global_batch}
    overrides = [f"{key}={value}" for key, value in flags.items() if value is not None]
    if args.config is None and args.model is None and args.arch is None:
        overrides.insert(0, "model.name=124m")
    return load_config(args.config, overrides)


# ---- the plan --------------------------------------------------------------------------------------------------------

@dataclass
class Plan:
    nodes: int
    gpus_per_node: int
    world_size: int
    model: ModelShape
    spec: ModelSpec
    dims: ParallelDims
    batch: BatchPlan
    job: JobConfig
    memory: list[dict] = field(default_factory=list)
    comm: list[dict] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def rank_row(self, rank: int) -> dict[str, Any]:
        c = self.dims.coords(rank)
        return {"rank": rank, "node": self.node_of(rank), "local_rank": rank % self.gpus_per_node, "pp": c.pp,
                "dp": self.dims.dp_rank(rank), "dp_replicate": c.dp_replicate, "dp_shard": c.dp_shard, "tp": c.tp,
                "groups": {name: self.dims.group(name, rank) for name in group_dims(self.dims)}}


def group_dims(dims: ParallelDims) -> list[str]:
    """The dimensions worth listing (degree > 1): tp, dp (and its parts when both are > 1), pp."""
    names = ["tp", "dp"]
    if dims.dp_replicate > 1 and dims.dp_shard > 1:
        names += ["dp_replicate", "dp_shard"]
    return [name for name in names + ["pp"] if dims.degree(name) > 1]


def build_plan(job: JobConfig, *, nodes: int, gpus_per_node: int, gpu_mem_gib: float = 80.0,
               dtype_bytes: int = 2) -> Plan:
    """Resolve and validate the layout and compute memory, traffic and warnings. Raises ConfigError."""
    if nodes < 1 or gpus_per_node < 1:
        raise ConfigError(f"--nodes {nodes} and --gpus-per-node {gpus_per_node} must both be >= 1")
    from meshrun.models.build import model_config, model_spec

    model, spec = model_config(job), model_spec(job)
    if model.dim % model.n_heads:
        raise ConfigError(f"model.dim={model.dim} (--hidden) is not divisible by model.n_heads={model.n_heads}")
    world = nodes * gpus_per_node
    dims = ParallelDims.from_config(job.parallel, world_size=world, gpus_per_node=gpus_per_node, model=model,
                                    spec=spec)
    batch = resolve_batch(job.train, dp_size=dims.dp_size, seq_len=model.seq_len)
    dims.validate_pipeline_batch(batch.micro_batch * batch.grad_accum)
    plan = Plan(nodes=nodes, gpus_per_node=gpus_per_node, world_size=world, model=model, spec=spec, dims=dims,
                batch=batch, job=job)
    plan.memory = [stage_memory(plan, s, dtype_bytes=dtype_bytes) for s in range(dims.pp)]
    plan.comm = communication(plan, dtype_bytes=dtype_bytes)
    plan.warnings = layout_warnings(plan, gpu_mem_gib=gpu_mem_gib)
    return plan


# ---- parameter counts, memory ------------------------------------------------------------------------------------

def pipeline_rank_layers(plan: Plan, pp_rank: int) -> list[int]:
    from meshrun.parallel.pipeline import layer_ranges, stage_ids

    d = plan.dims
    ranges = layer_ranges(plan.model.n_layers, d.stages)
    return [i for s in stage_ids(pp_rank, pp=d.pp, virtual_stages=d.pp_virtual_stages) for i in ranges[s]]


def rank_params(plan: Plan, pp_rank: int) -> tuple[int, int]:
    """(parameters of pipeline rank ``pp_rank``'s stages, its share on one TP rank)."""
    m, d = plan.model, plan.dims
    mats, norms = plan.spec.block_params(m)
    layers = len(pipeline_rank_layers(plan, pp_rank))
    total, per_tp = layers * (mats + norms), layers * (mats // d.tp + norms)
    first, last = pp_rank == 0, pp_rank == d.pp - 1  # with interleaving, rank 0 runs stage 0, rank pp-1 the last
    # (sharded by TP, replicated) parameters outside the blocks, first stage and last stage
    (embed, embed_rep), (head, head_rep) = plan.spec.edge_params(m, tied=m.tie_embeddings and d.pp == 1)
    if first:
        total, per_tp = total + embed + embed_rep, per_tp + embed // d.tp + embed_rep
    if last:
        total, per_tp = total + head + head_rep, per_tp + head // d.tp + head_rep
    return total, per_tp


def activation_bytes_per_token_layer(plan: Plan, dtype_bytes: int) -> float:
    """Saved activations of one block for one token (see docs/plan.md for the list)."""
    m, d = plan.model, plan.dims
    h, kv, f, t = m.dim, m.kv_heads * m.head_dim, m.hidden_dim, d.tp
    sp = plan.job.parallel.sequence_parallel and t > 1
    mode = plan.job.parallel.activation_checkpoint
    if mode == "full":
        elements = h / t if sp else h  # the block input only
    elif mode == "selective":
        elements = (h / t if sp else h) + (2 * h + 2 * kv + 2 * f) / t  # input + matmul/attention outputs
    else:
        outside = 4 * h  # two norm inputs (residual stream) and two norm outputs
        inside = 3 * h + 3 * kv + 4 * f  # q,k,v; rotated q,k; attention output; w1, w3, silu, product
        elements = (outside / t if sp else outside) + inside / t
    return elements * dtype_bytes


def inflight_microbatches(plan: Plan, pp_rank: int) -> int:
    """Pipeline micro-batches whose activations one rank holds at the peak."""
    d = plan.dims
    if d.pp == 1:
        return 1
    if d.pp_schedule == "gpipe":
        return d.pp_microbatches
    return min(d.pp_microbatches, d.pp - pp_rank)  # 1F1B warm-up depth (interleaved: about the same)


def stage_memory(plan: Plan, pp_rank: int, *, dtype_bytes: int) -> dict[str, Any]:
    """Per-GPU memory estimate of the ranks of pipeline rank ``pp_rank`` (bytes)."""
    m, d, b = plan.model, plan.dims, plan.batch
    total, per_tp = rank_params(plan, pp_rank)
    local = per_tp / d.dp_shard
    mats, norms = plan.spec.block_params(m)
    fsdp_working = 2 * (mats // d.tp + norms) * dtype_bytes if d.dp_shard > 1 else 0  # 2 gathered blocks
    params = local * MASTER_BYTES + fsdp_working
    # FSDP keeps unsharded fp32 gradients between micro-batches while it skips the reduce-scatter (grad
    # accumulation, and every pipeline step, which runs several micro-batches)
    grads = (per_tp if d.dp_shard > 1 and (b.grad_accum > 1 or d.pp > 1) else local) * GRAD_BYTES
    optimizer = local * ADAM_STATE_BYTES
    samples = b.micro_batch if d.pp == 1 else b.micro_batch * b.grad_accum / d.pp_microbatches
    tokens = samples * m.seq_len
    layers = len(pipeline_rank_layers(plan, pp_rank))
    acts = activation_bytes_per_token_layer(plan, dtype_bytes) * tokens * layers * inflight_microbatches(plan, pp_rank)
    if pp_rank == d.pp - 1:
        vocab = m.vocab_size / d.tp if d.tp > 1 and d.pp == 1 else m.vocab_size  # loss_parallel only without PP
        acts += tokens * vocab * (dtype_bytes + 4)  # logits, and their fp32 copy in the loss
    return {"pp_rank": pp_rank, "layers": pipeline_rank_layers(plan, pp_rank), "params_total": total,
            "params_local": int(local), "bytes": {"params": params, "grads": grads, "optimizer": optimizer,
                                                  "activations": acts},
            "total_bytes": params + grads + optimizer + acts}


# ---- communication -------------------------------------------------------------------------------------------------

def crosses_nodes(plan: Plan, name: str) -> tuple[bool, int]:
    """(whether any group along ``name`` spans nodes, the most nodes one group spans)."""
    if plan.dims.degree(name) == 1:
        return False, 1
    spans = max(len({plan.node_of(r) for r in group}) for group in plan.dims.groups(name))
    return spans > 1, spans


def communication(plan: Plan, *, dtype_bytes: int) -> list[dict[str, Any]]:
    """Bytes each GPU sends per optimizer step along each dimension (ring algorithms; see docs/plan.md)."""
    m, d, b = plan.model, plan.dims, plan.batch
    _, per_tp = rank_params(plan, 0)
    step_tokens = b.micro_batch * b.grad_accum * m.seq_len  # tokens each dp rank processes per step
    act = step_tokens * m.dim * dtype_bytes  # one (tokens, hidden) activation tensor
    rows = []
    if d.tp > 1:
        layers = len(pipeline_rank_layers(plan, 0))
        per_layer = 6 if plan.job.parallel.activation_checkpoint == "full" else 4  # recompute repeats forward's 2
        collectives = per_layer * layers + 2
        rows.append(_row(plan, "tp", f"{collectives} all-reduces (or all-gather + reduce-scatter) of activations",
                         collectives * 2 * (d.tp - 1) / d.tp * act))
    if d.dp_shard > 1:
        n = d.dp_shard
        gathers = (1 if d.pp > 1 else 2 * b.grad_accum)  # forward + backward per micro-batch; once with PP
        volume = (n - 1) / n * per_tp * (gathers * dtype_bytes + GRAD_BYTES)
        rows.append(_row(plan, "dp_shard", f"FSDP: {gathers} parameter all-gather(s) + 1 gradient reduce-scatter",
                         volume))
    if d.dp_replicate > 1:
        n, shard = d.dp_replicate, per_tp / d.dp_shard
        what = "gradient all-reduce" if d.dp_shard == 1 else "HSDP all-reduce of gradient shards"
        rows.append(_row(plan, "dp_replicate", what, 2 * (n - 1) / n * shard * GRAD_BYTES))
    if d.pp > 1:
        sp = plan.job.parallel.sequence_parallel and d.tp > 1
        volume = 2 * act * d.pp_virtual_stages / (d.tp if sp else 1)  # activations forward + gradients backward
        rows.append(_row(plan, "pp", f"point-to-point: {d.pp_microbatches} micro-batches x "
                                     f"{d.pp_virtual_stages} stage(s) each way", volume))
    return rows


def _row(plan: Plan, name: str, what: str, volume: float) -> dict[str, Any]:
    crosses, spans = crosses_nodes(plan, name)
    return {"dim": name, "degree": plan.dims.degree(name), "what": what, "bytes_per_step": volume,
            "crosses_nodes": crosses, "nodes_per_group": spans}


# ---- warnings --------------------------------------------------------------------------------------------------------

def layout_warnings(plan: Plan, *, gpu_mem_gib: float) -> list[str]:
    d, out = plan.dims, []
    comm = {row["dim"]: row for row in plan.comm}
    if "tp" in comm and comm["tp"]["crosses_nodes"]:
        out.append(f"TP groups span {comm['tp']['nodes_per_group']} nodes: {comm['tp']['what']} per step go over the "
                   f"network ({format_bytes(comm['tp']['bytes_per_step'])}/GPU). Keep tp <= {plan.gpus_per_node} "
                   "(GPUs per node) and use pp or dp across nodes")
    in_node_shard = plan.gpus_per_node // d.tp
    if "dp_shard" in comm and comm["dp_shard"]["crosses_nodes"] and in_node_shard > 1:
        out.append(f"FSDP groups (dp_shard={d.dp_shard}) span {comm['dp_shard']['nodes_per_group']} nodes: parameter "
                   f"all-gathers cross the network ({format_bytes(comm['dp_shard']['bytes_per_step'])}/GPU per step). If "
                   f"memory allows, HSDP keeps them inside a node: --dp-shard {in_node_shard} --dp-replicate -1")
    if d.pp > 1:
        idle = bubble(plan)
        if idle > 0.25:
            out.append(f"pipeline bubble {idle:.0%}: raise --pp-microbatches (now {d.pp_microbatches}) to 4 x pp "
                       "or more, or use interleaved1f1b")
        if not crosses_nodes(plan, "pp")[0] and plan.nodes > 1 and "dp_replicate" in comm and \
                comm["dp_replicate"]["crosses_nodes"]:
            out.append("pipeline stages sit inside one node while data-parallel groups cross nodes; PP's small "
                       "point-to-point sends are the cheaper traffic to put on the network")
    worst = max(plan.memory, key=lambda row: row["total_bytes"])
    if worst["total_bytes"] > 0.9 * gpu_mem_gib * GiB:
        out.append(f"estimated {format_bytes(worst['total_bytes'])} per GPU on pipeline rank {worst['pp_rank']} exceeds 90% "
                   f"of {gpu_mem_gib:g} GiB: shard more (dp_shard, tp, pp), use activation checkpointing, or a "
                   "smaller micro-batch")
    return out


def bubble(plan: Plan) -> float:
    from meshrun.parallel.pipeline import bubble_fraction

    d = plan.dims
    return bubble_fraction(d.pp, d.pp_microbatches, d.pp_virtual_stages) if d.pp > 1 else 0.0


def tp_shards(plan: Plan) -> dict[str, int]:
    m, t = plan.model, plan.dims.tp
    return {"tp": t, "heads_per_gpu": m.n_heads // t, "kv_heads_per_gpu": m.kv_heads // t,
            "head_dim": m.head_dim, "attention_width_per_gpu": m.n_heads * m.head_dim // t,
            "mlp_width": m.hidden_dim, "mlp_width_per_gpu": m.hidden_dim // t,
            "vocab_rows_per_gpu": m.vocab_size // t}


def batch_formula(plan: Plan) -> str:
    b, d = plan.batch, plan.dims
    if d.dp_size == plan.world_size:
        return (f"B_global = B_local {b.micro_batch} x G {plan.gpus_per_node} x N {plan.nodes} x A {b.grad_accum} "
                f"= {b.global_batch}")
    return (f"B_global = B_local {b.micro_batch} x {d.dp_size} data-parallel ranks ({plan.world_size} GPUs / "
            f"(tp {d.tp} x pp {d.pp})) x A {b.grad_accum} = {b.global_batch}")


# ---- output ----------------------------------------------------------------------------------------------------------

def to_json(plan: Plan) -> dict[str, Any]:
    d, b = plan.dims, plan.batch
    return {
        "world_size": plan.world_size, "nodes": plan.nodes, "gpus_per_node": plan.gpus_per_node,
        "model": dataclasses.asdict(plan.model) | {"ffn_dim": plan.model.hidden_dim},
        "parallel": {"dp_replicate": d.dp_replicate, "dp_shard": d.dp_shard, "tp": d.tp, "pp": d.pp,
                     "dp_size": d.dp_size, "pp_schedule": d.pp_schedule, "pp_microbatches": d.pp_microbatches,
                     "pp_virtual_stages": d.pp_virtual_stages},
        "batch": {"micro_batch": b.micro_batch, "dp_size": b.dp_size, "grad_accum": b.grad_accum,
                  "global_batch": b.global_batch, "tokens_per_step": b.tokens_per_step,
                  "formula": batch_formula(plan)},
        "ranks": [plan.rank_row(r) for r in range(plan.world_size)],
        "groups": {name: d.groups(name) for name in group_dims(d)},
        "memory": plan.memory, "tp_shards": tp_shards(plan),
        "pipeline": {"stages": d.stages, "microbatches": d.pp_microbatches, "bubble_fraction": bubble(plan),
                     "layers_per_rank": [pipeline_rank_layers(plan, r) for r in range(d.pp)]},
        "communication": plan.comm, "warnings": plan.warnings,
    }


def shown_ranks(plan: Plan, spec: str) -> list[int]:
    world, g = plan.world_size, plan.gpus_per_node
    if spec == "all":
        return list(range(world))
    if spec.isdigit():
        return list(range(min(int(spec), world)))
    if spec != "auto":
        raise ConfigError(f"--ranks {spec!r} must be auto, all or a number")
    if world <= 64:
        return list(range(world))
    return list(range(2 * g)) + list(range(world - g, world))


def print_plan(plan: Plan, *, ranks: str, console) -> None:

    d, m = plan.dims, plan.model
    console.print(f"[bold]world size {plan.world_size}[/] = {plan.nodes} node(s) x {plan.gpus_per_node} GPUs; "
                  f"layout {d.describe()}")
    console.print(f"model: dim {m.dim}, {m.n_layers} layers, {m.n_heads} heads ({m.kv_heads} kv), MLP {m.hidden_dim}, "
                  f"vocab {m.vocab_size}, seq {m.seq_len}, {'tied' if m.tie_embeddings and d.pp == 1 else 'untied'}"
                  " embeddings")
    console.print(f"global batch: {batch_formula(plan)} samples = {plan.batch.tokens_per_step:,} tokens per step")
    print_rank_table(plan, ranks=ranks, console=console)
    if not group_dims(d):
        console.print("no parallel dimension has a degree above 1: nothing to communicate")
    else:
        print_groups(plan, console=console)
    print_memory(plan, console=console)
    print_shards_and_comm(plan, console=console)
    for warning in plan.warnings:
        console.print(f"[bold yellow]warning:[/] {warning}")


def print_groups(plan: Plan, *, console) -> None:
    from rich.table import Table

    d = plan.dims
    table = Table(title="groups per dimension", title_justify="left")
    for column in ("dimension", "degree", "groups", "first groups", "crosses nodes"):
        table.add_column(column)
    for name in group_dims(d):
        groups = d.groups(name)
        crosses, spans = crosses_nodes(plan, name)
        table.add_row(name, str(d.degree(name)), str(len(groups)), "  ".join(f"[{format_ranks(g)}]" for g in groups[:3]) +
                      ("  ..." if len(groups) > 3 else ""), f"yes ({spans} nodes)" if crosses else "no")
    console.print(table)


def print_rank_table(plan: Plan, *, ranks: str, console) -> None:
    from rich.table import Table

    shown = shown_ranks(plan, ranks)
    table = Table(title=f"ranks ({len(shown)} of {plan.world_size} shown; --ranks all for every rank)"
                  if len(shown) < plan.world_size else "ranks", title_justify="left")
    names = group_dims(plan.dims)
    for column in ["rank", "node", "local", "pp", "dp", "tp"] + [f"{n} group" for n in names]:
        table.add_column(column, justify="right" if column in ("rank", "node", "local", "pp", "dp", "tp") else "left")
    previous = -1
    for rank in shown:
        if rank != previous + 1:
            table.add_row("...", *[""] * (5 + len(names)))
        row = plan.rank_row(rank)
        table.add_row(str(rank), str(row["node"]), str(row["local_rank"]), str(row["pp"]), str(row["dp"]),
                      str(row["tp"]), *[format_ranks(row["groups"][n]) for n in names])
        previous = rank
    console.print(table)


def print_memory(plan: Plan, *, console) -> None:
    from rich.table import Table


    table = Table(title="memory per GPU (estimate)", title_justify="left")
    for column in ("pp rank", "layers", "params/GPU", "params", "grads", "optimizer", "activations", "total"):
        table.add_column(column, justify="right")
    for row in plan.memory:
        layers = row["layers"]
        table.add_row(str(row["pp_rank"]), format_ranks(layers) if layers else "-",
                      f"{row['params_local'] / 1e6:,.1f}M", *[format_bytes(row["bytes"][k]) for k in
                                                              ("params", "grads", "optimizer", "activations")],
                      format_bytes(row["total_bytes"]))
    console.print(table)


def print_shards_and_comm(plan: Plan, *, console) -> None:
    from rich.table import Table

    s, d = tp_shards(plan), plan.dims
    console.print(f"tensor parallel {s['tp']}: {s['heads_per_gpu']} heads ({s['kv_heads_per_gpu']} kv) x "
                  f"{s['head_dim']} per GPU, MLP width {s['mlp_width']:,} / {s['tp']} = {s['mlp_width_per_gpu']:,} "
                  f"per GPU, {s['vocab_rows_per_gpu']:,} vocabulary rows per GPU")
    if d.pp > 1:
        v = f" x {d.pp_virtual_stages} virtual stages" if d.pp_virtual_stages > 1 else ""
        formula = f"({d.pp} - 1) / ({d.pp_virtual_stages} x {d.pp_microbatches})" if d.pp_virtual_stages > 1 \
            else f"({d.pp} - 1) / {d.pp_microbatches}"
        console.print(f"pipeline: {d.pp} stages{v}, {d.pp_schedule}, {d.pp_microbatches} micro-batches; bubble "
                      f"{formula} = {bubble(plan):.1%}")
    if not plan.comm:
        return
    table = Table(title="communication per optimizer step, per GPU (estimate)", title_justify="left")
    for column in ("dimension", "degree", "what", "volume", "crosses nodes"):
        table.add_column(column)
    for row in plan.comm:
        table.add_row(row["dim"], str(row["degree"]), row["what"], format_bytes(row["bytes_per_step"]),
                      f"yes ({row['nodes_per_group']} nodes/group)" if row["crosses_nodes"] else "no")
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        job = job_from_args(args)
        plan = build_plan(job, nodes=args.nodes, gpus_per_node=args.gpus_per_node, gpu_mem_gib=args.gpu_mem_gib,
                          dtype_bytes=2 if args.dtype == "bf16" else 4)
        shown_ranks(plan, args.ranks)  # validates --ranks before printing anything
    except (ConfigError, ValueError) as exc:
        print(f"meshrun plan: error: {exc}", file=sys.stderr)
        return 2
    try:
        estimate, params_from = plan_time_estimate(plan, args)
    except ConfigError as exc:
        print(f"meshrun plan: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**to_json(plan), **({"time_estimate": estimate} if estimate else {})}, indent=1))
    else:
        console = Console(width=None if sys.stdout.isatty() else 160)
        print_plan(plan, ranks=args.ranks, console=console)
        for line in estimate_lines(estimate, params_from=params_from) if estimate else []:
            console.print(line, highlight=False)
    if args.dry_run:
        return run_dry_run(plan, args)
    return 0


def plan_time_estimate(plan: Plan, args: argparse.Namespace) -> tuple[dict[str, Any] | None, str]:
    """(estimate, where N came from) for --tokens, or (None, '') without it."""
    if not args.tokens:
        return None, ""
    params, params_from = (parse_count(args.params, "--params"), "--params") if args.params else (
        float(plan.spec.count_params(plan.model)), f"the model's {plan.job.model.name or 'custom'} size")
    throughput = measured_tokens_per_s(args.from_run) if args.from_run else args.tokens_per_s
    peak = (args.peak_tflops or DEFAULT_PEAK_TFLOPS) * 1e12
    return time_estimate(params=params, tokens=parse_count(args.tokens, "--tokens"), gpus=plan.world_size,
                         peak_flops=peak, mfu=args.mfu, tokens_per_s=throughput), params_from


def run_dry_run(plan: Plan, args: argparse.Namespace) -> int:
    from rich.console import Console

    from meshrun.parallel.dryrun import default_ranks, print_rank_layout, simulate_rank

    try:
        ranks = [int(r) for r in args.dry_run_ranks.split(",") if r.strip()] or default_ranks(plan.dims)
    except ValueError:
        print(f"meshrun plan: error: --dry-run-ranks {args.dry_run_ranks!r} must be comma-separated ranks",
              file=sys.stderr)
        return 2
    console = Console(width=None if sys.stdout.isatty() else 160, stderr=args.json)
    for rank in ranks:
        if not 0 <= rank < plan.world_size:
            print(f"meshrun plan: error: --dry-run-ranks {rank} is outside world size {plan.world_size}",
                  file=sys.stderr)
            return 2
        layout = simulate_rank(plan.job, plan.model, plan.dims, rank)
        print_rank_layout(console, layout, plan.dims, gpus_per_node=plan.gpus_per_node)
    return 0
