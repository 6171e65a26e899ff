"""Fingerprints: what makes two nodes differ, and the message that names the odd node (or, without a majority,
every node's value side by side)."""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import numpy
import pytest
import torch

import meshrun
from meshrun.diag import fingerprint as fpmod
from meshrun.diag.fingerprint import (FingerprintMismatch, check_consistency, collect_fingerprint,
                                      compare_fingerprints, mismatch_message, source_hash)
from meshrun.env import ProcessPlacement

REPO = Path(__file__).resolve().parents[1]


def _env(rank: int = 0, node: int = 0) -> ProcessPlacement:
    return ProcessPlacement(rank=rank, local_rank=0, world_size=3, local_world_size=1, node_rank=node, num_nodes=3,
                      master_addr="127.0.0.1", master_port=29500, source="torchrun")


def _base() -> fpmod.Fingerprint:
    return fpmod.Fingerprint(rank=0, node_rank=0, host="a", python="3.11.7", meshrun="0.1.0",
                             meshrun_source="def0def0def0def0", git="1234567890ab", script=None,
                             torch_build="2.8.0+cu128 cuda 12.8", packages={"numpy": "2.1.0", "triton": None})


def _node(fp: fpmod.Fingerprint, node: int, host: str, **changes) -> fpmod.Fingerprint:
    return dataclasses.replace(fp, rank=node, node_rank=node, host=host, **changes)


def test_source_hash_changes_when_a_file_is_edited_or_renamed(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    before = source_hash.__wrapped__(tmp_path)
    (tmp_path / "pkg" / "a.py").write_text("x = 2\n")
    edited = source_hash.__wrapped__(tmp_path)
    (tmp_path / "pkg" / "a.py").rename(tmp_path / "pkg" / "b.py")
    renamed = source_hash.__wrapped__(tmp_path)
    assert len({before, edited, renamed}) == 3
    assert source_hash.__wrapped__(tmp_path) == renamed  # deterministic


def test_local_fingerprint_reports_real_versions_and_git_state(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    fp = collect_fingerprint(env=_env(), script=script, cwd=REPO)
    assert fp.meshrun == meshrun.__version__
    assert fp.meshrun_source == source_hash(Path(meshrun.__file__).parent)
    assert fp.torch_build.startswith(torch.__version__)
    assert fp.packages["numpy"] == numpy.__version__
    assert fp.script and len(fp.script) == 16
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert fp.git is not None and fp.git.startswith(head.strip()[:12])
    assert collect_fingerprint(env=_env(), cwd=tmp_path).git is None  # not a repository


def test_identical_nodes_have_no_differences():
    base = _base()
    assert compare_fingerprints([_node(base, n, h) for n, h in enumerate("abc")]) == []


def test_code_difference_leads_and_names_the_odd_node():
    base = _base()
    fps = [_node(base, 0, "a"), _node(base, 1, "b", meshrun_source="abc1abc1abc1abc1",
                                      packages={"numpy": "1.26.4", "triton": None}),
           _node(base, 2, "c")]
    diffs = compare_fingerprints(fps)
    assert {d.name for d in diffs} == {"meshrun_source", "pkg:numpy"}
    message = mismatch_message(diffs, fps)
    first, *table = message.splitlines()
    assert first == ("code differs across nodes: node 1 (host b) has meshrun source hash abc1abc1abc1abc1, "
                     "node 0 (host a) has def0def0def0def0; sync the code (git rev 1234567890ab) on node 1")
    numpy_rows = [line for line in table if "numpy" in line or "1.26.4" in line]
    assert any("2.1.0" in line and "(expected)" in line for line in numpy_rows)
    assert any("1 (b)" in line and "1.26.4" in line for line in numpy_rows)


NO_MAJORITY_FIX = "no majority: make the nodes run the same code (e.g. sync the checkout / same commit) — "


def test_two_nodes_with_different_code_blame_neither_node():
    base = _base()
    fps = [_node(base, 0, "a", git="1234567890ab +dirty 5e5e5e5e"),  # node 0 has the edited copy
           _node(base, 1, "b", meshrun_source="abc1abc1abc1abc1")]
    diffs = compare_fingerprints(fps)
    assert [(d.name, d.majority) for d in diffs] == [("meshrun_source", False), ("git", False)]
    first, *table = mismatch_message(diffs, fps).splitlines()
    assert first == ("code differs across nodes, " + NO_MAJORITY_FIX +
                     "node 0 (host a) has meshrun source hash def0def0def0def0 (git 1234567890ab +dirty 5e5e5e5e), "
                     "node 1 (host b) has meshrun source hash abc1abc1abc1abc1 (git 1234567890ab)")
    assert "sync the code (" not in first and " on node " not in first  # no node is told it is the odd one
    assert not any("(expected)" in line for line in table)
    assert any("0 (a)" in line and "1234567890ab +dirty 5e5e5e5e" in line for line in table)
    assert any("1 (b)" in line and "abc1abc1abc1abc1" in line for line in table)


def test_two_two_split_shows_both_groups_side_by_side():
    base = _base()
    edited = {"meshrun_source": "abc1abc1abc1abc1", "git": "1234567890ab +dirty 5e5e5e5e"}
    fps = [_node(base, 0, "a"), _node(base, 1, "b", **edited), _node(base, 2, "c"), _node(base, 3, "d", **edited)]
    diffs = compare_fingerprints(fps)
    assert not any(d.majority for d in diffs)
    first, *table = mismatch_message(diffs, fps).splitlines()
    assert first == ("code differs across nodes, " + NO_MAJORITY_FIX +
                     "nodes 0 (host a), 2 (host c) have meshrun source hash def0def0def0def0 (git 1234567890ab), "
                     "nodes 1 (host b), 3 (host d) have meshrun source hash abc1abc1abc1abc1 "
                     "(git 1234567890ab +dirty 5e5e5e5e)")
    assert not any("(expected)" in line for line in table)
    assert any("1 (b), 3 (d)" in line and "abc1abc1abc1abc1" in line for line in table)


def test_three_to_one_still_names_the_minority_node():
    base = _base()
    fps = [_node(base, 0, "a"), _node(base, 1, "b"), _node(base, 2, "c"),
           _node(base, 3, "d", meshrun_source="abc1abc1abc1abc1", git="1234567890ab +dirty 5e5e5e5e")]
    diffs = compare_fingerprints(fps)
    assert all(d.majority for d in diffs)
    first, *table = mismatch_message(diffs, fps).splitlines()
    assert first == ("code differs across nodes: node 3 (host d) has meshrun source hash abc1abc1abc1abc1, "
                     "node 0 (host a) has def0def0def0def0; sync the code (git rev 1234567890ab) on node 3")
    assert "no majority" not in first
    assert any("0 (a), 1 (b), 2 (c)" in line and "def0def0def0def0  (expected)" in line for line in table)


def test_package_split_without_majority_asks_for_one_version_everywhere():
    base = _base()
    fps = [_node(base, 0, "a"), _node(base, 1, "b", packages={"numpy": "1.26.4", "triton": None})]
    first = mismatch_message(compare_fingerprints(fps), fps).splitlines()[0]
    assert first == ("package versions differ across nodes, no majority: install the same numpy version on every "
                     "node — node 0 (host a) has numpy 2.1.0, node 1 (host b) has numpy 1.26.4")


def test_package_difference_says_what_to_install():
    base = _base()
    fps = [_node(base, 0, "a"), _node(base, 1, "b"), _node(base, 2, "c", torch_build="2.9.0+cu128 cuda 12.8")]
    first = mismatch_message(compare_fingerprints(fps), fps).splitlines()[0]
    assert first.startswith("package versions differ across nodes: node 2 (host c) has torch 2.9.0+cu128")
    assert first.endswith("on node 2")


def test_check_consistency_without_a_process_group_checks_only_itself():
    fps = check_consistency(env=ProcessPlacement.detect({}), strict=True)
    assert len(fps) == 1 and fps[0].rank == 0
    assert issubclass(FingerprintMismatch, RuntimeError)


def test_check_consistency_raises_when_strict_and_warns_otherwise(monkeypatch):
    base = _base()
    monkeypatch.setattr(fpmod, "gather_fingerprints",
                        lambda group=None, *, env, script=None: [base, _node(base, 1, "b", git="ffffffffffff")])
    # two nodes: no majority, so the message shows both commits and blames neither node
    with pytest.raises(FingerprintMismatch, match=r"^code differs across nodes, no majority: .* — node 0 \(host a\) "
                       r"has git commit 1234567890ab, node 1 \(host b\) has git commit ffffffffffff\n"):
        check_consistency(env=_env(), strict=True)
    with pytest.warns(RuntimeWarning, match="code differs"):
        check_consistency(env=_env(), strict=False)
