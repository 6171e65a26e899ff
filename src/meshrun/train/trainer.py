"""The training loop: build each piece in its own step, then one linear ``train_step``.

Order of construction (each a ``build_*`` method): process group -> run folder and logs -> data -> model and parallel
layout (engine) -> optimizer and schedule -> checkpointer (restoring state when resuming).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from meshrun.config import BatchPlan, ConfigError, JobConfig, resolve_batch
from meshrun.data.corpus import Corpus, load_corpus
from meshrun.data.loader import StepBatches, eval_batches
from meshrun.data.sampler import TokenWindows
from meshrun.comm.process_group import DistContext, init_distributed, set_mesh_timeouts, wants_cuda
from meshrun.env import ClusterEnv
from meshrun.models.build import model_config, model_spec, record_resolved
from meshrun.models.spec import count_unique_params
from meshrun.rng import seed_rank_streams
from meshrun.parallel.apply import build_engine, describe_layout
from meshrun.parallel.engine import Engine
from meshrun.parallel.kernels import describe_speed
from meshrun.ckpt.checkpointer import Checkpointer
from meshrun.ckpt.preemption import install_sigterm_handler
from meshrun.ckpt.state import ModelOptimState, RNGState, SchedulerState, TrainProgress
from meshrun.diag.fingerprint import check_consistency
from meshrun.comm.mesh import ParallelDims, choose_data_parallel
from meshrun.diag.flight_recorder import enable_flight_recorder
from meshrun.diag.gather import gather_floats
from meshrun.diag.hang import HangWatchdog
from meshrun.diag.stragglers import StragglerDetector, WorkTimer, gather_rank_infos
from meshrun.train.metrics import MetricsSink, SumMetrics, peak_flops
from meshrun.train.nonfinite import NonFiniteGuard
from meshrun.train.profiling import StepProfiler, build_profiler
from meshrun.train.rank_timing import FIELDS as TIMING_FIELDS, ranks_record, timing_row
from meshrun.train.runlog import start_record

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


def compute_dtype(job: JobConfig, device: torch.device) -> torch.dtype | None:
    """The autocast dtype, or None for plain fp32."""
    if job.train.dtype == "bf16" or (job.train.dtype == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None


class Trainer:
    """Trains the model ``model.arch`` selects (the built-in GPT or a registered ModelSpec) under the layout the
    config describes."""

    def __init__(self, job: JobConfig, *, env: ClusterEnv | None = None, corpus: Corpus | None = None):
        job.validate()
        self.job = job
        self.env = env or ClusterEnv.detect()
        self.corpus = corpus or load_corpus(job.data)
        self.spec = model_spec(job)
        self.model_cfg = model_config(job, self.corpus.vocab_size)
        record_resolved(job, self.model_cfg)
        job.parallel, self.layout_note = choose_data_parallel(
            job.parallel, params=self.spec.count_params(self.model_cfg), on_gpu=wants_cuda(job.dist))
        self.dims = ParallelDims.from_config(job.parallel, world_size=self.env.world_size,
                                             gpus_per_node=self.env.local_world_size, model=self.model_cfg,
                                             spec=self.spec)
        self.batch: BatchPlan = self.plan_batch()
        self.run_dir = Path(job.run.dir)
        if job.train.deterministic:
            use_deterministic_algorithms()
        if self.env.is_distributed and torch.cuda.is_available():
            enable_flight_recorder(os.environ, run_dir=self.run_dir)  # NCCL reads these at group creation
        self.ctx: DistContext = init_distributed(self.env, job.dist)
        self.device = self.ctx.device
        self.build_run_dir()
        if self.env.is_distributed and job.health.check_versions:
            check_consistency(env=self.env, strict=True, script=sys.argv[0])  # collective: every rank
        self.mesh = self.dims.build_mesh(self.device.type)  # collective: every rank
        set_mesh_timeouts(self.dims.all_meshes(), job.dist.timeout_s)
        self.engine: Engine = build_engine(job=job, model_cfg=self.model_cfg, dims=self.dims, mesh=self.mesh,
                                           device=self.device, compute_dtype=compute_dtype(job, self.device),
                                           batch=self.batch)
        seed_rank_streams(job.train.seed, self.env.rank)
        self.data, self.val = self.build_data()
        self.optimizer = self.build_optimizer()
        self.scheduler = self.build_scheduler()
        self.rank_infos = gather_rank_infos(self.env)  # collective: every rank; host names, gathered once
        self.guard = NonFiniteGuard(job.train.nonfinite, device=self.device, rank=self.env.rank,
                                    fused_optimizer=bool(self.optimizer.param_groups[0].get("fused")),
                                    hosts=[info.host for info in self.rank_infos])
        self.progress = TrainProgress()
        self.ckpt, self.app_state = self.build_checkpointer()
        self.resume_notes = self.resume()
        self.write_config()  # resuming at another world size may have re-derived the batch
        self.start_step = self.last_saved_step = self.step
        self.sink = MetricsSink(self.run_dir, total_steps=job.train.steps, progress=job.run.progress,
                                tensorboard=job.run.tensorboard, enabled=self.env.is_rank_zero, start_step=self.step)
        self.timer = WorkTimer(self.engine.timed_modules, self.device)
        self.watchdog: HangWatchdog | None = None
        self.stragglers = (StragglerDetector(env=self.env, threshold=job.health.straggler_threshold,
                                             min_gap_s=0.01, gemm_check=job.health.straggler_gemm_check,
                                             compute_device=self.device, ranks=self.rank_infos)
                           if self.env.is_distributed and job.health.straggler_threshold else None)
        self.print_header()
        self.sink.record({**self.start_record(), "hosts": [info.host for info in self.rank_infos]})
        self.profiler: StepProfiler | None = build_profiler(
            job.run, rank=self.env.rank, world_size=self.env.world_size, device=self.device, run_dir=self.run_dir,
            start_step=self.step, say=self.sink.print)

    @property
    def step(self) -> int:
        """Optimizer steps completed (held by ``progress``, which checkpoints save and restore)."""
        return self.progress.step

    @property
    def tokens_seen(self) -> int:
        return self.progress.tokens_seen

    # ---- construction -------------------------------------------------------------------------------------------

    def plan_batch(self) -> BatchPlan:
        """train.micro_batch, grad_accum and global_batch over this world's data-parallel ranks; with PP, checked
        against parallel.pp_microbatches. The engine and the data loaders use this one plan."""
        batch = resolve_batch(self.job.train, dp_size=self.dims.dp_size, seq_len=self.model_cfg.seq_len)
        self.dims.validate_pipeline_batch(batch.micro_batch * batch.grad_accum)
        return batch

    def build_run_dir(self) -> None:
        try:
            (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"run.dir={self.job.run.dir!r}: cannot create {self.run_dir / 'logs'} ({exc.strerror}); "
                              "choose a folder this user can write") from None
        _setup_logging(self.run_dir, self.env)
        self.write_config()

    def write_config(self) -> None:
        """<run.dir>/config.toml: the options this run trains with. Written at start, and again after a resume
        re-derived the batch; what the layout changes without an option of its own is recorded as comments."""
        if not self.env.is_rank_zero:
            return
        notes = []
        if getattr(self, "dims", None) is not None and self.dims.pp > 1 and self.job.model.tie_embeddings:
            notes.append("# model.tie_embeddings: trained untied (pipeline stages cannot share the embedding matrix)")
        (self.run_dir / "config.toml").write_text("".join(f"{n}\n" for n in notes) + self.job.to_toml())

    def build_data(self) -> tuple[StepBatches, list]:
        seq_len = self.model_cfg.seq_len
        train_set = TokenWindows(self.corpus.train, seq_len, self.model_cfg.vocab_size)
        val_set = TokenWindows(self.corpus.val, seq_len, self.model_cfg.vocab_size)
        dp_rank, dp_size = self.engine.dp_rank, self.engine.dp_size
        data = StepBatches(train_set, dp_rank=dp_rank, dp_size=dp_size, seed=self.job.train.seed,
                           micro_batch=self.batch.micro_batch, grad_accum=self.batch.grad_accum, device=self.device,
                           num_workers=self.job.data.num_workers)
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
        fused = t.fused_optimizer and self.device.type == "cuda"
        return torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                                  {"params": no_decay, "weight_decay": 0.0}],
                                 lr=t.lr, betas=(t.beta1, t.beta2), fused=fused or None)

    def build_scheduler(self) -> torch.optim.lr_scheduler.LambdaLR:
        t = self.job.train

        def factor(step: int) -> float:  # linear warm-up, then cosine decay to min_lr
            if step < t.warmup_steps:
                return (step + 1) / t.warmup_steps
            progress = min(1.0, (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps))
            return (t.min_lr + 0.5 * (t.lr - t.min_lr) * (1 + math.cos(math.pi * progress))) / t.lr

        return torch.optim.lr_scheduler.LambdaLR(self.optimizer, factor)

    def build_checkpointer(self) -> tuple[Checkpointer, dict[str, Any]]:
        """The checkpointer and the state it saves: model+optimizer (sharded, via DCP), schedule, this trainer's
        progress and its data loader's position (the live objects: loading restores them in place), every rank's RNG
        streams. Collective: every rank (it creates gloo groups)."""
        cfg = self.job.checkpoint
        folder = cfg.dir if cfg.dir else self.run_dir / "checkpoints"  # a path, or an s3:// / gs:// URL
        preemption = install_sigterm_handler(grace_s=cfg.signal_grace_s) if cfg.final else None
        layout = {"world_size": self.env.world_size, "nodes": self.env.num_nodes, "dp_replicate": self.dims.dp_replicate,
                  "dp_shard": self.dims.dp_shard, "tp": self.dims.tp, "pp": self.dims.pp,
                  "global_batch": self.batch.global_batch, "micro_batch": self.batch.micro_batch,
                  "grad_accum": self.batch.grad_accum}
        ckpt = Checkpointer(cfg, folder=folder, env=self.env, layout=layout, config_fingerprint=self.fingerprint(),
                            preemption=preemption)
        state = {"model_optim": ModelOptimState(self.engine.model_parts, [self.optimizer]),
                 "scheduler": SchedulerState(self.scheduler), "trainer": self.progress, "data": self.data,
                 "rng": RNGState(self.env, seed=self.job.train.seed)}
        return ckpt, state

    def fingerprint(self) -> str:
        """What must match for a resume to continue the same run: model, data and optimisation settings."""
        config = self.job.to_dict()
        optimisation = ("lr", "min_lr", "warmup_steps", "weight_decay", "beta1", "beta2", "grad_clip", "seed", "dtype")
        relevant = {"model": config["model"], "data": config["data"], "data_fingerprint": self.corpus.fingerprint,
                    "train": {k: config["train"][k] for k in optimisation}}
        return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()[:16]

    def resume(self) -> list[str]:
        """Load the checkpoint that checkpoint.resume names (newest valid by default); collective."""
        manifest = self.ckpt.load(self.app_state)  # restores self.progress and self.data's position in place
        if manifest is None:
            return self.ckpt.notes
        saved_batch = manifest.get("layout", {}).get("global_batch", self.batch.global_batch)
        if saved_batch != self.batch.global_batch:
            self.keep_global_batch(saved_batch)
        return self.ckpt.notes

    def keep_global_batch(self, saved: int) -> None:
        """The world size changed: keep the checkpoint's global batch by re-deriving accumulation, or refuse."""
        if self.job.train.global_batch and self.job.train.global_batch != saved:
            raise ConfigError(f"train.global_batch={self.job.train.global_batch} differs from the checkpoint's "
                              f"{saved}; the data position cannot continue exactly. Set --train.global_batch={saved}"
                              " or start a new run with --checkpoint.resume=none")
        before = self.batch
        self.job.train.global_batch, self.job.train.grad_accum = saved, 0
        self.batch = self.plan_batch()
        position = self.data.position  # global: the new per-rank batches continue from it
        self.data, self.val = self.build_data()
        self.data.seek(position)
        self.app_state["data"] = self.data
        self.ckpt.layout.update(global_batch=self.batch.global_batch, grad_accum=self.batch.grad_accum)
        message = (f"keeping the checkpoint's global batch {saved}: {before.dp_size} -> {self.batch.dp_size} "
                   f"data-parallel ranks, accumulation {before.grad_accum} -> {self.batch.grad_accum}")
        self.ckpt.notes.append(message)
        log.warning(message)

    def save_checkpoint(self, *, final: bool = False) -> None:
        """Collective: every rank, at the same step. A step already saved (or just resumed from) is not saved again."""
        if self.step == self.last_saved_step:
            return
        self.last_saved_step = self.step
        # a save may take up to checkpoint.timeout_s: not a hang until then
        self.beat("checkpoint", timeout_s=max(self.job.checkpoint.timeout_s, self.job.health.hang_timeout_s))
        started = time.perf_counter()
        self.ckpt.save(self.step, self.app_state, final=final,
                       meta={"epoch": self.data.position.epoch, "tokens_seen": self.tokens_seen,
                             "samples_in_epoch": self.data.position.consumed})
        how = "published" if final or not self.job.checkpoint.async_save else "staged; writing in the background"
        seconds = time.perf_counter() - started
        self.sink.print(f"checkpoint step {self.step} -> {self.ckpt.folder} ({how}, {seconds:.2f} s)")
        self.sink.record({"kind": "checkpoint", "step": self.step, "final": final, "seconds": round(seconds, 3)})

    def start_record(self) -> dict[str, Any]:
        """metrics.jsonl's ``start`` record: layout, batch and model as this process group trains them."""
        env, b = self.env, self.batch
        formula = (f"{b.global_batch} = {b.micro_batch} (B_local) x {b.dp_size // max(1, env.num_nodes)} (G) x "
                   f"{env.num_nodes} (N) x {b.grad_accum} (A)")
        return start_record(step=self.step, restart=env.restart_count, world_size=env.world_size,
                            nodes=env.num_nodes, layout=describe_layout(self.dims), batch_formula=formula,
                            global_batch=b.global_batch, tokens_per_step=b.tokens_per_step,
                            model=self.job.model.name, params=self.spec.count_params(self.model_cfg),
                            device=str(self.device))

    def print_header(self) -> None:
        env, b, m = self.env, self.batch, self.model_cfg
        log.info("rank %d of %d on %s: node %d of %d, local rank %d of %d (%s)", env.rank, env.world_size,
                 socket.gethostname(), env.node_rank, env.num_nodes, env.local_rank, env.local_world_size, env.source)
        params = count_unique_params(self.engine.model_parts)
        per_node = (f"{env.num_nodes} node(s) of different sizes" if env.nodes_differ
                    else f"{env.num_nodes} node(s) x {b.dp_size // max(1, env.num_nodes)} per node")
        lines = [
            f"meshrun train | {env.source}: {env.describe_nodes()} | {self.ctx.backend or 'no process group'} on "
            f"{self.device}",
            f"model {self.job.model.arch} {self.job.model.name}: {params / 1e6:.2f}M parameters on this rank, "
            f"{m.n_layers} layers, dim "
            f"{m.dim}, {m.n_heads} heads, seq {m.seq_len}, vocab {m.vocab_size}",
            f"data: {self.corpus.description}; fingerprint {self.corpus.fingerprint[:12]}",
            f"global batch {b.global_batch} = {b.micro_batch} per rank (B_local) x {b.dp_size} data-parallel ranks "
            f"({per_node}) x {b.grad_accum} accumulation"
            f" (A)",
            f"tokens per step will be: {b.tokens_per_step:,} ({b.global_batch} x {m.seq_len}); epoch = "
            f"{self.data.sampler.steps_per_epoch:,} steps ({len(self.data.sampler.dataset) - self.data.sampler.usable}"
            " tail samples dropped per epoch)",
            f"config: {self.run_dir / 'config.toml'}",
        ]
        lines[1:1] = [f"layout: {describe_layout(self.dims)}", *([self.layout_note] if self.layout_note else []),
                      describe_speed(self.job, self.device, compute_dtype(self.job, self.device))]
        if self.step:
            lines.append(f"resumed at step {self.step} (epoch {self.data.position.epoch}, "
                         f"{self.data.position.consumed:,} samples into it) from {self.ckpt.folder}")
        for section, values in self.job.to_dict().items():
            lines.append(f"  [{section}] " + " ".join(f"{k}={v}" for k, v in values.items()))
        self.sink.print("\n".join(lines))

    # ---- the loop -------------------------------------------------------------------------------------------------

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One optimizer step over grad_accum micro-batches: returns (loss_sum, tokens, grad_norm), on device."""
        start = time.perf_counter()
        batches = self.data.next_step()
        self.timer.add_data(time.perf_counter() - start)
        first = self.step == self.start_step  # compiles and warms up: as slow as a checkpoint, not a hang
        self.beat("forward_backward", timeout_s=max(1800.0, self.job.health.hang_timeout_s) if first else None)
        loss_sum, tokens = self.engine.forward_backward(batches)
        self.beat("optimizer")
        clip = self.job.train.grad_clip or (float("inf") if self.guard.enabled else 0.0)  # inf: the norm alone
        grad_norm = self.engine.clip_grad_norm(clip) if clip else None
        if grad_norm is None or self.guard.allow_step(self.step + 1, grad_norm, loss_sum, self.optimizer):
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.progress.step += 1
        self.progress.tokens_seen += self.batch.tokens_per_step
        return loss_sum, tokens, grad_norm

    @torch.no_grad()
    def evaluate(self) -> float:
        """Validation loss over every rank's fixed batches (one all-reduce; every rank must call it)."""
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
        if self.watchdog is not None:
            self.watchdog.beat(self.step, phase, timeout_s=timeout_s)

    def fit(self) -> TrainResult:
        """Train to ``train.steps``; the hang watchdog and the profiler (run.profile_steps) run for the loop."""
        if self.env.is_distributed and self.job.health.hang_timeout_s:
            self.watchdog = HangWatchdog(env=self.env, timeout_s=self.job.health.hang_timeout_s,
                                         stack_file=self.run_dir / "logs" / f"stacks_rank_{self.env.rank:05d}.txt",
                                         log=log.error, end_job=self.job.health.hang_action == "exit").start()
        if self.profiler is not None:
            self.profiler.start()
        try:
            return self._loop()
        finally:
            if self.profiler is not None:
                self.profiler.close()  # an error or SIGTERM inside the window: writes what was recorded
            if self.watchdog is not None:
                self.watchdog.stop()  # before the process group (and its store) goes away

    def _loop(self) -> TrainResult:
        job, result = self.job, TrainResult(step=self.step, run_dir=self.run_dir)
        if self.step >= job.train.steps:
            self.sink.print(f"nothing to train: resumed at step {self.step} >= train.steps={job.train.steps}; raise "
                            "--train.steps, or start over with a new --run.dir or --checkpoint.resume=none")
        sums = SumMetrics(("loss_sum", "tokens"), self.device)
        interval_start, interval_steps, gnorm = time.perf_counter(), 0, None
        while self.step < job.train.steps:
            loss_sum, tokens, grad_norm = self.train_step()
            sums.add(loss_sum=loss_sum, tokens=tokens)
            interval_steps += 1
            if self.step % job.train.log_every == 0 or self.step == job.train.steps:
                totals = sums.reduce()
                gnorm = float(grad_norm) if grad_norm is not None else None
                elapsed = time.perf_counter() - interval_start
                record = self.train_record(totals, interval_steps, elapsed, gnorm)
                result.losses.append(record["loss"])
                self.sink.log(record)
                self.check_nonfinite()
                self.check_stragglers(interval_steps, elapsed)
                interval_start, interval_steps = time.perf_counter(), 0
            if job.train.eval_every and (self.step % job.train.eval_every == 0 or self.step == job.train.steps):
                self.beat("evaluate")
                result.val_loss = self.evaluate()
                self.sink.log({"kind": "eval", "step": self.step, "loss": result.val_loss})
                interval_start = time.perf_counter()  # evaluation time is not training throughput
            if self.checkpoint_due():
                self.save_checkpoint(final=self.ckpt.stop_requested)  # SIGTERM: the job's last save, final
                interval_start = time.perf_counter()
                if self.ckpt.stop_requested:
                    result.stopped_by = self.stop_signal()
                    self.sink.print(f"stopping at step {self.step} after {result.stopped_by} (checkpoint saved)")
                    break
            if self.profiler is not None:  # after logging, evaluation and saving: they belong to this step
                self.beat("profiler")  # writing the trace after the window's last step can take a while
                self.profiler.step(self.step)
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

    def check_nonfinite(self) -> None:
        """At log steps: warn about steps whose gradient norm was NaN or inf (train.nonfinite=stop raises)."""
        report = self.guard.check(self.step, self.env.world_size) if self.guard.enabled else None
        if report is not None:
            self.sink.print(f"warning: {report}")
            log.warning("%s", report)

    def check_stragglers(self, steps: int, elapsed: float) -> None:
        """Every rank's own working time (data + forward, before any blocking collective), peak memory and, for the
        straggler detector, GPU clock, in one gather: the ``ranks`` record, and the numbers compared across ranks."""
        work_s, data_s = self.timer.take(steps)
        step_s = elapsed / max(steps, 1)
        # the first interval holds warm-up (compilation, allocator growth), not a rank's speed
        observe = self.stragglers is not None and self.step > self.start_step + self.job.train.log_every
        row = timing_row(work_s=work_s, data_s=data_s, step_s=step_s, device=self.device)
        if observe:
            row += self.stragglers.gpu_clock()
        table = gather_floats(row)  # collective: every rank; (world, 4), or (world, 7) with the clock
        if self.env.is_rank_zero:
            self.sink.record(ranks_record(table, step=self.step, step_s=step_s))
        if not observe:
            return
        self.beat("straggler_check")
        times = np.concatenate([table[:, :2], table[:, len(TIMING_FIELDS):]], axis=1)  # (world, 5): work, data, clock
        report = self.stragglers.observe_table(self.step, times)  # collective when the GEMM is re-run
        if report is not None:
            self.sink.print(f"warning: {report}")
            log.info("%s", report)

    def train_record(self, totals: dict[str, float], steps: int, elapsed: float, gnorm: float | None) -> dict[str, Any]:
        tokens_per_s = steps * self.batch.tokens_per_step / max(elapsed, 1e-9)
        per_device = tokens_per_s / self.env.world_size
        peak = peak_flops(self.device)
        # MFU = achieved model FLOP/s per device / peak: (6N + 12 L d T) FLOPs per token (PaLM, appendix B).
        mfu = self.spec.flops_per_token(self.model_cfg) * per_device / peak if peak else None
        return {"kind": "train", "step": self.step, "epoch": self.data.position.epoch,
                "loss": totals["loss_sum"] / max(totals["tokens"], 1.0), "lr": self.scheduler.get_last_lr()[0],
                "tokens_seen": self.tokens_seen, "tokens_per_s": tokens_per_s, "tokens_per_s_per_device": per_device,
                "mfu": mfu, "grad_norm": gnorm, "step_time_s": elapsed / max(steps, 1),
                "peak_mem_gib": torch.cuda.max_memory_allocated(self.device) / 2**30
                if self.device.type == "cuda" else None}

    def close(self) -> None:
        """Finish pending checkpoint writes and metrics, and give the process its own SIGTERM/SIGUSR1 handlers back
        (a closed trainer in a notebook or test process must not keep catching them)."""
        self.ckpt.close()
        self.sink.close()
        if self.ckpt.preemption is not None:
            self.ckpt.preemption.restore()


def _setup_logging(run_dir: Path, env: ClusterEnv) -> None:
    """Rank 0 logs to the console; every rank logs to logs/rank_XXXXX.log with its rank in each line."""
    logger = logging.getLogger("meshrun")
    logger.setLevel(logging.INFO)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    fmt = logging.Formatter(f"%(asctime)s [rank {env.rank}] %(levelname)s %(message)s")
    file_handler = logging.FileHandler(run_dir / "logs" / f"rank_{env.rank:05d}.log")
    file_handler.setFormatter(fmt)
    logger.addHandler(file_handler)
    logger.propagate = False
    if dist.is_initialized() and not env.is_rank_zero:
        return
    console = logging.StreamHandler()
    console.setLevel(logging.WARNING)
    console.setFormatter(fmt)
    logger.addHandler(console)
