"""Typed job configuration: nested dataclasses, loaded from TOML and overridden with ``--section.key=value``.

Every field carries a one-line docstring. Checks that involve more than one field live in
:meth:`JobConfig.validate` (static checks) and :func:`resolve_batch` (checks that need the world size), and they
raise :class:`ConfigError` naming the option to change and the values that were given.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, get_args, get_origin, get_type_hints

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

from meshrun.models.shape import ModelShape


# The allowed values of every choice-valued option, defined once: the field annotations, JobConfig.validate, the
# argparse choices of `meshrun plan` and the code that dispatches on them all read these.
DataFormat = Literal["auto", "text", "tokens"]
TokenDtype = Literal["uint16", "uint32"]
NonfiniteMode = Literal["skip", "stop", "off"]
TrainDtype = Literal["auto", "fp32", "bf16"]
LossMode = Literal["full", "chunked"]
AttentionBackend = Literal["auto", "cudnn", "flash", "efficient", "math", "default"]
PipelineSchedule = Literal["gpipe", "1f1b", "interleaved1f1b", "interleavedzb", "loopedbfs"]
PipelineBalance = Literal["cost", "blocks"]
DataParallelMode = Literal["auto", "ddp", "fsdp"]
ActivationCheckpointMode = Literal["none", "selective", "full"]
Backend = Literal["auto", "nccl", "gloo"]
DeviceKind = Literal["auto", "cpu", "cuda"]
HangAction = Literal["exit", "report"]
ProgressMode = Literal["auto", "bar", "lines"]
DdpGraphMode = Literal["auto", "split", "whole"]
LrSchedule = Literal["cosine", "wsd"]
TrackerName = Literal["none", "tensorboard", "wandb", "mlflow"]

DATA_FORMATS: tuple[str, ...] = get_args(DataFormat)
TOKEN_DTYPES: tuple[str, ...] = get_args(TokenDtype)
NONFINITE_MODES: tuple[str, ...] = get_args(NonfiniteMode)
TRAIN_DTYPES: tuple[str, ...] = get_args(TrainDtype)
LOSS_MODES: tuple[str, ...] = get_args(LossMode)
ATTENTION_BACKENDS: tuple[str, ...] = get_args(AttentionBackend)
PIPELINE_SCHEDULES: tuple[str, ...] = get_args(PipelineSchedule)
PIPELINE_BALANCES: tuple[str, ...] = get_args(PipelineBalance)
MULTI_STAGE_SCHEDULES: tuple[str, ...] = ("interleaved1f1b", "interleavedzb", "loopedbfs")
"""Pipeline schedules that run parallel.pp_virtual_stages stages per rank (looped placement)."""
DATA_PARALLEL_MODES: tuple[str, ...] = get_args(DataParallelMode)
ACTIVATION_CHECKPOINT_MODES: tuple[str, ...] = get_args(ActivationCheckpointMode)
BACKENDS: tuple[str, ...] = get_args(Backend)
DDP_GRAPH_MODES: tuple[str, ...] = get_args(DdpGraphMode)
DEVICE_KINDS: tuple[str, ...] = get_args(DeviceKind)
HANG_ACTIONS: tuple[str, ...] = get_args(HangAction)
PROGRESS_MODES: tuple[str, ...] = get_args(ProgressMode)
LR_SCHEDULES: tuple[str, ...] = get_args(LrSchedule)
TRACKERS: tuple[str, ...] = get_args(TrackerName)


class ConfigError(ValueError):
    """A user error in the configuration. The message's first line names the option and the fix."""


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
    """Compute dtype: auto (bf16 on GPU, fp32 on CPU), fp32 or bf16."""
    compile: str = "auto"
    """torch.compile the model: auto (on for CUDA GPUs, off on CPU, where compiling costs more than it saves),
    true or false."""
    cuda_graphs: str = "auto"
    """Compile the step with CUDA graphs (torch.compile mode reduce-overhead): each compiled graph is recorded once
    and replayed, so the host no longer launches every kernel. auto: on for one process and DDP when compiled on
    CUDA GPUs with the full loss and without float8 (the combinations tested on GPUs), off elsewhere; true refuses
    the layouts it cannot serve; false launches every kernel."""
    gc_every: int = 50
    """Python's garbage collector runs every N optimizer steps (young generations only) instead of whenever
    allocations trigger it, with the objects alive after the first step frozen out of its scans; 0 leaves Python's
    automatic collection on."""
    eval_every: int = 100
    """Evaluate on the validation split every N steps (0 disables)."""
    eval_samples: int = 256
    """Validation samples per evaluation over all ranks together (0 = the whole validation split)."""
    log_every: int = 10
    """Print and record metrics every N steps."""
    fused_optimizer: bool = True
    """Use the fused AdamW kernel where the device has one."""
    loss: LossMode = "full"
    """full (the logits of the whole micro-batch at once) or chunked (the output head and cross-entropy a few
    thousand tokens at a time: the B x T x V logits never exist whole; one process and DDP)."""
    float8: bool = False
    """Run the blocks' matmuls in float8 through torchao (Hopper or newer; the .[float8] extra)."""
    attention: AttentionBackend = "auto"
    """Attention kernel: auto (cuDNN first on Hopper and newer GPUs, else torch's order), cudnn, flash, efficient,
    math, or default (torch's own order)."""


@dataclass
class ParallelConfig:
    """How ranks are arranged on the device mesh. Degrees of -1 are inferred from the world size."""

    dp_replicate: int = -1
    """Data-parallel replicas (DDP, or the replicate dimension of HSDP)."""
    dp_shard: int = 1
    """FSDP2 shard degree (1 = no sharding)."""
    tp: int = 1
    """Tensor-parallel degree (innermost, inside a node)."""
    pp: int = 1
    """Pipeline stages (outermost, across nodes)."""
    cp: int = 1
    """Context parallelism: each sequence split over cp ranks, attention as a ring (CUDA; docs/parallelism.md)."""
    pp_schedule: PipelineSchedule = "1f1b"
    """Pipeline schedule: gpipe, 1f1b, or with pp_virtual_stages per rank interleaved1f1b, interleavedzb (zero
    bubble; uncompiled blocks only) or loopedbfs (docs/parallelism.md)."""
    pp_microbatches: int = 0
    """Pipeline micro-batches per step; 0 means one per sample of the step (micro_batch x grad_accum per
    data-parallel rank), the smallest bubble the step allows."""
    pp_virtual_stages: int = 2
    """Stages per rank for interleaved1f1b, interleavedzb and loopedbfs."""
    pp_balance: PipelineBalance = "cost"
    """Cut the blocks into stages so each stage's estimated FLOPs are even (cost: the last stage, which also runs the
    output head and loss, gets fewer blocks) or give every stage the same block count (blocks)."""
    sequence_parallel: bool = False
    """Shard norms and dropout along the sequence in TP regions."""
    async_tp: bool = False
    """Overlap TP's all-gathers and reduce-scatters with the matmuls they feed (inductor micro-pipelining over
    symmetric memory); needs parallel.sequence_parallel, compiled blocks and CUDA GPUs."""
    data_parallel: DataParallelMode = "auto"
    """How the default pure data-parallel layout runs (dp_replicate=-1 with dp_shard=1): ddp (every rank keeps the
    whole model and optimizer), fsdp (FSDP2 shards parameters, gradients and optimizer state over the ranks), or
    auto: fsdp on GPUs for models of 1B parameters or more, ddp otherwise. Explicit degrees always win."""
    fsdp_reshard_after_forward: str = "auto"
    """Free each block's gathered parameters after its forward (true) or keep them for backward (false: one
    all-gather per step instead of two, at the memory of the whole model in the compute dtype). auto keeps them
    when they take at most 1/16 of the GPU's memory."""
    fsdp_unit_blocks: int = 1
    """Consecutive blocks FSDP2 shards as one unit: one all-gather and one reduce-scatter per unit instead of per
    block. Fewer, larger collectives suit small models, whose per-block collectives are latency-bound; the cost is
    the gathered parameters of a whole unit in memory at once."""
    ddp_overlap: bool = False
    """With compile: compile the DDP-wrapped step instead of wrapping the compiled step in DDP. Either way dynamo
    splits the step at DDP's bucket boundaries, so each bucket's all-reduce overlaps the rest of backward."""
    ddp_bucket_mb: int = 25
    """DDP gradient bucket size in MiB (all-reduce granularity)."""
    ddp_graph: DdpGraphMode = "auto"
    """With compile: split (dynamo cuts the compiled step at DDP's bucket boundaries, so each bucket's all-reduce
    overlaps the rest of backward), whole (one forward and one backward graph, DDP's all-reduces after backward:
    fewer graphs for the host to enter, the all-reduce exposed), or auto: whole while every replica is on one
    node (an all-reduce over NVLink takes a few ms), split when replicas cross nodes."""
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
    tracker: TrackerName = "none"
    """Experiment tracker that rank 0 logs to: none, tensorboard, wandb or mlflow (each an extra of meshrun)."""
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
    """Ranks that record with run.profile_steps: all, or a comma list such as 0,3."""

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
        """Static checks of fields against each other; raises ConfigError naming the option."""
        _check_choice("train.dtype", self.train.dtype, TRAIN_DTYPES)
        _check_choice("dist.backend", self.dist.backend, BACKENDS)
        _check_choice("dist.device", self.dist.device, DEVICE_KINDS)
        _check_choice("data.format", self.data.format, DATA_FORMATS)
        _check_choice("data.token_dtype", self.data.token_dtype, TOKEN_DTYPES)
        _check_choice("parallel.pp_schedule", self.parallel.pp_schedule, PIPELINE_SCHEDULES)
        _check_choice("parallel.pp_balance", self.parallel.pp_balance, PIPELINE_BALANCES)
        _check_choice("parallel.activation_checkpoint", self.parallel.activation_checkpoint,
                      ACTIVATION_CHECKPOINT_MODES)
        _check_choice("train.attention", self.train.attention, ATTENTION_BACKENDS)
        _check_choice("train.loss", self.train.loss, LOSS_MODES)
        _check_choice("train.nonfinite", self.train.nonfinite, NONFINITE_MODES)
        _check_choice("train.lr_schedule", self.train.lr_schedule, LR_SCHEDULES)
        self.train.compile = _tri_state("train.compile", self.train.compile)
        self.train.cuda_graphs = _tri_state("train.cuda_graphs", self.train.cuda_graphs)
        _check_choice("parallel.ddp_graph", self.parallel.ddp_graph, DDP_GRAPH_MODES)
        self.parallel.fsdp_reshard_after_forward = _tri_state("parallel.fsdp_reshard_after_forward",
                                                              self.parallel.fsdp_reshard_after_forward)
        if self.parallel.async_tp and not self.parallel.sequence_parallel:
            raise ConfigError("parallel.async_tp=true overlaps the all-gathers and reduce-scatters of sequence "
                              "parallelism; add --parallel.sequence_parallel=true")
        if self.parallel.fsdp_unit_blocks < 1:
            raise ConfigError(f"parallel.fsdp_unit_blocks must be >= 1 (blocks per FSDP2 unit), got "
                              f"{self.parallel.fsdp_unit_blocks}")
        _check_choice("parallel.data_parallel", self.parallel.data_parallel, DATA_PARALLEL_MODES)
        _check_choice("run.progress", self.run.progress, PROGRESS_MODES)
        _check_choice("run.tracker", self.run.tracker, TRACKERS)
        if self.run.tensorboard and self.run.tracker not in ("none", "tensorboard"):
            raise ConfigError(f"run.tensorboard=true and run.tracker={self.run.tracker}: one tracker per run; drop "
                              "run.tensorboard (or set run.tracker=tensorboard)")
        if not 0 <= self.run.prometheus_port < 65536 or self.run.system_sample_s < 0:
            raise ConfigError(f"run.prometheus_port={self.run.prometheus_port} / run.system_sample_s="
                              f"{self.run.system_sample_s}: give a port in 1..65535 (0 = off) and seconds >= 0")
        _check_choice("health.hang_action", self.health.hang_action, HANG_ACTIONS)
        for name in ("steps", "micro_batch"):
            if getattr(self.train, name) < 1:
                raise ConfigError(f"train.{name} must be >= 1, got {getattr(self.train, name)}")
        for name in ("global_batch", "grad_accum", "eval_every", "eval_samples"):
            if getattr(self.train, name) < 0:
                raise ConfigError(f"train.{name} must be >= 0, got {getattr(self.train, name)}")
        if self.train.log_every < 1:
            raise ConfigError(f"train.log_every must be >= 1, got {self.train.log_every}")
        if not 0.0 <= self.data.val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction must be in [0, 1), got {self.data.val_fraction}")
        if not 0.0 <= self.model.dropout < 1.0:
            raise ConfigError(f"model.dropout must be in [0, 1), got {self.model.dropout}")
        if self.dist.init_timeout_s <= 0 or self.dist.timeout_s <= 0:
            raise ConfigError("dist.init_timeout_s and dist.timeout_s must be > 0, got "
                              f"{self.dist.init_timeout_s} and {self.dist.timeout_s}")
        if self.checkpoint.keep_last < 1:
            raise ConfigError(f"checkpoint.keep_last must be >= 1, got {self.checkpoint.keep_last}")
        window = self.run.profile_window()
        if window and window[1] > self.train.steps:
            raise ConfigError(f"run.profile_steps={self.run.profile_steps!r} ends after train.steps="
                              f"{self.train.steps}; choose steps up to {self.train.steps}")
        self.run.profiled_ranks()  # raises on a malformed list
        self.replicas.check()
        for option, valid, fix in _RANGES:
            section, _, key = option.partition(".")
            value = getattr(getattr(self, section), key)
            if not valid(value):
                raise ConfigError(f"{option}={value!r} is out of range: {fix}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        lines = []
        for section, values in self.to_dict().items():
            lines.append(f"[{section}]")
            lines.extend(f"{key} = {_toml_value(value)}" for key, value in values.items())
            lines.append("")
        return "\n".join(lines)


_RANGES: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    *((f"model.{name}", lambda v: v >= 0, "give a positive value, or 0 to take the named size's")
      for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "seq_len")),
    ("model.rope_theta", lambda v: v > 0, "give a positive base frequency, e.g. 10000"),
    ("model.norm_eps", lambda v: v > 0, "give a small positive epsilon, e.g. 1e-5"),
    ("data.max_bytes", lambda v: v >= 0, "give a number of bytes, or 0 to read the whole corpus"),
    ("data.num_workers", lambda v: v >= 0, "give a number of worker processes >= 0 (0: load in the training process)"),
    ("train.lr", lambda v: v >= 0, "give a learning rate >= 0, e.g. 3e-3"),
    ("train.min_lr", lambda v: v >= 0, "give a final learning rate >= 0, e.g. 3e-4"),
    ("train.warmup_steps", lambda v: v >= 0, "give a number of steps >= 0"),
    ("train.decay_fraction", lambda v: 0 < v <= 1, "give a fraction of train.steps in (0, 1], e.g. 0.2"),
    ("train.weight_decay", lambda v: v >= 0, "give a weight decay >= 0, e.g. 0.1"),
    ("train.beta1", lambda v: 0 <= v < 1, "AdamW's betas must be in [0, 1), e.g. 0.9"),
    ("train.beta2", lambda v: 0 <= v < 1, "AdamW's betas must be in [0, 1), e.g. 0.95"),
    ("train.gc_every", lambda v: v >= 0, "give a number of steps between collections, or 0 for Python's own"),
    ("train.grad_clip", lambda v: v >= 0, "give a maximum gradient norm > 0, or 0 to disable clipping"),
    ("checkpoint.interval_steps", lambda v: v >= 0, "give a number of steps, or 0 to save only by time or at the "
                                                    "end"),
    ("checkpoint.interval_minutes", lambda v: v >= 0, "give a number of minutes, or 0 to turn saving by time off"),
    ("checkpoint.keep_every", lambda v: v >= 0, "give a step multiple to keep as milestones, or 0 for none"),
    ("checkpoint.timeout_s", lambda v: v > 0, "give a positive number of seconds, e.g. 1800"),
    ("health.hang_timeout_s", lambda v: v >= 0, "give a number of seconds, or 0 to disable hang reports"),
    *((f"parallel.{name}", lambda v: v == -1 or v >= 1, "give a degree of 1 or more, or -1 to infer it from the "
       "world size") for name in ("pp", "dp_replicate", "dp_shard", "cp", "tp")),  # comm/mesh.py MESH_DIMS
    ("parallel.ddp_bucket_mb", lambda v: v >= 1, "give a bucket size of 1 MiB or more, e.g. 25"),
    ("parallel.pp_microbatches", lambda v: v >= 0, "give a number of micro-batches, or 0 for one per sample"),
    ("parallel.pp_virtual_stages", lambda v: v >= 1, "give 1 or more stages per rank, e.g. 2"),
    ("checkpoint.signal_grace_s", lambda v: v >= 0, "give a number of seconds, e.g. 30"),
    ("health.straggler_threshold", lambda v: v == 0 or v >= 1,
     "give a ratio of at least 1 (1.5 names a rank 50% slower than the median), or 0 to disable"),
)
"""Single-option ranges checked by JobConfig.validate: (option, valid, the fix to print)."""


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, dict):  # an inline table
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml_value(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)


def _tri_state(option: str, value: Any) -> str:
    """'auto', 'true' or 'false' from the spellings a user or TOML may give (true, 1, yes, on, ...)."""
    text = str(value).strip().lower()
    if text == "auto":
        return text
    if text in ("1", "true", "yes", "on"):
        return "true"
    if text in ("0", "false", "no", "off"):
        return "false"
    raise ConfigError(f"{option}={value!r} is not one of auto, true, false")


def _check_choice(option: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{option}={value!r} is not one of {', '.join(choices)}")


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> JobConfig:
    """Defaults, then the TOML file, then ``section.key=value`` overrides; validated."""
    config = JobConfig()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"--config {path}: no such file")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"--config {path}: not valid TOML ({exc})") from None
        for section, values in data.items():
            if not isinstance(values, dict):
                raise ConfigError(f"--config {path}: top-level key {section!r} must be a [section] table")
            for key, value in values.items():
                set_option(config, f"{section}.{key}", value)
    for item in overrides or []:
        key, sep, value = item.lstrip("-").partition("=")
        if not sep:
            raise ConfigError(f"override {item!r} must look like --section.key=value")
        set_option(config, key, value)
    config.validate()
    return config


def join_overrides(rest: list[str], *, command: str) -> list[str]:
    """The ``--section.key=value`` items of a command line that its own parser left over, accepting ``--a.b c`` as
    ``--a.b=c``; anything else is refused naming ``command``'s help."""
    overrides, i = [], 0
    while i < len(rest):
        item = rest[i]
        if not item.startswith("--") or "." not in item.split("=", 1)[0]:
            raise ConfigError(f"unexpected argument {item!r}; options look like --section.key=value "
                              f"(see `{command} --help`)")
        if "=" not in item and i + 1 < len(rest) and not rest[i + 1].startswith("--"):
            item, i = f"{item}={rest[i + 1]}", i + 1
        overrides.append(item)
        i += 1
    return overrides


def set_option(config: JobConfig, dotted: str, value: Any) -> None:
    """Set ``section.key`` on ``config``, converting strings to the field's type."""
    section_name, _, key = dotted.partition(".")
    sections = {f.name: f for f in dataclasses.fields(config)}
    hints = get_type_hints(type(getattr(config, section_name))) if section_name in sections else {}
    if key not in hints:
        from meshrun.config_help import suggest  # reads this module's classes: imported when needed

        raise ConfigError(f"unknown config option {dotted!r}{suggest(dotted)}"
                          + ("" if section_name in sections else f"; sections are {', '.join(sections)}"))
    setattr(getattr(config, section_name), key, _convert(dotted, value, hints[key]))


def _convert(option: str, value: Any, kind: Any) -> Any:
    if kind is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{option}={value!r} is not a boolean; use true or false")
    if get_origin(kind) is dict:
        try:
            value = json.loads(value) if isinstance(value, str) else value
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{option}={value!r} is not a JSON object ({exc}); e.g. "
                              f"'{{\"endpoint_url\": \"http://127.0.0.1:9000\"}}'") from None
        if not isinstance(value, dict):
            raise ConfigError(f"{option}={value!r} must be a table (TOML) or a JSON object")
        return dict(value)
    if kind in (int, float):
        if isinstance(value, bool):
            raise ConfigError(f"{option}={value!r} must be a {kind.__name__}")
        try:
            return kind(value) if kind is float or isinstance(value, int) else int(str(value), 0)
        except (TypeError, ValueError):
            raise ConfigError(f"{option}={value!r} is not a valid {kind.__name__}") from None
    return str(value)


@dataclass(frozen=True)
class BatchPlan:
    """The global batch: B_global = B_local x G x N x A, where G x N is the number of dp ranks."""

    micro_batch: int
    dp_size: int
    grad_accum: int
    global_batch: int
    seq_len: int

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len


def resolve_batch(train: TrainConfig, *, dp_size: int, seq_len: int) -> BatchPlan:
    """Derive grad accumulation from global_batch (or the reverse); refuse combinations that do not divide."""
    per_step = train.micro_batch * dp_size
    if train.global_batch:
        if train.global_batch % per_step:
            raise ConfigError(
                f"train.global_batch={train.global_batch} is not divisible by train.micro_batch={train.micro_batch} "
                f"x {dp_size} data-parallel ranks = {per_step}; choose a global_batch that is a multiple of "
                f"{per_step} or change train.micro_batch")
        accum = train.global_batch // per_step
        if train.grad_accum and train.grad_accum != accum:
            raise ConfigError(
                f"train.grad_accum={train.grad_accum} contradicts train.global_batch={train.global_batch} = "
                f"{train.micro_batch} x {dp_size} ranks x {accum}; set only one of them")
    else:
        accum = train.grad_accum or 1
    return BatchPlan(micro_batch=train.micro_batch, dp_size=dp_size, grad_accum=accum,
                     global_batch=per_step * accum, seq_len=seq_len)
