"""The configuration's validation tables: the allowed values of every choice-valued option, the single-option
ranges, the checks of fields against each other (:func:`validate_job`, run by :meth:`JobConfig.validate`) and the
batch arithmetic that needs the world size (:func:`resolve_batch`).

Everything here is re-exported by :mod:`meshrun.config`; import it from there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Literal, get_args

if TYPE_CHECKING:
    from meshrun.config import JobConfig, TrainConfig


# The allowed values of every choice-valued option, defined once: the field annotations, JobConfig.validate, the
# argparse choices of `meshrun plan` and the code that dispatches on them all read these.
DataFormat = Literal["auto", "text", "tokens"]
TokenDtype = Literal["uint16", "uint32"]
NonfiniteMode = Literal["skip", "stop", "off"]
TrainDtype = Literal["auto", "fp32", "bf16"]
LossMode = Literal["full", "chunked"]
CompileMode = Literal["default", "max-autotune"]
AttentionBackend = Literal["auto", "cudnn", "flash", "efficient", "math", "default"]
CrossEntropyKernel = Literal["auto", "triton", "torch"]
AdamWKernel = Literal["auto", "triton", "torch"]
PipelineSchedule = Literal["auto", "gpipe", "1f1b", "interleaved1f1b", "interleavedzb", "loopedbfs"]
PipelineBalance = Literal["cost", "blocks"]
DataParallelMode = Literal["auto", "ddp", "fsdp"]
ActivationCheckpointMode = Literal["none", "selective", "full"]
Backend = Literal["auto", "nccl", "gloo"]
DeviceKind = Literal["auto", "cpu", "cuda"]
HangAction = Literal["exit", "report"]
ProgressMode = Literal["auto", "bar", "lines"]
DdpGraphMode = Literal["auto", "split", "whole"]
ReduceDtype = Literal["auto", "fp32", "bf16"]
ResidualDtype = Literal["auto", "fp32", "bf16"]
LrSchedule = Literal["cosine", "wsd"]
TrackerName = Literal["none", "tensorboard", "wandb", "mlflow"]

DATA_FORMATS: tuple[str, ...] = get_args(DataFormat)
TOKEN_DTYPES: tuple[str, ...] = get_args(TokenDtype)
NONFINITE_MODES: tuple[str, ...] = get_args(NonfiniteMode)
TRAIN_DTYPES: tuple[str, ...] = get_args(TrainDtype)
LOSS_MODES: tuple[str, ...] = get_args(LossMode)
COMPILE_MODES: tuple[str, ...] = get_args(CompileMode)
ATTENTION_BACKENDS: tuple[str, ...] = get_args(AttentionBackend)
CROSS_ENTROPY_KERNELS: tuple[str, ...] = get_args(CrossEntropyKernel)
ADAMW_KERNELS: tuple[str, ...] = get_args(AdamWKernel)
PIPELINE_SCHEDULES: tuple[str, ...] = get_args(PipelineSchedule)
PIPELINE_BALANCES: tuple[str, ...] = get_args(PipelineBalance)
MULTI_STAGE_SCHEDULES: tuple[str, ...] = ("interleaved1f1b", "interleavedzb", "loopedbfs")
"""Pipeline schedules that run parallel.pp_virtual_stages stages per rank (looped placement)."""
MULTIPLE_OF_PP_SCHEDULES: tuple[str, ...] = ("interleaved1f1b", "interleavedzb")
"""Pipeline schedules whose micro-batch count must be a multiple of parallel.pp."""
DATA_PARALLEL_MODES: tuple[str, ...] = get_args(DataParallelMode)
ACTIVATION_CHECKPOINT_MODES: tuple[str, ...] = get_args(ActivationCheckpointMode)
BACKENDS: tuple[str, ...] = get_args(Backend)
DDP_GRAPH_MODES: tuple[str, ...] = get_args(DdpGraphMode)
REDUCE_DTYPES: tuple[str, ...] = get_args(ReduceDtype)
RESIDUAL_DTYPES: tuple[str, ...] = get_args(ResidualDtype)
DEVICE_KINDS: tuple[str, ...] = get_args(DeviceKind)
HANG_ACTIONS: tuple[str, ...] = get_args(HangAction)
PROGRESS_MODES: tuple[str, ...] = get_args(ProgressMode)
LR_SCHEDULES: tuple[str, ...] = get_args(LrSchedule)
TRACKERS: tuple[str, ...] = get_args(TrackerName)


class ConfigError(ValueError):
    """A user error in the configuration. The message's first line names the option and the fix."""

    same_on_node: bool = False
    """This node's local rank 0 raises this same message (this rank may be it): that rank says it for the node, and
    the node's other ranks stay quiet. Set where that is known (the checks before the process group: train/plan.py);
    otherwise each rank says its own."""


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
    ("run.profile_on_slowdown", lambda v: 0 <= v < 1, "give a fraction of the tokens/s, e.g. 0.05 to record a step "
                                                      "that runs 5% slow, or 0 for off"),
    *((f"parallel.{name}", lambda v: v == -1 or v >= 1, "give a degree of 1 or more, or -1 to infer it from the "
       "world size") for name in ("pp", "dp_replicate", "dp_shard", "cp", "tp")),  # comm/mesh.py MESH_DIMS
    ("parallel.ddp_bucket_mb", lambda v: v >= 0, "give a bucket size in MiB, e.g. 25, or 0 for auto"),
    ("parallel.pp_microbatches", lambda v: v >= 0, "give a number of micro-batches, or 0 to choose from the batch"),
    ("parallel.pp_virtual_stages", lambda v: v >= 1, "give 1 or more stages per rank, e.g. 2"),
    ("checkpoint.signal_grace_s", lambda v: v >= 0, "give a number of seconds, e.g. 30"),
    ("health.straggler_threshold", lambda v: v == 0 or v >= 1,
     "give a ratio of at least 1 (1.5 names a rank 50% slower than the median), or 0 to disable"),
)
"""Single-option ranges checked by JobConfig.validate: (option, valid, the fix to print)."""


def tri_state(option: str, value: Any) -> str:
    """'auto', 'true' or 'false' from the spellings a user or TOML may give (true, 1, yes, on, ...)."""
    text = str(value).strip().lower()
    if text == "auto":
        return text
    if text in ("1", "true", "yes", "on"):
        return "true"
    if text in ("0", "false", "no", "off"):
        return "false"
    raise ConfigError(f"{option}={value!r} is not one of auto, true, false")


CHOICE_HINTS: dict[tuple[str, str], str] = {
    **{("train.dtype", v): "float8 matmuls are a switch of their own: --train.float8=true (with bf16)"
       for v in ("fp8", "float8", "float8_e4m3fn", "e4m3")},
    **{("train.dtype", v): "fp16 needs loss scaling, which meshrun does not do; bf16 needs none (Ampere and newer)"
       for v in ("fp16", "float16", "half", "16-mixed")},
    **{("train.dtype", v): "spell it bf16" for v in ("bfloat16", "bf16-mixed", "bf16-true")},
    **{("train.dtype", v): "spell it fp32" for v in ("float32", "float", "32", "32-true")},
}
"""(option, a value other tools accept) -> what meshrun calls it, added to the refusal."""


def check_choice(option: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        hint = CHOICE_HINTS.get((option, str(value).lower()))
        raise ConfigError(f"{option}={value!r} is not one of {', '.join(choices)}" + (f"; {hint}" if hint else ""))


def _check_choices(job: JobConfig) -> None:
    """Every choice-valued option is one of its choices; the tri-state options normalised to auto/true/false."""
    check_choice("train.dtype", job.train.dtype, TRAIN_DTYPES)
    check_choice("dist.backend", job.dist.backend, BACKENDS)
    check_choice("dist.device", job.dist.device, DEVICE_KINDS)
    check_choice("data.format", job.data.format, DATA_FORMATS)
    check_choice("data.token_dtype", job.data.token_dtype, TOKEN_DTYPES)
    check_choice("parallel.pp_schedule", job.parallel.pp_schedule, PIPELINE_SCHEDULES)
    check_choice("parallel.pp_balance", job.parallel.pp_balance, PIPELINE_BALANCES)
    check_choice("parallel.activation_checkpoint", job.parallel.activation_checkpoint,
                 ACTIVATION_CHECKPOINT_MODES)
    check_choice("train.attention", job.train.attention, ATTENTION_BACKENDS)
    check_choice("train.cross_entropy", job.train.cross_entropy, CROSS_ENTROPY_KERNELS)
    check_choice("train.adamw_kernel", job.train.adamw_kernel, ADAMW_KERNELS)
    check_choice("train.loss", job.train.loss, LOSS_MODES)
    check_choice("train.residual_dtype", job.train.residual_dtype, RESIDUAL_DTYPES)
    check_choice("train.compile_mode", job.train.compile_mode, COMPILE_MODES)
    check_choice("train.nonfinite", job.train.nonfinite, NONFINITE_MODES)
    check_choice("train.lr_schedule", job.train.lr_schedule, LR_SCHEDULES)
    job.train.compile = tri_state("train.compile", job.train.compile)
    job.train.cuda_graphs = tri_state("train.cuda_graphs", job.train.cuda_graphs)
    job.parallel.pp_cast_once = tri_state("parallel.pp_cast_once", job.parallel.pp_cast_once)
    job.train.weight_copies = tri_state("train.weight_copies", job.train.weight_copies)
    job.parallel.comm_reorder = tri_state("parallel.comm_reorder", job.parallel.comm_reorder)
    check_choice("parallel.ddp_graph", job.parallel.ddp_graph, DDP_GRAPH_MODES)
    job.parallel.ddp_batched_copy = tri_state("parallel.ddp_batched_copy", job.parallel.ddp_batched_copy)
    check_choice("parallel.grad_reduce_dtype", job.parallel.grad_reduce_dtype, REDUCE_DTYPES)
    job.parallel.fsdp_reshard_after_forward = tri_state("parallel.fsdp_reshard_after_forward",
                                                         job.parallel.fsdp_reshard_after_forward)
    check_choice("parallel.data_parallel", job.parallel.data_parallel, DATA_PARALLEL_MODES)
    check_choice("run.progress", job.run.progress, PROGRESS_MODES)
    check_trackers(job.run.tracker)
    check_choice("health.hang_action", job.health.hang_action, HANG_ACTIONS)


def check_trackers(value: str) -> None:
    """run.tracker: none, or one or more of the trackers, comma-separated."""
    names = [name.strip() for name in value.split(",")]
    if any(name not in TRACKERS for name in names) or ("none" in names and len(names) > 1):
        raise ConfigError(f"run.tracker={value!r} is not one of {', '.join(TRACKERS)}; give none, or one or a comma "
                          "list of the others, e.g. mlflow,tensorboard")


def validate_job(job: JobConfig) -> None:
    """Static checks of fields against each other; raises ConfigError naming the option. Normalises the
    tri-state options (auto/true/false) in place."""
    _check_choices(job)
    if job.parallel.async_tp and not job.parallel.sequence_parallel:
        raise ConfigError("parallel.async_tp=true overlaps the all-gathers and reduce-scatters of sequence "
                          "parallelism; add --parallel.sequence_parallel=true")
    if job.parallel.pp_p2p_channels < 0:
        raise ConfigError(f"parallel.pp_p2p_channels must be >= 0 (NCCL channels for the pipeline's sends and "
                          f"receives; 0: auto), got {job.parallel.pp_p2p_channels}")
    if job.parallel.fsdp_unit_blocks < -1:
        raise ConfigError(f"parallel.fsdp_unit_blocks must be >= -1 (blocks per FSDP2 unit; 0: auto; -1: the whole "
                          f"model one unit), got {job.parallel.fsdp_unit_blocks}")
    if job.parallel.fsdp_prefetch < 0:
        raise ConfigError(f"parallel.fsdp_prefetch must be >= 0 (FSDP2 units each unit gathers ahead; 0: FSDP2's "
                          f"own order), got {job.parallel.fsdp_prefetch}")
    if job.run.tensorboard and job.run.tracker not in ("none", "tensorboard"):
        raise ConfigError(f"run.tensorboard=true and run.tracker={job.run.tracker}: one tracker per run; drop "
                          "run.tensorboard (or set run.tracker=tensorboard)")
    if not 0 <= job.run.prometheus_port < 65536 or job.run.system_sample_s < 0:
        raise ConfigError(f"run.prometheus_port={job.run.prometheus_port} / run.system_sample_s="
                          f"{job.run.system_sample_s}: give a port in 1..65535 (0 = off) and seconds >= 0")
    for name in ("steps", "micro_batch"):
        if getattr(job.train, name) < 1:
            raise ConfigError(f"train.{name} must be >= 1, got {getattr(job.train, name)}")
    for name in ("global_batch", "grad_accum", "eval_every", "eval_samples"):
        if getattr(job.train, name) < 0:
            raise ConfigError(f"train.{name} must be >= 0, got {getattr(job.train, name)}")
    if job.train.log_every < 1:
        raise ConfigError(f"train.log_every must be >= 1, got {job.train.log_every}")
    if not 0.0 <= job.data.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction must be in [0, 1), got {job.data.val_fraction}")
    if not 0.0 <= job.model.dropout < 1.0:
        raise ConfigError(f"model.dropout must be in [0, 1), got {job.model.dropout}")
    if job.dist.init_timeout_s <= 0 or job.dist.timeout_s <= 0:
        raise ConfigError("dist.init_timeout_s and dist.timeout_s must be > 0, got "
                          f"{job.dist.init_timeout_s} and {job.dist.timeout_s}")
    if job.checkpoint.keep_last < 1:
        raise ConfigError(f"checkpoint.keep_last must be >= 1, got {job.checkpoint.keep_last}")
    window = job.run.profile_window()
    if window and window[1] > job.train.steps:
        raise ConfigError(f"run.profile_steps={job.run.profile_steps!r} ends after train.steps="
                          f"{job.train.steps}; choose steps up to {job.train.steps}")
    job.run.profiled_ranks()  # raises on a malformed list
    job.replicas.check()
    for option, valid, fix in _RANGES:
        section, _, key = option.partition(".")
        value = getattr(getattr(job, section), key)
        if not valid(value):
            raise ConfigError(f"{option}={value!r} is out of range: {fix}")


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


def resolve_batch(train: TrainConfig, *, dp_size: int, seq_len: int, prefix: str = "train.") -> BatchPlan:
    """Derive grad accumulation from global_batch (or the reverse); refuse combinations that do not divide.
    ``prefix``: how errors name the options ('train.' for the CLI's, '' for Session.step_batches' arguments)."""
    per_step = train.micro_batch * dp_size
    if train.global_batch:
        if train.global_batch % per_step:
            raise ConfigError(
                f"{prefix}global_batch={train.global_batch} is not divisible by {prefix}micro_batch="
                f"{train.micro_batch} x {dp_size} data-parallel ranks = {per_step}; choose a global_batch that is a "
                f"multiple of {per_step} or change {prefix}micro_batch")
        accum = train.global_batch // per_step
        if train.grad_accum and train.grad_accum != accum:
            raise ConfigError(
                f"{prefix}grad_accum={train.grad_accum} contradicts {prefix}global_batch={train.global_batch} = "
                f"{train.micro_batch} x {dp_size} ranks x {accum}; set only one of them")
    else:
        accum = train.grad_accum or 1
    return BatchPlan(micro_batch=train.micro_batch, dp_size=dp_size, grad_accum=accum,
                     global_batch=per_step * accum, seq_len=seq_len)
