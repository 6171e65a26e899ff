"""The object-store side of :mod:`meshrun.ckpt.storage`: ``s3://`` and ``gs://`` through fsspec (s3fs, gcsfs).

DCP's shards go through ``torch.distributed.checkpoint``'s own file-system writer and reader, bound to this
store's fsspec instance (so ``checkpoint.storage_options`` apply, and its listings are not cached), with
``sync_files=False``: an object is durable once its upload completes, there is nothing to fsync.
"""

from __future__ import annotations

import errno
import os
import posixpath
import socket
import threading
import urllib.parse
from typing import IO, Any

from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as _DcpFsspecFileSystem
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter

from meshrun.ckpt.errors import CheckpointError
from meshrun.ckpt.safe_metadata import SafeMetadataMixin
from meshrun.ckpt.storage import COMPLETE, OPTIONS_IN, Item, Store, _import_filesystem, attempt_named

_PROBE_TIMEOUT_S = 5.0
_CREDENTIAL_HINT = {
    "s3": "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or key and secret in {options}",
    "gs": "set GOOGLE_APPLICATION_CREDENTIALS (or run `gcloud auth application-default login`), or token in {options}",
}
_ENDPOINT_HINT = {
    "s3": "check AWS_ENDPOINT_URL (or endpoint_url in {options}) and that the server is up",
    "gs": "check STORAGE_EMULATOR_HOST (or endpoint_url in {options}) and that the server is up",
}


class ObjectStore(Store):
    """A bucket through fsspec. Locations are URLs (``s3://bucket/prefix/...``)."""

    kind = "object"
    atomic_rename = False

    def __init__(self, scheme: str, options: dict[str, Any]):
        self.scheme = "gs" if scheme == "gcs" else scheme
        self.options = dict(options)
        cls = _import_filesystem(scheme)
        self.fs = cls(**self._kwargs(fast=False))
        self._probe_fs: Any = None

    def _kwargs(self, *, fast: bool) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"use_listings_cache": False, "skip_instance_cache": True, **self.options}
        if self.scheme == "s3":
            config = dict(kwargs.get("config_kwargs") or {})
            config.setdefault("connect_timeout", 2 if fast else 10)
            if fast:
                config.update(read_timeout=_PROBE_TIMEOUT_S, retries={"max_attempts": 1, "mode": "standard"})
            kwargs["config_kwargs"] = config
        if self.scheme == "gs" and os.environ.get("STORAGE_EMULATOR_HOST"):
            kwargs.setdefault("token", "anon")  # an emulator takes no credentials
        return kwargs

    # ---- names
    def join(self, base: str, *names: str) -> str:
        return posixpath.join(base.rstrip("/"), *names)

    def parent(self, location: str) -> str:
        head, _, _ = location.rstrip("/").rpartition("/")
        return head

    def _url(self, path: str) -> str:
        return path if "://" in path else f"{self.scheme}://{path}"

    def endpoint(self) -> str:
        if self.scheme == "s3":
            return (self.options.get("endpoint_url") or (self.options.get("client_kwargs") or {}).get("endpoint_url")
                    or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
                    or "the AWS endpoint of the bucket's region")
        return (self.options.get("endpoint_url") or os.environ.get("STORAGE_EMULATOR_HOST")
                or "https://storage.googleapis.com")

    # ---- objects
    def list(self, folder: str) -> list[Item]:
        self.fs.invalidate_cache(folder)  # never act on a cached listing (see the module docstring of storage.py)
        try:
            entries = self.fs.ls(folder, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return []
        own = self.fs._strip_protocol(folder).rstrip("/")
        items = []
        for info in entries:
            path = info["name"].rstrip("/")
            if path == own:
                continue
            kind = "dir" if info.get("type") == "directory" else "file"
            items.append(Item(self._url(path), posixpath.basename(path), kind, int(info.get("size") or 0)))
        return sorted(items, key=lambda i: i.name)

    def open_read(self, location: str) -> IO[bytes]:
        self.fs.invalidate_cache(location)
        return self.fs.open(location, "rb")

    def read(self, location: str) -> bytes:
        self.fs.invalidate_cache(location)
        return self.fs.cat_file(location)

    def write(self, location: str, data: bytes, *, exclusive: bool = False) -> None:
        """One object; with ``exclusive``, a conditional create (FileExistsError when it exists)."""
        with self.fs.open(location, "xb" if exclusive else "wb") as handle:
            handle.write(data)
        self.fs.invalidate_cache(location)

    def open_write(self, location: str) -> IO[bytes]:
        return self.fs.open(location, "wb")

    def exists(self, location: str) -> bool:
        self.fs.invalidate_cache(location)
        return self.fs.exists(location)

    def is_dir(self, location: str) -> bool:
        self.fs.invalidate_cache(location)
        return self.fs.isdir(location)

    def size(self, location: str) -> int:
        self.fs.invalidate_cache(location)
        return int(self.fs.size(location))

    def mtime(self, location: str) -> float:
        self.fs.invalidate_cache(location)
        try:
            files = self.fs.find(location) or [location]
            return max(self.fs.modified(path).timestamp() for path in files)
        except (FileNotFoundError, OSError):
            return float("inf")

    def delete(self, location: str, *, recursive: bool = False) -> None:
        try:
            self.fs.rm(location, recursive=recursive)
        except FileNotFoundError:
            pass
        self.fs.invalidate_cache(location)

    def makedirs(self, location: str) -> None:
        """Nothing to create: a prefix exists once an object is under it (buckets are never created here)."""

    # ---- errors
    def probe(self, location: str, *, options_in: str = OPTIONS_IN) -> None:
        """List ``location`` with a short timeout and no retries; one line naming the URL and the fix on failure
        (``options_in``: where the fix says storage options are set)."""
        self._check_endpoint_port(location, options_in=options_in)
        outcome: dict[str, BaseException | None] = {}

        def attempt() -> None:
            try:
                if self._probe_fs is None:
                    self._probe_fs = type(self.fs)(**self._kwargs(fast=True))
                    if hasattr(self._probe_fs, "retries"):  # s3fs's own retry loop (class attribute), not botocore's
                        self._probe_fs.retries = 1
                try:  # exists() would hide a connection error as False: list, then look at the bucket
                    self._probe_fs.ls(location)
                except FileNotFoundError:  # an empty prefix, or no bucket
                    bucket = self._probe_fs._strip_protocol(location).split("/")[0]
                    try:
                        self._probe_fs.info(bucket)
                    except FileNotFoundError:
                        raise FileNotFoundError(errno.ENOENT, "no such bucket", bucket) from None
                outcome["error"] = None
            except BaseException as exc:  # noqa: BLE001 - reported below
                outcome["error"] = exc

        worker = threading.Thread(target=attempt, name="meshrun-store-probe", daemon=True)
        worker.start()
        worker.join(_PROBE_TIMEOUT_S * 2)
        if "error" not in outcome:
            raise CheckpointError(f"{location}: the object store at {self.endpoint()} did not answer within "
                                  f"{_PROBE_TIMEOUT_S * 2:.0f}s; {self._hint(_ENDPOINT_HINT, options_in)}")
        exc = outcome["error"]
        if exc is not None:
            raise CheckpointError(self.describe_error(exc, location, options_in=options_in) or
                                  f"{location}: cannot be listed: {type(exc).__name__}: {exc}") from None

    def _hint(self, hints: dict[str, str], options_in: str) -> str:
        return hints[self.scheme].format(options=options_in)

    def _check_endpoint_port(self, location: str, *, options_in: str) -> None:
        """A TCP connection to an explicit endpoint: refused at once, where the clients retry a closed port with
        backoff (gcsfs for about 30 s)."""
        parsed = urllib.parse.urlsplit(self.endpoint())
        if not parsed.hostname:
            return
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        try:
            socket.create_connection((parsed.hostname, port), timeout=_PROBE_TIMEOUT_S).close()
        except OSError as exc:
            raise CheckpointError(f"{location}: cannot reach the object store at {self.endpoint()} "
                                  f"({type(exc).__name__}: {exc}); {self._hint(_ENDPOINT_HINT, options_in)}") from None

    def describe_error(self, exc: BaseException, location: str, *, options_in: str = OPTIONS_IN) -> str | None:
        for cause in _causes(exc):
            name, text = type(cause).__name__, str(cause)
            if name in ("NoCredentialsError", "PartialCredentialsError") or "credentials" in text.lower():
                return (f"{location}: no usable credentials for {self.scheme}:// ({name}); "
                        f"{self._hint(_CREDENTIAL_HINT, options_in)}")
            if isinstance(cause, FileNotFoundError) and "bucket" in text:
                bucket = location.split("://", 1)[1].split("/")[0]
                return (f"{location}: the bucket {bucket!r} does not exist at {self.endpoint()}; create it (meshrun "
                        "never creates buckets) or fix checkpoint.dir")
            if isinstance(cause, PermissionError) or "AccessDenied" in text or "Forbidden" in text:
                return f"{location}: access denied ({_first_line(cause)}); {self._hint(_CREDENTIAL_HINT, options_in)}"
            if name == "FlexibleChecksumError":
                return (f"{location}: the object store at {self.endpoint()} answered with a checksum that does not "
                        f"match the bytes it sent ({_first_line(cause)}). Either they were damaged on the way, or the "
                        "server is an S3-compatible one that does not follow S3's checksum rules (older MinIO or "
                        "Ceph, rclone serve s3): for such a server set AWS_RESPONSE_CHECKSUM_VALIDATION=when_required "
                        "and AWS_REQUEST_CHECKSUM_CALCULATION=when_required (meshrun's SHA-256 of every file still "
                        "checks the bytes)")
            if (name in ("EndpointConnectionError", "ConnectTimeoutError", "ClientConnectorError",
                         "ServerDisconnectedError", "ClientOSError") or isinstance(cause, ConnectionError)):
                return (f"{location}: cannot reach the object store at {self.endpoint()} ({_first_line(cause)}); "
                        f"{self._hint(_ENDPOINT_HINT, options_in)}")
        return None

    # ---- the save protocol
    def attempt_path(self, folder: str, step_dir: str, token: str) -> str:
        return self.join(step_dir, f"attempt-{token}")

    def publish(self, attempt: str, final: str, marker: bytes, *, replace: bool) -> None:
        """``final/COMPLETE`` names ``attempt``; created only where absent. A COMPLETE of an earlier save of the same
        step is deleted first when ``replace`` (its attempt after), and the marker is read back: a second writer
        that published at the same moment is detected on stores that ignore the create condition."""
        marker_path = self.join(final, COMPLETE)
        text = f"attempt {self.name(attempt)}\n".encode() + marker
        try:
            self.write(marker_path, text, exclusive=True)
            old = None
        except FileExistsError:
            if not replace:
                raise CheckpointError(f"{marker_path}: exists already (another writer published this step)") from None
            old = attempt_named(self.read(marker_path))
            self.delete(marker_path)
            try:
                self.write(marker_path, text, exclusive=True)
            except FileExistsError:
                raise CheckpointError(f"{marker_path}: another writer published step {self.name(final)} at the same "
                                      "time; two jobs write to one checkpoint.dir") from None
        if self.read(marker_path) != text:
            raise CheckpointError(f"{marker_path}: names another attempt than this save's; two jobs write to one "
                                  "checkpoint.dir")
        if old and old != self.name(attempt):
            self.delete(self.join(final, old), recursive=True)

    def retire(self, checkpoint: str) -> None:
        self.delete(self.join(checkpoint, COMPLETE))  # first: no reader trusts the data from here on
        self.delete(checkpoint, recursive=True)

    # ---- DCP
    def dcp_writer(self, location: str, *, thread_count: int, staging_cls: type | None = None, **kwargs: Any) -> Any:
        base = staging_cls or FileSystemWriter
        writer = base(location, sync_files=False, thread_count=thread_count, **kwargs)
        writer.fs, writer.path = _BoundFileSystem(self.fs), location
        return writer

    def dcp_reader(self, location: str) -> Any:
        reader = SafeObjectReader(location)
        reader.fs, reader.path = _BoundFileSystem(self.fs), location
        return reader


class _BoundFileSystem(_DcpFsspecFileSystem):
    """DCP's fsspec file system on this store's instance (its options, no listing cache), for every path DCP
    hands it, including the ``checkpoint_id`` of an async save."""

    def __init__(self, fs: Any):
        super().__init__()
        self.fs = fs

    def init_path(self, path: Any, **kwargs: Any) -> Any:
        return os.fspath(path)

    def mkdir(self, path: Any) -> None:
        """Prefixes need no creation (and fsspec's makedirs would create a missing bucket)."""

    def rename(self, path: Any, new_path: Any) -> None:
        """Copy, then delete (DCP renames ``.metadata.tmp`` once per save): what an object store's rename is anyway,
        without gcsfs's move API, which a bucket without hierarchical namespace answers with errors it retries."""
        self.fs.cp_file(os.fspath(path), os.fspath(new_path))
        self.fs.rm_file(os.fspath(path))


class SafeObjectReader(SafeMetadataMixin, FileSystemReader):
    """DCP's reader on an object store, with ``.metadata`` read by the restricted unpickler."""


def _causes(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    todo: list[Any] = [exc]
    while todo:
        current = todo.pop()
        if current is None or any(current is s for s in seen):
            continue
        seen.append(current)
        failures = getattr(current, "failures", None)  # DCP's CheckpointException: {rank: (exc, traceback)}
        if isinstance(failures, dict):
            todo.extend(pair[0] if isinstance(pair, tuple) else pair for pair in failures.values())
        todo.extend((current.__cause__, current.__context__))
    return seen


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"
