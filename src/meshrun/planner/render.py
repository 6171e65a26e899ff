"""``meshrun plan``'s output: the plan as JSON, or as rich tables."""

from __future__ import annotations

import dataclasses
from typing import Any

from meshrun.config import ConfigError
from meshrun.planner.estimate import (Plan, batch_formula, bubble, crosses_nodes, data_parallel_mode, group_dims,
                                      pipeline_rank_layers, tp_shards)
from meshrun.parallel.stage_cut import describe_cut
from meshrun.units import format_bytes, format_ranks

def to_json(plan: Plan) -> dict[str, Any]:
    d, b = plan.dims, plan.batch
    return {
        "world_size": plan.world_size, "nodes": plan.nodes, "gpus_per_node": plan.gpus_per_node,
        "model": dataclasses.asdict(plan.model) | {"ffn_dim": plan.model.hidden_dim,
                                                   "n_kv_heads": plan.model.kv_heads},
        "dtype": {"train_dtype": plan.job.train.dtype, "compute": compute_dtype_name(plan)},
        "parallel": d.degrees() | {"dp_size": d.dp_size, "pp_schedule": d.pp_schedule,
                                   "pp_microbatches": d.pp_microbatches, "pp_virtual_stages": d.pp_virtual_stages,
                                   "pp_balance": d.pp_balance},
        "data_parallel": {"mode": data_parallel_mode(d), "note": plan.data_parallel},
        "batch": {"micro_batch": b.micro_batch, "dp_size": b.dp_size, "grad_accum": b.grad_accum,
                  "global_batch": b.global_batch, "tokens_per_step": b.tokens_per_step,
                  "formula": batch_formula(plan)},
        "ranks": [plan.rank_row(r) for r in range(plan.world_size)],
        "groups": {name: d.groups(name) for name in group_dims(d)},
        "memory": plan.memory, "tp_shards": tp_shards(plan),
        "pipeline": {"stages": d.stages, "microbatches": d.pp_microbatches, "bubble_fraction": bubble(plan),
                     "layers_per_rank": [pipeline_rank_layers(plan, r) for r in range(d.pp)],
                     "blocks_per_stage": list(d.pp_layers), "cost_share_per_stage": list(d.pp_shares)},
        "communication": plan.comm, "warnings": plan.warnings,
    }


def compute_dtype_name(plan: Plan) -> str:
    """train.dtype as training resolves it on the GPUs the plan assumes: auto is bf16 there."""
    return "fp32" if plan.job.train.dtype == "fp32" else "bf16"


def dtype_source(plan: Plan) -> str:
    if plan.job.train.dtype == "auto":
        return "train.dtype=auto: bf16, as training picks on GPUs of compute capability 8.0+; fp32 on older ones"
    return f"train.dtype={plan.job.train.dtype}"


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
    console.print(f"compute dtype: {compute_dtype_name(plan)} ({dtype_source(plan)})", highlight=False)
    console.print(plan.data_parallel, highlight=False)
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
    coords = ["pp", "dp", *(["cp"] if plan.dims.cp > 1 else []), "tp"]
    for column in ["rank", "node", "local", *coords] + [f"{n} group" for n in names]:
        table.add_column(column, justify="left" if column.endswith(" group") else "right")
    previous = -1
    for rank in shown:
        if rank != previous + 1:
            table.add_row("...", *[""] * (2 + len(coords) + len(names)))
        row = plan.rank_row(rank)
        table.add_row(str(rank), str(row["node"]), str(row["local_rank"]), *[str(row[c]) for c in coords],
                      *[format_ranks(row["groups"][n]) for n in names])
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
    if d.cp > 1:
        console.print(f"context parallel {d.cp}: each sequence of {plan.model.seq_len} tokens split into {d.cp} parts "
                      f"of {plan.model.seq_len // d.cp} (head-and-tail chunks: the causal work is balanced); "
                      f"activations per GPU are 1/{d.cp} of a whole sequence's")
    if d.pp > 1:
        v = f" x {d.pp_virtual_stages} virtual stages" if d.pp_virtual_stages > 1 else ""
        formula = f"({d.pp} - 1) / ({d.pp_virtual_stages} x {d.pp_microbatches})" if d.pp_virtual_stages > 1 \
            else f"({d.pp} - 1) / {d.pp_microbatches}"
        console.print(f"pipeline: {d.pp} stages{v}, {d.pp_schedule}, {d.pp_microbatches} micro-batches; bubble "
                      f"{formula} = {bubble(plan):.1%}")
        console.print(f"stages cut by {d.pp_balance} (--pp-balance): {describe_cut(d.pp_layers, d.pp_shares)}, "
                      "costs from the model's FLOP formulas (the last stage also runs the head and loss)")
    if not plan.comm:
        return
    table = Table(title="communication per optimizer step, per GPU (estimate)", title_justify="left")
    for column in ("dimension", "degree", "what", "volume", "crosses nodes"):
        table.add_column(column)
    for row in plan.comm:
        table.add_row(row["dim"], str(row["degree"]), row["what"], format_bytes(row["bytes_per_step"]),
                      f"yes ({row['nodes_per_group']} nodes/group)" if row["crosses_nodes"] else "no")
    console.print(table)

