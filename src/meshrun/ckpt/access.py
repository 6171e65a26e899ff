"""Opening checkpoints from a command that runs no training job (``meshrun ckpt``, ``meshrun sample``).

Training registers ``checkpoint.storage_options`` when it builds its checkpointer; these commands take them from a
``--config`` job file (or a run folder's ``config.toml``) instead. A run folder whose ``config.toml`` puts the
checkpoints elsewhere (``checkpoint.dir``, a bucket say) is followed there, with that config's storage options. The
store is then asked first (:func:`open_location`: one line within seconds when it cannot be used), and a store
failure met later becomes one line too (:func:`failure_line`); both name what these commands take (the environment
variables, or ``--config``), not a config they cannot read.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from meshrun.ckpt.storage import is_url, register_options, store_for

if TYPE_CHECKING:
    from meshrun.config import JobConfig

CONFIG_OPTIONS_IN = "the checkpoint.storage_options of a --config job.toml"
"""Where a command's hints say storage options go (``endpoint_url``, ``key``, ``token``, ...)."""


def job_config(path: str | os.PathLike) -> JobConfig:
    """``--config``: a job TOML, or a run folder (its ``config.toml``). Raises ConfigError naming the file."""
    from meshrun.config import load_config

    given = Path(path)
    return load_config(given / "config.toml" if given.is_dir() else given)


def open_location(location: str, job: JobConfig | None) -> tuple[str, str | None]:
    """(where to read, a note when that is not ``location``). ``job`` (from ``--config``) supplies the storage
    options; a local run folder without ``checkpoints/`` whose ``config.toml`` sets ``checkpoint.dir`` is followed
    there (its storage options apply unless ``job`` is given). A URL is probed: CheckpointError, one line, when the
    store cannot be reached or used."""
    note = None
    elsewhere = run_checkpoint_dir(location)
    if elsewhere is not None:
        location, run_job, config_file = elsewhere
        note = f"{config_file} puts the checkpoints in {location} (checkpoint.dir); reading them there"
        job = job or run_job
    if job is not None:
        register_options(location, job.checkpoint.storage_options)
    if is_url(location):
        store_for(location).probe(location, options_in=CONFIG_OPTIONS_IN)
    return location, note


def run_checkpoint_dir(location: str) -> tuple[str, JobConfig, Path] | None:
    """(checkpoint.dir, the run's config, its file) for a local run folder that holds a ``config.toml`` setting
    ``checkpoint.dir`` and no checkpoints of its own; None otherwise."""
    if is_url(location) or not location:
        return None
    folder = Path(location)
    config_file = folder / "config.toml"
    if not config_file.is_file() or (folder / "checkpoints").exists() or any(folder.glob("step_*")):
        return None
    from meshrun.config import ConfigError

    try:
        job = job_config(config_file)
    except ConfigError:  # an older or hand-edited config: the folder is read as it is, and named if it is empty
        return None
    target = job.checkpoint.dir.rstrip("/")
    if not target or (not is_url(target) and Path(target).resolve() == folder.resolve()):
        return None
    return target, job, config_file


def failure_line(exc: BaseException, location: str) -> str | None:
    """One line for a store failure at ``location`` (unreachable, no credentials, no bucket, ...), or None when
    ``exc`` is not one (a local path, or a failure that is not the store's)."""
    if not is_url(location):
        return None
    return store_for(location).describe_error(exc, location, options_in=CONFIG_OPTIONS_IN)
