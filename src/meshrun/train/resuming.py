"""The trainer's checkpointer, and starting a run: resume the newest checkpoint (the default), or start anew.

A resume restores the state in place and then says what it changed: the global batch kept at another world size
(accumulation re-derived), a learning rate that jumps because train.steps or the schedule's options changed, and
tied embeddings (``model.tie_embeddings``) that the layout change unties or keeps untied. A pipeline trains them
untied; before the model is built, :func:`embeddings_as_saved` reads whether the checkpoint the load will pick holds
them untied (verifying its checksums first, once, where a fallback past a damaged one would change the answer), and
a layout without a pipeline then builds them untied too, so that training continues exactly. A tied
checkpoint resumed under a pipeline gives the output head the token embedding's values and optimizer state
(ModelOptimState's ``ties``): untying them at that step.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from meshrun.ckpt import loading
from meshrun.ckpt.checkpointer import Checkpointer, default_io_threads
from meshrun.ckpt.collectives import Coordinator, check_shared_folder
from meshrun.ckpt.errors import CheckpointError
from meshrun.ckpt.preemption import announce, install_sigterm_handler
from meshrun.ckpt.run_config import config_fingerprint, saved_config, saved_embeddings_tied
from meshrun.ckpt.state import ModelOptimState, RNGState, SchedulerState
from meshrun.ckpt.storage import register_options
from meshrun.config import ConfigError
from meshrun.env import ProcessPlacement
from meshrun.parallel.tied import tie_partners
from meshrun.train.plan import refused_alike_on_node
from meshrun.train.schedule import describe_lr_change

if TYPE_CHECKING:
    from meshrun.train.plan import RunPlan
    from meshrun.train.trainer import Trainer

log = logging.getLogger("meshrun")


def build_checkpointer(trainer: Trainer) -> tuple[Checkpointer, dict[str, Any]]:
    """The checkpointer and the state it saves: model+optimizer (sharded, via DCP), schedule, the trainer's
    progress and its data loader's position (the live objects: loading restores them in place), every rank's RNG
    streams. SIGTERM, SIGUSR1 and Ctrl-C then save and stop (checkpoint.final). Collective: every rank (it creates
    gloo groups)."""
    job, env, dims, batch = trainer.job, trainer.env, trainer.dims, trainer.batch
    cfg = job.checkpoint
    folder = checkpoint_folder(trainer.plan)
    preemption = (install_sigterm_handler(grace_s=cfg.signal_grace_s, interrupt=True,
                                          announce=announce if env.is_rank_zero else None)
                  if cfg.final else None)
    layout = {"world_size": env.world_size, "nodes": env.num_nodes, "dp_replicate": dims.dp_replicate,
              "dp_shard": dims.dp_shard, "tp": dims.tp, "pp": dims.pp, "global_batch": batch.global_batch,
              "micro_batch": batch.micro_batch, "grad_accum": batch.grad_accum}
    config = trainer.run_config()
    ckpt = Checkpointer(cfg, folder=folder, env=env, layout=layout, config_fingerprint=config_fingerprint(config),
                        preemption=preemption)
    ckpt.config = config
    ties = tie_partners(trainer.spec, trainer.model_cfg)  # where a tied checkpoint holds the output head's state
    state = {"model_optim": ModelOptimState(trainer.engine.model_parts, [trainer.optimizer], ties=ties),
             "scheduler": SchedulerState(trainer.scheduler), "trainer": trainer.progress, "data": trainer.data,
             "rng": RNGState(env, seed=job.train.seed)}
    if trainer.replicas is not None:
        state["replicas"] = trainer.replicas  # the manager's step; loading it re-derives the random streams
    return ckpt, state


def checkpoint_folder(plan: RunPlan) -> str:
    """Where this run's checkpoints go: checkpoint.dir (a path or an s3:// / gs:// URL), else <run.dir>/checkpoints."""
    return plan.job.checkpoint.dir or str(plan.run_dir / "checkpoints")


def embeddings_as_saved(plan: RunPlan, env: ProcessPlacement) -> tuple[RunPlan, loading.Findings | None]:
    """The plan to build the model from: with the embeddings untied when the checkpoint this run resumes trained them
    untied (under a pipeline, or with the option off) and this layout would tie them again. Before the model exists,
    from the checkpoint the load will pick: rank 0 reads the manifests of those it may pick (loading.peek: the first
    that passes the cheap checks, and with resume=auto and checkpoint.strict off the older ones it falls back to
    where the checksums find that one damaged). Where they all ask for the same model, that is the answer, with no
    checksums yet; where they differ (trained under a pipeline, then resumed tied, say), every rank verifies now as
    the load does (loading.foresee), and the one that passes decides; first, as the load does, the ranks check that
    the checkpoint folder is one they all see (on node-local folders each rank would hash files it cannot see, and
    every checkpoint would be reported damaged before the load refused). A checkpoint of another model shape is
    refused here (:func:`model_change_refusal`), on every rank. Returns the plan and what the checksums found (rank
    0's, empty elsewhere; None where they did not decide, nor was the folder checked), for this start's load to take
    instead of hashing the same files and checking the folder again (:func:`resume`).

    Collective with several ranks (a broadcast on the default process group; where the checksums decide, gloo
    groups to split them over, destroyed after): every rank must call it."""
    job = plan.job
    cfg = job.checkpoint
    resumes = cfg.resume != "none" and not (job.run.fresh and env.restart_count == 0)
    if not resumes:
        return plan, None
    folder = checkpoint_folder(plan)
    explicit = None if cfg.resume == "auto" else cfg.resume
    for location in (folder, explicit):
        if location:  # on every rank: each hashes its share where the checksums decide
            register_options(location, cfg.storage_options)
    answer: tuple[tuple[int, int] | None, str] = (None, "")
    checksums_decide = False
    if env.is_rank_zero:
        answer, checksums_decide = _answer_before_checksums(plan, folder, explicit)
    if env.is_distributed and dist.is_initialized():
        box = [(answer, checksums_decide)]
        dist.broadcast_object_list(box, src=0)  # collective: every rank builds the model rank 0's answer asks for
        answer, checksums_decide = box[0]
    known: loading.Findings | None = None
    if checksums_decide:  # collective: every rank creates the groups and hashes its share, as the load does
        coord = Coordinator(timeout_s=cfg.timeout_s)
        try:
            check_shared_folder(coord, folder)  # as the load does first (resume=auto, as checksums_decide implies)
            chosen, known = loading.foresee(coord, folder, explicit=explicit, strict=cfg.strict,
                                            threads=default_io_threads(env.local_world_size))
        finally:
            coord.close()
        answer = _answer(chosen[1], plan) if chosen is not None else (None, "")  # None: the load refuses, saying why
    found, refusal = answer
    if refusal:
        raise CheckpointError(refusal, same_on_every_rank=True)
    if found is None:
        return plan, known
    step, saved_pp = found
    how = f"trained under parallel.pp={saved_pp}" if saved_pp > 1 else "trained with model.tie_embeddings=false"
    log.warning("the checkpoint to resume (step %s) has untied embeddings (%s): building them untied here too, as "
                "model.tie_embeddings=false (config.toml records it)", step, how)
    return plan.untie_embeddings(), known


def _answer_before_checksums(plan: RunPlan, folder: str,
                             explicit: str | None) -> tuple[tuple[tuple[int, int] | None, str], bool]:
    """Rank 0: :func:`_answer` for the first checkpoint a resume tries that passes the cheap checks (none: nothing
    to change), and whether the checksums decide instead: an older one the load would fall back to, past a first one
    they find damaged, asks for another model (:func:`_model_asked`)."""
    falls_back = explicit is None and not plan.job.checkpoint.strict
    first: tuple[bool, dict[str, Any]] | None = None
    answer: tuple[tuple[int, int] | None, str] = (None, "")
    for manifest in loading.peek(folder, explicit):
        asked = _model_asked(manifest, plan)
        if first is None:
            first, answer = asked, _answer(manifest, plan)
        elif asked != first:
            return answer, True
        if not falls_back:
            break
    return answer, False


def _model_asked(manifest: dict[str, Any], plan: RunPlan) -> tuple[bool, dict[str, Any]]:
    """What the checkpoint asks of the model this run builds: its embeddings untied (it trained them untied, and this
    layout would tie them), and the shape options it holds other values of (:func:`shape_changes`)."""
    model = plan.job.model
    untie = model.tie_embeddings and plan.dims.pp == 1 and saved_embeddings_tied(manifest) is False
    return untie, shape_changes(manifest, model)


def _answer(manifest: dict[str, Any], plan: RunPlan) -> tuple[tuple[int, int] | None, str]:
    """The model to build for the checkpoint: (its step, its pipeline degree) where the embeddings are to be built
    untied, else None; and why it cannot be resumed ('' where it can: :func:`model_change_refusal`)."""
    untie, _ = _model_asked(manifest, plan)
    found = (manifest.get("step"), (manifest.get("layout") or {}).get("pp", 1)) if untie else None
    return found, model_change_refusal(manifest, plan.job.model)


def resume(trainer: Trainer) -> dict[str, Any] | None:
    """Load the checkpoint that checkpoint.resume names (newest valid by default), or, with run.fresh, move an
    earlier run aside and start anew (an elastic restart of a fresh run resumes it). Collective. Returns the manifest
    loaded, or None. Refused: the process gets its signal handlers back (a test or notebook goes on)."""
    try:
        fresh = trainer.folder.start_fresh(trainer.job, trainer.ckpt.coord)
        known, trainer.checksums_known = trainer.checksums_known, None  # this start's, taken once
        manifest = trainer.ckpt.load(trainer.app_state, resume="none" if fresh else None, known=known,
                                     folder_checked=known is not None)  # checked before the checksums decided
        if manifest is None:
            return None
        refusal = model_change_refusal(manifest, trainer.job.model)
        if refusal:
            raise CheckpointError(refusal, same_on_every_rank=True)
        layout = manifest.get("layout", {})
        if layout.get("global_batch", trainer.batch.global_batch) != trainer.batch.global_batch:
            keep_global_batch(trainer, layout)
    except BaseException:
        trainer.ckpt.close()
        if trainer.ckpt.preemption is not None:
            trainer.ckpt.preemption.restore()
        raise
    lr_change = describe_lr_change((saved_config(manifest) or {}).get("train"), trainer.job.train, trainer.step)
    if lr_change and trainer.step < trainer.job.train.steps:
        trainer.ckpt.notes.append(lr_change)
        log.warning(lr_change)
    ties_change = describe_ties_change(manifest, trainer)
    if ties_change:
        trainer.ckpt.notes.append(ties_change)
        log.warning(ties_change)
    return manifest


SHAPE_FIELDS = ("arch", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size")
"""The model options that decide which parameters exist and their shapes (seq_len, dropout, rope_theta and norm_eps
may change on a resume; tie_embeddings is followed, see :func:`embeddings_as_saved`)."""


def model_change_refusal(manifest: dict[str, Any], model: Any) -> str:
    """Why this run's model cannot continue the checkpoint's: '' when its shape options are the checkpoint's (or the
    checkpoint carries no config). DCP loads the parameters a model asks for, so a model with fewer blocks than the
    checkpoint's loads a part of it without a word; one with more, or wider, fails later on a missing key or shape."""
    saved = shape_changes(manifest, model)
    if not saved:
        return ""
    changed = [f"model.{name} {value} -> {getattr(model, name)}" for name, value in saved.items()]
    given = " ".join(f"--model.{name}={value}" for name, value in saved.items())
    return (f"the checkpoint of step {manifest.get('step')} holds another model than this run builds "
            f"({', '.join(changed)}): it would load only in part. Resume with the checkpoint's model ({given}), or "
            "start a new run with --fresh or another --run.dir")


def shape_changes(manifest: dict[str, Any], model: Any) -> dict[str, Any]:
    """The shape options (:data:`SHAPE_FIELDS`) that the checkpoint's config holds other values of than ``model``:
    name -> the checkpoint's value. 0 or empty in the checkpoint is a value left to the named size or the data, not
    recorded."""
    saved = (saved_config(manifest) or {}).get("model") or {}
    return {name: saved[name] for name in SHAPE_FIELDS
            if saved.get(name) not in (None, 0, "") and getattr(model, name, saved[name]) != saved[name]}


def describe_ties_change(manifest: dict[str, Any], trainer: Trainer) -> str:
    """The line that says that this run unties the embeddings that the checkpoint holds tied (at this step: the
    output head starts as the embedding); '' when it does not, or the model ties nothing. (A checkpoint with untied
    embeddings was said by :func:`embeddings_as_saved`, which built them untied.)"""
    if not saved_embeddings_tied(manifest) or not trainer.app_state["model_optim"].ties:
        return ""
    if trainer.job.model.tie_embeddings and trainer.dims.pp == 1:
        return ""
    why = f"parallel.pp={trainer.dims.pp}" if trainer.dims.pp > 1 else "model.tie_embeddings=false"
    return (f"the checkpoint of step {manifest['step']} has tied embeddings; {why} trains them untied from here: the "
            "output head starts as a copy of the token embedding, with its optimizer state")


def keep_global_batch(trainer: Trainer, layout: dict[str, Any]) -> None:
    """This run's options give another global batch than the checkpoint's (its ``layout``'s): keep the checkpoint's
    by re-deriving accumulation, or refuse. Said (a warning and a note) only where the data-parallel ranks or the
    accumulation differ from the checkpoint's: a later resume of a run whose batch was kept re-derives the same
    split silently. The refusals read only the options and the manifest every rank loaded: raised alike on every
    rank (``same_on_node``: each node's first rank says them)."""
    train, saved = trainer.plan.job.train, layout["global_batch"]
    saved_dp = layout.get("dp_replicate", 1) * layout.get("dp_shard", 1)
    dp = trainer.plan.dims.dp_size
    with refused_alike_on_node():  # the options and the manifest every rank loaded: every rank refuses alike
        if train.global_batch and train.global_batch != saved:
            raise ConfigError(f"train.global_batch={train.global_batch} differs from the checkpoint's {saved}; the "
                              f"data position cannot continue exactly. Set --train.global_batch={saved} or start a "
                              "new run with --fresh")
        if saved % (train.micro_batch * dp):
            raise ConfigError(kept_batch_fix(saved, micro_batch=train.micro_batch, dp_size=dp, saved_dp=saved_dp))
    trainer.plan = plan = trainer.plan.keep_global_batch(saved)  # a new plan; the config is not changed in place
    position = trainer.data.position  # global: the new per-rank batches continue from it
    trainer.data, trainer.val = trainer.build_data()
    trainer.data.seek(position)
    trainer.app_state["data"] = trainer.data
    if trainer.replicas is not None:
        trainer.replicas.data = trainer.data  # a healing peer continues this loader's position
    trainer.ckpt.layout.update(global_batch=plan.batch.global_batch, grad_accum=plan.batch.grad_accum)
    if saved_dp == plan.batch.dp_size and layout.get("grad_accum") == plan.batch.grad_accum:
        return  # the checkpoint's own split: nothing changes
    message = (f"keeping the checkpoint's global batch {saved}: {saved_dp} -> {plan.batch.dp_size} data-parallel "
               f"ranks, accumulation {layout.get('grad_accum', '?')} -> {plan.batch.grad_accum}")
    trainer.ckpt.notes.append(message)
    log.warning(message)


def kept_batch_fix(saved: int, *, micro_batch: int, dp_size: int, saved_dp: int) -> str:
    """Why the checkpoint's global batch ``saved``, kept on a resume at another layout, does not split over this
    one's ``dp_size`` data-parallel ranks of ``micro_batch`` samples, and what to change."""
    head = (f"train.micro_batch={micro_batch}: the checkpoint's global batch {saved} ({saved_dp} data-parallel ranks "
            f"then), kept so that the data continues exactly, is not divisible by {micro_batch} x {dp_size} "
            "data-parallel ranks now")
    if saved % dp_size:
        return (f"{head}, nor by {dp_size} ranks with any micro-batch; resume on a layout whose data-parallel ranks "
                f"divide {saved}, or start a new run with --fresh")
    per_rank = saved // dp_size
    fit = max(m for m in range(1, micro_batch + 1) if per_rank % m == 0)
    accum = per_rank // fit
    split = (f"{fit} x {dp_size} ranks, no accumulation" if accum == 1
             else f"{fit} x {dp_size} ranks x {accum} accumulated micro-batches")
    return f"{head}; resume with --train.micro_batch={fit} ({split}), or start a new run with --fresh"
