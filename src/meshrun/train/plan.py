"""The run plan: the job's config resolved once into what this run trains with; the JobConfig given is left as it was.

:meth:`RunPlan.resolve` checks a copy of the config (``validate`` normalises it), then fills in what the options
leave open: the named size's model shape, the data parallelism that runs (parallel.data_parallel), replica groups'
shared checkpoint folder, the mesh degrees and the batch; and it checks the layout against the options, the model
and the device (:func:`meshrun.parallel.checks.check_layout`), so a wrong combination fails before any process
group or model exists. The trainer and its helpers read the plan; a resume that
keeps the checkpoint's global batch at another world size builds a new plan (:meth:`RunPlan.keep_global_batch`).

A refusal at this stage is often every rank's: :func:`resolve_on_node` and :func:`refused_alike_on_node` mark those
that the node's local rank 0 meets too (``ConfigError.same_on_node``), so that train/cli.py says them once per node.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from meshrun.comm.mesh import ParallelDims, choose_data_parallel
from meshrun.comm.schedule_choice import choose_pp_schedule
from meshrun.comm.process_group import choose_device, wants_cuda
from meshrun.config import BatchPlan, ConfigError, JobConfig, TrainConfig, resolve_batch
from meshrun.env import ProcessPlacement
from meshrun.models.build import model_shape, model_spec, resolved_model
from meshrun.models.shape import ModelShape
from meshrun.models.spec import ModelSpec
from meshrun.parallel.checks import check_layout, compute_dtype
from meshrun.train.replicas import group_checkpoint_dir, group_run_dir


@contextmanager
def refused_alike_on_node() -> Iterator[None]:
    """Within: code that reads the options and this node's files but no rank, so that a ConfigError it raises is
    raised alike by every rank of the node: it leaves marked ``same_on_node``."""
    try:
        yield
    except ConfigError as exc:
        exc.same_on_node = True
        raise


def validated(job: JobConfig) -> JobConfig:
    """A checked copy of ``job`` (its tri-state options normalised); ConfigError naming the option. ``job`` itself
    is not changed."""
    checked = copy.deepcopy(job)
    checked.validate()
    return checked


def plan_batch(train: TrainConfig, dims: ParallelDims, shape: ModelShape) -> BatchPlan:
    """train.micro_batch, grad_accum and global_batch over this world's data-parallel ranks; with PP, checked
    against parallel.pp_microbatches (resolved here when 0). The engine and the data loaders use this one plan."""
    batch = resolve_batch(train, dp_size=dims.dp_size, seq_len=shape.seq_len)
    dims.resolve_pipeline_batch(batch.micro_batch * batch.grad_accum, seq_len=batch.seq_len)
    return batch


@dataclass(frozen=True)
class RunPlan:
    """What one run trains with, resolved once."""

    job: JobConfig
    """The resolved config (a copy): what config.toml, each checkpoint's meta.config and the trackers record."""
    spec: ModelSpec
    """The registered model model.arch selects."""
    shape: ModelShape
    """The model's shape with every size set."""
    dims: ParallelDims
    """The mesh degrees (it holds the meshes once built)."""
    batch: BatchPlan
    """Micro-batch, accumulation and global batch over the data-parallel ranks."""
    layout_note: str
    """The start-up header's line on the data parallelism parallel.data_parallel chose ('' when none)."""
    run_dir: Path
    """Where this run (this replica group) writes its logs and metrics."""

    @classmethod
    def resolve(cls, job: JobConfig, *, env: ProcessPlacement, vocab_size: int) -> RunPlan:
        """The plan of ``job`` (validated: see :func:`validated`) on this world, for a corpus of ``vocab_size``
        tokens. Raises ConfigError naming the option."""
        spec = model_spec(job)
        shape = model_shape(job, vocab_size)
        parallel, note = choose_data_parallel(job.parallel, params=spec.count_params(shape),
                                              on_gpu=wants_cuda(job.dist), world_size=env.world_size)
        auto, schedule_note = choose_pp_schedule(parallel, n_layers=shape.n_layers, on_gpu=wants_cuda(job.dist),
                                                 world_size=env.world_size, cuda_graphs=job.train.cuda_graphs)
        try:
            return cls._resolved(job, auto, " | ".join(n for n in (note, schedule_note) if n), spec=spec,
                                 shape=shape, env=env)
        except ConfigError:
            if not schedule_note:
                raise
            # the step's samples do not split into micro-batches the interleaved schedule takes: 1F1B, as before auto
            return cls._resolved(job, dataclasses.replace(parallel, pp_schedule="1f1b"), note, spec=spec,
                                 shape=shape, env=env)

    @classmethod
    def _resolved(cls, job: JobConfig, parallel, note: str, *, spec: ModelSpec, shape: ModelShape,
                  env: ProcessPlacement) -> RunPlan:
        job = dataclasses.replace(job, model=resolved_model(job.model, shape), parallel=parallel,
                                  checkpoint=dataclasses.replace(job.checkpoint, dir=group_checkpoint_dir(job)))
        dims = ParallelDims.from_config(parallel, world_size=env.world_size, gpus_per_node=env.local_world_size,
                                        model=shape, spec=spec)
        device = choose_device(env, job.dist)  # this rank's GPU, or the CPU; ConfigError when it is missing
        check_layout(job, spec, shape, dims, device=device, compute_dtype=compute_dtype(job, device))
        return cls(job=job, spec=spec, shape=shape, dims=dims, batch=plan_batch(job.train, dims, shape),
                   layout_note=note, run_dir=group_run_dir(job))

    def keep_global_batch(self, global_batch: int) -> RunPlan:
        """This plan with ``global_batch`` kept and accumulation re-derived (a resume at another world size)."""
        train = dataclasses.replace(self.job.train, global_batch=global_batch, grad_accum=0)
        return dataclasses.replace(self, job=dataclasses.replace(self.job, train=train),
                                   batch=plan_batch(train, self.dims, self.shape))


def resolve_on_node(job: JobConfig, *, env: ProcessPlacement, vocab_size: int) -> RunPlan:
    """:meth:`RunPlan.resolve` for this rank; its ConfigError is marked ``same_on_node`` when this node's local rank
    0 meets the same one. The plan reads the placement only for the world's and the node's sizes and for this rank's
    GPU, so resolving it as local rank 0 here gives what that rank meets, without a process group."""
    try:
        return RunPlan.resolve(job, env=env, vocab_size=vocab_size)
    except ConfigError as exc:
        exc.same_on_node = env.local_rank == 0 or _leader_refusal(job, env=env, vocab_size=vocab_size) == str(exc)
        raise


def _leader_refusal(job: JobConfig, *, env: ProcessPlacement, vocab_size: int) -> str | None:
    """The ConfigError message that the local rank 0 of ``env``'s node meets resolving ``job``; None when it meets
    none (or another error: never this refusal)."""
    leader = dataclasses.replace(env, rank=env.rank - env.local_rank, local_rank=0)  # ranks fill nodes in order
    try:
        RunPlan.resolve(job, env=leader, vocab_size=vocab_size)  # selects GPU 0 here: this rank is about to exit
    except ConfigError as exc:
        return str(exc)
    except Exception:  # noqa: BLE001 - whatever else it meets is not this refusal, and must not replace it
        return None
    return None
