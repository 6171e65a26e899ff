"""What ``meshrun ckpt`` shows and does: list a folder, verify a checkpoint, export consolidated weights.

Single process, no process group. Export reads tensors only (DCP's ``torch.load(weights_only=True)``) and writes
safetensors; DCP's own ``.metadata`` (whose checksum is verified first) is read by a restricted unpickler
(:mod:`meshrun.ckpt.safe_metadata`), so nothing in a checkpoint can run code.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from rich.table import Table
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from meshrun.ckpt.errors import CheckpointError, CheckpointPathError
from meshrun.ckpt.folder import STEP_RE, complete_steps, scan, step_dir_name
from meshrun.ckpt.manifest import check_checksums, check_structure, data_location, read_manifest
from meshrun.ckpt.run_config import trained_config
from meshrun.ckpt.safe_metadata import METADATA_FILE, load_metadata
from meshrun.ckpt.storage import Store, is_url, store_for
from meshrun.units import format_bytes

DEFAULT_FOLDER = Path("runs/default/checkpoints")
"""Where checkpoints go with the default config (run.dir=runs/default, checkpoint.dir empty)."""

_STATUS = {"complete": "complete", "incomplete": "INCOMPLETE (no COMPLETE marker)",
           "tmp": "unfinished (being written, or abandoned)", "trash": "being deleted", "symlink": "symlink (ignored)"}


@dataclass(frozen=True)
class Row:
    """One line of ``ckpt ls``."""

    step: int
    status: str
    size: int
    path: str
    world_size: int | None = None
    layout: dict[str, Any] | None = None
    epoch: int | None = None
    tokens_seen: int | None = None
    created: float | None = None


def resolve_folder(arg: str | None) -> str:
    """The folder to list (a path or URL): the argument (a checkpoint folder, or a run folder holding
    checkpoints/)."""
    folder = arg.rstrip("/") if arg else str(DEFAULT_FOLDER)
    store = store_for(folder)
    inner = store.join(folder, "checkpoints")
    return inner if store.is_dir(inner) else folder


def resolve_checkpoint(path: Path | str) -> Path | str:
    """A step directory from a step directory, a checkpoints folder or a run directory (its newest complete one, the
    one a resume picks first); paths or ``s3://`` / ``gs://`` URLs. A step directory is returned as it is, complete
    or not (verify and export then name what is wrong with it), and so is the one whose manifest.json or COMPLETE file
    is given; anything else that holds no complete checkpoint raises CheckpointError naming the path and what was
    expected."""
    store, location = store_for(path), str(path).rstrip("/")
    name = location.rsplit("/", 1)[-1]
    if name in ("manifest.json", "COMPLETE") and store.exists(location) and not store.is_dir(location):
        return resolve_checkpoint(store.parent(location) or ".")  # a checkpoint's own file: the checkpoint it is in
    if (store.exists(store.join(location, "COMPLETE")) or store.exists(store.join(location, "manifest.json"))
            or STEP_RE.match(name)):
        return location if is_url(location) else Path(location)
    expected = ("give a checkpoint directory (step_NNNNNNN), a checkpoints folder (step_* directories inside) or a "
                "run folder (checkpoints/ inside), e.g. runs/default")
    if not store.is_dir(location):
        what = "a file, not a folder" if store.exists(location) else "no such folder"
        raise CheckpointPathError(f"{path}: {what}; {expected}")
    inner = store.join(location, "checkpoints")
    for folder in (location, inner):
        entries = scan(folder) if store.is_dir(folder) else []
        if not entries:
            continue
        steps = complete_steps(entries)
        if not steps:
            raise CheckpointError(f"{folder}: no complete checkpoint ({len(entries)} step directories, none with "
                                  "COMPLETE: saves that did not finish); `meshrun ckpt ls` lists them")
        found = store.join(folder, step_dir_name(max(steps)))
        return found if is_url(found) else Path(found)
    if store.is_dir(inner):
        raise CheckpointError(f"{inner}: holds no checkpoint yet (no step_* directories); the run saved none here")
    if any(store.exists(store.join(location, marker)) for marker in ("config.toml", "metrics.jsonl")):
        raise CheckpointError(f"{path}: a run folder without checkpoints/ (checkpoint.dir may have put them "
                              "elsewhere: see its config.toml); give that checkpoint folder")
    raise CheckpointError(f"{path}: not a checkpoint directory, a checkpoints folder or a run folder (none of "
                          f"COMPLETE, manifest.json, step_* or checkpoints/ inside); {expected}")


def list_checkpoints(folder: str | Path) -> list[Row]:
    store = store_for(folder)
    rows = []
    for entry in scan(folder):
        size = _dir_size(store, entry.path) if entry.kind != "symlink" else 0
        mtime = store.mtime(entry.path)
        row = Row(step=entry.step, status=_STATUS[entry.kind], size=size, path=entry.path,
                  created=None if mtime == float("inf") else mtime)
        if entry.kind == "complete":
            try:
                manifest = read_manifest(data_location(entry.path))
            except CheckpointError as exc:
                row = Row(step=entry.step, status=f"DAMAGED: {exc}", size=size, path=entry.path, created=row.created)
            else:
                row = Row(step=entry.step, status="complete", size=size, path=entry.path,
                          world_size=manifest["world_size"], layout=manifest.get("layout"),
                          epoch=manifest.get("epoch"), tokens_seen=manifest.get("tokens_seen"),
                          created=manifest["created_unix"])
        rows.append(row)
    return rows


def _dir_size(store: Store, path: str) -> int:
    """Bytes of the files in ``path`` and, on an object store, in its attempt folders."""
    return sum(item.size if item.kind == "file" else _dir_size(store, item.path) if store.kind == "object" else 0
               for item in store.list(path))


def render_table(rows: list[Row], folder: Path | str, *, now: float | None = None) -> Table:
    now = time.time() if now is None else now
    table = Table(title=f"checkpoints in {folder}", title_justify="left")
    for column, justify in (("step", "right"), ("status", "left"), ("size", "right"), ("ranks", "right"),
                            ("layout", "left"), ("epoch", "right"), ("tokens", "right"), ("age", "right"),
                            ("directory", "left")):
        table.add_column(column, justify=justify)
    for row in rows:
        style = None if row.status == "complete" else "yellow"
        layout = " ".join(f"{k}={v}" for k, v in (row.layout or {}).items()) or "-"
        table.add_row(str(row.step), row.status, format_bytes(row.size), _or_dash(row.world_size), layout,
                      _or_dash(row.epoch), _or_dash(row.tokens_seen), human_age(now - row.created) if row.created
                      else "-", store_for(row.path).name(row.path), style=style)
    return table


def _or_dash(value: Any) -> str:
    return "-" if value is None else f"{value:,}" if isinstance(value, int) else str(value)


def human_age(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def verify(path: Path | str, *, checksums: bool = True) -> tuple[dict[str, Any] | None, list[str]]:
    """(manifest, problems): marker, manifest, names, sizes, unless disabled every file's SHA-256, and DCP's
    ``.metadata`` as a resume reads it (so verify refuses what a resume refuses, however well the hashes match)."""
    store, path = store_for(path), os.fspath(path)
    if not store.is_dir(path):
        return None, [f"{path}: no such checkpoint directory"]
    manifest, problems = check_structure(path)
    if manifest is not None and checksums:
        data = data_location(path)
        files = {item.name for item in store.list(data) if item.kind == "file"}
        present = [name for name in manifest["files"] if name in files]
        problems += check_checksums(data, manifest, present, threads=os.cpu_count() or 4)
    if manifest is not None and not problems:
        problems += metadata_problems(data_location(path))
    return manifest, problems


def metadata_problems(data: str) -> list[str]:
    """What a resume refuses in DCP's ``.metadata`` (in the folder ``data`` that holds a checkpoint's files): a
    global DCP never uses, or an entry stored as a pickled object rather than a tensor."""
    location = store_for(data).join(data, METADATA_FILE)
    try:
        entries = load_metadata(location).state_dict_metadata
    except CheckpointError as exc:
        return [str(exc)]
    odd = sorted(key for key, entry in entries.items() if not isinstance(entry, TensorStorageMetadata))
    if not odd:
        return []
    more = f" (and {len(odd) - 1} more)" if len(odd) > 1 else ""
    return [f"{location}: entry {odd[0]!r}{more} is stored as a pickled object; meshrun never writes those "
            "and a resume refuses them (the checkpoint is foreign or crafted)"]


def export_model(path: Path | str, out: Path) -> dict[str, Any]:
    """Write the model weights of checkpoint ``path`` (no optimizer state) to ``out`` as safetensors, keyed by
    the model's own parameter names, in the dtype stored. The checkpoint is verified first."""
    from safetensors.torch import save_file

    manifest, weights = load_model_weights(path, purpose="export")
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    metadata = {"format": "pt", "step": str(manifest["step"]), "source": str(path)}
    config = trained_config(manifest)  # tie_embeddings as trained: false for a checkpoint saved under a pipeline
    if config is not None:  # what the weights need to be rebuilt: the model section, and the whole job
        metadata.update(model_config=json.dumps(config.get("model", {}), sort_keys=True),
                        meshrun_config=json.dumps(config, sort_keys=True))
    save_file(weights, str(partial), metadata=metadata)
    os.replace(partial, out)
    return {"step": manifest["step"], "tensors": len(weights), "bytes": out.stat().st_size,
            "dtypes": sorted({str(t.dtype).removeprefix("torch.") for t in weights.values()})}


def load_model_weights(path: Path | str, *, purpose: str = "load") -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(manifest, weights): checkpoint ``path`` verified, then its whole (unsharded) model weights read on one
    process, keyed by the model's own parameter names, whatever layout saved them."""
    manifest, problems = verify(path)
    if problems:
        raise CheckpointError(f"{path}: will not {purpose} a damaged checkpoint: {'; '.join(problems[:3])}")
    owners = [name for name, kind in manifest.get("state", {}).items() if kind == "ModelOptimState"]
    if len(owners) != 1:
        raise CheckpointError(f"{path}: the manifest names {len(owners)} ModelOptimState entries; {purpose} needs one")
    prefix = f"{owners[0]}.model."
    data = data_location(path)
    reader = store_for(data).dcp_reader(data)
    entries = {key: entry for key, entry in reader.read_metadata().state_dict_metadata.items()
               if key.startswith(prefix)}
    odd = sorted(key for key, entry in entries.items() if not isinstance(entry, TensorStorageMetadata))
    if odd:  # a weight left out would load as the fresh model's random init: refuse, as resume does
        raise CheckpointError(f"{path}: model entry {odd[0]!r} is stored as a pickled object, not a tensor"
                              f"{f' (and {len(odd) - 1} more)' if len(odd) > 1 else ''}; meshrun never writes "
                              f"those and will not {purpose} a model without it (the checkpoint is foreign or crafted)")
    targets = {key: torch.empty(tuple(entry.size), dtype=entry.properties.dtype) for key, entry in entries.items()}
    if not targets:
        raise CheckpointError(f"{path}: holds no model tensors under {prefix!r}")
    dcp.load(targets, storage_reader=reader, no_dist=True)
    return manifest, {key[len(prefix):]: tensor for key, tensor in targets.items()}
