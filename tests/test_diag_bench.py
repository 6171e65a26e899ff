"""`meshrun bench`: sizes, the nccl-tests bus-bandwidth convention, and a 2-rank gloo run."""

from __future__ import annotations

import json

import pytest

from dist_utils import run_distributed
from meshrun.diag import bench


def test_bus_factor_follows_nccl_tests():
    assert bench.bus_factor("allreduce", 8) == pytest.approx(2 * 7 / 8)
    assert bench.bus_factor("allgather", 8) == pytest.approx(7 / 8)
    assert bench.bus_factor("reducescatter", 4) == pytest.approx(3 / 4)
    assert bench.bus_factor("allreduce", 1) == 0.0


def test_sizes_parse_with_binary_units():
    assert [bench.parse_size(s) for s in ("4096", "64K", "1M", "1G", "16MB")] == [4096, 65536, 2**20, 2**30, 2**24]
    with pytest.raises(ValueError, match="--sizes: '1.5M' is not a size"):
        bench.parse_size("1.5M")


def test_single_process_explains_how_to_launch(capsys, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    assert bench.main(["allreduce"]) == 2
    assert "meshrun launch --nproc-per-node 2 bench allreduce" in capsys.readouterr().out


def _bench_worker(rank: int, world_size: int, path: str):
    return bench.main(["all", "--sizes", "4K,64K", "--iters", "2", "--warmup", "1", "--json", path])


@pytest.mark.slow
def test_two_rank_gloo_bench_writes_a_row_per_op_and_size(tmp_path):
    path = tmp_path / "bench.json"
    assert run_distributed(_bench_worker, 2, str(path), init_pg=False, timeout=120) == [0, 0]
    result = json.loads(path.read_text())
    assert (result["backend"], result["world_size"], result["dtype"]) == ("gloo", 2, "float32")
    assert result["device"].startswith("cpu")
    rows = result["rows"]
    assert [(r["op"], r["size_bytes"]) for r in rows] == [
        (op, size) for op in ("allreduce", "allgather", "reducescatter") for size in (4096, 65536)]
    for row in rows:
        assert row["time_us"] > 0 and row["count"] * 4 == row["size_bytes"]
        assert row["algbw_gbps"] == pytest.approx(row["size_bytes"] / (row["time_us"] * 1e-6) / 1e9)
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * bench.bus_factor(row["op"], 2))
        assert row["busbw_gbps"] > 0
