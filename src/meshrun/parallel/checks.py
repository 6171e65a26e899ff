"""A layout checked against the options, the model and the device, before anything is built.

Validation happens in three places, each with one job, and a training run goes through all three in
:meth:`meshrun.train.plan.RunPlan.resolve`, before its process group exists:

1. ``config_checks.py`` (``JobConfig.validate``): each option's value and the options that depend on one another;
2. ``comm/mesh.py`` (``ParallelDims.from_config``): the degrees against the world size and the model's shape;
3. this module (:func:`check_layout`): the layout against the options it runs with (float8, async TP, CUDA graphs,
   the chunked loss, context parallelism) and the device type.

:func:`resolve_layout` runs 2 and 3 for one world and device, with the choices the options leave open; the real start
(``RunPlan.resolve``), ``meshrun plan`` and ``meshrun train --dry-run`` all go through it, so they refuse alike.
``build_engine`` runs :func:`check_layout` again, for callers that build an engine without a plan (Session, tests);
the checks read only their arguments, so a second run changes nothing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from meshrun.comm.dp_choice import choose_data_parallel, reduces_in_bf16
from meshrun.comm.mesh import ParallelDims
from meshrun.comm.process_group import choose_backend
from meshrun.comm.schedule_choice import choose_pp_schedule
from meshrun.config import MULTI_STAGE_SCHEDULES, BatchPlan, ConfigError, JobConfig, ParallelConfig, TrainConfig, \
    resolve_batch
from meshrun.config_checks import tri_state
from meshrun.models.shape import ModelShape
from meshrun.models.spec import ModelSpec
from meshrun.parallel.async_tp import check_async_tp
from meshrun.parallel.context_parallel import check_context_parallel
from meshrun.parallel.data_parallel import FSDP_ONE_UNIT_PARAMS, WHOLE_MODEL, symm_mem_supported
from meshrun.parallel.float8 import check_float8
from meshrun.parallel.kernels import (bf16_by_default, compile_enabled, require_compiled_cuda, resolve_adamw_kernel,
                                      resolve_cross_entropy)
from meshrun.parallel.pipeline import effective_model_config


def parallelisms(dims: ParallelDims) -> list[str]:
    """What applies the degrees, outermost first: ['PP', 'TP', 'HSDP'], ['DDP'], [] in a single process, ..."""
    parts = ["PP"] if dims.pp > 1 else []
    if dims.tp > 1:
        parts.append("TP")
    if dims.cp > 1:
        parts.append("CP")
    if uses_fsdp(dims):
        parts.append("HSDP" if dims.dp_replicate > 1 and dims.dp_shard * dims.cp > 1 else
                     "FSDP" if dims.dp_shard * dims.cp > 1 else "FSDP-replicate")
    elif dims.dp_replicate > 1:
        parts.append("DDP")
    return parts


def layout_name(dims: ParallelDims) -> str:
    """'PP 1f1b + TP + HSDP', 'DDP', 'single process', ..."""
    parts = [f"PP {dims.pp_schedule}" if name == "PP" else name for name in parallelisms(dims)]
    return " + ".join(parts) or "single process"


def uses_fsdp(dims: ParallelDims) -> bool:
    """FSDP2 handles data parallelism whenever parameters are sharded (over dp_shard x cp: the cp ranks of a replica
    hold the same parameters, so FSDP shards over them too, as torchtitan) or are DTensors/pipeline stages anyway."""
    return dims.dp_shard > 1 or dims.cp > 1 or dims.fsdp_replicates


def is_local(dims: ParallelDims) -> bool:
    """Every rank holds the whole model: one process, or DDP over dp_replicate."""
    return dims.pp == 1 and dims.tp == 1 and dims.dp_shard == 1 and dims.cp == 1


def graphs_block_by_block(dims: ParallelDims, *, async_tp: bool = False) -> bool:
    """train.cuda_graphs records each compiled block of a TP or pipeline layout, or both, without FSDP or context
    parallelism (replicas, dp_replicate, are HSDP with one shard: FSDP2 hooks, so not these): TP's all-reduces
    inside the graphs, the pipeline's sends and receives between them; async TP's symmetric-memory kernels are not
    recorded."""
    return (dims.tp > 1 or dims.pp > 1) and dims.dp_shard == 1 and dims.dp_replicate == 1 and dims.cp == 1 \
        and not async_tp and not several_stages_per_rank(dims)


def several_stages_per_rank(dims: ParallelDims) -> bool:
    """A pipeline schedule that runs several stages on each rank (interleaved1f1b, interleavedzb, loopedbfs). Its
    blocks do not run as CUDA graphs: on 2 H100s, interleaved1f1b with graphs trained to loss 3.17 where launched
    kernels reached 2.03 after 100 steps (tests/test_speed_gpu.py); why is not known yet (1f1b, one stage per rank,
    trains like launched kernels)."""
    return dims.pp > 1 and dims.pp_schedule in MULTI_STAGE_SCHEDULES


def graphs_supported(dims: ParallelDims, *, async_tp: bool = False, whole_fsdp: bool = False) -> bool:
    """Layouts train.cuda_graphs can serve: the whole step (one process, DDP), block by block (TP, PP), or with
    ``whole_fsdp`` (:func:`whole_model_unit`) FSDP2's whole model compiled as one graph, its hooks outside it."""
    return (is_local(dims) or graphs_block_by_block(dims, async_tp=async_tp)
            or (whole_fsdp and uses_fsdp(dims) and dims.tp == 1 and dims.pp == 1 and dims.cp == 1))


def graphs_measured(job: JobConfig, dims: ParallelDims) -> bool:
    """The step is one that GPU tests have run as CUDA graphs, so train.cuda_graphs=auto may turn them on (see
    :func:`untested_as_graphs`). train.cuda_graphs=true accepts the others."""
    return not untested_as_graphs(job, dims)


GRAPH_TESTED_PP = {"1f1b": 4, "gpipe": 2}
"""The most pipeline stages each schedule's GPU test has run as CUDA graphs (tests/test_speed_gpu.py: 1F1B of 2 and
4 stages, GPipe of 2); more stages put more micro-batches in flight per rank. The interleaved schedules trained
wrongly and are refused (checks.several_stages_per_rank)."""


def untested_as_graphs(job: JobConfig, dims: ParallelDims) -> list[str]:
    """What in this step GPU tests have not run as CUDA graphs: the chunked loss, float8, TP's sequence parallelism,
    PP beyond GRAPH_TESTED_PP, and TP with PP other than 2 stages of 1F1B (the combination its 4-GPU test ran)."""
    schedule = dims.pp_schedule  # resolved (parallel.pp_schedule=auto)
    return [what for what, applies in (
        ("train.loss=chunked", job.train.loss != "full"),
        ("train.float8", job.train.float8),
        ("sequence parallelism", dims.tp > 1 and job.parallel.sequence_parallel),
        ("TP with PP other than 2 stages of 1f1b", dims.tp > 1 and dims.pp > 1 and (dims.pp, schedule) != (2, "1f1b")),
        (f"PP {dims.pp} with {schedule}", dims.pp > GRAPH_TESTED_PP.get(schedule, 1))) if applies]


def whole_model_unit(job: JobConfig, dims: ParallelDims, *, params: int, device: torch.device,
                     compiled: bool) -> bool:
    """parallel.fsdp_unit_blocks resolved: is the whole model one FSDP2 unit (:data:`WHOLE_MODEL`), its forward
    compiled as one graph? -1 asks for it. 0 (auto) picks it where that step then runs as CUDA graphs
    (train.cuda_graphs auto or true): FSDP2 alone (no TP, PP or context parallelism), compiled on a CUDA GPU, a model
    of fewer than :data:`FSDP_ONE_UNIT_PARAMS` parameters (``params``), and nothing in the step that GPU tests have not
    run as graphs. For such a model the host, not the GPU, sets the pace of FSDP2 block by block: on one H200 (124m,
    FSDP2's hooks and copies on a one-rank mesh) 361k tokens/s block by block, 495k as one graph replayed
    (docs/benchmarks.md round 23)."""
    if not uses_fsdp(dims):
        return False
    choice = job.parallel.fsdp_unit_blocks
    if choice:
        return choice == WHOLE_MODEL
    return (dims.tp == 1 and dims.pp == 1 and dims.cp == 1 and compiled and device.type == "cuda"
            and params < FSDP_ONE_UNIT_PARAMS and job.train.cuda_graphs != "false" and graphs_measured(job, dims))


def fsdp_whole_model(job: JobConfig, dims: ParallelDims, spec: ModelSpec, shape: ModelShape,
                     device: torch.device) -> bool:
    """Does FSDP2 hold this run's whole model as one unit (:func:`whole_model_unit`, the model's parameters counted
    on the meta device only when FSDP2 runs)?"""
    return uses_fsdp(dims) and whole_model_unit(job, dims, params=spec.count_params(shape), device=device,
                                                compiled=compile_enabled(job.train.compile, device))


def compute_dtype(job: JobConfig, device: torch.device | str) -> torch.dtype | None:
    """The autocast dtype of a training run, or None for plain fp32 (train.dtype=auto: bf16 on CUDA GPUs that have
    it, compute capability 8.0 and newer)."""
    if job.train.dtype == "bf16" or (job.train.dtype == "auto" and bf16_by_default(device)):
        return torch.bfloat16
    return None


def bf16_stream(job: JobConfig, dims: ParallelDims, compute_dtype: torch.dtype | None) -> bool:
    """train.residual_dtype resolved for this run: the hidden state between blocks cast to bf16 under bf16 autocast.
    auto: on for one process, DDP, TP and pipelines computing in bf16 autocast without float8 (on one H200 the 124m
    model ran 1.05x and the 1b model 1.03x the fp32 stream; on 2 H200s the 1b model 1.03x with TP 2, 40.2-40.3% MFU,
    and 1.02x with PP 2; GPU tests of their losses, tests/test_parallel_gpu.py -k bf16_layouts); off under FSDP2
    (its bf16 parameters keep the stream in bf16 anyway), with context parallelism (not measured) and for fp32
    compute."""
    choice = job.train.residual_dtype
    if choice != "auto":
        return choice == "bf16"
    return compute_dtype == torch.bfloat16 and not uses_fsdp(dims) and dims.cp == 1 and not job.train.float8


def grad_reduce_bf16(job: JobConfig, dims: ParallelDims, compute_dtype: torch.dtype | None,
                     device: torch.device, *, grad_accum: int) -> bool:
    """parallel.grad_reduce_dtype resolved for this run: are gradients summed across ranks in bf16? auto: as
    :func:`meshrun.comm.dp_choice.reduces_in_bf16` decides, FSDP2 without replicas computing in bf16 on GPUs, all
    ranks on one node (``dims.gpus_per_node``, the launch's processes per node; 0, unknown, keeps fp32), one
    micro-batch per step (``grad_accum``, the resolved batch's, 1, and no pipeline)."""
    choice = job.parallel.grad_reduce_dtype
    if choice != "auto":
        return choice == "bf16"
    one_node = 0 < dims.world_size <= dims.gpus_per_node
    return reduces_in_bf16(fsdp=uses_fsdp(dims), replicate=dims.dp_replicate, bf16=compute_dtype == torch.bfloat16,
                           on_gpu=device.type == "cuda", one_node=one_node, accumulates=grad_accum > 1 or dims.pp > 1)


def bf16_accumulation_note(job: JobConfig, dims: ParallelDims, *, reduce_bf16: bool, grad_accum: int) -> str:
    """A start-up warning where parallel.grad_reduce_dtype=bf16, asked for, makes FSDP2 add a step's micro-batches'
    gradients in bf16 (its fp32 running sum exists only when the reduce dtype differs from the gradients'); ''
    otherwise, and for auto, which keeps fp32 there."""
    micro = dims.pp_microbatches if dims.pp > 1 else grad_accum  # a pipeline runs the step's samples at once
    if not (reduce_bf16 and uses_fsdp(dims) and micro > 1 and job.parallel.grad_reduce_dtype == "bf16"):
        return ""
    return (f"parallel.grad_reduce_dtype=bf16 with FSDP2 and {micro} micro-batches per step: FSDP2 adds their "
            "gradients in bf16 before the one reduce-scatter, losing precision with each; "
            "--parallel.grad_reduce_dtype=auto (or fp32) keeps that sum in fp32")


def ddp_batches_copies() -> bool:
    """Does this torch's DistributedDataParallel take ``batched_grad_copy`` (parallel.ddp_batched_copy)?"""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    return "batched_grad_copy" in inspect.signature(DistributedDataParallel).parameters


def check_layout(job: JobConfig, spec: ModelSpec, shape: ModelShape, dims: ParallelDims, *, device: torch.device,
                 compute_dtype: torch.dtype | None) -> None:
    """Raise ConfigError, naming the option and the fix, when ``dims`` cannot run ``job``'s options for this model on
    ``device`` (its type is what matters: ``torch.device('cuda')`` before a GPU is chosen)."""
    dims.validate_model(effective_model_config(shape, pp=dims.pp), spec)
    compiled = compile_enabled(job.train.compile, device)
    fp32 = compute_dtype in (None, torch.float32)
    if job.train.compile_mode != "default" and not compiled:
        raise ConfigError(f"train.compile_mode={job.train.compile_mode} needs compilation, which "
                          f"train.compile={job.train.compile} leaves off on {device.type}: set --train.compile=true "
                          "or drop --train.compile_mode")
    if job.train.float8:
        check_float8(device, tp=dims.tp)
    check_context_parallel(cp=dims.cp, device=device, spec=spec, attention=job.train.attention, fp32=fp32)
    if job.parallel.async_tp:
        check_async_tp(device, tp=dims.tp, compiled=compiled)
    if job.train.cuda_graphs == "true":
        if several_stages_per_rank(dims):
            raise ConfigError(f"train.cuda_graphs=true: parallel.pp_schedule={dims.pp_schedule} runs several stages "
                              "on each rank, whose blocks train wrongly as CUDA graphs (a GPU test's loss stayed at "
                              "3.17 where launched kernels reached 2.03); drop --train.cuda_graphs, or set "
                              "--parallel.pp_schedule=1f1b (which runs as CUDA graphs)")
        whole = fsdp_whole_model(job, dims, spec, shape, device)
        check_cuda_graphs(device, compiled=compiled,
                          supported=graphs_supported(dims, async_tp=job.parallel.async_tp, whole_fsdp=whole),
                          layout=layout_name(dims))
    check_chunked_loss(job.train.loss, spec, dims=dims, local=is_local(dims))
    if job.parallel.fsdp_unit_blocks == WHOLE_MODEL and uses_fsdp(dims) and (dims.tp > 1 or dims.pp > 1 or dims.cp > 1):
        raise ConfigError(f"parallel.fsdp_unit_blocks=-1 makes the whole model one FSDP2 unit, compiled as one graph, "
                          f"which {layout_name(dims)} cannot run (tensor, pipeline or context parallelism works "
                          "block by block): give a number of blocks per unit, or drop --parallel.fsdp_unit_blocks")
    if job.parallel.fsdp_symm_mem:
        refusal = symm_mem_refusal(dims, device)
        if refusal:
            raise ConfigError(refusal)
    if tri_state("parallel.ddp_batched_copy", job.parallel.ddp_batched_copy) == "true" and not ddp_batches_copies():
        raise ConfigError(f"parallel.ddp_batched_copy=true needs the batched_grad_copy of torch's "
                          f"DistributedDataParallel, which torch {torch.__version__} does not have: upgrade torch, or "
                          "drop --parallel.ddp_batched_copy")
    if tri_state("parallel.comm_reorder", job.parallel.comm_reorder) == "true" and not compiled:
        raise ConfigError(f"parallel.comm_reorder=true reorders the compiled graphs, and train.compile="
                          f"{job.train.compile} leaves compilation off on {device.type}: set --train.compile=true, "
                          "or drop --parallel.comm_reorder")
    if job.parallel.pp_p2p_channels and dims.pp == 1:
        raise ConfigError(f"parallel.pp_p2p_channels={job.parallel.pp_p2p_channels} sets NCCL's channels for a "
                          f"pipeline's sends and receives, and {layout_name(dims)} has no pipeline (parallel.pp=1): "
                          "drop --parallel.pp_p2p_channels")
    if job.train.residual_dtype == "bf16" and fp32:
        raise ConfigError(f"train.residual_dtype=bf16 keeps the hidden state between blocks in bf16 under bf16 "
                          f"autocast, and this run computes in fp32 (train.dtype={job.train.dtype} on "
                          f"{device.type}): set --train.dtype=bf16, or drop --train.residual_dtype")
    if tri_state("parallel.pp_cast_once", job.parallel.pp_cast_once) == "true":
        check_cast_once(dims, fp32=fp32, float8=job.train.float8)
    if tri_state("train.weight_copies", job.train.weight_copies) == "true":
        refusal = weight_copies_refusal(job, dims, fp32=fp32)
        if refusal:
            raise ConfigError(refusal)


def check_device_choices(job: JobConfig, dims: ParallelDims, device: torch.device) -> None:
    """Refuse the options that the process group, the engine and the optimizer resolve for ``device`` only once
    built (dist.backend, train.cross_entropy, train.adamw_kernel), so that a run refuses them before it starts."""
    if dims.world_size > 1:  # one process starts no process group
        choose_backend(device, job.dist)
    resolve_cross_entropy(job.train.cross_entropy, device, compiled=compile_enabled(job.train.compile, device))
    resolve_adamw_kernel(job, device)


def plan_batch(train: TrainConfig, dims: ParallelDims, shape: ModelShape) -> BatchPlan:
    """train.micro_batch, grad_accum and global_batch over this world's data-parallel ranks; with PP, checked
    against parallel.pp_microbatches (resolved here when 0). The engine and the data loaders use this one plan."""
    batch = resolve_batch(train, dp_size=dims.dp_size, seq_len=shape.seq_len)
    dims.resolve_pipeline_batch(batch.micro_batch * batch.grad_accum, seq_len=batch.seq_len)
    return batch


@dataclass(frozen=True)
class CheckedLayout:
    """A job's layout on one world and device, resolved and checked (:func:`resolve_layout`)."""

    job: JobConfig
    """The job with the parallel options that run (parallel.data_parallel and pp_schedule=auto resolved)."""
    dims: ParallelDims
    batch: BatchPlan
    data_parallel_note: str
    """What parallel.data_parallel chose, for the start-up header ('' when the degrees were given or stay DDP)."""
    schedule_note: str
    """What parallel.pp_schedule=auto chose ('' unless it chose an interleaved schedule)."""

    @property
    def note(self) -> str:
        return " | ".join(n for n in (self.data_parallel_note, self.schedule_note) if n)


def resolve_layout(job: JobConfig, spec: ModelSpec, shape: ModelShape, *, world_size: int, gpus_per_node: int,
                   device: torch.device) -> CheckedLayout:
    """``job``'s layout on ``world_size`` ranks, ``gpus_per_node`` of them per node (0: not known), on ``device``
    (its type is what matters: a machine without GPUs checks a GPU job with ``torch.device('cuda')``): the choices
    the options leave open made, the degrees checked against the world and the model (ParallelDims), the options
    against the layout and the device (:func:`check_layout`, :func:`check_device_choices`), and the batch planned.
    Everything a run refuses before its process group exists except the files and this rank's GPU; ConfigError names
    the option."""
    on_gpu = device.type == "cuda"
    parallel, dp_note = choose_data_parallel(job.parallel, params=spec.count_params(shape), on_gpu=on_gpu,
                                             world_size=world_size)
    auto, schedule_note = choose_pp_schedule(parallel, n_layers=shape.n_layers, on_gpu=on_gpu,
                                             world_size=world_size, cuda_graphs=job.train.cuda_graphs)
    where = {"spec": spec, "shape": shape, "world_size": world_size, "gpus_per_node": gpus_per_node,
             "device": device}
    try:
        return _checked(job, auto, dp_note, schedule_note, **where)
    except ConfigError:
        if not schedule_note:
            raise
        # the step's samples do not split into micro-batches the interleaved schedule takes: 1F1B, as before auto
        return _checked(job, dataclasses.replace(parallel, pp_schedule="1f1b"), dp_note, "", **where)


def _checked(job: JobConfig, parallel: ParallelConfig, dp_note: str, schedule_note: str, *, spec: ModelSpec,
             shape: ModelShape, world_size: int, gpus_per_node: int, device: torch.device) -> CheckedLayout:
    job = dataclasses.replace(job, parallel=parallel)
    dims = ParallelDims.from_config(parallel, world_size=world_size, gpus_per_node=gpus_per_node, model=shape,
                                    spec=spec)
    check_layout(job, spec, shape, dims, device=device, compute_dtype=compute_dtype(job, device))
    check_device_choices(job, dims, device)
    return CheckedLayout(job=job, dims=dims, batch=plan_batch(job.train, dims, shape), data_parallel_note=dp_note,
                         schedule_note=schedule_note)


SYMM_MEM_NCCL = (2, 28)
"""The NCCL release whose all-gathers on symmetric buffers run on the copy engines (zero-CTA policy)."""


def symm_mem_refusal(dims: ParallelDims, device: torch.device, *, nccl: tuple[int, ...] | None = None) -> str | None:
    """Why parallel.fsdp_symm_mem=true cannot serve this run (the error's text), or None where it can. ``nccl``: the
    NCCL version (default: the one torch was built with, on CUDA)."""
    option = "parallel.fsdp_symm_mem=true"
    if not uses_fsdp(dims):
        fix = ("shard the parameters (--parallel.dp_shard=-1)" if dims.world_size > 1 else
               "launch 2 or more ranks with --parallel.dp_shard=-1")
        return (f"{option} gathers FSDP2's parameters through symmetric memory, and {layout_name(dims)} has no FSDP2 "
                f"(parallel.dp_shard=1): {fix}, or drop --parallel.fsdp_symm_mem")
    if device.type != "cuda":
        return (f"{option} needs NCCL on CUDA GPUs, and this run is on {device.type}: drop --parallel.fsdp_symm_mem")
    if not symm_mem_supported():
        return (f"{option} needs FSDP2's symmetric-memory all-gather (torch 2.13's FSDPModule.set_symm_mem_for_comm, "
                f"or a custom all-gather and torch's symmetric memory pool, torch 2.11), which torch "
                f"{torch.__version__} lacks: install a newer torch, or drop --parallel.fsdp_symm_mem")
    if nccl is None and torch.cuda.is_available():
        nccl = tuple(torch.cuda.nccl.version())
    if nccl is not None and tuple(nccl[:2]) < SYMM_MEM_NCCL:
        return (f"{option} needs NCCL {SYMM_MEM_NCCL[0]}.{SYMM_MEM_NCCL[1]} or newer for copy-engine all-gathers, and "
                f"torch uses NCCL {'.'.join(map(str, nccl))}: install a torch built with a newer NCCL, or drop "
                "--parallel.fsdp_symm_mem")
    return None


def use_comm_reorder(job: JobConfig, dims: ParallelDims, device: torch.device) -> bool:
    """parallel.comm_reorder resolved for this run: true where the run compiles (check_layout has refused the rest),
    false, or auto: on for TP with compiled blocks on CUDA GPUs without async TP (its own pass rewrites those
    collectives), where it was measured faster."""
    choice = tri_state("parallel.comm_reorder", job.parallel.comm_reorder)
    if choice != "auto":
        return choice == "true"
    return reorders_by_default(dims, device, compiled=compile_enabled(job.train.compile, device),
                               async_tp=job.parallel.async_tp)


def reorders_by_default(dims: ParallelDims, device: torch.device, *, compiled: bool, async_tp: bool = False) -> bool:
    """Where inductor's reordering of collectives is on by default (meshrun train's parallel.comm_reorder=auto, and
    Session.prepare_model): TP with compiled blocks on CUDA GPUs, without async TP."""
    return device.type == "cuda" and dims.tp > 1 and compiled and not async_tp


AUTO_P2P_CHANNELS = 4
"""parallel.pp_p2p_channels=auto for interleaved schedules: on 2 H200s (1b, PP 2, interleaved1f1b, 2 repeats each,
one call) 67,208 tokens/s per GPU against 65,142 with NCCL's own choice."""


def p2p_channels(job: JobConfig, dims: ParallelDims, *, cuda: bool) -> int:
    """parallel.pp_p2p_channels resolved: the number given, or under auto 4 for schedules that run several stages
    per rank on CUDA GPUs (their early receives run beside compute), 0 (NCCL's own choice) otherwise."""
    if job.parallel.pp_p2p_channels:
        return job.parallel.pp_p2p_channels
    return AUTO_P2P_CHANNELS if cuda and several_stages_per_rank(dims) else 0


def use_cast_once(job: JobConfig, dims: ParallelDims, device: torch.device, compute_dtype: torch.dtype | None) -> bool:
    """parallel.pp_cast_once resolved for this run: true (check_layout has refused the layouts it cannot serve),
    false, or auto: on where it can serve on a CUDA GPU, where it was measured faster."""
    choice = tri_state("parallel.pp_cast_once", job.parallel.pp_cast_once)  # a JobConfig built in Python: True too
    if choice != "auto":
        return choice == "true"
    return device.type == "cuda" and cast_once_refusal(dims, fp32=compute_dtype in (None, torch.float32),
                                                       float8=job.train.float8) is None


def use_weight_copies(job: JobConfig, dims: ParallelDims, device: torch.device,
                      compute_dtype: torch.dtype | None, *, grad_accum: int = 1) -> bool:
    """train.weight_copies resolved for this run: true (check_layout has refused the layouts it cannot serve),
    false, or auto: on for CUDA GPUs where meshrun's Triton AdamW writes the copies (with torch's AdamW they would be
    cast once a step, as autocast casts them), in one process and under DDP on the GPUs of one node with one
    micro-batch per step and torch's ``Tensor.grad_dtype`` (2.10 and newer), which lets the fp32 weights take DDP's
    bf16 gradients as they are. Measured faster in both (124m: 1.027x in one process, about 1.02x under DDP on 2
    H200s); between nodes the bf16 sums were not measured."""
    from meshrun.parallel.kernels import resolve_adamw_kernel  # kernels imports this module
    choice = tri_state("train.weight_copies", job.train.weight_copies)
    if choice != "auto":
        return choice == "true"
    # under DDP with several micro-batches a step each one is all-reduced (DDP's no_sync would add them in bf16):
    # more collectives, not measured, so auto leaves that to train.weight_copies=true
    one_node = dims.world_size == 1 or (0 < dims.world_size <= dims.gpus_per_node and grad_accum == 1
                                        and hasattr(torch.Tensor, "grad_dtype"))
    return (device.type == "cuda" and one_node and resolve_adamw_kernel(job, device) == "triton"
            and weight_copies_refusal(job, dims, fp32=compute_dtype in (None, torch.float32)) is None)


def weight_copies_refusal(job: JobConfig, dims: ParallelDims, *, fp32: bool) -> str | None:
    """Why train.weight_copies cannot serve this run (the error's text), or None where it can: one process, or
    DDP, whose buckets then hold the copies' bf16 gradients and sum them in bf16."""
    option = "train.weight_copies=true"
    if dims.world_size > 1 and not is_local(dims):  # DDP alone holds the whole model on every rank
        fix = ("parallel.pp_cast_once gives a pipeline's stages such copies" if dims.pp > 1 else
               "FSDP2's sharding and TP's splits follow the parameters themselves")
        return (f"{option} runs in one process or under DDP, not for {layout_name(dims)} over {dims.world_size} "
                f"ranks ({fix}); drop --train.weight_copies")
    if fp32:
        return (f"{option} copies weights for bf16 compute, and this run computes in fp32: set --train.dtype=bf16, "
                "or drop --train.weight_copies")
    if job.train.float8:
        return (f"{option}: train.float8 layers cast their fp32 weights to float8 themselves; drop one of "
                "--train.float8 and --train.weight_copies")
    if job.replicas.groups:
        return (f"{option}: replica groups (replicas.groups) average the fp32 gradients across groups; drop "
                "--train.weight_copies")
    if dims.world_size > 1 and job.parallel.grad_reduce_dtype == "fp32":
        return (f"{option} under DDP puts the linear layers' bf16 gradients in DDP's buckets, which sum them in "
                "bf16, and parallel.grad_reduce_dtype=fp32 asks for fp32: drop one of --train.weight_copies and "
                "--parallel.grad_reduce_dtype")
    return None


def check_cast_once(dims: ParallelDims, *, fp32: bool, float8: bool) -> None:
    """Refuse parallel.pp_cast_once=true where its copies would not be used or their gradients would not be summed."""
    refusal = cast_once_refusal(dims, fp32=fp32, float8=float8)
    if refusal:
        raise ConfigError(refusal)


def cast_once_refusal(dims: ParallelDims, *, fp32: bool, float8: bool) -> str | None:
    """Why parallel.pp_cast_once cannot serve this layout (the error's text), or None where it can."""
    option = "parallel.pp_cast_once=true"
    if dims.pp == 1:
        return (f"{option} applies to pipeline layouts (parallel.pp > 1), not {layout_name(dims)}, which runs each "
                "weight once per micro-batch without a pipeline's schedule; drop --parallel.pp_cast_once")
    if fp32:
        return (f"{option} copies weights for bf16 compute, and this run computes in fp32: set --train.dtype=bf16, "
                "or drop --parallel.pp_cast_once")
    if uses_fsdp(dims):
        return (f"{option}: FSDP2 already gives {layout_name(dims)} its parameters in bf16 (its mixed-precision "
                "policy); drop --parallel.pp_cast_once")
    if dims.pp_schedule == "interleavedzb":
        return (f"{option}: parallel.pp_schedule=interleavedzb writes weight gradients outside autograd's "
                "accumulation, which the copies' gradients go through; set --parallel.pp_schedule=interleaved1f1b, "
                "or drop --parallel.pp_cast_once")
    if float8:
        return (f"{option}: train.float8 layers cast their fp32 weights to float8 themselves; drop one of "
                "--train.float8 and --parallel.pp_cast_once")
    return None


def check_chunked_loss(loss: str, spec: ModelSpec, *, dims: ParallelDims, local: bool) -> None:
    """Refuse train.loss=chunked where it cannot run: outside one process and DDP, or for a model without the hooks
    that give the output head's input and weight."""
    if loss != "chunked":
        return
    if not local:
        raise ConfigError(f"train.loss=chunked runs for one process and DDP only, not for {layout_name(dims)}; "
                          "drop --train.loss=chunked (the other layouts compile the full loss, without fp32 logits)")
    if spec.hidden_states is None or spec.head_weight is None:
        raise ConfigError(f"train.loss=chunked: model.arch={spec.arch!r} does not give its output head's input and "
                          "weight (ModelSpec.hidden_states, head_weight); drop --train.loss=chunked")


def check_cuda_graphs(device: torch.device, *, compiled: bool, supported: bool, layout: str) -> None:
    """Refuse train.cuda_graphs where it cannot run, naming what to change (``supported``: graphs_supported)."""
    require_compiled_cuda("train.cuda_graphs", cuda_why="it records CUDA graphs",
                          compile_why="graphs what torch.compile produces", device=device, compiled=compiled)
    if not supported:
        raise ConfigError(f"train.cuda_graphs=true runs for one process, DDP, TP, PP and FSDP2 with the whole "
                          f"model one unit (no FSDP2 block by block, context parallelism or async TP), not for "
                          f"{layout}, whose per-block hooks and collectives run between the compiled graphs; drop "
                          "--train.cuda_graphs, or for pure data parallelism set --parallel.fsdp_unit_blocks=-1 "
                          "(FSDP2) or --parallel.data_parallel=ddp")
