"""meshrun's pieces for a user's own training script, with their own model and dataset.

    session = meshrun.Session(seed=0, checkpoint="ckpt")    # reads torchrun / meshrun launch / SLURM, starts the group
    model = session.prepare_model(MyModel(), layout="fsdp")  # or "ddp", "hsdp", "tp", "tp+fsdp" ("pp": step())
    optimizer = torch.optim.AdamW(model.parameters())
    batches = session.step_batches(dataset, micro_batch=32, global_batch=256)
    start = session.resume(model=model, optimizer=optimizer, batches=batches)   # 0 when nothing was saved
    session.watch_health(hang_timeout_s=300)               # hang watchdog + straggler reports
    for step in range(start + 1, steps + 1):
        for i, (x, y) in enumerate(batches.next_step()):
            with session.sync_gradients(model, last=i == batches.grad_accum - 1):
                loss_fn(model(x), y).backward()
        optimizer.step(); optimizer.zero_grad()
        session.heartbeat(step)                             # one call per step
        if step % 100 == 0:
            session.save(step, model=model, optimizer=optimizer, batches=batches)
    totals = session.sum_metrics(correct=..., total=...)   # exact: every sample counted once

Replica groups (torchft; docs/fault_tolerance.md): ``Session(replicas=ReplicaConfig(groups=2, group=g,
lighthouse="host:29510"))``, then after ``resume``: ``ft = session.join_replicas(start, model=..., optimizer=...,
batches=...)`` and per step ``ft.start_step()``; forward/backward; ``if not ft.average_gradients(): continue``
(the step did not commit: run it again); ``optimizer.step()``; the step counter is ``ft.step``.
    session.print(...)                                      # rank 0 only

Runs unchanged as one process (``python train.py``) and under ``meshrun launch``/``torchrun``/``srun``. Layouts
come from meshrun.parallel.module (the trainer's own parallelisation code), checkpoints from
meshrun.ckpt.Checkpointer (manifest, checksums, COMPLETE, retention, async, RNG streams, data position) and health
from meshrun.watch.health (the hang watchdog and the straggler detector), as in ``meshrun train``.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn
from torch.utils.data import Dataset

from meshrun.config import CheckpointConfig, ConfigError, DistConfig, ReplicaConfig, TrainConfig, resolve_batch
from meshrun.data.loader import StepBatches
from meshrun.comm.mesh import ParallelDims
from meshrun.comm.process_group import init_distributed, shutdown
from meshrun.env import ProcessPlacement
from meshrun.parallel.module import (ModuleLayout, check_layout_word, check_session_graphs, layout_dims,
                                     prepare_module, session_reduce_dtype, session_residual)
from meshrun.parallel.module_pipeline import PipelinedModule, PipelineOptions, prepare_pipeline
from meshrun.rng import seed_rank_streams
from meshrun.ckpt.session import SessionCheckpoints, model_fingerprint
from meshrun.watch.health import JobHealth
from meshrun.train.metrics import SumMetrics
from meshrun.train.replicas import ReplicaGroups, data_shard


class Session:
    """Placement, device, parallel layouts, data sharding, exact metrics, checkpoints and health."""

    def __init__(self, *, seed: int = 1234, dist_config: DistConfig | None = None, env: ProcessPlacement | None = None,
                 checkpoint: CheckpointConfig | str | None = None, replicas: ReplicaConfig | None = None):
        if replicas is not None:
            replicas.check()
        self.replicas_config = replicas if replicas is not None and replicas.groups else None
        self.replicas: ReplicaGroups | None = None
        self.env = env or ProcessPlacement.detect()
        self.ctx = init_distributed(self.env, dist_config or DistConfig())
        self.device = self.ctx.device
        self.seed = seed
        torch.manual_seed(seed)  # a model built next starts from the same weights on every rank
        self.layout: ModuleLayout | None = None
        cfg = CheckpointConfig(dir=checkpoint) if isinstance(checkpoint, str) else checkpoint
        self.checkpoints = SessionCheckpoints(cfg, env=self.env, seed=seed) if cfg is not None else None
        self._batches: StepBatches | None = None
        self._batches_split: tuple[str, int, tuple[int, ...]] | None = None  # (layout name, dp size, dp rank by rank)
        self._health: JobHealth | None = None
        self._graph_steps = None  # the optimizer-step hook of prepare_model(cuda_graphs=True)
        self._every = 10

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel rank (ranks of one TP group see the same data)."""
        return self.layout.dims.dp_rank(self.rank) if self.layout else self.rank

    @property
    def dp_size(self) -> int:
        return self.layout.dims.dp_size if self.layout else self.world_size

    def prepare_model(self, model: nn.Module, layout: str = "ddp", *, tp: int = 0, dp_replicate: int = 0,
                      pp: int = 0, blocks: str | None = None, tp_plan: Mapping[str, Any] | None = None,
                      pipeline: PipelineOptions | None = None, activation_checkpoint: str = "none",
                      compute_dtype: torch.dtype | str | None = "auto",
                      compile: bool = False, compile_mode: str = "default", grad_reduce_dtype: str = "fp32",
                      cuda_graphs: bool = False, residual_dtype: str = "fp32") -> nn.Module | PipelinedModule:
        """Apply ``layout`` (ddp, fsdp, hsdp, tp, tp+fsdp, pp, pp+fsdp) on this rank's device; see
        meshrun.parallel.module and, for pp, meshrun.parallel.module_pipeline.

        ``compute_dtype="auto"``: bf16 parameters with fp32 gradient reduction where FSDP2 holds them on a GPU, fp32
        otherwise (DDP, one process: autocast in your loop); None or torch.float32 keeps fp32 everywhere.
        ``compile=True`` compiles each repeated block in place before FSDP2 wraps it, as ``meshrun train`` does.
        ``compile_mode="max-autotune"`` (with ``compile=True``) has inductor benchmark each matmul shape against its
        Triton templates, as ``--train.compile_mode`` does: minutes more of compilation, for a step that is at times
        faster (1b FSDP2: 1.4-3.9% faster on 2 H200s, 1.3% slower on 2 H100s; 124m DDP and 1b TP level;
        docs/performance.md). With TP and ``compile=True`` on a CUDA GPU inductor reorders the collectives inside the
        compiled blocks beside independent compute (meshrun train's parallel.comm_reorder=auto; process-wide).
        ``grad_reduce_dtype="bf16"`` sums gradients across data-parallel ranks in bf16 (DDP, FSDP2, HSDP; half the
        bytes of the default fp32). For FSDP2 computing in bf16 on one node with one micro-batch per optimizer step
        it is meshrun train's default, 1.02-1.03x fp32 on a 1B model on 2 H200s; for DDP within a node it was slower.
        With gradient accumulation (``sync_gradients``) FSDP2 then adds the micro-batches' gradients in bf16 too, so
        keep fp32 there (docs/performance.md).
        ``cuda_graphs=True`` (with ``compile=True``, layout ddp, fsdp, hsdp or one process, on a CUDA GPU) records the
        compiled model as CUDA graphs and replays them, so the host no longer launches each kernel (meshrun train's
        default there); DDP's all-reduce then runs per 100 MiB bucket during backward; FSDP2 holds the whole model as
        one unit, its forward compiled as one graph (as meshrun train does below 350M parameters; from that size a
        start-up note says to drop cuda_graphs). Each ``optimizer.step()`` of any
        optimizer starts a new replay generation, so a loop must call it once per training step, after all of the
        step's micro-batches (gradient accumulation stays correct); evaluation in between is fine. The next step's
        replay overwrites the model's outputs of this one: ``.item()`` or ``.clone()`` what you keep past
        ``optimizer.step()``.
        ``residual_dtype="bf16"`` casts each block's first input (the hidden state between blocks) to the autocast
        dtype while your loop autocasts, so the stream between the blocks, its gradient and a pipeline's sends stay
        bf16, as ``meshrun train`` does by default for one process and DDP (1.05x the fp32 stream on 124m on one
        H200; docs/performance.md); without autocast it changes nothing.
        Rank 0 prints one line saying what was applied.

        FSDP2 shards each repeated block (``blocks``, a dotted path, or detected), then the root; TP follows
        ``tp_plan`` (or the model's ``tp_plan`` attribute). ``pp`` cuts the blocks into pipeline stages and returns
        a PipelinedModule (train it with ``step(inputs, targets)``; ``pipeline`` sets schedule, micro-batches and
        loss). Every rank starts from rank 0's weights. Per-rank random streams (seed + rank) are set afterwards,
        for dropout and augmentation. Collective."""
        session_reduce_dtype(grad_reduce_dtype)  # refused before any collective
        session_residual(residual_dtype)
        check_layout_word(layout)  # in one process too, where any layout runs as one: not only at scale
        if layout.startswith("pp"):
            if cuda_graphs:
                check_session_graphs(layout, whole_graph=False, compile=compile, device=self.device)
            if tp or dp_replicate or tp_plan:
                raise ConfigError(f"layout={layout!r} takes no tp, dp_replicate or tp_plan (pipelines here combine "
                                  "with DDP-style replication ('pp') or FSDP2 ('pp+fsdp') only); drop them")
            self._check_batches_split(layout, pp=pp)
            prepared, self.layout = prepare_pipeline(
                model, layout, device=self.device, world_size=self.world_size, nodes=self.env.num_nodes, pp=pp,
                blocks=blocks, options=pipeline, activation_checkpoint=activation_checkpoint,
                compute_dtype=compute_dtype, compile=compile, compile_mode=compile_mode,
                grad_reduce_dtype=grad_reduce_dtype, residual_dtype=residual_dtype)
        else:
            if pp or pipeline is not None:
                raise ConfigError(f"pp={pp} / pipeline= need layout='pp' or 'pp+fsdp', not {layout!r}")
            self._check_batches_split(layout, tp=tp, dp_replicate=dp_replicate)
            prepared, self.layout = prepare_module(
                model, layout if self.world_size > 1 else "none", device=self.device, world_size=self.world_size,
                nodes=self.env.num_nodes, tp=tp, dp_replicate=dp_replicate, blocks=blocks, tp_plan=tp_plan,
                activation_checkpoint=activation_checkpoint, compute_dtype=compute_dtype, compile=compile,
                compile_mode=compile_mode, grad_reduce_dtype=grad_reduce_dtype, cuda_graphs=cuda_graphs,
                residual_dtype=residual_dtype)
            if cuda_graphs and self._graph_steps is None:
                self._graph_steps = replay_generation_per_optimizer_step()
        self.print(self.layout.describe(self.device, compute_dtype))
        if self.layout.note:
            self.print(f"meshrun: {self.layout.note}")  # the start-up line says what the layout word ran as
        seed_rank_streams(self.seed, self.rank)
        return prepared

    def step_batches(self, dataset: Dataset, *, micro_batch: int, global_batch: int = 0,
                     grad_accum: int = 0) -> StepBatches:
        """This rank's micro-batches of each optimizer step; B_global = micro_batch x dp ranks x accumulation.
        Call it after prepare_model: the layout decides how many data-parallel ranks share the batch (the ranks of
        a TP group or of one pipeline read the same samples). Before it, every rank counts as a data-parallel one (a
        script that wraps the model itself), and a later prepare_model whose layout splits the batch otherwise
        raises ConfigError instead of training on the wrong samples."""
        for name, value, least in (("micro_batch", micro_batch, 1), ("global_batch", global_batch, 0),
                                   ("grad_accum", grad_accum, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ConfigError(f"{name}={value!r} must be an integer >= {least}"
                                  + (" (0: derived from the others)" if least == 0 else ""))
        plan = resolve_batch(TrainConfig(micro_batch=micro_batch, global_batch=global_batch, grad_accum=grad_accum),
                             dp_size=self.dp_size, seq_len=1, prefix="")
        if hasattr(dataset, "__len__") and len(dataset) < plan.global_batch:
            raise ConfigError(f"the dataset has {len(dataset)} samples, fewer than one global batch of "
                              f"{plan.global_batch} (micro_batch={micro_batch} x {self.dp_size} data-parallel ranks x "
                              f"{plan.grad_accum} accumulation); give more samples or a smaller global_batch or "
                              "micro_batch")
        dp_rank, dp_size = data_shard(self.replicas_config, self.dp_rank, self.dp_size)  # a group reads its share
        self._batches = StepBatches(dataset, dp_rank=dp_rank, dp_size=dp_size, seed=self.seed,
                                    micro_batch=micro_batch, grad_accum=plan.grad_accum, device=self.device)
        self._batches_split = (("no layout yet: every rank a data-parallel one", self.world_size,
                                tuple(range(self.world_size))) if self.layout is None
                               else (self.layout.name, *self._data_split(self.layout.dims)))
        return self._batches

    def _data_split(self, dims: ParallelDims) -> tuple[int, tuple[int, ...]]:
        """(data-parallel size, the data shard of every global rank) under ``dims``: the same on every rank."""
        return dims.dp_size, tuple(dims.dp_rank(r) for r in range(self.world_size))

    def _check_batches_split(self, layout: str, *, tp: int = 0, dp_replicate: int = 0, pp: int = 0) -> None:
        """Refuse a layout that splits each batch otherwise than the StepBatches step_batches already made, before
        any collective. Every rank compares the shards of all ranks, so all of them refuse together."""
        if self._batches_split is None or self.world_size == 1:  # one process: one data-parallel rank, any layout
            return
        dims = layout_dims(layout, world_size=self.world_size, nodes=self.env.num_nodes, tp=tp,
                           dp_replicate=dp_replicate, pp=pp)
        name, size, shards = self._batches_split
        new_size, new_shards = self._data_split(dims)
        if (size, shards) == (new_size, new_shards):
            return
        order = f" (data shard by rank {list(shards)}, not {list(new_shards)})" if size == new_size else ""
        raise ConfigError(f"Session.prepare_model(layout={layout!r}): Session.step_batches already split each batch "
                          f"over {size} data-parallel rank(s) ({name}), but layout={layout!r} "
                          f"splits it over {new_size}{order}; call prepare_model first and step_batches after it, "
                          "or start a new Session for another layout")

    @contextlib.contextmanager
    def sync_gradients(self, model: nn.Module, *, last: bool) -> Iterator[None]:
        """Reduce gradients only on the last micro-batch of an optimizer step (DDP's no_sync, FSDP2's
        set_requires_gradient_sync)."""
        if hasattr(model, "set_requires_gradient_sync"):
            model.set_requires_gradient_sync(last)
            yield
        elif last or not hasattr(model, "no_sync"):
            yield
        else:
            with model.no_sync():
                yield

    def sum_metrics(self, **values: float | torch.Tensor) -> dict[str, float]:
        """Sum each value over the data-parallel ranks, counting a TP group once (one all-reduce every rank must
        reach; the ranks of a TP group hold the same values)."""
        sums = SumMetrics(tuple(values), self.device)
        sums.add(**values)
        totals = sums.reduce()  # collective: every rank
        tp = self.layout.dims.tp if self.layout else 1
        return {k: v / tp for k, v in totals.items()} if tp > 1 else totals

    def join_replicas(self, step: int = 0, *, model: nn.Module | PipelinedModule, optimizer: torch.optim.Optimizer,
                      batches: StepBatches | None = None, scheduler: Any = None) -> ReplicaGroups:
        """Join the other replica groups (``Session(replicas=...)``) at ``step`` (what ``resume`` returned). The
        returned object runs the per-step protocol: ``start_step()`` (quorum; heals this group from a live one when
        it is behind), ``average_gradients()`` (after backward: True = step the optimizer), ``step``."""
        if self.replicas_config is None:
            raise ConfigError("join_replicas needs Session(replicas=ReplicaConfig(groups=N, group=G, lighthouse=...))")
        batches = batches or self._batches
        if batches is None:
            raise ValueError("join_replicas needs the StepBatches (session.step_batches) a healing group continues")
        self.replicas = ReplicaGroups(self.replicas_config, env=self.env, device=self.device, seed=self.seed,
                                      parts=self._parts(model), optimizer=optimizer, data=batches,
                                      scheduler=scheduler)
        self.replicas.manager.load_state_dict({"step": step, "batches_committed": 0})
        self.replicas.say = self.print
        return self.replicas

    # ---- checkpoints ----------------------------------------------------------------------------------------------

    def save(self, step: int, *, model: nn.Module | PipelinedModule, optimizer: torch.optim.Optimizer | None = None,
             batches: StepBatches | None = None, scheduler: Any = None, extra: dict[str, float] | None = None,
             final: bool = False) -> Path | str | None:
        """Save a sharded checkpoint of step ``step`` (collective: every rank, same step); returns its folder (a
        URL for an ``s3://`` or ``gs://`` checkpoint folder). With replica groups only the quorum's first group
        writes (the others return None)."""
        if self.replicas is not None and not self.replicas.saves_checkpoints():
            return None
        return self._checkpoints().save(step, parts=self._parts(model), fingerprint=self._fingerprint(model),
                                        optimizer=optimizer, batches=batches or self._batches, scheduler=scheduler,
                                        extra=extra, layout=self.layout, final=final)

    def resume(self, *, model: nn.Module | PipelinedModule, optimizer: torch.optim.Optimizer | None = None,
               batches: StepBatches | None = None, scheduler: Any = None, extra: dict[str, float] | None = None,
               path: str | None = None) -> int:
        """Load the newest complete checkpoint (or ``path``) into the given objects, at any world size and layout;
        ``batches`` continues from the saved data position and ``extra`` is updated in place. Returns the saved
        step, or 0 when there is none. Collective."""
        return self._checkpoints().resume(parts=self._parts(model), fingerprint=self._fingerprint(model),
                                          optimizer=optimizer, batches=batches or self._batches,
                                          scheduler=scheduler, extra=extra, layout=self.layout, path=path)

    def _checkpoints(self) -> SessionCheckpoints:
        if self.checkpoints is None:
            raise ValueError("Session(checkpoint=...) is not set: give a folder, e.g. Session(checkpoint='ckpt'), "
                             "or a CheckpointConfig")
        return self.checkpoints

    def _parts(self, model: nn.Module | PipelinedModule) -> list[nn.Module]:
        """The modules with their own parameter names: this rank's pipeline stages, or the model (never the DDP
        wrapper)."""
        if isinstance(model, PipelinedModule):
            return model.parts
        return [model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model]

    def _fingerprint(self, model: nn.Module | PipelinedModule) -> str:
        """The whole model's parameter names and shapes (a pipeline stage holds only some of them)."""
        return model.fingerprint if isinstance(model, PipelinedModule) else model_fingerprint(self._parts(model)[0])

    # ---- health ---------------------------------------------------------------------------------------------------

    def watch_health(self, model: nn.Module | PipelinedModule | None = None, *, hang_timeout_s: float = 300.0,
                     straggler_threshold: float = 1.5, every: int = 10, stack_dir: str | None = None,
                     on_hang: Callable[[str], None] | None = None) -> None:
        """Start the hang watchdog (a rank without a heartbeat for ``hang_timeout_s`` is named, with its host and
        where the others wait) and straggler reports every ``every`` heartbeats (a rank whose own work -- data wait
        and forward passes of ``model`` -- is ``straggler_threshold`` x the median's). No-op in one process.
        ``on_hang`` receives each hang message (e.g. to abort). Collective (it gathers host names)."""
        if not self.env.is_distributed:
            return
        self._every = max(1, every)
        parts = self._parts(model) if model is not None and straggler_threshold else []
        self._health = JobHealth(env=self.env, device=self.device, parts=parts,
                                 straggler_threshold=straggler_threshold)  # collective: gathers host names
        self._health.start_watchdog(timeout_s=hang_timeout_s, stack_dir=stack_dir, on_hang=on_hang)

    def heartbeat(self, step: int) -> str | None:
        """Call once per step on every rank: tells the watchdog this rank made progress and, every ``every``
        steps, gathers the ranks' work times (collective); returns the straggler report on rank 0, else None."""
        health = self._health
        if health is None:
            return None
        health.beat(step, "step")
        if health.stragglers is None or step % self._every:
            return None
        if self._batches is not None:
            health.timer.add_data(self._batches.take_fetch_time())
        work_s, data_s, _ = health.timer.take(self._every)
        if step <= self._every:  # the first interval holds start-up costs (first batches, first kernels)
            return None
        report = health.stragglers.observe(step, work_s, data_s)  # collective: every rank
        notice = health.notice(step, report)  # said again only when it changes
        if notice:
            self.print(f"meshrun: {notice}")
        return str(report) if report is not None else None

    def print(self, *args, **kwargs) -> None:
        if self.env.is_rank_zero:
            print(*args, **kwargs, flush=True)

    def close(self) -> None:
        """Finish pending checkpoint writes, stop the watchdog and destroy the process group (idempotent)."""
        if self.checkpoints is not None:
            self.checkpoints.close()
        if self.replicas is not None:
            self.replicas.close()
            self.replicas = None
        if self._health is not None:
            self._health.stop()  # before the process group (and its store) goes away
        if self._graph_steps is not None:
            self._graph_steps.remove()
            self._graph_steps = None
        shutdown()  # frees the recorded CUDA graphs before the process group


def replay_generation_per_optimizer_step():
    """Session.prepare_model(cuda_graphs=True): a new CUDA-graph replay generation at every optimizer step, of any
    optimizer (a hook torch runs after each ``step()``); returns the hook's handle.

    Without it torch starts a new generation whenever a compiled forward runs with no backward pending, which under
    gradient accumulation is every micro-batch: the second micro-batch's replay would overwrite the memory of the
    first one's gradients, which became ``.grad`` without a copy (pytorch#169545). Marked once here, generations
    change only when marked, as meshrun train marks them once per optimizer step."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    torch.compiler.cudagraph_mark_step_begin()
    return register_optimizer_step_post_hook(lambda optimizer, args, kwargs: torch.compiler.cudagraph_mark_step_begin())
