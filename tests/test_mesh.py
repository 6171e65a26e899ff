"""ParallelDims: degree inference, validation messages, rank coordinates and groups; the DeviceMesh it builds
(checked on a fake process group, so a 64-rank mesh needs no other process)."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace

import pytest
import torch.distributed as dist

from meshrun.config import ConfigError, ParallelConfig
from meshrun.comm.mesh import MESH_DIMS, ParallelDims
from meshrun.models.gpt import SIZES
from meshrun.models.gpt_spec import GPT_SPEC


def dims_for(world: int, gpus_per_node: int = 8, model=None, **parallel) -> ParallelDims:
    return ParallelDims.from_config(ParallelConfig(**parallel), world_size=world, gpus_per_node=gpus_per_node,
                                    model=model, spec=GPT_SPEC)


def test_minus_one_is_inferred_from_the_world_size():
    dims = dims_for(64, dp_replicate=-1, tp=4, pp=2)
    assert (dims.pp, dims.dp_replicate, dims.dp_shard, dims.tp) == (2, 8, 1, 4)
    assert dims.dp_size == 8
    assert dims_for(16, dp_replicate=2, dp_shard=-1).dp_shard == 8


def test_sharding_over_the_rest_needs_no_replica_count():
    """--parallel.dp_shard=-1 alone (dp_replicate keeps its default -1) shards over the ranks TP leaves."""
    dims = dims_for(8, dp_replicate=-1, dp_shard=-1, tp=2)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp) == (1, 4, 2)


@pytest.mark.parametrize("parallel, world, message", [
    ({"dp_replicate": 3, "tp": 2}, 8, "parallel.pp x dp_replicate x dp_shard x cp x tp = 1 x 3 x 1 x 1 x 2 = 6 does not equal the world size 8"),
    ({"dp_replicate": -1, "tp": 3}, 8, "parallel.dp_replicate=-1 cannot be inferred: world size 8 .*; run a multiple of 3 processes "
     "or change parallel.tp=3"),
    ({"dp_shard": -1, "tp": -1}, 8, "parallel.dp_shard and parallel.tp are both -1; at most one degree can be "
     "inferred from the world size 8: give parallel.tp a number (e.g. --parallel.tp=1)"),
    ({"dp_replicate": -1, "cp": -1, "tp": -1}, 8, "parallel.dp_replicate, parallel.cp, parallel.tp are all -1"),
    ({"dp_replicate": 0}, 8, "parallel.dp_replicate=0 is not a degree"),
    ({"dp_replicate": 1, "tp": 16}, 16, "parallel.tp=16 is larger than the 8 GPUs of one node"),
    ({"dp_replicate": 2, "pp": 4, "pp_microbatches": 2}, 8,
     "parallel.pp_microbatches=2 is fewer than the 4 pipeline stages"),
    ({"dp_replicate": 1, "pp": 2, "pp_microbatches": 3, "pp_schedule": "interleaved1f1b"}, 2,
     "must be a multiple of parallel.pp=2"),
])
def test_bad_layouts_name_the_option_and_numbers(parallel, world, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        dims_for(world, **parallel)


def test_tp_across_nodes_only_when_allowed():
    dims = dims_for(16, dp_replicate=1, tp=16, allow_tp_across_nodes=True)
    assert dims.tp == 16
    with pytest.raises(ConfigError, match="does not divide the 8 GPUs per node"):
        dims_for(12, dp_replicate=-1, tp=6, gpus_per_node=8)
    assert dims_for(3, dp_replicate=-1, tp=3, gpus_per_node=8).tp == 3  # 3 ranks on one node straddle nothing


@pytest.mark.parametrize("model_change, parallel, message", [
    ({"n_heads": 12, "dim": 768}, {"tp": 8}, "parallel.tp=8 does not divide model.n_heads=12"),
    ({"n_kv_heads": 2}, {"tp": 4}, "does not divide model.n_kv_heads (key/value heads)=2"),
    ({"ffn_dim": 102}, {"tp": 4}, "does not divide model.ffn_dim (MLP width)=102"),
    ({}, {"pp": 4}, "parallel.pp=4 = 4 pipeline stages but the model has only model.n_layers=2; every stage needs "
                    "at least one layer. Lower parallel.pp, or set --model.n_layers=4"),
    ({}, {"pp": 2, "pp_schedule": "interleaved1f1b", "pp_virtual_stages": 2},
     "parallel.pp=2 x parallel.pp_virtual_stages=2 = 4 pipeline stages but the model has only model.n_layers=2; "
     "every stage needs at least one layer. Lower parallel.pp or parallel.pp_virtual_stages, or set "
     "--model.n_layers=4"),
])
def test_model_checks_name_the_option(model_change, parallel, message):
    model = replace(SIZES["tiny"], **model_change)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        dims_for(8, model=model, dp_replicate=-1, **parallel)


def test_pipeline_batch_must_split_into_microbatches():
    dims = dims_for(2, dp_replicate=1, pp=2, pp_microbatches=4)
    dims.resolve_pipeline_batch(8)
    with pytest.raises(ConfigError, match="parallel.pp_microbatches=4 does not divide the 6 samples"):
        dims.resolve_pipeline_batch(6)


def test_default_pipeline_microbatches_weigh_the_bubble_against_each_micro_batch_cost():
    dims = dims_for(2, dp_replicate=1, pp=2)
    assert dims.pp_microbatches == 0  # resolved with the batch
    dims.resolve_pipeline_batch(16, seq_len=2048)
    assert dims.pp_microbatches == 8  # 1F1B on 2 stages: 8 of two samples and 4 of four cost about the same
    two_per_rank = dims_for(2, dp_replicate=1, pp=2, pp_schedule="interleaved1f1b", pp_virtual_stages=2)
    two_per_rank.resolve_pipeline_batch(16, seq_len=2048)
    assert two_per_rank.pp_microbatches == 4  # half the bubble per micro-batch: 1.046x 8 of two on 2x H200
    deep = dims_for(4, dp_replicate=1, pp=4)
    deep.resolve_pipeline_batch(16, seq_len=2048)
    assert deep.pp_microbatches == 8  # 3 stages' bubble: 4 micro-batches would idle 3/7 of the step
    long = dims_for(2, dp_replicate=1, pp=2)
    long.resolve_pipeline_batch(16, seq_len=8192)
    assert long.pp_microbatches == 16  # one sample already holds 8192 tokens
    short = dims_for(4, dp_replicate=1, pp=4)
    short.resolve_pipeline_batch(8, seq_len=256)
    assert short.pp_microbatches == 4  # 512 tokens each, but never fewer micro-batches than stages
    no_length = dims_for(2, dp_replicate=1, pp=2)
    no_length.resolve_pipeline_batch(6)
    assert no_length.pp_microbatches == 6  # without a sequence length: one per sample
    ring = dims_for(2, dp_replicate=1, pp=2, pp_schedule="interleaved1f1b", pp_virtual_stages=2)
    ring.resolve_pipeline_batch(12, seq_len=1024)
    assert ring.pp_microbatches == 2  # 3 x 1024 = 3072 tokens fall short; 6 x 1024 with a multiple of pp
    few = dims_for(4, dp_replicate=1, pp=4)
    with pytest.raises(ConfigError, match=r"fewer than the 4 pipeline stages.*chose 2 for 2 samples"):
        few.resolve_pipeline_batch(2, seq_len=2048)
    interleaved = dims_for(2, dp_replicate=1, pp=2, pp_schedule="interleaved1f1b", pp_virtual_stages=2)
    with pytest.raises(ConfigError, match="must be a multiple of parallel.pp=2 for interleaved1f1b"):
        interleaved.resolve_pipeline_batch(3)
    zero_bubble = dims_for(2, dp_replicate=1, pp=2, pp_schedule="interleavedzb")
    assert zero_bubble.pp_virtual_stages == 2 and zero_bubble.stages == 4
    with pytest.raises(ConfigError, match="must be a multiple of parallel.pp=2 for interleavedzb"):
        zero_bubble.resolve_pipeline_batch(3)
    looped = dims_for(2, dp_replicate=1, pp=2, pp_schedule="loopedbfs")
    looped.resolve_pipeline_batch(3)  # any count of at least pp
    assert looped.pp_virtual_stages == 2 and looped.pp_microbatches == 3


def test_64_gpu_dp8_tp4_pp2_groups():
    """A 64-GPU layout: DP 8 x TP 4 x PP 2 on 8 nodes of 8 GPUs."""
    dims = dims_for(64, dp_replicate=8, tp=4, pp=2)
    assert dims.coords(0) == (0, 0, 0, 0, 0)
    assert dims.coords(37) == (1, 1, 0, 0, 1)  # 37 = 32 (pp 1) + 4 (dp 1) + 1 (tp 1)
    assert dims.group("tp", 37) == [36, 37, 38, 39]  # inside one node
    assert dims.group("dp", 37) == [33, 37, 41, 45, 49, 53, 57, 61]
    assert dims.group("pp", 37) == [5, 37]
    assert dims.dp_rank(37) == 1
    for name, size, count in (("tp", 4, 16), ("dp", 8, 8), ("pp", 2, 32)):
        groups = dims.groups(name)
        assert len(groups) == count and all(len(g) == size for g in groups)
        assert sorted(r for g in groups for r in g) == list(range(64)), f"{name} groups must partition the ranks"
    assert all(len({r // 8 for r in g}) == 1 for g in dims.groups("tp")), "TP groups must stay inside a node"


def test_hsdp_dp_rank_flattens_replicate_and_shard():
    dims = dims_for(8, dp_replicate=2, dp_shard=2, tp=2)
    assert [dims.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert dims.group("dp", 0) == [0, 2, 4, 6]
    assert dims.group("dp_shard", 0) == [0, 2] and dims.group("dp_replicate", 0) == [0, 4]


def test_mesh_on_a_fake_process_group_matches_the_arithmetic():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dims = dims_for(64, dp_replicate=4, dp_shard=2, tp=4, pp=2)
    rank = 45
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=64)
    try:
        mesh = dims.build_mesh("cpu")
        assert mesh.mesh_dim_names == tuple(n for n in MESH_DIMS if n != "cp") and tuple(mesh.shape) == (2, 4, 2, 4)
        for name in ("tp", "dp", "pp", "dp_shard", "dp_replicate"):
            assert dims.get_mesh(name).mesh.flatten().tolist() == dims.group(name, rank), name
        hsdp = dims.get_mesh(("dp_replicate", "dp_shard"))
        assert hsdp.mesh.flatten().tolist() == dims.group("dp", rank)
        assert dims.get_mesh("world") is mesh
    finally:
        dist.destroy_process_group()


def test_get_mesh_raises_and_get_optional_mesh_returns_none_for_degree_one():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dims = dims_for(4, dp_replicate=4)
    with pytest.raises(RuntimeError, match="build_mesh"):
        dims.get_mesh("tp")
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    try:
        dims.build_mesh("cpu")
        assert dims.get_optional_mesh("tp") is None and dims.get_optional_mesh("pp") is None
        with pytest.raises(ValueError, match=r"mesh dimension 'tp' is not enabled \(tp=1\)"):
            dims.get_mesh("tp")
        with pytest.raises(ValueError, match="unknown mesh 'sp'"):
            dims.get_mesh("sp")
        assert dims.get_optional_mesh("cp") is None
        assert dims.get_mesh("dp").size() == 4
    finally:
        dist.destroy_process_group()



@contextmanager
def fake_world(world_size: int, rank: int = 0):
    """A fake process group of ``world_size`` ranks (this process is ``rank``); yields torch's group counter."""
    from torch.distributed import distributed_c10d as c10d
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield lambda: c10d._world.group_count  # new_group calls so far, for every rank's groups
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world, parallel, names, groups", [
    # Building all four dimensions created 6 groups for 2-rank DDP (pp, dp_shard, tp: one per rank each).
    (2, {"dp_replicate": -1}, ("dp_replicate",), 0),
    (4, {"dp_replicate": 2, "dp_shard": 2}, ("dp_replicate", "dp_shard"), 4),  # 2 + 2; "dp" is the default group
    (8, {"dp_replicate": 2, "tp": 4}, ("dp_replicate", "dp_shard", "tp"), 14),  # FSDP2 replication keeps dp_shard=1
    (1, {}, (), 0),
])
def test_build_mesh_makes_groups_only_for_dimensions_above_one(world, parallel, names, groups):
    dims = dims_for(world, gpus_per_node=world, **parallel)
    with fake_world(world) as group_count:
        before = group_count()
        mesh = dims.build_mesh("cpu")
        assert dims.mesh_dim_names() == names and group_count() - before == groups
        if not names:
            assert mesh is None and dims.all_meshes() == [] and dims.get_optional_mesh("dp") is None
            return
        assert mesh.mesh_dim_names == names and tuple(mesh.shape) == tuple(dims.degree(n) for n in names)
        for name in ("dp", "dp_replicate", "dp_shard", "tp", "pp"):
            sub = dims.get_optional_mesh(name)
            assert (sub is None) == (dims.degree(name) == 1), name
            assert sub is None or sub.mesh.flatten().tolist() == dims.group(name, 0), name
        hsdp = dims.get_optional_mesh(("dp_replicate", "dp_shard"))
        assert hsdp.mesh.flatten().tolist() == dims.group("dp", 0)
        assert hsdp.ndim == (2 if dims.dp_shard > 1 or dims.fsdp_replicates else 1)
        assert group_count() - before == groups, "slicing sub-meshes must create no group"
