"""`meshrun bench`: sizes, the nccl-tests bus-bandwidth convention, and a 2-rank gloo run."""

from __future__ import annotations

import json
import re

import pytest
import torch

from dist_utils import run_distributed
from meshrun.diag import bench, links


def test_bus_factor_follows_nccl_tests():
    assert bench.bus_factor("allreduce", 8) == pytest.approx(2 * 7 / 8)
    assert bench.bus_factor("allgather", 8) == pytest.approx(7 / 8)
    assert bench.bus_factor("reducescatter", 4) == pytest.approx(3 / 4)
    assert bench.bus_factor("allreduce", 1) == 0.0
    assert bench.bus_factor("alltoall", 4) == pytest.approx(3 / 4)
    assert bench.bus_factor("broadcast", 8) == bench.bus_factor("sendrecv", 8) == 1.0


def test_pair_rounds_meet_every_pair_once_with_one_partner_per_round():
    for n in (2, 3, 4, 7, 8):
        schedule = links.rounds(n)
        pairs = [pair for pairs in schedule for pair in pairs]
        assert sorted(pairs) == [(a, b) for a in range(n) for b in range(a + 1, n)]
        for pairs in schedule:
            ranks = [r for pair in pairs for r in pair]
            assert len(ranks) == len(set(ranks))  # nobody has two partners in one round
        assert len(schedule) == (n - 1 if n % 2 == 0 else n)


def test_slowest_link_is_the_smallest_bandwidth():
    matrix = links.LinkMatrix(size_bytes=1, gbps=[[None, 9.0, 8.0], [9.0, None, 2.5], [8.0, 2.5, None]])
    assert matrix.slowest() == (1, 2, 2.5)


def test_sizes_parse_with_binary_units():
    assert [bench.parse_size(s) for s in ("4096", "64K", "1M", "1G", "16MB")] == [4096, 65536, 2**20, 2**30, 2**24]
    with pytest.raises(ValueError, match="--sizes: '1.5M' is not a size"):
        bench.parse_size("1.5M")


@pytest.mark.parametrize("argv, message", [
    (["--sizes", "1X"], "--sizes: '1X' is not a size; use e.g. 64K"),
    (["--sizes", "0"], "--sizes: '0' is 0 bytes; give a size above 0"),
    (["--pairs", "0"], "--pairs: '0' is 0 bytes"),
    (["--iters", "0"], "--iters 0: give 1 or more timed runs per size"),
    (["--warmup", "-1"], "--warmup -1: give 0 or more"),
    (["--groups", "world,nodes"], "--groups world,nodes: choose from world, intra, inter"),
    (["--backend", "nccl"], "--backend nccl needs CUDA GPUs and none is available here; use --backend gloo"),
])
def test_bad_options_are_refused_once_before_the_workers_start(capsys, monkeypatch, argv, message):
    from meshrun.launch.args import LaunchUsageError, check_target, parse_launch_args

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for command in (["bench"], ["-m", "meshrun", "bench"]):
        with pytest.raises(LaunchUsageError, match="^bench: " + re.escape(message)):
            check_target(parse_launch_args(["--nproc-per-node", "2", *command, "allreduce", *argv]).target)
    for rank in (1, 0):  # under torchrun directly: every rank refuses before its process group, rank 0 says why
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        assert bench.main(["allreduce", *argv]) == 2
        err = capsys.readouterr().err
        assert (err.startswith(f"meshrun bench: error: {message}") and len(err.splitlines()) == 1) if rank == 0 \
            else err == ""


def test_single_process_explains_how_to_launch(capsys, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    assert bench.main(["allreduce"]) == 2
    assert "meshrun launch --nproc-per-node 2 bench allreduce" in capsys.readouterr().out


def _bench_worker(rank: int, world_size: int, path: str):
    return bench.main(["all", "--sizes", "4K,64K", "--iters", "2", "--warmup", "1", "--json", path,
                       "--groups", "world,intra,inter", "--pairs", "16K"])


@pytest.mark.slow
def test_two_rank_gloo_bench_writes_a_row_per_op_and_size(tmp_path):
    path = tmp_path / "bench.json"
    assert run_distributed(_bench_worker, 2, str(path), init_pg=False, timeout=120) == [0, 0]
    result = json.loads(path.read_text())
    assert (result["backend"], result["world_size"], result["dtype"]) == ("gloo", 2, "float32")
    assert result["device"].startswith("cpu")
    rows = result["rows"]
    ops = ("allreduce", "allgather", "reducescatter", "broadcast", "alltoall", "sendrecv")
    # one node of two ranks: the intra-node group is both ranks, and there is no inter-node group to measure
    assert [(r["group"], r["op"], r["size_bytes"]) for r in rows] == [
        (group, op, size) for group in ("world", "intra") for op in ops for size in (4096, 65536)]
    assert result["skipped_groups"] == {"inter": "1 rank per group (1 node(s) x 2 rank(s))"}
    pairs = result["pairs"]
    assert pairs["size_bytes"] == 16384 and pairs["gbps"][0][0] is None and pairs["gbps"][1][1] is None
    assert pairs["gbps"][0][1] == pairs["gbps"][1][0] > 0 and pairs["slowest"] == [0, 1, pairs["gbps"][0][1]]
    for row in rows:
        assert row["time_us"] > 0 and row["count"] * 4 == row["size_bytes"]
        assert row["algbw_gbps"] == pytest.approx(row["size_bytes"] / (row["time_us"] * 1e-6) / 1e9)
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * bench.bus_factor(row["op"], 2))
        assert row["busbw_gbps"] > 0
