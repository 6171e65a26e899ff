"""A save's SHA-256s are taken while DCP writes (ckpt/write_digest.py), not by reading the shards back: the manifest
still equals a read-back hash of every file, a file written out of order is hashed by reading it back, and a
stored size that differs from the bytes written stops the save before it is published. One process, local disk
(the object-store path goes through the same writer wrapper: tests/test_ckpt_objectstore.py)."""

from __future__ import annotations

import io
import os

import pytest

import meshrun.ckpt.checkpointer as checkpointer_module
from meshrun.ckpt.errors import CheckpointError
from meshrun.ckpt.folder import COMPLETE, MANIFEST, scan, step_dir_name
from meshrun.ckpt.manifest import describe_files, read_manifest
from meshrun.ckpt.write_digest import DigestingFileSystem
from meshrun.env import ProcessPlacement
from test_ckpt_support import Job, checkpointer


def _read_back_calls(monkeypatch) -> list[list[str]]:
    """Record the names the checkpointer hashes by reading them back."""
    calls: list[list[str]] = []
    real = checkpointer_module.describe_files

    def recording(folder, names, **kwargs):
        calls.append(list(names))
        return real(folder, names, **kwargs)

    monkeypatch.setattr(checkpointer_module, "describe_files", recording)
    return calls


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_the_manifest_holds_the_digests_taken_while_writing(tmp_path, monkeypatch, async_save):
    calls = _read_back_calls(monkeypatch)
    env = ProcessPlacement.detect({})
    job = Job(env)
    job.train(2, data_seed=1)
    ckpt = checkpointer(tmp_path, async_save=async_save)
    ckpt.save(2, job.state)
    ckpt.close()
    folder = tmp_path / step_dir_name(2)
    assert (folder / COMPLETE).exists()
    files = read_manifest(folder)["files"]
    assert files == describe_files(folder, sorted(files)), "a digest taken while writing differs from the file"
    shards = [name for name in files if name.endswith(".distcp")]
    assert shards and ".metadata" in files
    assert not any(name in call for call in calls for name in [*shards, ".metadata"]), \
        f"files were read back to be hashed: {calls}"


def test_a_file_written_out_of_order_is_hashed_by_reading_it_back(tmp_path):
    class Folder:
        @staticmethod
        def create_stream(path, mode):
            return open(path, mode)

        @staticmethod
        def rename(path, new_path):
            os.rename(path, new_path)

    fs = DigestingFileSystem(Folder())
    attempt = tmp_path / "attempt-1"
    attempt.mkdir()
    with fs.create_stream(attempt / "in_order", "wb") as stream:
        stream.write(b"abc")
        stream.write(memoryview(b"defg"))
    with fs.create_stream(attempt / "patched", "wb") as stream:
        stream.write(b"xxxx")
        stream.seek(0, io.SEEK_SET)
        stream.write(b"y")  # a header patched after the fact: the running digest is not the file's
    with fs.create_stream(attempt / ".metadata.tmp", "wb") as stream:
        stream.write(b"meta")
    fs.rename(attempt / ".metadata.tmp", attempt / ".metadata")
    taken = fs.take(attempt, ["in_order", "patched", ".metadata", "absent"])
    assert taken == describe_files(attempt, ["in_order", ".metadata"])
    assert fs.take(attempt, ["in_order"]) == {}, "a digest is taken once"


def test_a_short_file_stops_the_save_before_it_is_published(tmp_path, monkeypatch):
    real_take = DigestingFileSystem.take

    def one_byte_more(self, folder, names):  # as if the storage kept one byte less than was written
        return {name: {**entry, "size": entry["size"] + 1} for name, entry in real_take(self, folder, names).items()}

    monkeypatch.setattr(DigestingFileSystem, "take", one_byte_more)
    env = ProcessPlacement.detect({})
    job = Job(env)
    ckpt = checkpointer(tmp_path)
    with pytest.raises(CheckpointError, match=r"bytes stored but \d+ written; the storage lost part of the file"):
        ckpt.save(1, job.state)
    ckpt.close()
    assert [e for e in scan(tmp_path) if e.kind == "complete"] == []
    assert not (tmp_path / step_dir_name(1) / MANIFEST).exists()
