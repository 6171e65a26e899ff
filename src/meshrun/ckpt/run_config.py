"""The resolved job config a checkpoint carries (its manifest's ``meta.config``), and what changed since.

The trainer stores the whole resolved config (every section, the model's named size written out) in each
checkpoint's manifest, so ``meshrun sample``, ``ckpt export`` and a resume read the config the weights were trained
with, never a ``config.toml`` that a later invocation may have rewritten. Pure logic: no process group, no files.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from meshrun.config import ConfigError, JobConfig, set_option

CONFIG_KEY = "config"
"""Key of the resolved config in the manifest's ``meta``."""

OPTIMISATION_KEYS = ("lr", "min_lr", "warmup_steps", "weight_decay", "beta1", "beta2", "grad_clip", "seed", "dtype")
"""train.* options that must match for a resume to continue the same run (with model.* and data.*)."""


def saved_config(manifest: dict[str, Any]) -> dict[str, Any] | None:
    """The resolved config stored with a checkpoint ({section: {key: value}}), or None (older checkpoints)."""
    config = (manifest.get("meta") or {}).get(CONFIG_KEY)
    return config if isinstance(config, dict) else None


def saved_embeddings_tied(manifest: dict[str, Any]) -> bool | None:
    """Whether the checkpoint holds the token embedding and the output head as one matrix (tied), as it was trained;
    None when it carries no config (a Session's checkpoint, or an older meshrun's).

    The trainer records the model it trained (``model.tie_embeddings=false`` under a pipeline, which unties them);
    checkpoints of an older meshrun recorded the option as given, so a pipeline in their ``layout`` says untied."""
    model = (saved_config(manifest) or {}).get("model")
    if not isinstance(model, dict) or "tie_embeddings" not in model:
        return None
    return bool(model["tie_embeddings"]) and int((manifest.get("layout") or {}).get("pp", 1)) == 1


def trained_config(manifest: dict[str, Any]) -> dict[str, Any] | None:
    """:func:`saved_config` with ``model.tie_embeddings`` as the weights were trained (:func:`saved_embeddings_tied`):
    what rebuilds the model of these weights (export, sample)."""
    config = saved_config(manifest)
    tied = saved_embeddings_tied(manifest)
    if config is None or tied is None or config["model"]["tie_embeddings"] == tied:
        return config
    return {**config, "model": {**config["model"], "tie_embeddings": tied}}


def job_from_dict(config: dict[str, Any]) -> JobConfig:
    """A JobConfig from a stored config; options this meshrun no longer knows are left out."""
    job = JobConfig()
    sections = {f.name for f in dataclasses.fields(job)}
    for section, values in config.items():
        if section not in sections or not isinstance(values, dict):
            continue
        for key, value in values.items():
            try:
                set_option(job, f"{section}.{key}", value)
            except ConfigError:
                continue  # an option of another meshrun version
    return job


def fingerprinted(config: dict[str, Any]) -> dict[str, Any]:
    """The options a resume compares, flattened to ``section.key``: model.*, data.* and train's optimisation."""
    flat = {f"{section}.{key}": value for section in ("model", "data")
            for key, value in (config.get(section) or {}).items()}
    train = config.get("train") or {}
    flat.update({f"train.{key}": train[key] for key in OPTIMISATION_KEYS if key in train})
    if config.get("data_fingerprint"):
        flat["data (content fingerprint)"] = str(config["data_fingerprint"])[:12]
    for key, default in (("lr_schedule", "cosine"), ("decay_fraction", 0.2)):  # compared when set only
        if train.get(key, default) != default:
            flat[f"train.{key}"] = train[key]
    return flat


def config_fingerprint(config: dict[str, Any]) -> str:
    """What must match for a resume to continue the same run: model, data (options and content) and optimisation
    settings (``config``: a resolved config with ``data_fingerprint``). The structure hashed is the one older
    checkpoints were fingerprinted with; lr_schedule and decay_fraction join it only when set."""
    train = {key: config["train"][key] for key in OPTIMISATION_KEYS}
    train.update({key: config["train"][key] for key, default in (("lr_schedule", "cosine"), ("decay_fraction", 0.2))
                  if config["train"].get(key, default) != default})
    relevant = {"model": config["model"], "data": config["data"], "data_fingerprint": config["data_fingerprint"],
                "train": train}
    return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()[:16]


def describe_changes(saved: dict[str, Any] | None, now: dict[str, Any] | None, *, limit: int = 6) -> str:
    """'model.dim 64 -> 128, train.lr 0.003 -> 0.001' for the compared options that differ; '' when unknown."""
    if not saved or not now:
        return ""
    before, after = fingerprinted(saved), fingerprinted(now)
    changed = [f"{key} {before.get(key, '(unset)')} -> {after.get(key, '(unset)')}"
               for key in sorted(set(before) | set(after)) if before.get(key) != after.get(key)]
    more = f" and {len(changed) - limit} more" if len(changed) > limit else ""
    return ", ".join(changed[:limit]) + more
