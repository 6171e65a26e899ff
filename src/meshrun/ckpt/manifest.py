"""manifest.json: what a checkpoint holds, and checks that its files are the ones that were written.

The manifest lists every file of the checkpoint with its size and SHA-256. SHA-256 rather than a faster
non-cryptographic hash (CRC32, xxHash): it is strong against both bit rot and a crafted file, ``sha256sum``
checks it by hand, and it costs little where it runs: each rank hashes only the shard it just wrote (still in
the page cache; read back once on an object store), in parallel with the others, at about 1 GB/s per core
(hashlib releases the GIL, so several files hash on several threads). Load verifies sizes of every candidate
and checksums of the one chosen, again split over ranks. Pure logic plus I/O through :mod:`meshrun.ckpt.storage`:
no process group.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from meshrun.ckpt.errors import CheckpointError
from meshrun.ckpt.folder import MANIFEST
from meshrun.ckpt.storage import ATTEMPT_RE, COMPLETE, Store, attempt_named, store_for
from meshrun.gitstate import git_state

FORMAT = "meshrun.checkpoint"
FORMAT_VERSION = 1
CHECKSUM = "sha256"
REQUIRED_FIELDS = ("format", "format_version", "step", "world_size", "files", "checksum", "created_unix")
_CHUNK = 8 << 20  # 8 MiB reads: large enough that hashing, not syscalls, dominates


def check_file_name(name: Any) -> str:
    """Accept only a plain file name, so that a crafted manifest cannot point outside its checkpoint directory."""
    if (not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name or "\x00" in name
            or os.path.isabs(name)):
        raise CheckpointError(f"manifest lists the file name {name!r}, which is not a plain file name inside the "
                              "checkpoint directory (absolute paths, '..' and sub-paths are refused); the manifest is "
                              "damaged or crafted: do not load this checkpoint")
    return name


def sha256_file(path: Path | str) -> str:
    return store_for(path).sha256(os.fspath(path), _CHUNK)


def describe_files(folder: Path | str, names: list[str], *, threads: int = 4) -> dict[str, dict[str, Any]]:
    """{name: {"size", "sha256"}} for files in ``folder`` (a path or URL), hashed on up to ``threads`` threads."""
    store = store_for(folder)

    def one(name: str) -> tuple[str, dict[str, Any]]:
        path = store.join(os.fspath(folder), check_file_name(name))
        return name, {"size": store.size(path), CHECKSUM: store.sha256(path, _CHUNK)}

    if not names:
        return {}
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(names)))) as pool:
        return dict(pool.map(one, names))


def write_durable(path: Path | str, data: bytes) -> None:
    """Write one file (fsync'd) or object, so that it survives a crash once this returns."""
    store_for(path).write(os.fspath(path), data)


def fsync_dir(path: Path | str) -> None:
    """fsync a directory so that the names created or renamed in it are durable (no-op where unsupported)."""
    store_for(path).sync(os.fspath(path))


@functools.lru_cache(maxsize=4)
def code_version(source: Path | None = None) -> dict[str, Any]:
    """Git commit and dirty flag of the meshrun source tree; None for each where git or the repo is absent.

    Cached per process: the code a process runs does not change under it (a later edit is not what it runs)."""
    root = source or Path(__file__).resolve().parents[1]

    state = git_state(root)
    return {"git_commit": None if state is None else state.commit, "git_dirty": None if state is None else state.dirty}


def build_manifest(*, step: int, files: dict[str, dict[str, Any]], world_size: int, layout: dict[str, Any],
                   config_fingerprint: str, code: dict[str, Any], meta: dict[str, Any], state_kinds: dict[str, str],
                   final: bool, async_save: bool, timings: dict[str, float]) -> dict[str, Any]:
    """The manifest's content. ``meta`` may carry epoch and tokens_seen (hoisted) and anything JSON-able."""
    meta = dict(meta)
    now = time.time()
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "step": step, "epoch": meta.pop("epoch", None), "tokens_seen": meta.pop("tokens_seen", None),
        "world_size": world_size, "layout": layout, "config_fingerprint": config_fingerprint,
        "code": code, "torch_version": torch.__version__, "meshrun_version": _meshrun_version(),
        "created_unix": now, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(now)),
        "final": final, "async_save": async_save, "state": state_kinds, "meta": meta, "timings": timings,
        "checksum": CHECKSUM, "files": dict(sorted(files.items())),
    }


def _meshrun_version() -> str:
    from meshrun import __version__

    return __version__


def read_manifest(folder: Path | str) -> dict[str, Any]:
    """Parse and validate ``folder/manifest.json`` (``folder``: where the checkpoint's data is, see
    :func:`data_location`); CheckpointError naming the file and what is wrong."""
    store = store_for(folder)
    path = store.join(os.fspath(folder), MANIFEST)
    try:
        manifest = json.loads(store.read(path).decode("utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; the checkpoint was not finished or was damaged") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON (truncated or damaged?): {exc}") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a meshrun checkpoint manifest (format is not {FORMAT!r})")
    missing = [key for key in REQUIRED_FIELDS if key not in manifest]
    if missing:
        raise CheckpointError(f"{path}: lacks the field(s) {', '.join(missing)} (truncated or damaged?)")
    if manifest["format_version"] > FORMAT_VERSION:
        raise CheckpointError(f"{path}: format version {manifest['format_version']} is newer than this meshrun "
                              f"reads ({FORMAT_VERSION}); upgrade meshrun")
    if manifest["checksum"] != CHECKSUM:
        raise CheckpointError(f"{path}: unknown checksum {manifest['checksum']!r}; expected {CHECKSUM!r}")
    files = manifest["files"]
    if not isinstance(files, dict) or not files:
        raise CheckpointError(f"{path}: 'files' must list the checkpoint's files")
    for name, info in files.items():
        check_file_name(name)
        if name in (MANIFEST, COMPLETE) or not isinstance(info, dict) or not isinstance(info.get("size"), int) \
                or not isinstance(info.get(CHECKSUM), str):
            raise CheckpointError(f"{path}: entry for {name!r} is malformed (needs an int size and a {CHECKSUM})")
    return manifest


def data_location(checkpoint: Path | str) -> str:
    """Where the files of ``checkpoint`` (a step_* directory) are: beside its COMPLETE on a local folder, in the
    attempt its COMPLETE names on an object store. The checkpoint itself when it has no COMPLETE."""
    store, location = store_for(checkpoint), os.fspath(checkpoint)
    try:
        attempt = attempt_named(store.read(store.join(location, COMPLETE)))
    except (FileNotFoundError, IsADirectoryError):
        return location
    return store.join(location, attempt) if attempt else location


def check_structure(folder: Path | str) -> tuple[dict[str, Any] | None, list[str]]:
    """Cheap checks of a checkpoint (marker, manifest, names, sizes, no stray or linked files). Returns
    (manifest, problems)."""
    store, location = store_for(folder), os.fspath(folder)
    marker_path = store.join(location, COMPLETE)
    try:
        marker = store.read(marker_path)
        data = data_location(location)
        manifest = read_manifest(data)
    except FileNotFoundError:
        return None, [f"{marker_path}: missing; the save did not finish"]
    except (CheckpointError, OSError) as exc:
        return None, [str(exc)]
    problems = _check_marker(store, marker, data)
    present = {item.name: item for item in store.list(data)}
    for name, info in manifest["files"].items():
        path, item = store.join(data, name), present.get(name)
        if item is None:
            problems.append(f"{path}: missing (listed in the manifest)")
        elif item.kind != "file":
            problems.append(f"{path}: not a regular file (symlinks are refused)")
        elif item.size != info["size"]:
            problems.append(f"{path}: size {item.size} bytes, the manifest says {info['size']}")
    for name, item in present.items():
        if name not in manifest["files"] and name not in (MANIFEST, COMPLETE):
            problems.append(f"{item.path}: not listed in the manifest")
    if data != location:  # beside the attempts, only COMPLETE (other attempts are unfinished saves, not trusted)
        problems += [f"{item.path}: not listed in the manifest" for item in store.list(location)
                     if item.name != COMPLETE and not (item.kind == "dir" and ATTEMPT_RE.match(item.name))]
    return manifest, problems


def _check_marker(store: Store, marker: bytes, data: str) -> list[str]:
    """COMPLETE records the manifest's SHA-256: a damaged manifest is told from a damaged shard."""
    words = [line.split() for line in marker.decode(errors="replace").splitlines()]
    for pair in words:
        if len(pair) == 2 and pair[0] == "manifest-sha256":
            actual = hashlib.sha256(store.read(store.join(data, MANIFEST))).hexdigest()
            if actual != pair[1]:
                return [f"{store.join(data, MANIFEST)}: {CHECKSUM} differs from the one recorded in {COMPLETE} (the "
                        "manifest is damaged)"]
    return []


def check_checksums(folder: Path | str, manifest: dict[str, Any], names: list[str], *, threads: int = 4) -> list[str]:
    """Hash ``names`` (a share of the manifest's files) and report each mismatch, naming the file."""
    problems = []
    try:
        actual = describe_files(folder, names, threads=threads)
    except (OSError, CheckpointError) as exc:
        return [f"{folder}: cannot hash: {exc}"]
    for name in names:
        expected = manifest["files"][name][CHECKSUM]
        if actual[name][CHECKSUM] != expected:
            path = store_for(folder).join(os.fspath(folder), name)
            problems.append(f"{path}: {CHECKSUM} {actual[name][CHECKSUM][:16]}... differs from the "
                            f"manifest's {expected[:16]}... (the file is damaged)")
    return problems


def share_of_files(manifest: dict[str, Any], rank: int, world: int) -> list[str]:
    """This rank's share of the files to hash: largest first, each to the least-loaded rank (same on every rank)."""
    loads = [0] * world
    mine = []
    for name, info in sorted(manifest["files"].items(), key=lambda kv: (-kv[1]["size"], kv[0])):
        owner = loads.index(min(loads))
        loads[owner] += info["size"]
        if owner == rank:
            mine.append(name)
    return mine
