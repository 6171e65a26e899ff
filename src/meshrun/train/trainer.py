"""The training loop: build each piece in its own step, then one linear ``train_step``.

Order of construction (each a ``build_*`` method): process group -> run folder and logs -> data -> model and parallel
layout (engine) -> optimizer and schedule -> checkpointer (restoring state when resuming).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from meshrun.config import BatchPlan, ConfigError, JobConfig
from meshrun.data.corpus import Corpus, load_corpus
from meshrun.data.loader import StepBatches, eval_batches
from meshrun.data.sampler import TokenWindows
from meshrun.comm.process_group import DistContext, init_distributed, set_mesh_timeouts, wants_cuda
from meshrun.env import ProcessPlacement
from meshrun.models.shape import ModelShape
from meshrun.models.spec import ModelSpec
from meshrun.rng import seed_rank_streams
from meshrun.parallel.apply import build_engine
from meshrun.parallel.pipeline import effective_model_config
from meshrun.parallel.checks import compute_dtype, p2p_channels
from meshrun.parallel.comm_overlap import set_p2p_channels, set_zero_cta
from meshrun.parallel.engine import Engine
from meshrun.parallel.grad_norm import clip_divisor
from meshrun.parallel.kernels import resolve_adamw_kernel
from meshrun.parallel.local_adamw import LocalShardAdamW
from meshrun.ckpt.preemption import signal_label
from meshrun.ckpt.state import TrainProgress
from meshrun.diag.fingerprint import check_consistency
from meshrun.comm.mesh import ParallelDims
from meshrun.watch.flight_recorder import enable_flight_recorder
from meshrun.watch.health import JobHealth
from meshrun.watch.stragglers import gather_rank_infos
from meshrun.train.gc_control import StepCollector
from meshrun.report.trackers import open_tracker
from meshrun.train.log_step import IntervalClock, LogSnapshot, PendingValues
from meshrun.train.metrics import MetricsSink, SumMetrics, peak_flops
from meshrun.watch.node import SystemWatch
from meshrun.train.header import print_header, start_record
from meshrun.train.nonfinite import NonFiniteGuard
from meshrun.train.rank_timing import data_share, log_rank_timing, rank0_step_s
from meshrun.train.profiling import IntervalMachine, SlowdownWatch, StepProfiler, build_profiler, profiled_ranks
from meshrun.train.plan import refused_alike_on_node, resolve_on_node, validated
from meshrun.train.replicas import ReplicaGroups, ReplicaQuorumError, data_shard
from meshrun.train.run_folder import RunFolder
from meshrun.train.resuming import build_checkpointer, embeddings_as_saved, resume
from meshrun.train.schedule import build_scheduler

log = logging.getLogger("meshrun")


@dataclass
class TrainResult:
    step: int
    """Optimizer steps completed."""
    losses: list[float] = field(default_factory=list)
    """Training loss of every log record (every step with train.log_every=1)."""
    val_loss: float | None = None
    """Validation loss of the last evaluation."""
    run_dir: Path | None = None
    stopped_by: str | None = None
    """The signal that stopped the run before train.steps (e.g. 'SIGTERM'); None when it ran to the end."""


def use_deterministic_algorithms() -> None:
    """train.deterministic: only deterministic kernels (cuBLAS needs its workspace setting before CUDA starts)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


class Trainer:
    """Trains the model ``model.arch`` selects (the built-in GPT or a registered ModelSpec) under the layout the
    config describes."""

    def __init__(self, job: JobConfig, *, env: ProcessPlacement | None = None, corpus: Corpus | None = None):
        self.env = env or ProcessPlacement.detect()
        with refused_alike_on_node():  # a refusal here is every rank's: the node's local rank 0 says it (train/cli.py)
            checked = validated(job)  # a checked copy: the JobConfig given is left as it was
            self.corpus = corpus or load_corpus(checked.data)
        self.plan = resolve_on_node(checked, env=self.env, vocab_size=self.corpus.vocab_size)
        """What this run trains with (train/plan.py); a resume that keeps the global batch replaces it."""
        job = self.job  # from here on, the resolved config
        if job.train.deterministic:
            use_deterministic_algorithms()
        if self.env.is_distributed and torch.cuda.is_available():
            enable_flight_recorder(os.environ, run_dir=self.run_dir)  # NCCL reads these at group creation
            set_p2p_channels(os.environ, p2p_channels(job, self.dims, cuda=wants_cuda(job.dist)),
                             explicit=job.parallel.pp_p2p_channels > 0)
            if job.parallel.fsdp_symm_mem:
                set_zero_cta(os.environ)  # check_layout refused it off CUDA GPUs and without FSDP2
        self.ctx: DistContext = init_distributed(self.env, job.dist)
        self.device = self.ctx.device
        self.folder = RunFolder(job, self.env, path=self.run_dir)  # nothing written into it until the run proceeds
        if self.env.is_distributed and job.health.check_versions:
            check_consistency(env=self.env, strict=True, script=sys.argv[0])  # collective: every rank
        # collective: untied in the checkpoint stays untied
        self.plan, self.checksums_known = embeddings_as_saved(self.plan, self.env)
        """What the checksums of checkpoints found while choosing the model (rank 0's), for resume() to take; None
        where they did not decide it (nor was the checkpoint folder checked then)."""
        job = self.job
        self.mesh = self.dims.build_mesh(self.device.type)  # collective: every rank
        set_mesh_timeouts(self.dims.all_meshes(), job.dist.timeout_s)
        self.compute_dtype = compute_dtype(job, self.device)
        self.engine: Engine = build_engine(job=job, model_cfg=self.model_cfg, dims=self.dims, mesh=self.mesh,
                                           device=self.device, compute_dtype=self.compute_dtype,
                                           batch=self.batch)
        seed_rank_streams(job.train.seed, self.env.rank)
        self.data, self.val = self.build_data()
        self.optimizer = self.build_optimizer()
        self.scheduler = build_scheduler(self.optimizer, job.train)
        self.step_lr = self.scheduler.get_last_lr()[0]
        """The learning rate of the last optimizer step (its log record's ``lr``)."""
        self.rank_infos = gather_rank_infos(self.env)  # collective: every rank; host names, gathered once
        self.fused_optimizer = bool(self.optimizer.param_groups[0].get("fused"))
        self.guard = NonFiniteGuard(job.train.nonfinite, device=self.device, rank=self.env.rank,
                                    fused_optimizer=self.fused_optimizer,
                                    hosts=[info.host for info in self.rank_infos])
        self.progress = TrainProgress()
        self.replicas = self.build_replicas()
        self.ckpt, self.app_state = build_checkpointer(self)
        self.resumed: dict[str, Any] | None = resume(self)  # a fresh run's folder is moved aside here
        self.proceeds = self.step < job.train.steps
        """False: nothing to train; the run folder is left as it was."""
        if self.proceeds:  # after the resume: it may have re-derived the batch
            self.folder.open(self.config_toml())
        self.start_step = self.last_saved_step = self.step
        self.evaluations = 0
        """Evaluations this process has run (the first compiles the evaluation graphs)."""
        self.sink = MetricsSink(self.run_dir, total_steps=job.train.steps, progress=job.run.progress,
                                enabled=self.env.is_rank_zero and self.proceeds, start_step=self.step,
                                tracker=open_tracker(self.job, self.run_dir) if self.env.is_rank_zero and self.proceeds
                                else None)
        self.system = SystemWatch(job.run, env=self.env, device=self.device)  # node leaders sample in a thread
        self.health = JobHealth(env=self.env, device=self.device, parts=self.engine.timed_modules,
                                straggler_threshold=job.health.straggler_threshold,
                                gemm_check=job.health.straggler_gemm_check, ranks=self.rank_infos)
        if self.replicas is not None:
            self.replicas.say, self.replicas.record = self.sink.print, self.sink.record
        if self.proceeds:
            self.print_header()
            self.sink.record({**start_record(self), "hosts": [info.host for info in self.rank_infos]})
        self.profiler: StepProfiler | None = build_profiler(
            job.run, rank=self.env.rank, world_size=self.env.world_size, device=self.device, run_dir=self.run_dir,
            start_step=self.step, say=self.sink.print)
        self.slowdown = SlowdownWatch(
            job.run.profile_on_slowdown, ranks=profiled_ranks(job.run, self.env.world_size), rank=self.env.rank,
            run_dir=self.run_dir, device=self.device, profile_steps=job.run.profile_window(),
        ) if job.run.profile_on_slowdown else None

    @property
    def step(self) -> int:
        """Optimizer steps completed (held by ``progress``, which checkpoints save and restore)."""
        return self.progress.step

    @property
    def tokens_seen(self) -> int:
        return self.progress.tokens_seen

    # ---- the plan's parts (read-only: train/plan.py resolves them once) -----------------------------------------

    @property
    def job(self) -> JobConfig:
        """The resolved config: what config.toml, the checkpoints and the trackers record."""
        return self.plan.job

    @property
    def spec(self) -> ModelSpec:
        return self.plan.spec

    @property
    def model_cfg(self) -> ModelShape:
        return self.plan.shape

    @property
    def dims(self) -> ParallelDims:
        return self.plan.dims

    @property
    def batch(self) -> BatchPlan:
        return self.plan.batch

    @property
    def layout_note(self) -> str:
        return self.plan.layout_note

    @property
    def run_dir(self) -> Path:
        return self.plan.run_dir

    # ---- construction -------------------------------------------------------------------------------------------

    def config_toml(self) -> str:
        """<run.dir>/config.toml: the options this run trains with (after a resume re-derived the batch); what the
        layout changes without an option of its own is recorded as comments."""
        notes = []
        if self.dims.pp > 1 and self.job.model.tie_embeddings:
            notes.append("# model.tie_embeddings: trained untied (pipeline stages cannot share the embedding matrix)")
        return "".join(f"{n}\n" for n in notes) + self.job.to_toml()

    def run_config(self) -> dict[str, Any]:
        """The resolved config each checkpoint carries (sample, export and resume read it), with the data's
        content fingerprint. It records the model as trained: ``model.tie_embeddings`` false under a pipeline."""
        config = self.job.to_dict()
        tied = effective_model_config(self.model_cfg, pp=self.dims.pp).tie_embeddings
        return {**config, "model": {**config["model"], "tie_embeddings": tied},
                "data_fingerprint": self.corpus.fingerprint}

    def build_data(self) -> tuple[StepBatches, list]:
        seq_len = self.model_cfg.seq_len
        train_set = TokenWindows(self.corpus.train, seq_len, self.model_cfg.vocab_size)
        val_set = TokenWindows(self.corpus.val, seq_len, self.model_cfg.vocab_size)
        dp_rank, dp_size = data_shard(self.job.replicas, self.engine.dp_rank, self.engine.dp_size)
        try:
            data = StepBatches(train_set, dp_rank=dp_rank, dp_size=dp_size, seed=self.job.train.seed,
                               micro_batch=self.batch.micro_batch, grad_accum=self.batch.grad_accum,
                               device=self.device, num_workers=self.job.data.num_workers)
        except ValueError as exc:  # too few samples (an empty file): name the option, not the sampler
            raise ConfigError(f"data.source={self.job.data.source!r}: {exc}") from None
        val = []
        if self.job.train.eval_every:
            val = eval_batches(val_set, dp_rank=dp_rank, dp_size=dp_size, micro_batch=self.batch.micro_batch,
                               samples=self.job.train.eval_samples, device=self.device)
        return data, val

    def build_optimizer(self) -> torch.optim.Optimizer:
        params = [p for part in self.engine.model_parts for p in part.parameters() if p.requires_grad]
        decay = [p for p in params if p.ndim >= 2]  # matrices and embeddings; not norms or biases
        no_decay = [p for p in params if p.ndim < 2]
        t = self.job.train
        kernel = resolve_adamw_kernel(self.job, self.device)
        # torch's AdamW, stepping FSDP2's and TP's DTensor parameters on their local shards (parallel/local_adamw.py),
        # its fused update by default through meshrun's Triton kernel (parallel/triton_adamw.py)
        return LocalShardAdamW([{"params": decay, "weight_decay": t.weight_decay},
                                {"params": no_decay, "weight_decay": 0.0}],
                               lr=t.lr, betas=(t.beta1, t.beta2), fused=kernel != "foreach" or None,
                               triton=kernel == "triton", copies=getattr(self.engine, "step_weights", None))

    def build_replicas(self) -> ReplicaGroups | None:
        """replicas.groups: this group's torchft manager (train/replicas.py); None without replica groups."""
        if not self.job.replicas.groups:
            return None
        return ReplicaGroups(self.job.replicas, env=self.env, device=self.device, seed=self.job.train.seed,
                             parts=self.engine.model_parts, optimizer=self.optimizer, scheduler=self.scheduler,
                             data=self.data, progress=self.progress)

    def save_checkpoint(self, *, final: bool = False) -> None:
        """Collective: every rank, at the same step. A step already saved (or just resumed from) is not saved again."""
        if self.step == self.last_saved_step or (self.replicas is not None and not self.replicas.saves_checkpoints()):
            return
        self.last_saved_step = self.step
        # a save may take up to checkpoint.timeout_s: not a hang until then
        self.beat("checkpoint", timeout_s=max(self.job.checkpoint.timeout_s, self.job.health.hang_timeout_s))
        started = time.perf_counter()
        self.ckpt.save(self.step, self.app_state, final=final,
                       meta={"epoch": self.data.position.epoch, "tokens_seen": self.tokens_seen,
                             "samples_in_epoch": self.data.position.consumed, "config": self.run_config()})
        how = "published" if final or not self.job.checkpoint.async_save else "staged; writing in the background"
        seconds = time.perf_counter() - started
        self.sink.print(f"checkpoint step {self.step} -> {self.ckpt.folder} ({how}, {seconds:.2f} s)")
        self.sink.record({"kind": "checkpoint", "step": self.step, "final": final, "seconds": round(seconds, 3)})

    def print_header(self) -> None:
        """Rank 0's start-up lines: placement, layout, model, data, batch formula, resume (train/header.py)."""
        print_header(self)

    # ---- the loop -------------------------------------------------------------------------------------------------

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """One optimizer step over grad_accum micro-batches: returns (loss_sum, tokens, grad_norm), on device; None
        when replica groups discarded the step (a group failed during it; it runs again)."""
        if self.replicas is not None:
            self.replicas.start_step()  # quorum across groups; a group that is behind heals here
        start = time.perf_counter()
        batches = self.data.next_step()
        self.health.timer.add_data(time.perf_counter() - start)
        first = self.step == self.start_step  # compiles and warms up: as slow as a checkpoint, not a hang
        self.beat("forward_backward", timeout_s=self.compile_allowance_s() if first else None)
        loss_sum, tokens = self.engine.forward_backward(batches)
        self.beat("optimizer")
        if self.replicas is not None and not self.replicas.average_gradients():
            return None
        clip = self.job.train.grad_clip or (float("inf") if self.guard.enabled else 0.0)  # inf: the norm alone
        if clip and self.fused_optimizer:
            # the fused AdamW clips as it reads each gradient (grad_scale): no pass over the gradients to scale them
            grad_norm = self.engine.clip_grad_norm(float("inf"))
            self.optimizer.grad_scale = clip_divisor(grad_norm, clip) if not math.isinf(clip) else None
        else:
            grad_norm = self.engine.clip_grad_norm(clip) if clip else None
        if grad_norm is None or self.guard.allow_step(self.step + 1, grad_norm, loss_sum, self.optimizer):
            self.optimizer.step()
            if first and self.optimizer.triton and not self.optimizer.triton_steps:
                log.warning("train.adamw_kernel: meshrun's Triton AdamW could not take these parameters (not "
                            "contiguous fp32 tensors on one GPU); torch's fused AdamW steps them")
        self.step_lr = self.scheduler.get_last_lr()[0]  # the rate this step used, which its log record names
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.progress.step = self.replicas.step if self.replicas is not None else self.progress.step + 1
        self.progress.tokens_seen += self.batch.tokens_per_step * (self.replicas.live_groups if self.replicas else 1)
        return loss_sum, tokens, grad_norm

    def compile_allowance_s(self) -> float:
        """The hang limit of a phase that compiles (the first step, the first evaluation): torch.compile, and with
        train.compile_mode=max-autotune its matmul benchmarks, can take minutes before the next heartbeat."""
        return max(1800.0, self.job.health.hang_timeout_s)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Validation loss over every rank's fixed batches (one all-reduce; every rank must call it). The first one
        compiles the evaluation graphs (no autograd, the model in eval mode), so it gets the first step's hang limit."""
        self.beat("evaluate", timeout_s=self.compile_allowance_s() if not self.evaluations else None)
        self.evaluations += 1
        for part in self.engine.model_parts:
            part.eval()
        sums = SumMetrics(("loss_sum", "tokens"), self.device)
        for inputs, targets in self.val:
            loss_sum, tokens = self.engine.eval_loss(inputs, targets)
            sums.add(loss_sum=loss_sum, tokens=tokens)
        for part in self.engine.model_parts:
            part.train()
        totals = sums.reduce()
        return totals["loss_sum"] / max(totals["tokens"], 1.0)

    def beat(self, phase: str, timeout_s: float | None = None) -> None:
        self.health.beat(self.step, phase, timeout_s)

    def fit(self) -> TrainResult:
        """Train to ``train.steps``; the hang watchdog and the profiler (run.profile_steps) run for the loop."""
        self.health.start_watchdog(timeout_s=self.job.health.hang_timeout_s, stack_dir=self.run_dir / "logs",
                                   log=log.error, end_job=self.job.health.hang_action == "exit")
        if self.profiler is not None:
            self.profiler.start()
        self.collector = StepCollector(self.job.train.gc_every)
        try:
            return self._loop()
        except ReplicaQuorumError:  # lighthouse lost or too few groups: keep the last committed step, then stop
            self.save_checkpoint(final=True)
            raise
        finally:
            self.collector.close()
            if self.profiler is not None:
                self.profiler.close()  # an error or SIGTERM inside the window: writes what was recorded
            self.health.stop()  # before the process group (and its store) goes away

    def _loop(self) -> TrainResult:
        job, result = self.job, TrainResult(step=self.step, run_dir=self.run_dir)
        if not self.proceeds and self.env.is_rank_zero:
            print(f"nothing to train: resumed at step {self.step} >= train.steps={job.train.steps}; {self.run_dir} is "
                  "left as it was; raise --train.steps, or start a new run with --fresh", flush=True)
        sums = SumMetrics(("loss_sum", "tokens"), self.device)
        self.clock, interval_steps = IntervalClock(self.device), 0  # each record's time (train/log_step.py)
        pending: LogSnapshot | None = None
        try:
            while self.step < job.train.steps:
                stepped = self.train_step()
                if pending is not None:  # the last log step's records, read now that this step is queued
                    self.write_log(pending, result)
                    pending = None
                if stepped is None:
                    continue
                loss_sum, tokens, grad_norm = stepped
                self.collector.step(self.step)
                sums.add(loss_sum=loss_sum, tokens=tokens)
                interval_steps += 1
                if self.step % job.train.log_every == 0 or self.step == job.train.steps:
                    snapshot = self.take_log(sums, interval_steps, grad_norm)
                    interval_steps = 0
                    if self.defers_log():
                        pending = snapshot  # written after the next step is queued: the GPU does not run dry
                    else:
                        self.write_log(snapshot, result)
                if job.train.eval_every and (self.step % job.train.eval_every == 0 or self.step == job.train.steps):
                    self.clock.pause()  # evaluation time is not training throughput
                    result.val_loss = self.evaluate()
                    self.sink.log({"kind": "eval", "step": self.step, "loss": result.val_loss})
                    self.clock.resume()
                if self.checkpoint_due():
                    if pending is not None:  # a checkpoint asked for by time or a signal: its records first
                        self.write_log(pending, result)
                        pending = None
                    self.clock.pause()
                    # SIGTERM, or the last step with checkpoint.final: the job's last save, final (synchronous)
                    last = job.checkpoint.final and self.step == job.train.steps
                    self.save_checkpoint(final=self.ckpt.stop_requested or last)
                    self.clock.resume()
                    if self.ckpt.stop_requested:
                        result.stopped_by = self.stop_signal()
                        self.sink.print(f"stopping at step {self.step} after {signal_label(result.stopped_by)} "
                                        "(checkpoint saved)")
                        break
                if self.profiler is not None:  # after logging, evaluation and saving: they belong to this step
                    self.beat("profiler")  # writing the trace after the window's last step can take a while
                    self.profiler.step(self.step)
                if self.slowdown is not None and (capture := self.slowdown.start(self.step)) is not None:
                    self.profiler = capture  # records the slow steps from the next one on (warm-up), closed as above
            if pending is not None:
                self.write_log(pending, result)
        except BaseException:
            # a failing step: the last log step's records still go out where their values have arrived (on a GPU
            # that may have failed, waiting for them could hang)
            if pending is not None and pending.values.ready():
                with contextlib.suppress(Exception):
                    self.write_log(pending, result)
            raise
        if job.checkpoint.final and not self.ckpt.stop_requested:
            self.save_checkpoint(final=True)
        self.ckpt.wait()
        result.step = self.step
        return result

    def stop_signal(self) -> str:
        """The signal that asked this run to stop, as this rank knows it (another rank may have received it)."""
        flag = self.ckpt.preemption
        return flag.signal_name if flag is not None and flag.signal_name else "a signal to another rank"

    def checkpoint_due(self) -> bool:
        """Asked at log and checkpoint-interval steps only: with a time interval or SIGTERM watch the question is a
        small collective, not worth paying every step."""
        every = self.job.checkpoint.interval_steps
        if self.step % self.job.train.log_every and not (every and self.step % every == 0):
            return False
        return self.ckpt.should_save(self.step)

    def take_log(self, sums: SumMetrics, steps: int, grad_norm: torch.Tensor | None) -> LogSnapshot:
        """At a log step: what its records need, without waiting for the GPU (train/log_step.py). Collective: the
        loss sums' all-reduce, queued on every rank."""
        seconds = self.clock.take()  # the interval ends with this step's work, before the log step's own
        totals = sums.take()
        values = PendingValues([totals[0], totals[1], grad_norm if grad_norm is not None else float("nan"),
                                self.guard.count, self.guard.first_step], self.device)
        return LogSnapshot(step=self.step, epoch=self.data.position.epoch, lr=self.step_lr,
                           tokens_seen=self.tokens_seen, steps=steps, values=values,
                           has_norm=grad_norm is not None, timing=self.health.timer.take_later(steps),
                           seconds=seconds)

    def defers_log(self) -> bool:
        """Whether this log step's records are written after the next step is queued (train/log_step.py): in one
        process, where nothing else at this step reads the GPU or needs them first (not the last step, an
        evaluation, a checkpoint by steps, a profiled step, the slowdown watch, replica groups, and not with
        train.nonfinite=stop, which ends the run at the log step itself)."""
        t, every = self.job.train, self.job.checkpoint.interval_steps
        return (self.env.world_size == 1 and self.replicas is None and self.profiler is None
                and self.guard.mode != "stop"
                and self.slowdown is None and self.step < t.steps
                and not (t.eval_every and self.step % t.eval_every == 0)
                and not (every and self.step % every == 0))

    def write_log(self, snapshot: LogSnapshot, result: TrainResult) -> None:
        """A log step's records: the train record, the non-finite report, the ``ranks`` record and straggler check,
        the system records and the slowdown watch. Collective on several ranks (their gathers)."""
        totals, gnorm, bad, first = snapshot.read()
        elapsed = snapshot.seconds()  # up to the end of the log step's work, not to now: see IntervalClock
        record = self.train_record(snapshot, totals, elapsed, gnorm)
        result.losses.append(record["loss"])
        self.sink.log(record)
        self.check_nonfinite(snapshot.step, count=bad, first=first)
        table = self.check_stragglers(snapshot.steps, elapsed, step=snapshot.step, timing=snapshot.timing)
        self.beat("system_metrics")
        system = self.system.log_interval(snapshot.step, record, self.sink)  # collective when on: every rank
        self.watch_slowdown(table, snapshot.steps, system, step=snapshot.step)

    def check_nonfinite(self, step: int, *, count: int | None = None, first: int | None = None) -> None:
        """At log steps: warn about steps whose gradient norm was NaN or inf (train.nonfinite=stop raises);
        ``count`` and ``first`` as the log step read them (NonFiniteGuard.check)."""
        report = (self.guard.check(step, self.env.world_size, count=count, first=first)
                  if self.guard.enabled else None)
        if report is not None:
            self.sink.print(f"warning: {report}")
            log.info("%s", report)  # the rank log; the console has the line above

    def check_stragglers(self, steps: int, elapsed: float, *, step: int,
                         timing: Callable[[], tuple[float, float]]) -> np.ndarray:
        """At log steps: the ``ranks`` record and the straggler check, from one gather (train/rank_timing.py); returns
        the gathered table."""
        return log_rank_timing(self, steps, elapsed, step=step, timing=timing)

    def watch_slowdown(self, table: np.ndarray, steps: int, system: list[dict[str, Any]], *, step: int) -> None:
        """At log steps, with run.profile_on_slowdown: the run's first slow interval is said (with what the machine
        did in it: the interval's ``system`` records and timing ``table``), recorded in the metrics and, where the
        profiler is free, recorded by it on run.profile_ranks (train/profiling.py)."""
        if self.slowdown is None:
            return
        found = self.slowdown.observe(step=step, interval_steps=steps, step_s=rank0_step_s(table),
                                      last_step=self.job.train.steps,
                                      machine=IntervalMachine.of(system, data_share(table)))
        if found is not None:
            line, record = found
            self.sink.print(line)
            self.sink.record(record)
            log.info("%s", line)

    def train_record(self, snapshot: LogSnapshot, totals: dict[str, float], elapsed: float,
                     gnorm: float | None) -> dict[str, Any]:
        steps = snapshot.steps
        tokens_per_s = steps * self.batch.tokens_per_step / max(elapsed, 1e-9)
        per_device = tokens_per_s / self.env.world_size
        peak = peak_flops(self.device)
        # MFU = achieved model FLOP/s per device / peak: (6N + 12 L d T) FLOPs per token (PaLM, appendix B).
        mfu = self.spec.flops_per_token(self.model_cfg) * per_device / peak if peak else None
        return {"kind": "train", "step": snapshot.step, "epoch": snapshot.epoch,
                "loss": totals["loss_sum"] / max(totals["tokens"], 1.0), "lr": snapshot.lr,
                "tokens_seen": snapshot.tokens_seen, "tokens_per_s": tokens_per_s,
                "tokens_per_s_per_device": per_device, "mfu": mfu, "grad_norm": gnorm,
                "step_time_s": elapsed / max(steps, 1),
                "peak_mem_gib": torch.cuda.max_memory_allocated(self.device) / 2**30
                if self.device.type == "cuda" else None,
                **({"live_groups": self.replicas.live_groups} if self.replicas is not None else {})}

    def close(self) -> None:
        """Finish pending checkpoint writes and metrics, and give the process its own SIGTERM/SIGUSR1 handlers back
        (a closed trainer in a notebook or test process must not keep catching them)."""
        self.ckpt.close()
        if self.replicas is not None:
            self.replicas.close()
        self.system.close()
        self.sink.close()
        if self.ckpt.preemption is not None:
            self.ckpt.preemption.restore()

