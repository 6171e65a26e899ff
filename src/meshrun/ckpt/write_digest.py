"""SHA-256 of each checkpoint file taken while DCP writes it, so that a save does not read its shards back to hash
them.

A save used to write its shards, then read every byte back to hash it for the manifest: on a local disk that is a
second pass over the data (from the page cache, on ``io_threads`` threads), on an object store a second transfer of
the whole checkpoint. :class:`DigestingFileSystem` wraps the file system a DCP writer writes through
(``writer.fs``): every stream it opens for writing feeds the bytes to SHA-256 on the way, in DCP's own writer
threads (``hashlib`` releases the GIL on large buffers). The save then takes these digests and checks each file's
stored size against the bytes written (a stat, or a HEAD on an object store), so a short write is still caught
before the checkpoint is published; ``meshrun ckpt verify`` and every resume read the bytes back and compare them
with the manifest, as before.

A stream that is not written front to back (a seek away from its end) gets no digest; such a file, and any file
the writer did not open (a DCP naming change), is hashed by reading it back.
"""

from __future__ import annotations

import hashlib
import os
import threading
from contextlib import contextmanager
from typing import Any, Iterator

from meshrun.ckpt.manifest import CHECKSUM


def _key(path: Any) -> tuple[str, str]:
    """(attempt folder name, file name): a save's attempt folder carries a fresh token, so saves never collide."""
    parts = os.fspath(path).rstrip("/").rsplit("/", 2)
    return (parts[-2] if len(parts) > 1 else "", parts[-1])


class _DigestingStream:
    """A write stream that hashes what passes through it; everything else is the wrapped stream's."""

    def __init__(self, inner: Any):
        self._inner = inner
        self._digest = hashlib.sha256()
        self.size = 0
        self.sequential = True

    def write(self, data: Any) -> int:
        written = self._inner.write(data)
        try:
            view = memoryview(data).cast("B")
        except (TypeError, ValueError):  # no flat byte view of it (not seen from DCP): read the file back instead
            self.sequential = False
            return written
        count = len(view) if written is None else written
        self._digest.update(view[:count])
        self.size += count
        return written

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        position = self._inner.seek(offset, whence)
        if position != self.size:
            self.sequential = False  # bytes may be rewritten: this digest would not be the file's
        return position

    def hexdigest(self) -> str:
        return self._digest.hexdigest()

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno (DCP's fsync), close, ...
        return getattr(self._inner, name)


class DigestingFileSystem:
    """DCP's file system (``writer.fs``) with a SHA-256 of every file written through it; see the module docstring."""

    def __init__(self, inner: Any):
        self._inner = inner
        self._lock = threading.Lock()
        self._digests: dict[tuple[str, str], dict[str, Any]] = {}

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        with self._inner.create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            tee = _DigestingStream(stream)
            yield tee
        if tee.sequential:  # closed without an error: the file (or object) holds these bytes
            with self._lock:
                self._digests[_key(path)] = {"size": tee.size, CHECKSUM: tee.hexdigest()}

    def rename(self, path: Any, new_path: Any) -> None:
        self._inner.rename(path, new_path)
        with self._lock:
            entry = self._digests.pop(_key(path), None)
            if entry is not None:
                self._digests[_key(new_path)] = entry

    def take(self, folder: Any, names: list[str]) -> dict[str, dict[str, Any]]:
        """The digests of ``names`` written into ``folder`` (a path or URL), removed from this record; a name the
        writer did not hash is left out."""
        attempt = _key(folder)[1]
        with self._lock:
            return {name: entry for name in names
                    if (entry := self._digests.pop((attempt, name), None)) is not None}

    def __getattr__(self, name: str) -> Any:  # concat_path, init_path, mkdir, exists, rm_file, ...
        return getattr(self._inner, name)


def digesting(writer: Any) -> Any:
    """``writer`` (a DCP FileSystemWriter) writing through a :class:`DigestingFileSystem`."""
    if not isinstance(writer.fs, DigestingFileSystem):
        writer.fs = DigestingFileSystem(writer.fs)
    return writer
