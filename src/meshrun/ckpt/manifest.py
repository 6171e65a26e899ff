"""manifest.json: what a checkpoint holds, and checks that its files are the ones that were written.

The manifest lists every file of the checkpoint with its size and SHA-256. SHA-256 rather than a faster
non-cryptographic hash (CRC32, xxHash): it is strong against both bit rot and a crafted file, ``sha256sum``
checks it by hand, and it costs little where it runs: each rank hashes only the shard it just wrote (still in
the page cache), in parallel with the others, at about 1 GB/s per core (hashlib releases the GIL, so several
files hash on several threads). Load verifies sizes of every candidate and checksums of the one chosen, again
split over ranks. Pure logic plus file I/O: no process group.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from meshrun.ckpt.errors import CheckpointError
from meshrun.ckpt.layout import COMPLETE, MANIFEST
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


def _open_regular(path: Path) -> int:
    """Open for reading without following a symlink; refuse anything that is not a regular file."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(f"{path}: not a regular file")
    return fd


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    fd = _open_regular(path)
    try:
        while count := os.readv(fd, [buffer]):
            digest.update(view[:count])
    finally:
        os.close(fd)
    return digest.hexdigest()


def describe_files(folder: Path, names: list[str], *, threads: int = 4) -> dict[str, dict[str, Any]]:
    """{name: {"size", "sha256"}} for files in ``folder``, hashed on up to ``threads`` threads."""
    def one(name: str) -> tuple[str, dict[str, Any]]:
        path = folder / check_file_name(name)
        return name, {"size": path.lstat().st_size, CHECKSUM: sha256_file(path)}

    if not names:
        return {}
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(names)))) as pool:
        return dict(pool.map(one, names))


def write_durable(path: Path, data: bytes) -> None:
    """Write and fsync one file, so that it survives a crash once this returns."""
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def fsync_dir(path: Path) -> None:
    """fsync a directory so that the names created or renamed in it are durable (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some network file systems refuse fsync on directories; their renames are synchronous
        pass
    finally:
        os.close(fd)


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


def read_manifest(folder: Path) -> dict[str, Any]:
    """Parse and validate ``folder/manifest.json``; CheckpointError naming the file and what is wrong."""
    path = folder / MANIFEST
    try:
        fd = _open_regular(path)
        with os.fdopen(fd, "rb") as handle:
            manifest = json.loads(handle.read().decode("utf-8"))
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


def check_structure(folder: Path) -> tuple[dict[str, Any] | None, list[str]]:
    """Cheap checks (marker, manifest, names, sizes, no stray or linked files). Returns (manifest, problems)."""
    if not (folder / COMPLETE).is_file():
        return None, [f"{folder / COMPLETE}: missing; the save did not finish"]
    try:
        manifest = read_manifest(folder)
    except CheckpointError as exc:
        return None, [str(exc)]
    problems = _check_marker(folder)
    for name, info in manifest["files"].items():
        path = folder / name
        try:
            st = path.lstat()
        except FileNotFoundError:
            problems.append(f"{path}: missing (listed in the manifest)")
            continue
        if not stat.S_ISREG(st.st_mode):
            problems.append(f"{path}: not a regular file (symlinks are refused)")
        elif st.st_size != info["size"]:
            problems.append(f"{path}: size {st.st_size} bytes, the manifest says {info['size']}")
    for child in sorted(folder.iterdir()):
        if child.name not in manifest["files"] and child.name not in (MANIFEST, COMPLETE):
            problems.append(f"{child}: not listed in the manifest")
    return manifest, problems


def _check_marker(folder: Path) -> list[str]:
    """COMPLETE records the manifest's SHA-256: a damaged manifest is told from a damaged shard."""
    words = (folder / COMPLETE).read_text(errors="replace").split()
    if len(words) == 2 and words[0] == "manifest-sha256":
        with os.fdopen(_open_regular(folder / MANIFEST), "rb") as handle:
            actual = hashlib.sha256(handle.read()).hexdigest()
        if actual != words[1]:
            return [f"{folder / MANIFEST}: {CHECKSUM} differs from the one recorded in {COMPLETE} (the manifest is "
                    "damaged)"]
    return []


def check_checksums(folder: Path, manifest: dict[str, Any], names: list[str], *, threads: int = 4) -> list[str]:
    """Hash ``names`` (a share of the manifest's files) and report each mismatch, naming the file."""
    problems = []
    try:
        actual = describe_files(folder, names, threads=threads)
    except (OSError, CheckpointError) as exc:
        return [f"{folder}: cannot hash: {exc}"]
    for name in names:
        expected = manifest["files"][name][CHECKSUM]
        if actual[name][CHECKSUM] != expected:
            problems.append(f"{folder / name}: {CHECKSUM} {actual[name][CHECKSUM][:16]}... differs from the "
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
