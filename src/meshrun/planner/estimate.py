"""The plan of a layout: the resolved mesh and batch, and estimates of memory, communication, the pipeline bubble,
and warnings. Formulas, not measurements: docs/plan.md gives each one."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from meshrun.config import BatchPlan, ConfigError, JobConfig, ParallelConfig
from meshrun.comm.dp_choice import auto_unit_blocks
from meshrun.comm.mesh import FLAT_DIMS, FSDP_AUTO_PARAMS, MESH_DIMS, ParallelDims
from meshrun.models.shape import ModelShape
from meshrun.models.spec import ModelSpec
from meshrun.units import format_bytes

GiB = 2**30
ADAM_STATE_BYTES = 8  # two fp32 moments per parameter
MASTER_BYTES = 4  # fp32 parameters (FSDP's sharded master copy, or the DDP/TP parameters)
GRAD_BYTES = 4  # fp32 gradients (reduced in fp32 unless parallel.grad_reduce_dtype resolves to bf16)

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
    """The job as the trainer on GPUs runs it: parallel.data_parallel applied by comm.mesh.choose_data_parallel."""
    data_parallel: str = ""
    """One line: the data parallelism of the layout, and why (parallel.data_parallel, or the degrees given)."""
    memory: list[dict] = field(default_factory=list)
    comm: list[dict] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    cast_once: bool = False
    """parallel.pp_cast_once as the trainer on GPUs resolves it: the stages keep compute-dtype copies of their weights."""
    compiled: bool = True
    """train.compile as the trainer on GPUs resolves it."""
    reduce_bf16: bool = False
    """parallel.grad_reduce_dtype as the trainer on GPUs resolves it: gradients summed across ranks in bf16."""
    weight_copies: bool = False
    """train.weight_copies as the trainer on GPUs resolves it: under DDP the linear layers' gradients are all-reduced
    in bf16 (and every micro-batch is)."""

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def rank_row(self, rank: int) -> dict[str, Any]:
        c = self.dims.coords(rank)
        return {"rank": rank, "node": self.node_of(rank), "local_rank": rank % self.gpus_per_node,
                "dp": self.dims.dp_rank(rank), **c._asdict(),
                "groups": {name: self.dims.group(name, rank) for name in group_dims(self.dims)}}


def group_dims(dims: ParallelDims) -> list[str]:
    """The dimensions worth listing (degree > 1), innermost first: tp, cp, dp (and its parts when both are > 1),
    dp_shard_cp (what FSDP shards over, when both dp_shard and cp are > 1), pp."""
    both = [flat for flat, members in FLAT_DIMS.items() if all(dims.degree(m) > 1 for m in members)]
    names = ["tp", "cp", "dp", *(FLAT_DIMS["dp"] if "dp" in both else ()), *(f for f in both if f != "dp"), "pp"]
    return [name for name in names if dims.degree(name) > 1]


def build_plan(job: JobConfig, *, nodes: int, gpus_per_node: int, gpu_mem_gib: float = 80.0,
               dtype_bytes: int | None = None) -> Plan:
    """Resolve and validate the layout and compute memory, traffic and warnings. Raises ConfigError.

    ``dtype_bytes`` is the compute dtype's size; by default train.dtype's on a GPU (auto and bf16: 2, fp32: 4)."""
    if dtype_bytes is None:
        dtype_bytes = 4 if job.train.dtype == "fp32" else 2
    if nodes < 1 or gpus_per_node < 1:
        raise ConfigError(f"--nodes {nodes} and --gpus-per-node {gpus_per_node} must both be >= 1")
    from meshrun.parallel.kernels import gpus_elsewhere

    with gpus_elsewhere():  # the target's GPUs, whatever this host has
        return _build_plan(job, nodes=nodes, gpus_per_node=gpus_per_node, gpu_mem_gib=gpu_mem_gib,
                           dtype_bytes=dtype_bytes)


def _build_plan(job: JobConfig, *, nodes: int, gpus_per_node: int, gpu_mem_gib: float, dtype_bytes: int) -> Plan:
    import torch

    from meshrun.models.build import model_shape, model_spec
    from meshrun.parallel.checks import compute_dtype, grad_reduce_bf16, resolve_layout, use_cast_once, \
        use_weight_copies
    from meshrun.parallel.kernels import compile_enabled

    model, spec = model_shape(job), model_spec(job)
    if model.dim % model.n_heads:
        raise ConfigError(f"model.dim={model.dim} (--hidden) is not divisible by model.n_heads={model.n_heads}")
    world = nodes * gpus_per_node
    params = spec.count_params(model)
    given = job.parallel
    gpu = torch.device("cuda")
    # the same resolution and checks as the trainer's start (RunPlan.resolve) on GPUs, and meshrun train --dry-run
    layout = resolve_layout(job, spec, model, world_size=world, gpus_per_node=gpus_per_node, device=gpu)
    job, dims, batch, note = layout.job, layout.dims, layout.batch, layout.data_parallel_note
    plan = Plan(nodes=nodes, gpus_per_node=gpus_per_node, world_size=world, model=model, spec=spec, dims=dims,
                batch=batch, job=job,
                data_parallel=note or data_parallel_line(given, dims, params=params),
                cast_once=use_cast_once(job, dims, gpu, compute_dtype(job, "cuda")),
                compiled=compile_enabled(job.train.compile, gpu),
                reduce_bf16=grad_reduce_bf16(job, dims, compute_dtype(job, "cuda"), gpu, grad_accum=batch.grad_accum),
                weight_copies=compute_dtype(job, "cuda") == torch.bfloat16 and use_weight_copies(
                    job, dims, gpu, compute_dtype(job, "cuda"), grad_accum=batch.grad_accum))
    plan.memory = [stage_memory(plan, s, dtype_bytes=dtype_bytes) for s in range(dims.pp)]
    plan.comm = communication(plan, dtype_bytes=dtype_bytes)
    plan.warnings = layout_warnings(plan, gpu_mem_gib=gpu_mem_gib)
    return plan


def data_parallel_line(given: ParallelConfig, dims: ParallelDims, *, params: int) -> str:
    """Why the data parallelism of ``dims`` is what it is, when choose_data_parallel left ``given`` as it was."""
    if dims.dp_size == 1:
        why = ""
    elif (given.dp_replicate, given.dp_shard) != (-1, 1):
        why = (f"the degrees given, parallel.dp_replicate={given.dp_replicate} and parallel.dp_shard="
               f"{given.dp_shard}; parallel.data_parallel applies to the default -1 and 1 only")
    elif given.data_parallel == "ddp":
        why = "parallel.data_parallel=ddp"
    elif given.tp > 1 or given.pp > 1:
        why = "parallel.data_parallel=auto shards only layouts without tp and pp"
    else:
        why = (f"{params / 1e6:.3g}M parameters < {FSDP_AUTO_PARAMS / 1e9:g}B: parallel.data_parallel=auto shards "
               "from there on GPUs; --parallel.data_parallel=fsdp shards anyway")
    return f"data parallelism: {data_parallel_name(dims)}" + (f" ({why})" if why else "")


def data_parallel_mode(dims: ParallelDims) -> str:
    """none, ddp, fsdp, hsdp, or replicate (dp_replicate beside tp or pp: parallel/apply.py runs it as FSDP2 with a
    shard degree of 1, whole replicas like DDP)."""
    if dims.dp_shard * dims.cp > 1:  # FSDP shards over dp_shard x cp (the cp ranks hold the same parameters)
        return "hsdp" if dims.dp_replicate > 1 else "fsdp"
    if dims.dp_size == 1:
        return "none"
    return "ddp" if dims.tp == 1 and dims.pp == 1 else "replicate"


_MODE_WORDS = {"none": "none, 1 data-parallel rank", "ddp": "DDP, {r} whole replicas",
               "fsdp": "FSDP2 over {s} ranks", "hsdp": "HSDP, {r} replicas of FSDP2 over {s} ranks",
               "replicate": "{r} whole replicas beside tp and pp, FSDP2 with a shard degree of 1"}


def data_parallel_name(dims: ParallelDims) -> str:
    """What replicates or shards the model over the data-parallel ranks, in the trainer's terms."""
    words = _MODE_WORDS[data_parallel_mode(dims)].format(r=dims.dp_replicate, s=dims.dp_shard * dims.cp)
    return words + (f" (dp_shard {dims.dp_shard} x cp {dims.cp})" if dims.cp > 1 else "")


# ---- parameter counts, memory ------------------------------------------------------------------------------------

def pipeline_rank_layers(plan: Plan, pp_rank: int) -> list[int]:
    from meshrun.parallel.pipeline import stage_ids
    from meshrun.parallel.stage_cut import stage_ranges

    d = plan.dims
    ranges = stage_ranges(d, plan.model.n_layers)
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
    if d.pp_schedule in ("gpipe", "loopedbfs"):  # every forward before the first backward
        return d.pp_microbatches
    return min(d.pp_microbatches, d.pp - pp_rank)  # 1F1B warm-up depth (interleaved, zero bubble: about the same)


def gathered_blocks(plan: Plan, pp_rank: int, params: int) -> int:
    """Blocks whose parameters FSDP2 holds gathered at once on pipeline rank ``pp_rank`` (``params`` parameters):
    two units' worth (the one running and the next one being gathered), a unit as parallel.fsdp_unit_blocks makes
    it on GPUs (comm.dp_choice.auto_unit_blocks for 0), the whole stage for -1."""
    layers = len(pipeline_rank_layers(plan, pp_rank))
    choice = plan.job.parallel.fsdp_unit_blocks
    if choice < 0:
        return layers
    mats, norms = plan.spec.block_params(plan.model)
    per_unit = choice or auto_unit_blocks(params, mats + norms, layers)
    return min(2 * per_unit, layers)


def stage_memory(plan: Plan, pp_rank: int, *, dtype_bytes: int) -> dict[str, Any]:
    """Per-GPU memory estimate of the ranks of pipeline rank ``pp_rank`` (bytes)."""
    m, d, b = plan.model, plan.dims, plan.batch
    total, per_tp = rank_params(plan, pp_rank)
    shard = d.dp_shard * d.cp  # FSDP shards over dp_shard x cp
    local = per_tp / shard
    mats, norms = plan.spec.block_params(m)
    fsdp_working = gathered_blocks(plan, pp_rank, total) * (mats // d.tp + norms) * dtype_bytes if shard > 1 else 0
    params = local * MASTER_BYTES + fsdp_working
    copies = 0
    if plan.cast_once:  # the linear layers' compute-dtype copies: blocks' matrices and the head
        head = plan.spec.edge_params(m, tied=False)[1][0] // d.tp if pp_rank == d.pp - 1 else 0
        copies = (len(pipeline_rank_layers(plan, pp_rank)) * mats // d.tp + head) * dtype_bytes
        params += copies
    # FSDP keeps unsharded fp32 gradients between micro-batches while it skips the reduce-scatter (grad
    # accumulation, and every pipeline step, which runs several micro-batches)
    grads = (per_tp if shard > 1 and (b.grad_accum > 1 or d.pp > 1) else local) * GRAD_BYTES
    if plan.compiled:  # compiled on a GPU, a micro-batch's gradients of the copies are added together when its
        grads += copies  # backward pass ends (meshrun.parallel.step_weights.grad_adder)
    optimizer = local * ADAM_STATE_BYTES
    samples = b.micro_batch if d.pp == 1 else b.micro_batch * b.grad_accum / d.pp_microbatches
    tokens = samples * m.seq_len / d.cp  # context parallelism: each GPU holds T/cp positions of every sequence
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
    if d.cp > 1:
        rows.append(_row(plan, "cp", *ring_traffic(plan, dtype_bytes=dtype_bytes)))
    if d.dp_shard * d.cp > 1:
        n = d.dp_shard * d.cp
        gathers = (1 if d.pp > 1 else 2 * b.grad_accum)  # forward + backward per micro-batch; once with PP
        reduced = 2 if plan.reduce_bf16 else GRAD_BYTES
        volume = (n - 1) / n * per_tp * (gathers * dtype_bytes + reduced)
        rows.append(_row(plan, "dp_shard_cp" if d.cp > 1 else "dp_shard",
                         f"FSDP: {gathers} parameter all-gather(s) + 1 gradient reduce-scatter"
                         f"{' (bf16)' if plan.reduce_bf16 else ''}", volume))
    if d.dp_replicate > 1:
        n, shard = d.dp_replicate, per_tp / (d.dp_shard * d.cp)
        what = "gradient all-reduce" if d.dp_shard * d.cp == 1 else "HSDP all-reduce of gradient shards"
        grad_bytes = shard * GRAD_BYTES
        if d.world_size == d.dp_replicate and plan.reduce_bf16:  # DDP's bf16 compression hook: every bucket
            grad_bytes, what = shard * 2, what + " (bf16)"
        elif d.world_size == d.dp_replicate and plan.weight_copies:
            # the linear layers' bf16 copies: their gradients all-reduced in bf16, every micro-batch
            mats, _ = plan.spec.block_params(m)
            head = 0 if m.tie_embeddings else plan.spec.edge_params(m, tied=False)[1][0]
            linear = mats * m.n_layers + head
            grad_bytes = b.grad_accum * (linear * 2 + (shard - linear) * GRAD_BYTES)
            what += f" (linear layers in bf16{', every micro-batch' if b.grad_accum > 1 else ''})"
        rows.append(_row(plan, "dp_replicate", what, 2 * (n - 1) / n * grad_bytes))
    if d.pp > 1:
        sp = plan.job.parallel.sequence_parallel and d.tp > 1
        volume = 2 * act * d.pp_virtual_stages / (d.tp if sp else 1)  # activations forward + gradients backward
        rows.append(_row(plan, "pp", f"point-to-point: {d.pp_microbatches} micro-batches x "
                                     f"{d.pp_virtual_stages} stage(s) each way", volume))
    return rows


def ring_traffic(plan: Plan, *, dtype_bytes: int) -> tuple[str, float]:
    """Context parallelism's ring attention, per GPU and step: in every layer each rank receives the K and V of the
    other cp - 1 shards in forward (again in backward, and in the recompute under full checkpointing), and sends
    back the fp32 gradients of theirs in backward (torch's default all-gather rotation)."""
    m, d, b = plan.model, plan.dims, plan.batch
    layers = len(pipeline_rank_layers(plan, 0))
    shard_tokens = b.micro_batch * m.seq_len / d.cp
    kv = shard_tokens * 2 * m.kv_heads * m.head_dim / d.tp  # elements of one rank's K and V in one layer
    passes = 3 if plan.job.parallel.activation_checkpoint == "full" else 2  # forward, backward (+ recompute)
    volume = (d.cp - 1) * kv * (passes * dtype_bytes + 4) * layers * b.grad_accum
    return f"ring attention: K/V of {d.cp - 1} other shard(s), {passes} passes x {layers} layers, + fp32 grads", volume


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
    if "cp" in comm and comm["cp"]["crosses_nodes"]:
        out.append(f"CP rings span {comm['cp']['nodes_per_group']} nodes: ring attention's K/V exchange "
                   f"({format_bytes(comm['cp']['bytes_per_step'])}/GPU per step, every layer) crosses the network; "
                   f"keep cp x tp <= {plan.gpus_per_node} (GPUs per node)")
    if d.pp > 1:
        idle = bubble(plan)
        if idle > 0.25:
            samples = plan.batch.micro_batch * plan.batch.grad_accum
            tokens = samples // d.pp_microbatches * plan.batch.seq_len  # per pipeline micro-batch
            best = d.default_microbatches(samples, plan.batch.seq_len)
            if best > d.pp_microbatches:
                out.append(f"pipeline bubble {idle:.0%}: raise --pp-microbatches (now {d.pp_microbatches}, {tokens} "
                           f"tokens each) to {best}, the default for this batch, or use interleaved1f1b")
            else:  # smaller micro-batches cost more in fixed per-micro-batch work than the bubble they save
                out.append(f"pipeline bubble {idle:.0%} with {d.pp_microbatches} micro-batches of {tokens} tokens: "
                           "more samples per step (--train.grad_accum) allow more micro-batches of this size, or use "
                           "interleaved1f1b; smaller micro-batches ran slower on GPUs (docs/parallelism.md)")
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
    # the axes whose ranks read the same samples: all but the data-parallel ones (tp, pp, and cp if it is used)
    same = [n for n in reversed(MESH_DIMS) if n not in FLAT_DIMS["dp"] and (n != "cp" or d.cp > 1)]
    others = " x ".join(f"{n} {d.degree(n)}" for n in same)
    return (f"B_global = B_local {b.micro_batch} x {d.dp_size} data-parallel ranks ({plan.world_size} GPUs / "
            f"({others})) x A {b.grad_accum} = {b.global_batch}")

