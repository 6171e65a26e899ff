"""Checkpoints across ranks (gloo, CPU): DDP dedup, bitwise round trip, async = sync, resharding 1->2, 2->3,
2->1 and FSDP2 3->1, consistent save decisions, and a folder that is not shared.

The reference is always the state as it was when saved (bitwise: a checkpoint must not change a single bit),
captured as full tensors; the 1-rank loads run in this process.
"""

from __future__ import annotations

import json
import os
import pickle
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from test_ckpt_support import Job, assert_same, checkpointer, rng_draws

from meshrun.ckpt import collectives
from meshrun.ckpt.errors import CheckpointError
from meshrun.ckpt.preemption import PreemptionFlag
from meshrun.env import ProcessPlacement

pytestmark = pytest.mark.slow


def _ddp(model):
    return torch.nn.parallel.DistributedDataParallel(model)


def _two_ranks(rank: int, world_size: int, root: str) -> dict:
    """1->2 load, DDP training, sync save, bitwise reload, async vs sync, save decisions, unshared folder."""
    root_path, env, out = Path(root), ProcessPlacement.detect(), {}
    job = Job(env, seed=0, wrap=_ddp)
    ckpt = checkpointer(root_path / "run2", env)
    manifest = ckpt.load(job.state, resume=str(root_path / "single" / "step_0000005"))
    out["from_single"] = (manifest["step"], job.snapshot(), job.state["rng"].reseeded, list(ckpt.notes))
    job.train(2, data_seed=100 + rank)  # different data per rank; DDP keeps the replicas equal
    ckpt.save(7, job.state, meta={"epoch": 0, "tokens_seen": job.counters.tokens_seen})
    out["saved"], out["draws"] = job.snapshot(), rng_draws()
    job.train(1, data_seed=200 + rank)
    ckpt.load(job.state)  # auto: the newest, step 7
    out["reloaded"], out["redraws"] = job.snapshot(), rng_draws()
    out["counters"] = (job.counters.step, job.metrics["loss_sum"])
    # Async and sync saves of one unchanged state must write the same shard bytes.
    async_ckpt = checkpointer(root_path / "run2_async", env, async_save=True)
    async_ckpt.save(8, job.state)
    async_ckpt.close()
    checkpointer(root_path / "run2_sync", env).save(8, job.state)
    out["decisions"] = _decisions(env, root_path)
    out["unshared"] = _unshared(env, root_path, job)
    return out


def _decisions(env: ProcessPlacement, root: Path) -> list[tuple[bool, bool]]:
    """Rank 0's clock and rank 1's SIGTERM decide for both ranks."""
    flag = PreemptionFlag()
    ckpt = checkpointer(root / "decide", env, interval_minutes=0.0005, interval_steps=0)
    ckpt.preemption = flag
    decisions = []
    for step in range(1, 7):
        time.sleep(0.02 if env.rank == 0 else 0.0)
        if env.rank == 1 and step == 4:
            flag.set("SIGTERM")
        decisions.append((ckpt.should_save(step), ckpt.stop_requested))
    return decisions


def _unshared(env: ProcessPlacement, root: Path, job: Job) -> str:
    collectives.SHARED_CHECK_WAIT_S = 0.3
    ckpt = checkpointer(root / f"private_{env.rank}", env)
    try:
        ckpt.save(1, job.state)
    except CheckpointError as exc:
        return str(exc)
    return "no error"


def _fsdp(model):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _three_ranks(rank: int, world_size: int, root: str) -> dict:
    """2->3 into FSDP2 shards (DTensor resharding), then an FSDP2 save for the 3->1 load."""
    root_path, env = Path(root), ProcessPlacement.detect()
    job = Job(env, seed=1, wrap=_fsdp)  # another seed: everything below must come from the checkpoint
    ckpt = checkpointer(root_path / "run2", env)
    manifest = ckpt.load(job.state)
    out = {"step": manifest["step"], "loaded": job.snapshot(), "draws": rng_draws(),
           "reseeded": job.state["rng"].reseeded, "notes": list(ckpt.notes)}
    fsdp_ckpt = checkpointer(root_path / "run3", env)
    fsdp_ckpt.save(manifest["step"], job.state, meta={"epoch": 0})
    return out


def test_checkpoints_across_ranks(tmp_path):
    env1 = ProcessPlacement.detect({})
    single = Job(env1, seed=5)
    single.train(2, data_seed=7)
    single.counters.step = 5
    checkpointer(tmp_path / "single", env1).save(5, single.state)
    single_state = single.snapshot()

    two = run_distributed(_two_ranks, 2, str(tmp_path), timeout=240)

    # 1 -> 2: both ranks hold the single-process state; rank 1 had no RNG stream and reseeded.
    for rank, result in enumerate(two):
        step, state, reseeded, notes = result["from_single"]
        assert step == 5 and reseeded == (rank == 1)
        assert_same(state, single_state)
        assert any("saved by 1 ranks and is loaded by 2" in note for note in notes)
    # Bitwise round trip of model + optimizer + each rank's RNG + counters.
    for result in two:
        assert_same(result["reloaded"], result["saved"])
        assert result["redraws"] == result["draws"]
        assert result["counters"][0] == 7
    assert two[0]["draws"] != two[1]["draws"], "each rank keeps its own stream"
    assert_same(two[0]["saved"], two[1]["saved"])  # DDP replicas
    _check_dedup(tmp_path)
    _check_async_equals_sync(tmp_path)
    assert two[0]["decisions"] == two[1]["decisions"]
    assert any(save for save, _ in two[0]["decisions"][:3]), "rank 0's clock triggers time-based saves"
    assert [stop for _, stop in two[0]["decisions"]] == [False] * 3 + [True] * 3
    for result in two:
        assert "not on storage shared by all ranks: rank 1" in result["unshared"], result["unshared"]

    three = run_distributed(_three_ranks, 3, str(tmp_path), timeout=240)
    reference = two[0]["saved"]
    for rank, result in enumerate(three):
        assert result["step"] == 7
        assert_same(result["loaded"], reference)
        assert result["reseeded"] == (rank == 2)
        if rank < 2:
            assert result["draws"] == two[rank]["draws"]
        assert any("saved by 2 ranks and is loaded by 3" in note for note in result["notes"])
    # 2 -> 1 (DDP checkpoint) and 3 -> 1 (FSDP2 DTensor shards) into a plain model.
    for folder in ("run2", "run3"):
        job = Job(env1, seed=9)
        manifest = checkpointer(tmp_path / folder, env1).load(job.state)
        assert manifest["step"] == 7
        assert_same(job.snapshot(), reference)


def _check_dedup(root: Path) -> None:
    """DDP: each model and optimizer tensor is stored once, and the shards are about one replica's size."""
    step7 = root / "run2" / "step_0000007"
    with open(step7 / ".metadata", "rb") as handle:
        metadata = pickle.load(handle)  # the test's own file; meshrun itself lets DCP read it
    files_per_key: dict[str, set[str]] = {}
    for index, info in metadata.storage_data.items():
        files_per_key.setdefault(index.fqn, set()).add(info.relative_path)
    model_keys = [k for k in files_per_key if k.startswith("model_optim.model.")]
    assert model_keys and all(len(files_per_key[k]) == 1 for k in model_keys)
    shards = lambda d: sum(p.stat().st_size for p in d.glob("*.distcp"))  # noqa: E731
    assert shards(step7) < 1.2 * shards(root / "single" / "step_0000005")


def _check_async_equals_sync(root: Path) -> None:
    manifests = [json.loads((root / d / "step_0000008" / "manifest.json").read_text())
                 for d in ("run2_async", "run2_sync")]
    shard_sums = [{k: v for k, v in m["files"].items() if k.endswith(".distcp")} for m in manifests]
    assert shard_sums[0] == shard_sums[1] and shard_sums[0]
    assert manifests[0]["async_save"] and not manifests[1]["async_save"]
    assert os.path.isfile(root / "run2_async" / "step_0000008" / "COMPLETE")
