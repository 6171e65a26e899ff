"""The one byte formatter, rank-list formatter and git probe (pure logic, no process group)."""

import subprocess

from meshrun.gitstate import git_state
from meshrun.launch.net import is_loopback
from meshrun.units import format_bytes, format_ranks


def test_bytes_read_in_binary_units_with_one_decimal():
    assert [format_bytes(n) for n in (0, 1000, 1024, 1536, 10**6, 3 * 2**30, 2**41)] == \
        ["0 B", "1000 B", "1.0 KiB", "1.5 KiB", "976.6 KiB", "3.0 GiB", "2.0 TiB"]


def test_rank_lists_read_as_runs_and_strides():
    assert format_ranks([0, 1, 2, 3, 8]) == "0-3,8"
    assert format_ranks([0, 1, 2, 5, 7, 8]) == "0-2,5,7,8"
    assert format_ranks([0, 4, 8, 12, 16]) == "0,4,..,16"
    assert format_ranks([5, 37]) == "5,37" and format_ranks([3]) == "3" and format_ranks([]) == ""


def test_loopback_accepts_addresses_and_localhost():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("10.0.0.1") and not is_loopback("node7")


def test_git_dirty_means_tracked_files_differ_from_head(tmp_path):
    assert git_state(tmp_path) is None  # not a repository
    run = lambda *a: subprocess.run(["git", "-C", str(tmp_path), *a], check=True, capture_output=True)  # noqa: E731
    run("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    run("add", "a.py")
    run("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    (tmp_path / "untracked.txt").write_text("not counted")
    clean = git_state(tmp_path)
    assert clean is not None and clean.dirty is False and clean.describe() == clean.commit[:12]
    (tmp_path / "a.py").write_text("x = 2\n")
    dirty = git_state(tmp_path)
    assert dirty.dirty is True and dirty.describe().startswith(f"{clean.commit[:12]} +dirty ")
