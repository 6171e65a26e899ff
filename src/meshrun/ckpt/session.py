"""Checkpoints of a user's own training script (``Session.save`` / ``Session.resume``), through the trainer's
Checkpointer: the same checkpoint folder (:mod:`.folder`), manifest, SHA-256 checksums, COMPLETE marker, retention,
async option and resharding across world sizes and parallel layouts, so ``meshrun ckpt ls/verify/export`` read them.

What is saved: the model and optimizer (sharded, with DCP; FSDP2, HSDP, TP, DDP models and pipeline stages all
save under the model's own parameter names), the step, the script's StepBatches itself (a Stateful entry: its data
position, epoch and samples consumed by all ranks, independent of the world size, restored in place), every rank's
RNG streams, an LR scheduler, and ``extra`` floats.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from meshrun.ckpt.checkpointer import Checkpointer
from meshrun.ckpt.folder import step_dir_name
from meshrun.ckpt.storage import is_url, store_for
from meshrun.ckpt.state import MetricsState, ModelOptimState, RNGState, SchedulerState, TrainProgress
from meshrun.comm.axes import MESH_DIMS
from meshrun.config import CheckpointConfig
from meshrun.data.loader import StepBatches
from meshrun.env import ProcessPlacement


class SessionCheckpoints:
    """One checkpoint folder of a user script; every method is a collective over all ranks."""

    def __init__(self, cfg: CheckpointConfig, *, env: ProcessPlacement, seed: int):
        if not cfg.dir:
            raise ValueError("Session checkpoint folder is empty: pass Session(checkpoint='DIR') or "
                             "CheckpointConfig(dir='DIR')")
        self.cfg, self.env, self.seed = cfg, env, seed
        self._ckpt: Checkpointer | None = None

    def _checkpointer(self, fingerprint: str, layout: Any, batches: StepBatches | None) -> Checkpointer:
        if self._ckpt is None:  # collective: it creates the checkpointer's gloo groups
            self._ckpt = Checkpointer(self.cfg, folder=self.cfg.dir, env=self.env, layout={},
                                      config_fingerprint=fingerprint)
        self._ckpt.layout = layout_record(self.env, layout, batches)
        return self._ckpt

    def _state(self, parts: Sequence[nn.Module], optimizer: Any, batches: StepBatches | None, scheduler: Any,
               extra: dict[str, float] | None, step: int = 0) -> dict[str, Any]:
        state: dict[str, Any] = {"model_optim": ModelOptimState(parts, [optimizer] if optimizer else []),
                                 "trainer": TrainProgress(step=step), "rng": RNGState(self.env, seed=self.seed)}
        if batches is not None:
            state["data"] = batches
        if scheduler is not None:
            state["scheduler"] = SchedulerState(scheduler)
        if extra is not None:
            state["extra"] = MetricsState(extra)
        return state

    def save(self, step: int, *, parts: Sequence[nn.Module], fingerprint: str, optimizer: Any,
             batches: StepBatches | None, scheduler: Any, extra: dict[str, float] | None, layout: Any,
             final: bool) -> Path | str:
        """``parts``: this rank's model parts (one module, or its pipeline stages); ``fingerprint``: the whole
        model's (:func:`model_fingerprint`)."""
        ckpt = self._checkpointer(fingerprint, layout, batches)
        state = self._state(parts, optimizer, batches, scheduler, extra, step=step)
        meta = {"epoch": batches.position.epoch, "samples_in_epoch": batches.position.consumed} if batches else {}
        ckpt.save(step, state, final=final, meta=meta)
        if is_url(self.cfg.dir):
            return store_for(self.cfg.dir).join(self.cfg.dir, step_dir_name(step))
        return Path(self.cfg.dir) / step_dir_name(step)

    def resume(self, *, parts: Sequence[nn.Module], fingerprint: str, optimizer: Any, batches: StepBatches | None,
               scheduler: Any, extra: dict[str, float] | None, layout: Any, path: str | None) -> int:
        ckpt = self._checkpointer(fingerprint, layout, batches)
        state = self._state(parts, optimizer, batches, scheduler, extra)
        manifest = ckpt.load(state, resume=path)  # restores batches' data position in place
        if manifest is None:
            return 0
        saved = manifest.get("layout", {}).get("global_batch")
        if batches is not None and saved and saved != batches.global_batch and self.env.is_rank_zero:
            print(f"meshrun: the checkpoint's global batch was {saved}, this run's is {batches.global_batch}: "
                  "the data order continues from the same sample, in steps of the new size", flush=True)
        return state["trainer"].step

    def close(self) -> None:
        if self._ckpt is not None:
            self._ckpt.close()


def layout_record(env: ProcessPlacement, layout: Any, batches: StepBatches | None) -> dict[str, Any]:
    """The manifest's layout entry: world, degrees, and the batch of the data position."""
    dims = layout.dims if layout is not None else None
    degrees = dims.degrees() if dims else {name: 1 for name in MESH_DIMS} | {"dp_replicate": env.world_size}
    entry = {"world_size": env.world_size, "nodes": env.num_nodes, **degrees}
    if batches is not None:
        entry.update(global_batch=batches.global_batch, micro_batch=batches.micro_batch,
                     grad_accum=batches.grad_accum)
    return entry


def model_fingerprint(module: nn.Module) -> str:
    """Parameter names and global shapes: a resume into a different model is reported."""
    shapes = {name: list(p.shape) for name, p in module.state_dict().items() if isinstance(p, torch.Tensor)}
    return hashlib.sha256(json.dumps(shapes, sort_keys=True).encode()).hexdigest()[:16]
