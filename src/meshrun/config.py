"""Typed job configuration: nested dataclasses, loaded from TOML and overridden with ``--section.key=value``.

Every field carries a one-line docstring. Checks that involve more than one field live in
:meth:`JobConfig.validate` (static checks) and :func:`resolve_batch` (checks that need the world size), and they
raise :class:`ConfigError` naming the option to change and the values that were given.

This module holds the dataclasses and is the one to import from: it re-exports the validation tables
(:mod:`meshrun.config_checks`: the choices, :class:`ConfigError`, :func:`resolve_batch`) and the loading
functions (:mod:`meshrun.config_load`: :func:`load_config`, :func:`set_option`, :func:`join_overrides`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from meshrun.config_checks import (  # noqa: F401 - re-exported: `from meshrun.config import X` for all of them
    ACTIVATION_CHECKPOINT_MODES, ADAMW_KERNELS, ATTENTION_BACKENDS, ActivationCheckpointMode, AdamWKernel,
    AttentionBackend, BACKENDS, Backend, BatchPlan, COMPILE_MODES, CROSS_ENTROPY_KERNELS, CompileMode, ConfigError,
    CrossEntropyKernel, DATA_FORMATS,
    DATA_PARALLEL_MODES, DDP_GRAPH_MODES, DEVICE_KINDS, DataFormat, DataParallelMode, DdpGraphMode, DeviceKind,
    HANG_ACTIONS, HangAction, LOSS_MODES, LR_SCHEDULES, LossMode, LrSchedule, MULTI_STAGE_SCHEDULES,
    MULTIPLE_OF_PP_SCHEDULES, NONFINITE_MODES, NonfiniteMode, PIPELINE_BALANCES, PIPELINE_SCHEDULES, PROGRESS_MODES,
    PipelineBalance, PipelineSchedule, ProgressMode, REDUCE_DTYPES, RESIDUAL_DTYPES, ReduceDtype, ResidualDtype,
    TOKEN_DTYPES, TRACKERS, TRAIN_DTYPES, TokenDtype, TrackerName, TrainDtype, resolve_batch, validate_job)
from meshrun.config_load import join_overrides, load_config, set_option, to_toml  # noqa: F401 - re-exported
from meshrun.models.shape import ModelShape


@dataclass
class ModelConfig(ModelShape):
    """Which registered model, which named size, and overrides of its shape.

    The shape fields are ModelShape's (meshrun/models/shape.py, the one schema every registered transformer
    builds from); here 0 means "the named size's value". meshrun.models.build resolves them by field name."""

    arch: str = "gpt"
    """Registered model (meshrun.register_model); 'module:name' imports module first. Built in: gpt."""
    name: str = "tiny"
    """Named size of model.arch (gpt: tiny, small, 124m, 350m, 1b). Fields left at 0 take the named size's value."""


@dataclass
class DataConfig:
    """Where the tokens come from."""

    source: str = "stdlib"
    """'stdlib' (the Python standard library's source, byte-level), a text file or folder, or a token file."""
    format: DataFormat = "auto"
    """'auto', 'text' (bytes as tokens) or 'tokens' (a flat uint16/uint32 array, memory-mapped)."""
    token_dtype: TokenDtype = "uint16"
    """dtype of a token file: uint16 or uint32."""
    val_fraction: float = 0.02
    """Share of the corpus held out for validation (by file for text, by tail for token files)."""
    max_bytes: int = 0
    """Read at most this many bytes of a text corpus (0 = all); keeps CPU runs short."""
    num_workers: int = 0
    """DataLoader worker processes per rank that index, collate and pin the next batches while the GPU trains
    (0: the training process does it between steps, which costs host time a small, fast model may not have)."""


@dataclass
class TrainConfig:
    """The optimisation loop."""

    steps: int = 300
    """Optimizer steps to run."""
    micro_batch: int = 8
    """Samples per micro-batch on each data-parallel rank (B_local)."""
    global_batch: int = 0
    """Samples per optimizer step over all ranks (B_global); 0 means micro_batch x dp ranks x grad_accum."""
    grad_accum: int = 0
    """Micro-batches per optimizer step (A); 0 derives it from global_batch, or 1."""
    lr: float = 3e-3
    """Peak learning rate."""
    min_lr: float = 3e-4
    """Learning rate at the end of the decay."""
    warmup_steps: int = 20
    """Linear warm-up steps."""
    lr_schedule: LrSchedule = "cosine"
    """After warm-up: cosine (decay to min_lr over train.steps) or wsd (constant, then a linear decay over the last
    train.decay_fraction; extends to more steps without a jump, docs/training.md)."""
    decay_fraction: float = 0.2
    """lr_schedule=wsd: the final fraction of train.steps over which the rate decays to min_lr."""
    weight_decay: float = 0.1
    """AdamW weight decay (not applied to norms and biases)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables."""
    nonfinite: NonfiniteMode = "skip"
    """A step whose gradient norm is NaN or inf: skip (no update, a warning naming the step and rank), stop (no
    update, and the run ends with an error at the next log step), or off (no check)."""
    seed: int = 1234
    """Base seed. Data order depends only on it and the epoch; rank r's streams use seed + r."""
    deterministic: bool = False
    """Use deterministic algorithms only (slower; torch.use_deterministic_algorithms)."""
    dtype: TrainDtype = "auto"
    """Compute dtype: auto (bf16 on GPUs of compute capability 8.0 and newer; fp32 on older GPUs, which have no bf16
    matmuls, and on CPU), fp32 or bf16."""
    residual_dtype: ResidualDtype = "auto"
    """The dtype of the hidden state between blocks (the residual stream) when bf16 autocast runs (one process, DDP,
    TP, PP): fp32 (autocast leaves the embedding's output and the sums after each block in the parameters' fp32) or
    bf16 (each block's input is cast to bf16, so the stream, its gradient and a pipeline's sends are bf16: half the
    bytes for the norms and additions between the matmuls, as torchtitan and Megatron-LM run; needs bf16 compute).
    auto: bf16 for one process, DDP, TP and pipelines computing in bf16 (1.03-1.06x on one H200; 1b on 2 H200s:
    TP 2 1.03x, PP 2 1.02x), fp32 with context parallelism and float8 (not measured) and for fp32 compute. FSDP2
    computes with bf16 parameters and keeps the stream in bf16 either way."""
    compile: str = "auto"
    """torch.compile the model: auto (on for CUDA GPUs of compute capability 7.0 and newer, which Triton supports;
    off on older GPUs and on CPU, where compiling costs more than it saves), true or false."""
    compile_mode: CompileMode = "default"
    """How inductor compiles: default, or max-autotune (each matmul shape benchmarked against Triton GEMM templates,
    pointwise work fused into them where one wins, and the Triton kernels' launch settings tuned: minutes more of
    compilation, cached on disk, for a step that is at times faster: 1b FSDP2 1.4-3.9% on 2 H200s but 1.3% slower
    on 2 H100s, 124m DDP and 1b TP level; docs/performance.md). CUDA graphs stay as train.cuda_graphs decides.
    Needs compilation (train.compile)."""
    cuda_graphs: str = "auto"
    """Compile with CUDA graphs (torch.compile mode reduce-overhead): each compiled graph is recorded once and
    replayed, so the host no longer launches every kernel. One process and DDP record the whole step; TP and PP
    without FSDP or context parallelism record each block (TP's all-reduces inside, the pipeline's sends between;
    not the schedules with several stages per rank, which trained wrongly as graphs); FSDP2 with the whole model one
    unit (parallel.fsdp_unit_blocks) records the model's forward and backward, its all-gather and reduce-scatter
    outside. auto: on for those layouts when compiled on CUDA GPUs with the full loss, without float8, TP without
    sequence parallelism, PP of up to 4 stages with the 1f1b schedule or 2 with gpipe, and TP with PP of 2 stages
    with 1f1b (the combinations tested on GPUs), off elsewhere; true refuses the layouts it cannot serve; false
    launches every kernel."""
    gc_every: int = 50
    """Python's garbage collector runs every N optimizer steps (young generations only) instead of whenever
    allocations trigger it, with the objects alive after the first step frozen out of its scans; 0 leaves Python's
    automatic collection on."""
    eval_every: int = 100
    """Evaluate on the validation split every N steps (0 disables)."""
    eval_samples: int = 256
    """Validation samples per evaluation over all ranks together (0 = the whole validation split)."""
    log_every: int = 10
    """Print and record metrics every N steps. Reading them back waits for the GPU; in one process the record is
    written after the next step is queued, so the GPU never runs dry for it (train/log_step.py). A record's tokens/s
    and step time are over its own steps: from the end of the previous log step to the end of its own, evaluations
    and checkpoint saves left out."""
    fused_optimizer: bool = True
    """Use a fused AdamW kernel (one pass over each parameter) where the device has one (train.adamw_kernel);
    false: torch's for-each AdamW (on CPU, where torch has no for-each kernels, its single-tensor one)."""
    adamw_kernel: AdamWKernel = "auto"
    """The fused AdamW's kernel: auto (on CUDA GPUs with Triton meshrun's, one launch over all parameters that
    leaves the gradients unwritten, where torch's fused kernel writes the clipped gradients back: the 1b training
    step ran 1.020x torch's on an H200; torch's elsewhere), triton, or torch (torch's fused AdamW)."""
    weight_copies: str = "auto"
    """bf16 compute in one process or under DDP: the linear layers hold bf16 copies of their weights, which meshrun's
    Triton AdamW writes as it updates the fp32 weights, so no step casts the weights (autocast casts each weight in
    every forward pass, a read of 4 bytes and a write of 2 per parameter), and with one micro-batch a step (no
    gradient accumulation) their gradients stay bf16 (no cast of them to fp32, 2 bytes less for the optimizer to
    read; torch 2.10 and newer). The arithmetic is autocast's: the same bf16 weights in the matmuls, the gradients'
    same values. Under DDP the copies are DDP's parameters, so their gradients are all-reduced in bf16 (half the
    bytes, each sum rounded to bf16), whatever parallel.grad_reduce_dtype says for the others. A weight shared
    with an embedding keeps autocast's cast. auto: on with the Triton AdamW (train.adamw_kernel) on CUDA GPUs, for
    one process (on one H200 the 1b step ran 1.026x and the 124m step 1.027x autocast's casts, at the same peak
    memory) and for DDP on the GPUs of one node with one micro-batch a step on torch 2.10 and newer (124m on 2
    H200s: 1.02x; losses within 0.1% of fp32 all-reduce's in a GPU test); true serves DDP with several micro-batches
    a step too, all-reducing each one (DDP's no_sync would add them in bf16) and adding them in fp32, as a resume
    that keeps the checkpoint's global batch on fewer ranks does under auto, and refuses the layouts it cannot
    serve (FSDP, TP, pipelines, which have parallel.pp_cast_once; DDP with parallel.grad_reduce_dtype=fp32; fp32
    compute, float8, replica groups); false: autocast casts."""
    loss: LossMode = "full"
    """full (the logits of the whole micro-batch at once) or chunked (the output head and cross-entropy a few
    thousand tokens at a time: the B x T x V logits never exist whole; one process and DDP)."""
    float8: bool = False
    """Run the blocks' matmuls in float8 through torchao (Hopper or newer; the .[float8] extra)."""
    attention: AttentionBackend = "auto"
    """Attention kernel: auto (cuDNN first on Hopper and newer GPUs, else torch's order), cudnn, flash, efficient,
    math, or default (torch's own order)."""
    cross_entropy: CrossEntropyKernel = "auto"
    """The loss's kernels: auto (in a compiled step on CUDA GPUs meshrun's Triton kernel for the forward, one read of
    the logits at 4.0 TB/s against 1.5 for inductor's on an H200, 1.017x on the 124m step; torch's cross-entropy on
    CPU, without compile and in evaluations), triton (a compiled step on a CUDA GPU) or torch (F.cross_entropy,
    compiled with the model where it is). TP's loss on vocabulary shards keeps its own."""


@dataclass
class ParallelConfig:
    """How ranks are arranged on the device mesh. Degrees of -1 are inferred from the world size."""

    dp_replicate: int = -1
    """Data-parallel replicas (DDP, or the replicate dimension of HSDP). -1: the ranks the other axes leave, or 1
    when dp_shard is -1 too (FSDP2 over them)."""
    dp_shard: int = 1
    """FSDP2 shard degree (1 = no sharding)."""
    tp: int = 1
    """Tensor-parallel degree (innermost, inside a node)."""
    pp: int = 1
    """Pipeline stages (outermost, across nodes)."""
    cp: int = 1
    """Context parallelism: each sequence split over cp ranks, attention as a ring (CUDA; docs/parallelism.md)."""
    pp_schedule: PipelineSchedule = "auto"
    """Pipeline schedule: auto (interleaved1f1b on GPUs for a pipeline without TP, FSDP or CP where the layers and
    micro-batches allow it: 1.024-1.027x 1f1b with 8 micro-batches for the 1b model on 2 H200s, and 0.996x of FSDP2
    with the 4 that pp_microbatches=0 now chooses; 1f1b otherwise),
    gpipe, 1f1b, or with pp_virtual_stages per rank interleaved1f1b, interleavedzb (zero bubble; compiled blocks
    keep their linear layers eager, so that each backward can split: 0.42x of 1f1b for the 1b model on 2 H200s) or
    loopedbfs (docs/parallelism.md)."""
    pp_microbatches: int = 0
    """Pipeline micro-batches per step; 0 chooses, of the counts that divide the step's samples (micro_batch x
    grad_accum per data-parallel rank), are at least pp and keep at least 4096 tokens each, the one whose bubble
    and fixed cost per micro-batch (about 1000 tokens' work) make the shortest step: 4 micro-batches of 4 samples
    for the 1b model's 16 x 2048 on 2 ranks of 2 stages (0.996x of FSDP2 on 2 H200s, against 0.947x with 8), 8 with
    1F1B on 4 ranks (docs/parallelism.md, Bubble)."""
    pp_virtual_stages: int = 2
    """Stages per rank for interleaved1f1b, interleavedzb and loopedbfs."""
    pp_balance: PipelineBalance = "cost"
    """Cut the blocks into stages so each stage's estimated FLOPs are even (cost: the last stage, which also runs the
    output head and loss, gets fewer blocks) or give every stage the same block count (blocks)."""
    pp_cast_once: str = "auto"
    """With bf16 compute: each stage's linear layers hold bf16 copies of their weights, made once per optimizer step,
    instead of casting the fp32 weights again for every micro-batch, and each micro-batch's weight gradient is added
    straight into the fp32 one (autocast's arithmetic, bitwise). Pipeline layouts without FSDP, with a schedule that
    runs each backward whole (not interleavedzb), without float8. auto: on for those layouts on CUDA GPUs (1b, PP 2
    on 2 H200s: 1.027x the per-micro-batch casts, 1 GiB less memory), off elsewhere; true refuses the layouts it
    cannot serve; false casts per micro-batch."""
    pp_p2p_channels: int = 0
    """NCCL channels for the pipeline's sends and receives (NCCL_MAX_P2P_NCHANNELS, set for the training processes
    before their process groups exist). Fewer channels take fewer of the GPU's SMs from the matmuls they run beside:
    interleaved1f1b posts its receives early, and they run beside compute for much of the step. 0 (auto): 4 on CUDA
    GPUs for the schedules that run several stages per rank (1b, PP 2, interleaved1f1b on 2 H200s: 1.032x NCCL's
    own choice), NCCL's own choice otherwise, and a NCCL_MAX_P2P_NCHANNELS already in the environment is kept; a
    number sets it for every schedule. Gloo ignores it."""
    sequence_parallel: bool = False
    """Shard norms and dropout along the sequence in TP regions."""
    async_tp: bool = False
    """Overlap TP's all-gathers and reduce-scatters with the matmuls they feed (inductor micro-pipelining over
    symmetric memory); needs parallel.sequence_parallel, compiled blocks and CUDA GPUs."""
    comm_reorder: str = "auto"
    """Let inductor reorder each compiled graph that holds collectives so that they run beside compute that does not
    need their result: TP's all-reduce of a block's input gradient beside the weight gradients (torch's
    reorder_compute_for_overlap, sink_waits and raise_comms passes). auto: on for TP with compiled blocks on CUDA
    GPUs without async TP (1b, TP 2 on 2 H200s: 1.012-1.029x in three calls), off elsewhere; true: wherever the run
    compiles (graphs without collectives are left as they were); false: inductor's own order."""
    data_parallel: DataParallelMode = "auto"
    """How the default pure data-parallel layout runs (dp_replicate=-1 with dp_shard=1): ddp (every rank keeps the
    whole model and optimizer), fsdp (FSDP2 shards parameters, gradients and optimizer state over the ranks), or
    auto: fsdp on GPUs for models of 1B parameters or more, ddp otherwise. Explicit degrees always win."""
    fsdp_reshard_after_forward: str = "auto"
    """Free each block's gathered parameters after its forward (true) or keep them for backward (false: one
    all-gather per step instead of two, at the memory of the whole model in the compute dtype). auto keeps them
    when they take at most 1/16 of the GPU's memory."""
    fsdp_unit_blocks: int = 0
    """Consecutive blocks FSDP2 shards as one unit: one all-gather and one reduce-scatter per unit instead of per
    block. Fewer, larger collectives suit small models, whose per-block collectives are latency-bound; the cost is
    the gathered parameters of a whole unit in memory at once. -1: the whole model is one unit (embedding, blocks
    and head gathered together) and, when compiled, its forward is compiled as one graph instead of block by block,
    and recorded as CUDA graphs where train.cuda_graphs is on: the fewest hooks and compiled regions for the host to
    run through each step (FSDP/HSDP without tp, pp or cp). 0 (auto), on GPUs for models under 350M parameters: -1
    where that step runs as CUDA graphs (compiled, FSDP/HSDP alone, what train.cuda_graphs=auto covers), else all
    blocks in one unit; for larger models as many blocks per unit as make 150M parameters (one where a block is
    that big), because the host spends about 2 ms in each unit's forward whatever its size (3 blocks a unit for the
    1b model: 1.117x the plain DDP script on 2 H200s, steady from run to run); one block per unit on CPU."""
    fsdp_prefetch: int = 0
    """How many FSDP2 units ahead each unit's forward gathers: their all-gathers are issued from the host right
    after the unit's own, a unit earlier than FSDP2 issues them (when the host reaches each unit), and as many
    units behind in backward. For hosts that are only just ahead of the GPU (slow CPUs, a profiler): there each
    all-gather starts late and the other ranks' all-gathers wait for it, holding SMs beside the matmuls. 0: FSDP2's
    own order. No effect where the whole model is one unit (parallel.fsdp_unit_blocks=-1). On 2 H200s (1b,
    GPU-bound) 1 ahead ran as fast as 0 (71.2k against 72.0k and 70.2k against 69.9k tokens/s per GPU, inside both
    rows' spreads), so it stays off by default."""
    fsdp_symm_mem: bool = False
    """FSDP2 gathers parameters into symmetric-memory buffers (torch's FSDPModule.set_symm_mem_for_comm), and
    NCCL runs with its zero-CTA policy (NCCL_CTA_POLICY=2 for the training processes, unless already set) so that
    within a node those all-gathers are done by the GPU's copy engines instead of kernels on its SMs: the matmuls
    they overlap keep every SM. Needs FSDP/HSDP on CUDA GPUs, NCCL 2.28 or newer and torch 2.11 or newer
    (2.13's FSDPModule.set_symm_mem_for_comm, before it FSDP2's custom all-gather on torch's symmetric memory
    pool). The policy is NCCL's for every communicator of the process; collectives
    that the copy engines cannot do run as before. Off by default: on 2 H200s (1b, torch 2.11, whose path is the
    custom all-gather) it trained bitwise like NCCL's own all-gather and ran level with the defaults of then (1.026x
    and 0.987x in two calls), its all-gathers' added host work (the forward's host time 36-55 ms against 37-41)
    costing about what the freed SMs gain."""
    ddp_overlap: bool = False
    """With compile: compile the DDP-wrapped step instead of wrapping the compiled step in DDP. Either way, where
    parallel.ddp_graph splits the step at DDP's bucket boundaries, each bucket's all-reduce overlaps the rest of
    backward."""
    ddp_bucket_mb: int = 0
    """DDP gradient bucket size in MiB (all-reduce granularity). 0 (auto): 100 when the compiled step runs as CUDA
    graphs split at the buckets (fewer, larger buckets mean fewer graphs; measured faster than 25 on GPUs), torch's
    own 25 otherwise."""
    ddp_batched_copy: str = "auto"
    """DDP copies each gradient into its bucket, divided by the world size, in one kernel launch per parameter as the
    backward pass produces it (about 75 small launches per 100 MiB bucket for the 124m model). true has torch's DDP
    defer those copies and make them, once a bucket is full, with one ``_foreach_copy_`` and one division of the
    flat bucket (DistributedDataParallel's ``batched_grad_copy``, in torch releases that have it; the values are
    the same sums, divided once per bucket). auto: off, until it is measured against the per-parameter copies on
    GPUs (torch 2.13 has it, 2.11 does not); true refuses a torch without it."""
    ddp_graph: DdpGraphMode = "auto"
    """With compile: split (dynamo cuts the compiled step at DDP's bucket boundaries, so each bucket's all-reduce
    overlaps the rest of backward), whole (one forward and one backward graph, DDP's all-reduces after backward:
    fewer graphs for the host to enter, the all-reduce exposed), or auto: split when the step runs as CUDA graphs
    or replicas cross nodes, whole for launched kernels within one node."""
    grad_reduce_dtype: ReduceDtype = "auto"
    """The dtype data parallelism sums gradients in across ranks: fp32, or bf16 (half the bytes; each rank's
    gradients are reduced in bf16, and the result cast back to the parameters' dtype). auto: bf16 for FSDP2 without
    replicas, computing in bf16 on GPUs of one node, one micro-batch per step (the 1b model on 2 H200s ran
    1.02-1.03x fp32 reduction; losses within 0.1% of fp32's in a GPU test), fp32 otherwise (DDP, HSDP, several
    nodes, gradient accumulation or a pipeline, where FSDP2 would add the micro-batches' gradients in bf16, fp32
    compute, CPU). DDP uses torch's bf16 compression hook, FSDP2 and HSDP their mixed-precision reduce dtype.
    Under DDP, train.weight_copies (on by default on the GPUs of one node) sums the linear layers' gradients in bf16
    anyway, without the hook's casts; fp32 here then turns the copies off.
    Layouts without data parallelism reduce nothing and ignore it; the sum across replica groups (replicas.groups)
    stays fp32."""
    activation_checkpoint: ActivationCheckpointMode = "none"
    """none, selective or full."""
    allow_tp_across_nodes: bool = False
    """Permit tp larger than the GPUs of one node."""


@dataclass
class DistConfig:
    """Process group and device."""

    backend: Backend = "auto"
    """auto (nccl with CUDA, else gloo), nccl or gloo."""
    device: DeviceKind = "auto"
    """auto, cpu or cuda."""
    init_timeout_s: float = 120.0
    """Seconds to wait for every rank at the first contact before failing with the address tried."""
    timeout_s: float = 600.0
    """Collective timeout during training; a hang fails after this with the rank named."""


@dataclass
class CheckpointConfig:
    """Sharded checkpoints."""

    dir: str = ""
    """Checkpoint folder, a path or an s3:// or gs:// URL; empty means <run.dir>/checkpoints."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """fsspec options for an s3:// or gs:// checkpoint.dir (endpoint_url, profile, project, ...); keep secrets in
    the environment: the config is saved with the run."""
    interval_steps: int = 0
    """Save every N steps (0 = only by time or at the end)."""
    interval_minutes: float = 0.0
    """Save when this many minutes have passed since the last save (0 = off)."""
    keep_last: int = 3
    """Keep the newest K complete checkpoints."""
    keep_every: int = 0
    """Also keep every checkpoint whose step is a multiple of N (0 = off)."""
    resume: str = "auto"
    """auto (newest valid), none, or a checkpoint path."""
    strict: bool = False
    """Refuse to fall back to an older checkpoint when the newest one is damaged."""
    async_save: bool = False
    """Stage to CPU and write in the background."""
    final: bool = True
    """Save on normal exit and on SIGTERM."""
    timeout_s: float = 1800.0
    """Seconds a rank waits for the others inside a save or load before failing with the missing ranks named."""
    signal_grace_s: float = 30.0
    """After SIGTERM/SIGUSR1, repeats within this many seconds are ignored (docs/fault_tolerance.md)."""


@dataclass
class HealthConfig:
    """Checks that make failures and slow ranks loud."""

    check_versions: bool = True
    """Compare code and package versions of every node at start and refuse to train when they differ."""
    straggler_threshold: float = 1.5
    """Name a rank whose working time per step exceeds the others' median by this ratio, at least 1 (0 disables)."""
    straggler_gemm_check: bool = True
    """When a straggler is named, re-run a short GEMM on every rank to tell a slow GPU from slow data or other causes."""
    hang_timeout_s: float = 300.0
    """Report a rank that made no progress for this many seconds, naming it and where the others wait (0 disables;
    negative values are refused)."""
    hang_action: HangAction = "exit"
    """After a hang report: exit (every rank ends with code 124, the verdict in the launcher's summary) or report
    (log it and keep running until dist.timeout_s)."""


@dataclass
class RunConfig:
    """Where results go."""

    dir: str = "runs/default"
    """Run folder: resolved config, metrics.jsonl, rank logs, checkpoints, profiler traces."""
    fresh: bool = False
    """Start a new run, not resume: an earlier run in run.dir is moved to <run.dir>.N first (nothing is deleted);
    an elastic restart of this job continues the new run. `meshrun train --fresh` sets it."""
    tensorboard: bool = False
    """Also write TensorBoard event files (needs the tensorboard package); the same as run.tracker=tensorboard."""
    tracker: str = "none"
    """Experiment trackers that rank 0 logs to: none, or one or a comma list of tensorboard, wandb, mlflow (each an
    extra of meshrun), e.g. mlflow,tensorboard."""
    tracker_project: str = "meshrun"
    """W&B project or MLflow experiment name."""
    tracker_uri: str = ""
    """MLflow tracking URI (default: MLFLOW_TRACKING_URI, else a file store in <run.dir>/mlruns); W&B ignores it."""
    system_sample_s: float = 1.0
    """Seconds between readings of each node's GPUs, CPU, memory and network (a thread off the training loop);
    0 = no system metrics."""
    prometheus_port: int = 0
    """Each node serves its metrics for Prometheus from this port (the next free one when taken); 0 = off."""
    prometheus_addr: str = ""
    """Address the Prometheus endpoint binds to (default: the address meshrun launch chose for the node, else
    127.0.0.1); 0.0.0.0 serves every interface."""
    progress: ProgressMode = "auto"
    """auto (a live bar on a terminal, log lines otherwise), bar, or lines."""
    print_config: bool = True
    """Print the resolved config at start, a line per section (false: only the path of <run.dir>/config.toml)."""
    profile_steps: str = ""
    """Optimizer steps to record with the torch profiler, e.g. 20-22 or 20 (counted from 1); empty = off."""
    profile_ranks: str = "0"
    """Ranks that record with run.profile_steps (and run.profile_on_slowdown): all, or a comma list such as 0,3."""
    profile_on_slowdown: float = 0.0
    """Record 2 steps with the torch profiler on run.profile_ranks when a logged interval runs this fraction under the
    tokens/s of the run's earlier intervals (their median), e.g. 0.05; once per run, into
    <run.dir>/profile/slowdown_<first>-<last>/; 0 = off."""

    def profile_window(self) -> tuple[int, int] | None:
        """(first, last) step of run.profile_steps, both recorded; None when profiling is off."""
        text = self.profile_steps.strip()
        if not text:
            return None
        first, sep, last = text.partition("-")
        if not (first.isdecimal() and (last.isdecimal() or not sep)):
            raise ConfigError(f"run.profile_steps={self.profile_steps!r} is not a step or a range such as 20-22")
        window = int(first), int(last if sep else first)
        if not 1 <= window[0] <= window[1]:
            raise ConfigError(f"run.profile_steps={self.profile_steps!r}: the first step must be >= 1 and not after "
                              "the last, e.g. 20-22")
        return window

    def profiled_ranks(self) -> frozenset[int] | None:
        """The ranks in run.profile_ranks; None means all."""
        text = self.profile_ranks.strip()
        if text == "all":
            return None
        ranks = [part.strip() for part in text.split(",")]
        if not all(rank.isdecimal() for rank in ranks):
            raise ConfigError(f"run.profile_ranks={self.profile_ranks!r} is not 'all' or a comma list of ranks "
                              "such as 0,3")
        return frozenset(int(rank) for rank in ranks)


@dataclass
class ReplicaConfig:
    """Replica groups joined by torchft: several whole jobs of this layout that survive the loss of one
    (docs/fault_tolerance.md)."""

    groups: int = 0
    """Replica groups in the job (0 = off); each reads its own share of the data."""
    group: int = 0
    """This group's id, 0 .. groups-1."""
    lighthouse: str = ""
    """host:port of the torchft lighthouse (`meshrun lighthouse`)."""
    min_groups: int = 1
    """Live groups a step needs to commit."""
    timeout_s: float = 30.0
    """Limit of a cross-group all-reduce, commit vote and weight transfer to a healing group."""
    quorum_timeout_s: float = 60.0
    """Limit of one quorum (a lost lighthouse stops every group after it)."""
    connect_timeout_s: float = 10.0
    """How long a group tries to reach the lighthouse at start before it stops with one line."""

    def check(self) -> None:
        if self.groups < 0 or (self.groups and not 0 <= self.group < self.groups):
            raise ConfigError(f"replicas.group={self.group} with replicas.groups={self.groups}: give groups >= 1 "
                              "and a group id from 0 to groups-1 (groups=0 turns replica groups off)")
        if self.groups and not self.lighthouse:
            raise ConfigError("replicas.groups is set but replicas.lighthouse is empty: start `meshrun lighthouse` "
                              "and pass its address, e.g. --replicas.lighthouse=10.0.0.5:29510")
        if not 1 <= self.min_groups <= max(self.groups, 1):
            raise ConfigError(f"replicas.min_groups={self.min_groups}: give 1 .. replicas.groups ({self.groups})")


@dataclass
class JobConfig:
    """The whole job."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    run: RunConfig = field(default_factory=RunConfig)
    replicas: ReplicaConfig = field(default_factory=ReplicaConfig)

    def validate(self) -> None:
        """Static checks of fields against each other; raises ConfigError naming the option
        (:func:`meshrun.config_checks.validate_job`)."""
        validate_job(self)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        return to_toml(self)
