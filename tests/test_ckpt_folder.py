"""Checkpoint folder layout, retention and manifest validation: pure logic and file checks, no process group."""

from __future__ import annotations

import json
import os

import pytest

from meshrun.ckpt.errors import CheckpointError
from meshrun.ckpt.folder import COMPLETE, MANIFEST, classify, scan, step_dir_name, steps_to_keep, tmp_dir_name
from meshrun.ckpt.manifest import (build_manifest, check_file_name, check_structure, describe_files, read_manifest,
                                   share_of_files)


def test_names_sort_by_step_and_classify(tmp_path):
    assert step_dir_name(1000) == "step_0001000" and step_dir_name(12345678) == "step_12345678"
    (tmp_path / step_dir_name(20)).mkdir()
    (tmp_path / step_dir_name(20) / COMPLETE).write_text("x")
    (tmp_path / step_dir_name(30)).mkdir()
    (tmp_path / tmp_dir_name(40, "beef")).mkdir()
    (tmp_path / step_dir_name(50)).symlink_to(tmp_path / step_dir_name(20))
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    kinds = [(e.step, e.kind) for e in scan(tmp_path)]
    assert kinds == [(20, "complete"), (30, "incomplete"), (40, "tmp"), (50, "symlink")]
    assert classify(tmp_path / "notes.txt") is None
    assert scan(tmp_path / "missing") == []


def test_retention_keeps_last_k_every_nth_and_the_newest():
    steps = list(range(1, 10))
    assert steps_to_keep(steps, keep_last=2, keep_every=4) == {4, 8, 9}
    assert steps_to_keep(steps, keep_last=3, keep_every=0) == {7, 8, 9}
    assert steps_to_keep(steps, keep_last=0, keep_every=0) == {9}, "the newest complete one always stays"
    assert steps_to_keep(steps, keep_last=1, keep_every=0, protect=(5,)) == {5, 9}
    assert steps_to_keep([], keep_last=2, keep_every=3) == set()


@pytest.mark.parametrize("name", ["../x", "/etc/passwd", "a/b", "..", ".", "", "a\\b", "x\x00y", 7])
def test_file_names_that_leave_the_directory_are_refused(name):
    with pytest.raises(CheckpointError, match="not a plain file name"):
        check_file_name(name)


def _checkpoint(folder, files: dict[str, bytes]):
    folder.mkdir()
    for name, data in files.items():
        (folder / name).write_bytes(data)
    manifest = build_manifest(step=3, files=describe_files(folder, list(files)), world_size=1, layout={},
                              config_fingerprint="f", code={}, meta={"epoch": 1}, state_kinds={}, final=False,
                              async_save=False, timings={})
    (folder / MANIFEST).write_text(json.dumps(manifest))
    (folder / COMPLETE).write_text("")
    return manifest


def test_manifest_round_trip_and_structure(tmp_path):
    manifest = _checkpoint(tmp_path / "ck", {"__0_0.distcp": b"abc" * 100, ".metadata": b"m"})
    assert read_manifest(tmp_path / "ck") == manifest
    assert manifest["epoch"] == 1 and manifest["files"]["__0_0.distcp"]["size"] == 300
    assert check_structure(tmp_path / "ck") == (manifest, [])


def test_crafted_manifest_pointing_outside_is_rejected(tmp_path):
    manifest = _checkpoint(tmp_path / "ck", {"a.distcp": b"abc"})
    manifest["files"]["../x"] = manifest["files"]["a.distcp"]
    (tmp_path / "x").write_bytes(b"abc")
    (tmp_path / "ck" / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"'\.\./x'.*not a plain file name"):
        read_manifest(tmp_path / "ck")
    _, problems = check_structure(tmp_path / "ck")
    assert len(problems) == 1 and "../x" in problems[0]


def test_truncated_manifest_named(tmp_path):
    _checkpoint(tmp_path / "ck", {"a.distcp": b"abc"})
    text = (tmp_path / "ck" / MANIFEST).read_text()
    (tmp_path / "ck" / MANIFEST).write_text(text[: len(text) // 2])
    with pytest.raises(CheckpointError, match=r"manifest\.json: not valid JSON"):
        read_manifest(tmp_path / "ck")


def test_symlinked_stray_and_resized_files_are_reported(tmp_path):
    _checkpoint(tmp_path / "ck", {"a.distcp": b"abc", "b.distcp": b"def"})
    (tmp_path / "outside").write_bytes(b"def")
    os.remove(tmp_path / "ck" / "b.distcp")
    (tmp_path / "ck" / "b.distcp").symlink_to(tmp_path / "outside")
    (tmp_path / "ck" / "a.distcp").write_bytes(b"abcd")
    (tmp_path / "ck" / "extra").write_bytes(b"")
    _, problems = check_structure(tmp_path / "ck")
    assert any("a.distcp: size 4 bytes, the manifest says 3" in p for p in problems)
    assert any("b.distcp: not a regular file" in p for p in problems)
    assert any("extra: not listed in the manifest" in p for p in problems)


def test_marker_binds_the_manifest(tmp_path):
    import hashlib

    _checkpoint(tmp_path / "ck", {"a.distcp": b"abc"})
    payload = (tmp_path / "ck" / MANIFEST).read_bytes()
    (tmp_path / "ck" / COMPLETE).write_text(f"manifest-sha256 {hashlib.sha256(payload).hexdigest()}\n")
    assert check_structure(tmp_path / "ck")[1] == []
    (tmp_path / "ck" / MANIFEST).write_bytes(payload.replace(b'"step": 3', b'"step": 4'))
    assert "manifest.json: sha256 differs from the one recorded in COMPLETE" in check_structure(tmp_path / "ck")[1][0]


def test_hashing_is_split_over_ranks_without_overlap():
    manifest = {"files": {f"f{i}": {"size": size} for i, size in enumerate([50, 40, 30, 20, 10, 5])}}
    shares = [share_of_files(manifest, rank, 3) for rank in range(3)]
    assert sorted(sum(shares, [])) == sorted(manifest["files"])
    loads = [sum(manifest["files"][n]["size"] for n in share) for share in shares]
    assert max(loads) - min(loads) <= 20
