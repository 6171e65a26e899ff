"""Where checkpoints live: one small interface over a local folder and an object store (``s3://``, ``gs://``).

Every module of ``meshrun.ckpt`` reads and writes through a :class:`Store` from :func:`store_for`; a location is a
plain path or a URL, always passed as a string. What differs between the two kinds is how a finished save becomes
visible (``publish``):

* :class:`LocalStore` (POSIX folders, NFS, Lustre): the save is written into ``.step_N.tmp-<id>/``, ``COMPLETE``
  is written and fsync'd inside it, and the folder is renamed to ``step_N/`` (an atomic rename).
* :class:`ObjectStore` (fsspec: s3fs, gcsfs): an object store has no atomic rename (fsspec's rename is copy +
  delete), so the save is written under a fresh attempt prefix ``step_N/attempt-<id>/`` and published by writing
  ``step_N/COMPLETE`` last, naming the attempt and the manifest's SHA-256, with a conditional create (S3
  ``If-None-Match: *``, GCS ``ifGenerationMatch=0``) so two writers cannot both publish. Readers trust only the
  attempt a ``COMPLETE`` names; other attempts are unfinished saves, ignored and collected by retention.

Listings are never cached (``use_listings_cache=False`` and an explicit invalidation before each listing): s3fs
and gcsfs cache directory listings per instance, and a rank acting on a stale listing would miss a checkpoint that
another node has just published, or resume one that retention has just deleted.

Credentials and endpoints come from where the client library looks (``AWS_*`` variables and ``~/.aws``, including
``AWS_ENDPOINT_URL``; ``GOOGLE_APPLICATION_CREDENTIALS``, ``STORAGE_EMULATOR_HOST``; fsspec's ``FSSPEC_S3_*``
variables) and from ``checkpoint.storage_options`` (keyword arguments of the fsspec file system), registered here
with :func:`register_options`.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import shutil
import stat
import threading
from dataclasses import dataclass
from typing import IO, Any

from meshrun.ckpt.errors import CheckpointError

COMPLETE = "COMPLETE"
ATTEMPT_RE = re.compile(r"^attempt-([0-9a-f]+)$")
_URL_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_EXTRAS = {"s3": ("s3fs", "s3"), "gs": ("gcsfs", "gcs"), "gcs": ("gcsfs", "gcs")}
_options: dict[str, dict[str, Any]] = {}
_stores: dict[tuple[str, str], Store] = {}
_lock = threading.Lock()


@dataclass(frozen=True)
class Item:
    """One child of a folder: its full location, name, kind ('file', 'dir', 'link' or 'other') and size."""

    path: str
    name: str
    kind: str
    size: int = 0


def scheme_of(location: str | os.PathLike) -> str:
    """'s3', 'gs', ... for a URL; '' for a local path."""
    match = _URL_RE.match(os.fspath(location))
    return match.group(1).lower() if match else ""


def is_url(location: str | os.PathLike) -> bool:
    return bool(scheme_of(location))


def register_options(location: str | os.PathLike, options: dict[str, Any] | None) -> None:
    """Use ``options`` (fsspec keyword arguments: endpoint_url, key, secret, token, project, ...) for every store of
    ``location``'s scheme opened from now on in this process (checkpoint.storage_options)."""
    scheme = scheme_of(location)
    if scheme and options:
        with _lock:
            if _options.get(scheme) != options:
                _options[scheme] = dict(options)
                for key in [k for k in _stores if k[0] == scheme]:
                    del _stores[key]


def forget_clients() -> None:
    """Drop the object-store clients made so far; the next :func:`store_for` builds new ones from the environment
    as it is then (a test that changes endpoints or credentials, a long-lived process whose credentials rotated)."""
    with _lock:
        _stores.clear()


def store_for(location: str | os.PathLike) -> Store:
    """The store that holds ``location``. A URL whose scheme has no installed client is refused: it would
    otherwise become a local folder named ``s3:``."""
    scheme = scheme_of(location)
    if not scheme or scheme == "file":
        return LOCAL
    if scheme not in _EXTRAS:
        raise CheckpointError(f"{os.fspath(location)}: checkpoint locations are local paths, s3:// or gs:// URLs; "
                              f"{scheme}:// is not supported (and is not used as a local folder name)")
    with _lock:
        store = _stores.get((scheme, ""))
        if store is None:
            from meshrun.ckpt.objectstore import ObjectStore

            store = _stores[(scheme, "")] = ObjectStore(scheme, dict(_options.get(scheme, {})))
    return store


def attempt_named(marker: bytes) -> str | None:
    """The attempt a COMPLETE marker names (object stores), or None (local checkpoints: the data is beside it).
    A name that is not ``attempt-<hex>`` is refused, so a crafted marker cannot point outside its checkpoint."""
    for line in marker.decode(errors="replace").splitlines():
        words = line.split()
        if len(words) == 2 and words[0] == "attempt":
            if not ATTEMPT_RE.match(words[1]):
                raise CheckpointError(f"COMPLETE names the attempt {words[1]!r}, which is not attempt-<hex>; the "
                                      "marker is damaged or crafted")
            return words[1]
    return None


def local_path(location: str | os.PathLike) -> str:
    """``location`` as a string, with a ``file://`` prefix removed."""
    text = os.fspath(location)
    return text[len("file://"):] if text.startswith("file://") else text


OPTIONS_IN = "checkpoint.storage_options"
"""Where a store's one-line errors say storage options are set (training's words; a command that reads them
elsewhere passes its own: meshrun.ckpt.access)."""


class Store:
    """The operations checkpoints need. Locations are strings (paths or URLs) as given; ``join`` builds them."""

    kind = "local"
    atomic_rename = True

    def join(self, base: str, *names: str) -> str:
        return os.path.join(local_path(base), *names)

    def name(self, location: str) -> str:
        return os.path.basename(os.fspath(location).rstrip("/"))

    def parent(self, location: str) -> str:
        return os.path.dirname(local_path(location).rstrip("/"))

    def list(self, folder: str) -> list[Item]:
        raise NotImplementedError

    def read(self, location: str) -> bytes:
        with self.open_read(location) as handle:
            return handle.read()

    def open_read(self, location: str) -> IO[bytes]:
        raise NotImplementedError

    def write(self, location: str, data: bytes, *, exclusive: bool = False) -> None:
        """Durable once this returns; ``exclusive`` raises FileExistsError when the object exists."""
        raise NotImplementedError

    def open_write(self, location: str) -> IO[bytes]:
        """A stream for an object too large to hold in memory (an object store uploads it in parts); durable once
        closed on an object store, after ``fsync`` on a local disk."""
        raise NotImplementedError

    def exists(self, location: str) -> bool:
        raise NotImplementedError

    def is_dir(self, location: str) -> bool:
        raise NotImplementedError

    def size(self, location: str) -> int:
        raise NotImplementedError

    def mtime(self, location: str) -> float:
        """Newest modification time under ``location`` (inf when it is gone)."""
        raise NotImplementedError

    def delete(self, location: str, *, recursive: bool = False) -> None:
        raise NotImplementedError

    def makedirs(self, location: str) -> None:
        raise NotImplementedError

    def free_bytes(self, location: str) -> int | None:
        """Free bytes where ``location`` lives, or None where that has no meaning or cannot be known."""
        return None

    def probe(self, location: str, *, options_in: str = OPTIONS_IN) -> None:
        """Raise a one-line CheckpointError within a few seconds when ``location`` cannot be reached; its fix names
        ``options_in`` as where storage options are set."""

    def describe_error(self, exc: BaseException, location: str, *,
                       options_in: str = OPTIONS_IN) -> str | None:
        """One line for a failure of this store (unreachable, no credentials), or None when it is not one."""
        return None

    def sha256(self, location: str, chunk: int = 8 << 20) -> str:
        digest = hashlib.sha256()
        with self.open_read(location) as handle:
            while block := handle.read(chunk):
                digest.update(block)
        return digest.hexdigest()

    def sync(self, folder: str) -> None:
        """Make the names created in ``folder`` durable (fsync of a directory); a no-op on object stores."""

    # ---- the save protocol
    def attempt_path(self, folder: str, step_dir: str, token: str) -> str:
        """Where a save of ``step_dir`` writes before it is published."""
        raise NotImplementedError

    def publish(self, attempt: str, final: str, marker: bytes, *, replace: bool) -> None:
        """Make ``attempt`` the checkpoint ``final``, writing ``COMPLETE`` (``marker``) last."""
        raise NotImplementedError

    def retire(self, checkpoint: str) -> None:
        """Delete a checkpoint so that no reader ever finds it half-deleted (its COMPLETE goes first)."""
        raise NotImplementedError

    # ---- DCP
    def dcp_writer(self, location: str, *, thread_count: int, staging_cls: type | None = None, **kwargs: Any) -> Any:
        raise NotImplementedError

    def dcp_reader(self, location: str) -> Any:
        raise NotImplementedError


class LocalStore(Store):
    """A POSIX folder (local disk or a shared file system): fsync'd writes and an atomic rename."""

    def list(self, folder: str) -> list[Item]:
        folder = local_path(folder)
        try:
            children = list(os.scandir(folder))
        except (FileNotFoundError, NotADirectoryError):
            return []
        items = []
        for child in children:
            kind = ("link" if child.is_symlink() else "dir" if child.is_dir() else "file" if child.is_file()
                    else "other")
            size = child.stat(follow_symlinks=False).st_size if kind == "file" else 0
            items.append(Item(child.path, child.name, kind, size))
        return sorted(items, key=lambda i: i.name)

    def open_read(self, location: str) -> IO[bytes]:
        """Open without following a symlink; refuse anything that is not a regular file."""
        path = local_path(location)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise CheckpointError(f"{path}: not a regular file")
        return os.fdopen(fd, "rb")

    def write(self, location: str, data: bytes, *, exclusive: bool = False) -> None:
        with open(local_path(location), "xb" if exclusive else "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())

    def open_write(self, location: str) -> IO[bytes]:
        return open(local_path(location), "wb")

    def exists(self, location: str) -> bool:
        return os.path.lexists(local_path(location))

    def is_dir(self, location: str) -> bool:
        path = local_path(location)
        return os.path.isdir(path) and not os.path.islink(path)

    def size(self, location: str) -> int:
        return os.lstat(local_path(location)).st_size

    def mtime(self, location: str) -> float:
        try:
            return os.lstat(local_path(location)).st_mtime
        except OSError:
            return float("inf")

    def delete(self, location: str, *, recursive: bool = False) -> None:
        path = local_path(location)
        if recursive and os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def makedirs(self, location: str) -> None:
        os.makedirs(local_path(location), exist_ok=True)

    def free_bytes(self, location: str) -> int | None:
        try:
            return shutil.disk_usage(local_path(location)).free
        except (OSError, ValueError):
            return None

    def sync(self, folder: str) -> None:
        try:
            fd = os.open(local_path(folder), os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except OSError:
            return
        try:
            os.fsync(fd)
        except OSError:  # some network file systems refuse fsync on directories; their renames are synchronous
            pass
        finally:
            os.close(fd)

    def attempt_path(self, folder: str, step_dir: str, token: str) -> str:
        return self.join(folder, f".{self.name(step_dir)}.tmp-{token}")

    def publish(self, attempt: str, final: str, marker: bytes, *, replace: bool) -> None:
        self.write(self.join(attempt, COMPLETE), marker)
        self.sync(attempt)
        if os.path.exists(final):  # the same step saved before: set aside, then replaced
            aside = self.join(self.parent(final), f".{self.name(final)}.del-{secrets.token_hex(4)}")
            os.rename(final, aside)
            os.rename(attempt, final)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.rename(attempt, final)
        self.sync(self.parent(final))

    def retire(self, checkpoint: str) -> None:
        aside = self.join(self.parent(checkpoint), f".{self.name(checkpoint)}.del-{secrets.token_hex(4)}")
        os.rename(checkpoint, aside)  # out of sight first, so no reader finds it half-deleted
        shutil.rmtree(aside, ignore_errors=True)

    def dcp_writer(self, location: str, *, thread_count: int, staging_cls: type | None = None, **kwargs: Any) -> Any:
        import torch.distributed.checkpoint as dcp

        cls = staging_cls or dcp.FileSystemWriter
        return cls(local_path(location), sync_files=True, thread_count=thread_count, **kwargs)

    def dcp_reader(self, location: str) -> Any:
        from meshrun.ckpt.safe_metadata import SafeFileSystemReader

        return SafeFileSystemReader(local_path(location))


LOCAL = LocalStore()


def _import_filesystem(scheme: str) -> Any:
    """The fsspec file system class of ``scheme``; a CheckpointError naming the extra when its client is missing."""
    try:
        import fsspec

        if scheme in ("gs", "gcs") and os.environ.get("STORAGE_EMULATOR_HOST"):
            # An emulator has no storage-control API: gcsfs's bucket-type probe (its default class since 2025)
            # would retry it for a minute at every open; the plain class does not probe.
            from gcsfs.core import GCSFileSystem

            return GCSFileSystem
        return fsspec.get_filesystem_class(scheme)
    except (ImportError, ValueError) as exc:
        package, extra = _EXTRAS.get(scheme, (None, None))
        hint = (f"install {package} (pip install 'meshrun[{extra}]')" if package else
                "meshrun stores checkpoints in a local folder, s3:// or gs://")
        raise CheckpointError(f"{scheme}:// checkpoint locations need an fsspec client for {scheme!r}, which is not "
                              f"available ({exc}); {hint}. The URL is not used as a local folder name") from None
