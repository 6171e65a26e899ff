"""The run plan: the job's config resolved once into what this run trains with; the JobConfig given is left as it was.

:meth:`RunPlan.resolve` checks a copy of the config (``validate`` normalises it), then fills in what the options
leave open: the named size's model shape, the data parallelism that runs (parallel.data_parallel), replica groups'
shared checkpoint folder, the mesh degrees and the batch; and it checks the layout against the options, the model
and the device (:func:`meshrun.parallel.checks.resolve_layout`, which ``meshrun plan`` and ``meshrun train
--dry-run`` run too), so a wrong combination fails before any process group or model exists. The trainer and its
helpers read the plan; a resume that keeps the checkpoint's global batch at another world size builds a new plan
(:meth:`RunPlan.keep_global_batch`).

A refusal at this stage is often every rank's: :func:`resolve_on_node` and :func:`refused_alike_on_node` mark those
that the node's local rank 0 meets too (``ConfigError.same_on_node``), so that train/cli.py says them once per node.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from meshrun.comm.mesh import ParallelDims
from meshrun.comm.process_group import choose_device, device_of
from meshrun.config import BatchPlan, ConfigError, DistConfig, JobConfig
from meshrun.env import ProcessPlacement
from meshrun.models.build import model_shape, model_spec, resolved_model
from meshrun.models.shape import ModelShape
from meshrun.models.spec import ModelSpec
from meshrun.parallel.checks import plan_batch, resolve_layout
from meshrun.report import trackers
from meshrun.train.profiling import profiled_ranks
from meshrun.train.replicas import group_checkpoint_dir, group_run_dir
from meshrun.watch import prometheus


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
        tokens; this rank's GPU is selected. Raises ConfigError naming the option."""
        return cls._resolve(job, world_size=env.world_size, gpus_per_node=env.local_world_size,
                            vocab_size=vocab_size, find_device=lambda dist: choose_device(env, dist))

    @classmethod
    def resolve_as_node_leader(cls, job: JobConfig, *, world_size: int, gpus_per_node: int,
                               vocab_size: int) -> RunPlan:
        """The plan that local rank 0 of a node of ``gpus_per_node`` ranks resolves in a world of ``world_size``,
        with the same ConfigError, resolved from any rank of that node (:func:`resolve_on_node`): it needs no
        global rank (ranks need not fill the nodes in order: srun's cyclic distribution), and it finds GPU 0
        without selecting it, so that no CUDA context is made on GPU 0 for it."""
        return cls._resolve(job, world_size=world_size, gpus_per_node=gpus_per_node, vocab_size=vocab_size,
                            find_device=lambda dist: device_of(dist, local_rank=0))

    @classmethod
    def _resolve(cls, job: JobConfig, *, world_size: int, gpus_per_node: int, vocab_size: int,
                 find_device: Callable[[DistConfig], torch.device]) -> RunPlan:
        """The plan on a world of ``world_size`` ranks, ``gpus_per_node`` of them on this node, on the device that
        ``find_device`` gives for dist (a GPU, or the CPU; ConfigError when it is missing)."""
        world_options(job, world_size=world_size)
        spec = model_spec(job)
        shape = model_shape(job, vocab_size)
        device = find_device(job.dist)
        # the same resolution and checks as `meshrun plan` and `meshrun train --dry-run` (parallel/checks.py)
        layout = resolve_layout(job, spec, shape, world_size=world_size, gpus_per_node=gpus_per_node, device=device)
        job = dataclasses.replace(layout.job, model=resolved_model(job.model, shape),
                                  checkpoint=dataclasses.replace(job.checkpoint, dir=group_checkpoint_dir(job)))
        return cls(job=job, spec=spec, shape=shape, dims=layout.dims, batch=layout.batch, layout_note=layout.note,
                   run_dir=group_run_dir(job))

    def keep_global_batch(self, global_batch: int) -> RunPlan:
        """This plan with ``global_batch`` kept and accumulation re-derived (a resume at another world size)."""
        train = dataclasses.replace(self.job.train, global_batch=global_batch, grad_accum=0)
        return dataclasses.replace(self, job=dataclasses.replace(self.job, train=train),
                                   batch=plan_batch(train, self.dims, self.shape))

    def untie_embeddings(self) -> RunPlan:
        """This plan with ``model.tie_embeddings`` off (a resume of a checkpoint that trained them untied, in a
        layout without a pipeline); the layout and the batch do not depend on it."""
        model = dataclasses.replace(self.job.model, tie_embeddings=False)
        return dataclasses.replace(self, job=dataclasses.replace(self.job, model=model),
                                   shape=dataclasses.replace(self.shape, tie_embeddings=False))


def world_options(job: JobConfig, *, world_size: int) -> None:
    """The options checked against this world rather than the config alone, here so that their refusal comes before
    anything is written into run.dir (train/run_folder.py): run.profile_ranks against the world size, run.tracker's
    packages (rank 0 alone logs to them) and prometheus-client (the node leaders serve run.prometheus_port), each
    asked on every rank."""
    profiled_ranks(job.run, world_size)
    # every rank asks (a lookup, no import), so that every rank refuses alike: a refusal on rank 0 alone would leave
    # the others waiting in the process group's start-up where no launcher stops them (srun)
    trackers.check_installed(job)
    if job.run.prometheus_port and job.run.system_sample_s > 0:
        prometheus.check_installed()


def resolve_on_node(job: JobConfig, *, env: ProcessPlacement, vocab_size: int) -> RunPlan:
    """:meth:`RunPlan.resolve` for this rank; its ConfigError is marked ``same_on_node`` when this node's local rank
    0 meets the same one. The plan reads the placement only for the world's and the node's sizes and for this rank's
    GPU, so :meth:`RunPlan.resolve_as_node_leader` gives here what that rank meets, without a process group."""
    try:
        return RunPlan.resolve(job, env=env, vocab_size=vocab_size)
    except ConfigError as exc:
        exc.same_on_node = env.local_rank == 0 or _leader_refusal(job, env=env, vocab_size=vocab_size) == str(exc)
        raise


def _leader_refusal(job: JobConfig, *, env: ProcessPlacement, vocab_size: int) -> str | None:
    """The ConfigError message that the local rank 0 of ``env``'s node meets resolving ``job``; None when it meets
    none (or another error: never this refusal). Its global rank is not known here, and not needed; its GPU is not
    selected (this rank is about to exit)."""
    try:
        RunPlan.resolve_as_node_leader(job, world_size=env.world_size, gpus_per_node=env.local_world_size,
                                       vocab_size=vocab_size)
    except ConfigError as exc:
        return str(exc)
    except Exception:  # noqa: BLE001 - whatever else it meets is not this refusal, and must not replace it
        return None
    return None
