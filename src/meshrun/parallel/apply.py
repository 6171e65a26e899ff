"""Build the engine for a layout: the selected model (its ModelSpec), parallelised from outside in one fixed order.

For every model part (the whole model, or each pipeline stage this rank runs):

1. build on the meta device (no memory), and with PP cut out this rank's stage(s);
2. tensor parallelism, from the spec's plan (optional sequence parallelism) -- parallel/tp.py
   context parallelism needs nothing here: it shards each micro-batch and the spec's position buffers while the
   step runs, and FSDP below shards over dp_shard x cp                     -- parallel/context_parallel.py
   then, with train.float8, the blocks' linears become torchao Float8Linear -- parallel/float8.py
3. activation checkpointing (none / selective / full)                      -- parallel/activation_checkpoint.py
4. torch.compile of each block (in place: names keep no "_orig_mod."), and of the loss (engine.loss_function)
5. data parallelism: FSDP2 ``fully_shard`` over dp_shard (x cp), HSDP over (dp_replicate, dp_shard x cp),
   or, with TP/PP and only dp_replicate > 1, HSDP with a shard degree of 1 (pure replication); plain DDP only
   for a pure data-parallel layout                                          -- parallel/data_parallel.py
6. materialise: ``to_empty`` on the device, then the spec's ``init_weights`` -- each rank allocates and initialises only its
   own shards, so a model larger than one device never exists whole on one rank.

Then the engine: LocalEngine (one process, or DDP), ShardedEngine (FSDP/HSDP/TP/CP) or PipelineEngine (PP, with any
of the above inside each stage). ``engine.model_parts`` are the modules themselves (never a DDP wrapper), with
the original parameter names, so torch.distributed.checkpoint can reshard a checkpoint across layouts.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch
from torch import nn

from meshrun.config import BatchPlan, ConfigError, JobConfig, resolve_batch
from meshrun.config_checks import tri_state
from meshrun.comm.mesh import ParallelDims
from meshrun.models.build import model_spec
from meshrun.models.shape import ModelShape
from meshrun.models.spec import ModelSpec, ModelStructure
from meshrun.parallel.activation_checkpoint import apply_activation_checkpointing
from meshrun.parallel.checks import (bf16_accumulation_note, bf16_stream, check_chunked_loss, check_cuda_graphs,
                                    check_layout, fsdp_whole_model, grad_reduce_bf16, graphs_measured,
                                    graphs_supported, is_local, layout_name, several_stages_per_rank,
                                    untested_as_graphs, use_cast_once, use_comm_reorder, use_weight_copies, uses_fsdp)
from meshrun.parallel.context_parallel import SequenceShards
from meshrun.parallel.data_parallel import (WHOLE_MODEL, apply_ddp, apply_fsdp, auto_unit_blocks, fsdp_units,
                                            gather_in_pool)
from meshrun.parallel.engine import Engine, LocalEngine, LossStep, loss_function
from meshrun.parallel.async_tp import enable_async_tp
from meshrun.parallel.comm_overlap import enable_comm_reorder
from meshrun.parallel.float8 import convert_blocks_to_float8
from meshrun.parallel.kernels import (compile_enabled, inductor_mode, resolve_adamw_kernel, select_attention,
                                     select_cross_entropy)
from meshrun.parallel.options import ParallelOptions, parallel_options
from meshrun.parallel.pipeline import (EAGER_WEIGHTS, PipelineEngine, bubble_fraction, effective_model_config,
                                      split_backward_routes_each_output, split_stage, stage_ids)
from meshrun.parallel.stage_cut import stage_ranges
from meshrun.parallel.sharded import ShardedEngine
from meshrun.parallel.step_weights import StepWeights, grad_adder
from meshrun.parallel.tied import TP_FIX, find_shared
from meshrun.parallel.tp import apply_tp, settle_async_outputs

log = logging.getLogger("meshrun")


def build_engine(*, job: JobConfig, model_cfg: ModelShape, dims: ParallelDims, mesh, device: torch.device,
                 compute_dtype: torch.dtype | None, batch: BatchPlan | None = None) -> Engine:
    """The engine for ``dims`` on this rank. Collective: every rank must call it (it may create process groups
    and, for DDP, broadcasts parameters). ``mesh`` is ``dims.build_mesh(...)`` (None for a single process);
    ``compute_dtype`` is None or torch.float32 for fp32, torch.bfloat16 for bf16 compute. ``batch`` is the caller's
    resolved batch (the trainer's); without it, it is resolved from ``job.train`` here.

    Initial weights: ``job.train.seed`` seeds ``init_weights``. Without sharding every rank holds the same
    weights as a single process with that seed; sharded layouts draw each shard from its own stream (so they start
    from different, equally distributed weights than a single process: start from a checkpoint to compare).
    """
    spec = model_spec(job)
    cfg = effective_model_config(model_cfg, pp=dims.pp)
    if cfg is not model_cfg:
        log.warning("parallel.pp=%d: untying the embeddings (the input embedding on the first stage, the output head "
                    "on the last); set --model.tie_embeddings=false to make this explicit", dims.pp)
    check_layout(job, spec, model_cfg, dims, device=device, compute_dtype=compute_dtype)
    if batch is None:
        batch = resolve_batch(job.train, dp_size=dims.dp_size, seq_len=cfg.seq_len)
    dims.resolve_pipeline_batch(batch.micro_batch * batch.grad_accum, seq_len=batch.seq_len)
    if dims.world_size > 1 and mesh is None:
        raise ValueError(f"build_engine: world size {dims.world_size} needs the mesh from dims.build_mesh()")
    rank = mesh.get_rank() if mesh is not None else 0
    log.info("layout: %s", describe_layout(dims))
    log.info("attention kernel: %s", select_attention(job.train.attention, device))
    fp32 = compute_dtype is None or compute_dtype == torch.float32
    compiled = compile_enabled(job.train.compile, device)
    log.info("cross-entropy kernels: %s", select_cross_entropy(job.train.cross_entropy, device, compiled=compiled))
    if job.parallel.async_tp:
        enable_async_tp(dims.get_mesh("tp"))
    if use_comm_reorder(job, dims, device):
        enable_comm_reorder()
    local = is_local(dims)
    whole = fsdp_whole_model(job, dims, spec, cfg, device)
    graphs = use_cuda_graphs(job.train.cuda_graphs, device, compiled=compiled,
                             supported=graphs_supported(dims, async_tp=job.parallel.async_tp, whole_fsdp=whole),
                             measured=graphs_measured(job, dims))
    reduce_bf16 = grad_reduce_bf16(job, dims, compute_dtype, device, grad_accum=batch.grad_accum)
    if rank == 0 and (note := bf16_accumulation_note(job, dims, reduce_bf16=reduce_bf16, grad_accum=batch.grad_accum)):
        log.warning(note)
    options = parallel_options(job, compute_dtype=compute_dtype, compiled=compiled, device=device,
                               cuda_graphs=graphs and not local, split_backward=splits_backward(dims),
                               residual_bf16=bf16_stream(job, dims, compute_dtype), whole_model=whole,
                               reduce_bf16=reduce_bf16)
    if local:
        return _local_engine(job, spec, cfg, dims, device, rank=rank, autocast_dtype=None if fp32 else compute_dtype,
                             options=options, cuda_graphs=graphs, grad_accum=batch.grad_accum)
    ids = stage_ids(dims.coords(rank).pp, pp=dims.pp, virtual_stages=dims.pp_virtual_stages) if dims.pp > 1 else [0]
    parts = build_parts(cfg, dims, ids, spec=spec, options=options)
    materialize(parts, device=device, seed=job.train.seed, dims=dims, rank=rank, spec=spec)
    sharded_dp = uses_fsdp(dims)
    autocast = None if fp32 or sharded_dp else compute_dtype  # FSDP casts itself (MixedPrecisionPolicy)
    coords = dims.coords(rank)
    loss_fn = loss_function(compiled, vocab_sharded=use_loss_parallel(dims))
    if dims.pp > 1:
        pipeline = PipelineEngine(parts, ids, n_stages=dims.stages, schedule=dims.pp_schedule,
                                  microbatches=dims.pp_microbatches, device=device,
                                  pp_group=dims.get_mesh("pp").get_group(), dp_rank=dims.dp_rank(rank),
                                  dp_size=dims.dp_size, tp_rank=coords.tp, autocast_dtype=autocast, loss_fn=loss_fn,
                                  cuda_graphs=options.cuda_graphs,
                                  step_weights=StepWeights(parts, autocast,
                                                           add=grad_adder(compiled=compiled, device=device))
                                  if use_cast_once(job, dims, device, compute_dtype) else None)
        pipeline.timed_modules = [m for part in parts for m in timed_modules(part, spec, dims=dims, compiled=compiled)]
        return pipeline
    engine = ShardedEngine(parts[0], dp_rank=dims.dp_rank(rank), dp_size=dims.dp_size, reports_loss=coords.tp == 0,
                           fsdp=sharded_dp, loss_parallel=use_loss_parallel(dims), autocast_dtype=autocast,
                           loss_fn=loss_fn, aux_loss=spec.aux_loss,
                           sequence_shards=SequenceShards(dims.get_mesh("cp"), spec) if dims.cp > 1 else None,
                           cuda_graphs=options.cuda_graphs)
    engine.timed_modules = timed_modules(parts[0], spec, dims=dims, compiled=compiled)
    return engine


def timed_modules(part: nn.Module, spec, *, dims: ParallelDims, compiled: bool) -> list[nn.Module]:
    """What the straggler timer hooks: modules whose forward is this rank's own work, without waiting for peers.

    Under FSDP without TP the blocks: FSDP's pre-forward hook (registered first, so it runs before the timer's)
    waits for the block's all-gather, so a block's own forward holds no wait. The root's forward would include
    every all-gather, and a slow rank's delay would show on its peers. Compiled blocks are not hooked (a hook
    would run inside the compiled region); nor are TP blocks, whose all-reduces are inside the forward: those keep
    the whole part, waits included, and the straggler report says less about which rank is slow.
    """
    if dims.dp_shard > 1 and dims.tp == 1 and dims.cp == 1 and not compiled:
        return list(spec.block_modules(part))
    return [part]


def describe_layout(dims: ParallelDims) -> str:
    """One line for the start-up header: the degrees, what applies them, and the pipeline bubble."""
    text = f"{dims.describe()} | {layout_name(dims)}"
    if dims.pp > 1:
        v, m, p = dims.pp_virtual_stages, dims.pp_microbatches, dims.pp
        formula = f"({p} - 1) / ({v} x {m})" if v > 1 else f"({p} - 1) / {m}"
        text += f" | pipeline bubble {formula} = {bubble_fraction(p, m, v):.1%}"
    return text


def use_loss_parallel(dims: ParallelDims) -> bool:
    """Vocabulary-sharded cross-entropy with TP; not across pipeline stages (stage outputs are plain tensors)."""
    return dims.tp > 1 and dims.pp == 1


def build_parts(cfg: ModelShape, dims: ParallelDims, ids: list[int], *, spec: ModelSpec,
                options: ParallelOptions) -> list[nn.Module]:
    """Steps 1-5 of the fixed order, on the meta device: this rank's model parts, parallelised, not materialised."""
    with torch.device("meta"):
        whole = spec.build(cfg)
    ranges = stage_ranges(dims, cfg.n_layers)
    parts = [split_stage(whole, i, dims.stages, spec=spec, ranges=ranges) for i in ids] if dims.pp > 1 else [whole]
    for part in parts:
        parallelize(part, spec, dims, options)
    return parts


def parallelize(part: nn.Module, structure: ModelStructure, dims: ParallelDims, options: ParallelOptions) -> None:
    """TP -> float8 -> activation checkpointing -> compile -> FSDP/HSDP, in place (DDP is applied after
    materialising): the one front door of the trainer and Session. ``structure`` says where the blocks and the
    TP plan are (a ModelSpec, or Session's description of a built model); ``options`` the resolved choices. Tied
    parameters stay one parameter or are refused (parallel/tied.py), naming ``options.layout``."""
    layout = options.layout or layout_name(dims)
    shared = find_shared(part)  # before any step replaces parameters
    blocks = structure.block_modules(part)
    if dims.tp > 1:
        if structure.tp_plan is None:  # the trainer refuses it earlier, naming model.arch (ParallelDims.validate_model)
            raise ConfigError(f"parallel.tp={dims.tp}: {layout} has no tensor-parallel plan for "
                              f"{type(part).__name__}; give one, or use tp=1")
        apply_tp(part, structure.tp_plan, dims.get_mesh("tp"), sequence_parallel=options.sequence_parallel,
                 loss_parallel=use_loss_parallel(dims))
        shared.restore(part, layout=layout, after="tensor parallelism", fix=TP_FIX)
    if options.float8:
        convert_blocks_to_float8(part, fsdp=uses_fsdp(dims), blocks_attr=structure.blocks)
    apply_activation_checkpointing(part, options.activation_checkpoint, blocks=blocks)
    if options.residual_in_compute_dtype:
        cast_block_inputs(blocks)
    whole = uses_fsdp(dims) and options.fsdp_unit_blocks == WHOLE_MODEL
    if options.compiled and not whole:
        mode = inductor_mode(options.compile_mode, options.cuda_graphs)  # CUDA graphs: block by block
        for block in blocks:
            if options.split_backward:
                keep_weights_eager(block, only_linears=split_backward_routes_each_output())
            block.compile(mode=mode)  # in place: parameter names stay as they are (no "_orig_mod.")
        if dims.tp > 1:  # the TP styles' async collectives must not reach a compiled block as its input
            settle_async_outputs(part, compiled=blocks)
    shared.restore(part, layout=layout, after="float8 and activation checkpointing")
    if uses_fsdp(dims):
        # cp=1: "dp_shard" (not "dp_shard_cp", the same ranks), so FSDP-replicate finds its degree-1 dimension
        shard = "dp_shard_cp" if dims.cp > 1 else "dp_shard"
        dp_mesh = dims.get_mesh(shard) if dims.dp_replicate == 1 else dims.get_mesh(("dp_replicate", shard))
        reshard = dims.pp == 1 and reshard_after_forward(options.fsdp_reshard_after_forward, part,
                                                         compute_dtype=options.compute_dtype, device=options.device)
        per_unit = unit_blocks(options.fsdp_unit_blocks, part, blocks, device=options.device)
        shared.check_units(part, fsdp_units(blocks, per_unit), layout=layout)
        apply_fsdp(part, dp_mesh, compute_dtype=options.compute_dtype, reshard_after_forward=reshard, blocks=blocks,
                   unit_blocks=per_unit, reduce_dtype=options.reduce_dtype,
                   prefetch=options.fsdp_prefetch, symm_mem=options.fsdp_symm_mem)
        shared.restore(part, layout=layout, after="FSDP2", reshare=False)
    if options.compiled and whole:
        compile_forward(part, inductor_mode(options.compile_mode, cuda_graphs=options.cuda_graphs))
        if options.cuda_graphs:
            gather_in_pool(part)  # the graphs take the gathered parameters as fixed addresses


def compile_forward(part: nn.Module, mode: str) -> None:
    """parallel.fsdp_unit_blocks=-1: ``part``'s forward compiled as one graph, in place (an attribute of the
    instance: parameter names keep no "_orig_mod."). FSDP2's hooks stay outside it: the root unit's pre-forward
    (the one all-gather) runs in the module's call before this forward, and torch keeps dynamo out of FSDP2's hooks;
    no block holds a hook of FSDP2's to break the graph. One compiled region a step each way, where compiling
    block by block enters one per block (0.6-0.8 ms of host time each for the 124m model's blocks on an H200,
    docs/benchmarks.md round 22)."""
    part.forward = torch.compile(part.forward, mode=mode)


def cast_block_inputs(blocks: list[nn.Module]) -> None:
    """train.residual_dtype=bf16: under autocast each block's first input (the hidden state between blocks) is cast to
    the autocast dtype before the block runs. Autocast computes the matmuls in bf16 but leaves the embedding's output
    and the residual additions in the parameters' fp32; cast once at the first block, the stream stays bf16 (a bf16
    input plus a bf16 branch), and so do its gradient and a pipeline stage's sends and receives. The first block's
    cast does the work; at the others the input is already bf16 and the hook changes nothing. Without autocast (fp32
    compute, FSDP2's bf16 parameters) it changes nothing either. Traced into compiled blocks (no graph break)."""
    for block in blocks:
        block.register_forward_pre_hook(_cast_to_autocast_dtype)


def _cast_to_autocast_dtype(module: nn.Module, args: tuple):
    x = args[0] if args else None
    if isinstance(x, torch.Tensor) and x.is_floating_point() and torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        if x.dtype != dtype:
            return (x.to(dtype), *args[1:])
    return None


def splits_backward(dims: ParallelDims) -> bool:
    """A pipeline whose schedule computes weight gradients apart from input gradients (zero bubble)."""
    return dims.pp > 1 and dims.pp_schedule == "interleavedzb"


def keep_weights_eager(block: nn.Module, *, only_linears: bool) -> None:
    """Leave the modules that hold ``block``'s weights out of the graphs it is compiled into, so that a zero-bubble
    schedule can split its backward. Such a schedule runs each micro-batch's backward in two passes: input gradients
    first, weight gradients later, where the bubble would be. It relies on autograd computing only the gradients
    asked for, which an eager matmul does (its input and weight gradients are two matmuls it runs apart) and a
    compiled graph's backward does not (it computes all of its gradients at once, so the weight pass runs it again).

    ``only_linears``: only the linear layers stay eager; the graphs hold the rest (norms, RoPE, attention, SwiGLU's
    gating, residual adds), and the weight pass recomputes a norm's small weight gradient in its graph. That needs a
    torch whose weight pass routes each output of a compiled graph (pipeline.split_backward_routes_each_output);
    with an older one every module that holds parameters (norms too) stays eager, so no graph holds a weight."""
    for module in block.modules():
        holds_weights = next(module.parameters(recurse=False), None) is not None
        if isinstance(module, nn.Linear) or (holds_weights and not only_linears):
            module.forward = torch.compiler.disable(module.forward, recursive=True)
    setattr(block, EAGER_WEIGHTS, "linears" if only_linears else "all")
    # the input pass keeps the graph for the weight pass (retain_graph=True), which compiled backwards that reuse
    # ("donate") their saved buffers refuse: this process compiles without donated buffers
    import torch._functorch.config as functorch_config

    functorch_config.donated_buffer = False


def unit_blocks(choice: int, part: nn.Module, blocks: list[nn.Module], *, device: torch.device | None) -> int:
    """parallel.fsdp_unit_blocks: the number given (-1: :data:`WHOLE_MODEL`, also where checks.whole_model_unit
    resolved 0 to it), or for 0 (auto) on a GPU :func:`auto_unit_blocks` of ``part``'s parameters and its largest
    block's (all blocks in one unit for small models, units of about 150M parameters for large ones); one block
    per unit on CPU."""
    if choice:
        return choice
    if device is None or device.type != "cuda" or not blocks:
        return 1
    return auto_unit_blocks(sum(p.numel() for p in part.parameters()),
                            max(sum(p.numel() for p in block.parameters()) for block in blocks), len(blocks))


def reshard_after_forward(choice: str, part: nn.Module, *, compute_dtype: torch.dtype | None,
                          device: torch.device | None) -> bool:
    """parallel.fsdp_reshard_after_forward: 'auto' keeps gathered parameters for backward (saving the second
    all-gather of each block) when this part's whole parameters in the compute dtype take at most 1/16 of the
    GPU's memory; on CPU, or when the device is unknown, it reshards (the memory-lean choice)."""
    if choice != "auto":
        return choice == "true"
    if device is None or device.type != "cuda":
        return True
    itemsize = (compute_dtype or torch.float32).itemsize
    gathered = sum(p.numel() for p in part.parameters()) * itemsize
    return gathered > torch.cuda.get_device_properties(device).total_memory / 16


def materialize(parts: list[nn.Module], *, device: torch.device, seed: int, dims: ParallelDims, rank: int,
                spec: ModelSpec) -> None:
    """Allocate this rank's shards on ``device`` and initialise them (the spec's init_weights works on DTensor
    shards)."""
    seed_for_init(seed, dims=dims, rank=rank, device=device)
    for part in parts:
        shared = find_shared(part)
        part.to_empty(device=device)
        # to_empty gives each module its own tensor unless FSDP2 swaps them in place: share them again (before
        # init, which fills a tied weight once)
        shared.restore(part, layout=layout_name(dims), after="to_empty", reshare=not uses_fsdp(dims))
        spec.init_weights(part, device)


def seed_for_init(seed: int, *, dims: ParallelDims, rank: int, device: torch.device) -> None:
    """Seed so that pipeline stages draw different weights, while ranks that must agree (dp replicas) draw the
    same. On accelerators DTensor's RNG tracker gives each shard its own part of one stream (same seed for a
    stage's ranks); on CPU it is not available, so every distinct shard (pp, dp_shard, cp, tp) gets its own seed."""
    c = dims.coords(rank)
    if device.type == "cpu":
        torch.manual_seed(seed + ((c.pp * dims.dp_shard + c.dp_shard) * dims.cp + c.cp) * dims.tp + c.tp)
        return
    torch.manual_seed(seed + c.pp)
    if dims.tp > 1 or dims.dp_shard > 1 or dims.cp > 1 or dims.dp_replicate > 1:
        try:  # a tracker without the rank-0 broadcast, which would erase the per-stage seeds
            # private: DTensor's RNG tracker has no public seeding function (2.8 to 2.13)
            from torch.distributed.tensor._random import manual_seed
        except ImportError:  # pragma: no cover - older layout of the module
            return
        manual_seed(seed + c.pp, dims.mesh)


def graphs_left_off(job: JobConfig, dims: ParallelDims, device: torch.device, *, whole_fsdp: bool = False) -> str:
    """Why train.cuda_graphs=auto leaves CUDA graphs off where compile is on on a GPU (the start-up header says it
    beside "compile on"); empty where auto turns them on, or where compile or the GPU is what is missing.
    ``whole_fsdp``: FSDP2 holds the whole model as one unit (checks.whole_model_unit)."""
    if job.train.cuda_graphs != "auto" or device.type != "cuda" or not compile_enabled(job.train.compile, device):
        return ""
    if several_stages_per_rank(dims):
        return f"parallel.pp_schedule={dims.pp_schedule} runs several stages per rank, which train wrongly as graphs"
    if not graphs_supported(dims, async_tp=job.parallel.async_tp, whole_fsdp=whole_fsdp):
        return f"{layout_name(dims)}'s hooks or collectives run between the compiled graphs"
    untested = untested_as_graphs(job, dims)
    return f"{', '.join(untested)} not yet run as graphs on a GPU" if untested else ""


def use_cuda_graphs(choice: str, device: torch.device, *, compiled: bool, supported: bool,
                    measured: bool = True) -> bool:
    """train.cuda_graphs resolved for this run: 'true' refuses what cannot run, 'auto' is on where 'true' would be
    accepted (``supported``: one process, DDP, TP or PP -- checks.graphs_supported --, compiled, on CUDA) and the
    step is one GPU tests have covered (``measured``: the full loss without float8; the chunked loss and float8
    scaling have not run under CUDA graphs on a GPU yet), 'false' is off."""
    if choice == "true":
        return True  # check_layout refused what cannot run
    return choice == "auto" and device.type == "cuda" and compiled and supported and measured


def ddp_graph_split(choice: str, dims: ParallelDims, *, cuda_graphs: bool) -> bool:
    """parallel.ddp_graph resolved: split the compiled DDP step at its buckets? auto splits when the step runs as
    CUDA graphs (the host no longer launches each split graph's kernels, and each bucket's all-reduce overlaps the
    rest of backward) and when the replicas span nodes (or the node size is unknown), where an exposed all-reduce
    costs more than the split graphs' host time. Only launched kernels within one node keep one graph each way. On
    2 H200s (124m, CUDA graphs, 100 MiB buckets) split ran 453-458k tokens/s per GPU against 448-451k for one graph;
    on 2 H100s without CUDA graphs one graph ran 423k against 318k split (25 MiB buckets)."""
    if choice != "auto":
        return choice == "split"
    return cuda_graphs or not (dims.gpus_per_node and dims.dp_replicate <= dims.gpus_per_node)


def ddp_bucket_mb(choice: int, *, cuda_graphs: bool) -> int:
    """parallel.ddp_bucket_mb resolved: 0 (auto) is 100 MiB for a step recorded as CUDA graphs, which auto splits at
    the buckets (on 2 H200s, 124m: 457.8k tokens/s per GPU against 447.9k with 25 MiB buckets), and torch's 25
    elsewhere (launched kernels, eager DDP), where no measurement says otherwise."""
    if choice:
        return choice
    return 100 if cuda_graphs else 25


def _local_engine(job: JobConfig, spec: ModelSpec, cfg: ModelShape, dims: ParallelDims, device: torch.device, *,
                  rank: int, autocast_dtype: torch.dtype | None, options: ParallelOptions,
                  cuda_graphs: bool, grad_accum: int = 1) -> LocalEngine:
    """One process, or DDP over dp_replicate: every rank holds the whole model, initialised like 1 process.

    Compile covers the whole model and its loss (``LossStep``), not each block: one graph lets inductor fuse the
    head, the fp32 upcast and the cross-entropy. With DDP, ``parallel.ddp_overlap`` decides the order,
    DDP(compile(step)) or compile(DDP(step)). In both, dynamo's DDP optimizer splits the compiled step at the
    gradient buckets' boundaries (DDP marks itself active while its forward runs the compiled module), so each
    bucket's all-reduce starts while the rest of backward runs; a 2-GPU trace shows an all-reduce every 1.6 ms of
    backward; ``parallel.ddp_graph=whole`` turns that split off (one graph each way, all-reduces after backward).
    ``cuda_graphs`` compiles with inductor's CUDA graphs (mode reduce-overhead).
    """
    with torch.device("meta"):
        model = spec.build(cfg)
    shared = find_shared(model)
    compiled = options.compiled
    parallelize(model, spec, dims, replace(options, compiled=False))  # float8, activation checkpointing; compiled below
    model.to_empty(device=device)
    if spec.tie_weights is not None:
        spec.tie_weights(model)  # to_empty may have replaced the shared parameter
    shared.restore(model, layout=layout_name(dims), after="to_empty")  # and any tie the spec does not re-make
    torch.manual_seed(job.train.seed)
    spec.init_weights(model, device)
    step: nn.Module = LossStep(model, autocast_dtype, structure=spec, chunked=job.train.loss == "chunked")
    ddp = dims.dp_replicate > 1
    overlap = ddp and compiled and job.parallel.ddp_overlap
    mode = inductor_mode(job.train.compile_mode, cuda_graphs)
    if ddp and compiled:
        split = ddp_graph_split(job.parallel.ddp_graph, dims, cuda_graphs=cuda_graphs)
        log.info("DDP compiled as %s", "graphs split at the gradient buckets (all-reduce overlaps backward)" if split
                 else "one forward and one backward graph (all-reduce after backward)")
        # process-wide dynamo switch, read when the step is first compiled; this process compiles only this step
        torch._dynamo.config.optimize_ddp = split
    if compiled and not overlap:
        step = torch.compile(step, mode=mode)
    copies = None
    if autocast_dtype is not None and use_weight_copies(job, dims, device, autocast_dtype,
                                                        grad_accum=grad_accum):
        # with one micro-batch a step the gradients stay bf16 where the Triton AdamW reads them
        copies = StepWeights([model], autocast_dtype, grads_in_dtype=resolve_adamw_kernel(job, device) == "triton",
                             reduced_by_ddp=ddp)
    if ddp:
        step = apply_ddp(step, dims.get_mesh("dp_replicate"), device,
                         bucket_mb=ddp_bucket_mb(job.parallel.ddp_bucket_mb, cuda_graphs=cuda_graphs),
                         reduce_dtype=options.reduce_dtype, copies=copies,
                         batched_copy=tri_state("parallel.ddp_batched_copy", job.parallel.ddp_batched_copy) == "true")
    if overlap:
        step = torch.compile(step, mode=mode)  # dynamo's DDP optimizer splits the graph at bucket boundaries
    return LocalEngine(model, step=step, autocast_dtype=autocast_dtype, dp_rank=dims.dp_rank(rank),
                       dp_size=dims.dp_size, cuda_graphs=cuda_graphs, step_weights=copies)
