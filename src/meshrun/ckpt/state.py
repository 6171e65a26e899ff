"""What a checkpoint saves: Stateful pieces that the trainer composes into one dict.

    state = {
        "model_optim": ModelOptimState(engine.model_parts, optimizers),
        "scheduler": SchedulerState(schedulers),
        "trainer": trainer.progress,             # TrainProgress: the trainer counts on it directly
        "data": trainer.data,                    # StepBatches: its global data position
        "rng": RNGState(env, seed=cfg.train.seed),
        "metrics": MetricsState(accumulators),
    }

As torchtitan puts its ``train_state`` and ``dataloader`` into the state handed to DCP, the objects that hold the
progress are themselves the Stateful entries: a save reads them and a load restores them in place, with nothing
copied in or out by hand.

Everything is stored as tensors, so that loading never unpickles:

* model and optimizer tensors as ``torch.distributed.checkpoint.state_dict`` gives them (plain tensors under DDP,
  DTensors under FSDP2/TP), keyed by the original parameter names (FQNs), so that any layout can load them;
* counters as int64 scalars;
* everything else (optimizer hyperparameters, scheduler state, RNG states, metric accumulators) as JSON text in
  a 1-D uint8 tensor stored under a key named ``json`` (a "JSON blob"). The checkpointer sizes each blob from
  the checkpoint's metadata before loading, so a blob may change length from one save to the next.

Entries that every rank holds under the same key are written once (DCP keeps one copy of replicated plain
tensors), so they must be equal on all ranks: the checkpointer checks this for the ``replicated`` helpers.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import random
from dataclasses import dataclass
from typing import Any, ClassVar, Iterable, Iterator, Mapping, Sequence

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from meshrun.env import ProcessPlacement

log = logging.getLogger("meshrun.ckpt")

BLOB_KEY = "json"
# Flattened optimizer state ("state.<fqn>.exp_avg", "param_groups.<fqn>.lr") is keyed by parameter name, so it
# reshards across layouts and merges across pipeline stages by plain dict union.
_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def json_blob(obj: Any, *, what: str) -> torch.Tensor:
    """obj as compact, key-sorted JSON in a (N,) uint8 tensor."""
    try:
        text = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{what}: cannot be stored in a checkpoint as JSON ({exc}); checkpoints hold tensors and "
                        "JSON values only") from None
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)


def from_json_blob(blob: torch.Tensor) -> Any:
    return json.loads(blob.detach().cpu().numpy().tobytes().decode("utf-8"))


def walk(tree: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, leaf) pairs, keys joined with '.' exactly as DCP flattens nested dicts."""
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from walk(value, dotted + ".")
        else:
            yield dotted, value


def is_blob_key(dotted: str) -> bool:
    return dotted.rsplit(".", 1)[-1] == BLOB_KEY


class ModelOptimState(Stateful):
    """Model and optimizer state of this rank's model parts (one part for most layouts, one per local pipeline
    stage), through torch.distributed.checkpoint.state_dict: DDP is unwrapped (one copy, not one per rank), FSDP2
    and TP parameters stay sharded DTensors, and keys are the original FQNs.

    ``optimizers``: one per part (as torchtitan builds them), one over all parts, or none (model only).

    ``ties``: each parameter name that the model ties to another when built with its weights tied -> that other
    name (``{"output.weight": "tok_embeddings.weight"}``: the output head to the token embedding). A tied run saves
    the optimizer state of the one parameter under the first name only; with ``ties`` known, a run that trains the
    two apart (a pipeline) reads the missing second name's state from there (:meth:`tied_key`), and a run that ties
    them refuses a checkpoint that trained them apart (:meth:`load_refusal`) instead of merging two matrices.
    """

    def __init__(self, parts: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer] = (), *,
                 ties: Mapping[str, str] | None = None):
        self.parts = list(parts)
        self.optimizers = list(optimizers)
        self.ties = dict(ties or {})
        if not self.parts:
            raise ValueError("ModelOptimState: no model parts given")
        if len(self.optimizers) == 1 and len(self.parts) > 1:
            self.modules = [union_of_parts(self.parts)]  # DCP maps an optimizer's parameters through one module
        elif not self.optimizers or len(self.optimizers) == len(self.parts):
            self.modules = self.parts
        else:
            raise ValueError(f"ModelOptimState: got {len(self.parts)} model parts and {len(self.optimizers)} "
                             "optimizers; build one optimizer per model part, or one over all of them")

    def _held_as_one(self) -> dict[str, bool]:
        """For each tied name of ``ties`` that this rank's parts hold: whether it is the same parameter as the name it
        is tied to (False: this run trains them apart, or this rank holds only this one: a pipeline stage)."""
        params = {name: param for module in self.modules
                  for name, param in module.named_parameters(remove_duplicate=False)}
        return {name: params.get(first) is params[name] for name, first in self.ties.items() if name in params}

    def tied_key(self, key: str) -> str | None:
        """Where a checkpoint that trained a tied parameter as one holds ``key`` of this state dict, when ``key`` is
        the second name's and this run trains the two apart: 'optim.state.output.weight.exp_avg' ->
        'optim.state.tok_embeddings.weight.exp_avg'; else None. Loading reads it from there only when the checkpoint
        lacks ``key``: both parameters then start from the one's values and optimizer moments, which is exactly
        untying them at the step loaded."""
        apart = [name for name, one in self._held_as_one().items() if not one]
        for head in ("model.", "optim.state.", "optim_extra."):
            rest = key.removeprefix(head)
            if rest == key:
                continue
            for name in apart:
                if rest == name or rest.startswith(name + "."):
                    return head + self.ties[name] + rest[len(name):]
        return None

    def load_refusal(self, saved: Iterable[str], prefix: str) -> str | None:
        """Why a checkpoint holding DCP keys ``saved`` (this entry's under ``prefix``) cannot be loaded here: it has
        optimizer state of its own for a name that this run ties to another (it trained the two apart: under a
        pipeline, or untied by the model's option), and loading both matrices into one parameter would keep only one
        of them. None when it can."""
        one = [name for name, held_as_one in self._held_as_one().items() if held_as_one]
        own = {name for name in one for key in saved if key.startswith(f"{prefix}optim.state.{name}.")}
        if not own:
            return None
        name = sorted(own)[0]
        return (f"it trained {name} and {self.ties[name]} as two parameters (untied, e.g. under a pipeline), "
                "which this run ties into one, so loading would keep only one of the two matrices; untie them for "
                "this resume (meshrun train: --model.tie_embeddings=false), or start a new run with --fresh")

    def state_dict(self) -> dict[str, Any]:
        model: dict[str, Any] = {}
        for module in self.modules:
            _merge_unique(model, get_model_state_dict(module), what="model")
        for key, value in model.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"model state entry {key!r} is a {type(value).__name__}, not a tensor; meshrun "
                                "checkpoints store tensors only (move it to a buffer or drop get_extra_state)")
        if not self.optimizers:
            return {"model": model}
        optim: dict[str, torch.Tensor] = {}
        extra: dict[str, dict[str, Any]] = {}
        for module, optimizer in zip(self.modules, self.optimizers):
            for key, value in get_optimizer_state_dict(module, optimizer, options=_OPTIM_OPTIONS).items():
                if isinstance(value, torch.Tensor):
                    optim[key] = value
                else:
                    section, fqn, name = _split_optim_key(key)
                    extra.setdefault(fqn, {})[f"{section}.{name}"] = value
        blobs = {fqn: {BLOB_KEY: json_blob(values, what=f"optimizer settings of {fqn}")}
                 for fqn, values in extra.items()}
        return {"model": model, "optim": optim, "optim_extra": blobs}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        model = state_dict["model"]
        for module in self.modules:
            keys = get_model_state_dict(module).keys()
            set_model_state_dict(module, {key: model[key] for key in keys})
        extras = {fqn: from_json_blob(entry[BLOB_KEY]) for fqn, entry in state_dict.get("optim_extra", {}).items()}
        for module, optimizer in zip(self.modules, self.optimizers):
            loaded = {}
            for key, current in get_optimizer_state_dict(module, optimizer, options=_OPTIM_OPTIONS).items():
                if isinstance(current, torch.Tensor):
                    loaded[key] = state_dict["optim"][key]
                else:
                    section, fqn, name = _split_optim_key(key)
                    loaded[key] = _like(current, extras[fqn][f"{section}.{name}"])
            set_optimizer_state_dict(module, optimizer, loaded, options=_OPTIM_OPTIONS)


def union_of_parts(parts: Sequence[nn.Module]) -> nn.Module:
    """One module holding the parts' own submodules and parameters (no copies) under their own names.

    Pipeline stages cut from one model share container names (both hold ``layers``), so containers present in
    several parts are merged level by level: ``layers.0`` of stage 0 and ``layers.2`` of stage 1 keep their FQNs.
    """
    if len(parts) == 1:
        return parts[0]
    root = nn.Module()
    for part in parts:
        saved = {key for key in part.state_dict(keep_vars=True) if "." not in key}  # the part's own entries
        parameters = dict(part.named_parameters(recurse=False))
        for name, tensor in [*parameters.items(), *part.named_buffers(recurse=False)]:
            if name not in saved:  # a non-persistent buffer: never saved; may repeat (rope)
                continue
            if hasattr(root, name):
                raise ValueError(f"ModelOptimState: {name!r} is held by two model parts; each parameter must "
                                 "belong to exactly one part")
            if name in parameters:
                root.register_parameter(name, tensor)
            else:
                root.register_buffer(name, tensor)
    children: dict[str, list[nn.Module]] = {}
    for part in parts:
        for name, child in part.named_children():
            children.setdefault(name, []).append(child)
    for name, group in children.items():
        root.add_module(name, group[0] if len(group) == 1 else union_of_parts(group))
    return root


def _merge_unique(into: dict[str, Any], new: dict[str, Any], *, what: str) -> None:
    clash = into.keys() & new.keys()
    if clash:
        raise ValueError(f"ModelOptimState: {what} key(s) {sorted(clash)[:3]} appear in two model parts; each "
                         "parameter must belong to exactly one part")
    into.update(new)


def _split_optim_key(key: str) -> tuple[str, str, str]:
    """'param_groups.layers.0.wq.weight.lr' -> ('param_groups', 'layers.0.wq.weight', 'lr')."""
    section, rest = key.split(".", 1)
    fqn, name = rest.rsplit(".", 1)
    return section, fqn, name


def _like(current: Any, loaded: Any) -> Any:
    """JSON turns tuples into lists; give the value back the type the optimizer uses (betas is a tuple)."""
    return tuple(loaded) if isinstance(current, tuple) and isinstance(loaded, list) else loaded


class SchedulerState(Stateful):
    """LR scheduler(s): their state_dicts as one JSON blob (same on every rank)."""

    replicated: ClassVar[bool] = True

    def __init__(self, schedulers: Any | Sequence[Any]):
        self.schedulers = list(schedulers) if isinstance(schedulers, (list, tuple)) else [schedulers]

    def state_dict(self) -> dict[str, Any]:
        return {BLOB_KEY: json_blob([s.state_dict() for s in self.schedulers], what="LR scheduler state")}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = from_json_blob(state_dict[BLOB_KEY])
        if len(saved) != len(self.schedulers):
            raise ValueError(f"the checkpoint holds {len(saved)} LR scheduler state(s), this run has "
                             f"{len(self.schedulers)}; build one scheduler per optimizer as when it was saved")
        for scheduler, state in zip(self.schedulers, saved):
            scheduler.load_state_dict(state)


@dataclass
class IntFields(Stateful):
    """A dataclass of int fields, each saved as an int64 scalar under its own name, equal on every rank."""

    replicated: ClassVar[bool] = True

    def state_dict(self) -> dict[str, Any]:
        return {f.name: torch.tensor(getattr(self, f.name), dtype=torch.int64) for f in dataclasses.fields(self)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, int(state_dict[f.name].item()))


@dataclass
class TrainProgress(IntFields):
    """How far training has gone: the trainer advances this object itself, and checkpoints save and restore it."""

    step: int = 0
    """Optimizer steps completed."""
    tokens_seen: int = 0
    """Tokens of all ranks trained on so far."""


@dataclass
class CountersState(IntFields):
    """Step, tokens and data position in one record, for a hand-written loop that keeps its counters here.

    The data position is (epoch, samples_in_epoch): samples consumed from this epoch's global order, summed over
    data-parallel ranks, so it does not depend on the world size and a resharded resume continues the same order.
    The trainer and Session save :class:`TrainProgress` under ``trainer`` and their StepBatches under ``data``;
    checkpoints written with CountersState (``trainer.epoch``, ``trainer.samples_in_epoch``) still load into them
    (see :data:`MOVED_KEYS`).
    """

    step: int = 0
    epoch: int = 0
    tokens_seen: int = 0
    samples_in_epoch: int = 0


MOVED_KEYS = {"data.epoch": "trainer.epoch", "data.samples_in_epoch": "trainer.samples_in_epoch"}
"""Keys that checkpoints written before the data position became its own entry hold elsewhere: new key -> old key.
Loading reads the old key when the checkpoint lacks the new one."""


class MetricsState(Stateful):
    """Metric accumulators (name -> float), same on every rank; loading updates the given dict in place."""

    replicated: ClassVar[bool] = True

    def __init__(self, values: dict[str, float] | None = None):
        self.values = values if values is not None else {}

    def state_dict(self) -> dict[str, Any]:
        return {BLOB_KEY: json_blob({k: float(v) for k, v in self.values.items()}, what="metric accumulators")}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.values.clear()
        self.values.update({k: float(v) for k, v in from_json_blob(state_dict[BLOB_KEY]).items()})


class RNGState(Stateful):
    """Every rank's random streams (Python, NumPy's global generator, torch CPU, CUDA of the current device),
    under per-rank keys ``rank_<r>``.

    On resume at another world size a rank with no saved stream (rank >= the saved world size) reseeds from
    (seed, rank) deterministically, logs it and sets ``reseeded``; streams of ranks that no longer exist are not
    loaded.
    """

    missing_ok: ClassVar[bool] = True

    def __init__(self, env: ProcessPlacement, *, seed: int = 0):
        self.rank = env.rank
        self.seed = seed
        self.reseeded = False

    def state_dict(self) -> dict[str, Any]:
        return {f"rank_{self.rank}": {BLOB_KEY: json_blob(capture_rng(), what="RNG state")}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        entry = state_dict.get(f"rank_{self.rank}")
        if entry is None:
            reseed_rng(self.seed, self.rank)
            self.reseeded = True
            log.warning("rank %d: the checkpoint holds no RNG state for this rank (saved with fewer ranks); "
                        "reseeded deterministically from seed=%d and the rank", self.rank, self.seed)
            return
        restore_rng(from_json_blob(entry[BLOB_KEY]))
        self.reseeded = False


def _b64(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.cpu().numpy().tobytes()).decode("ascii")


def _unb64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def capture_rng() -> dict[str, Any]:
    """This process's RNG states as JSON-able values."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": [version, list(internal), gauss],
             "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
             "torch": _b64(torch.get_rng_state())}
    # Only an initialised CUDA context: touching CUDA here would create one on every rank of a CPU job.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = _b64(torch.cuda.get_rng_state())
    return state


def restore_rng(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_unb64(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(_unb64(state["cuda"]))


def reseed_rng(seed: int, rank: int) -> None:
    """Seed every stream from (seed, rank) and a fixed tag, so the stream differs from the run's first one."""
    words = np.random.SeedSequence([seed, rank, 0x5EED]).generate_state(4, dtype=np.uint32)
    random.seed(int(words[0]))
    np.random.seed(int(words[1]))
    torch.manual_seed((int(words[2]) << 32) | int(words[3]))
