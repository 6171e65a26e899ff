"""Context parallelism (parallel.cp) on CPU: the axis in the mesh, its validation, the planner, and -- on 2 gloo
ranks -- the sequence sharding, the exact loss and gradient reduction, and checkpoints moving across cp.

torch's ring attention dispatches only SDPA's CUDA kernels (torch 2.8 to 2.13: on CPU
``aten._scaled_dot_product_flash_attention_for_cpu`` has no sharding strategy), so the parity of a whole GPT with
attention is a GPU test (tests/test_parallel_gpu.py, layouts cp2 and cp2_compile_selective). Here the 2-rank test
runs the engine's CP path with a GPT of no blocks (embedding, norm, head: no attention), which exercises the rest
of it: torch's context_parallel shards the inputs, targets and RoPE table, each rank reports its part's loss
sum, and FSDP reduces gradients over the cp ranks. Compared with one process on the whole batch:

* loss sum: rtol 1e-6 (fp32 sums of 2 x 16 token losses in another order);
* every gradient: atol 1e-6 (seen ~1e-8; a missing or doubled cp reduction is off by the gradient itself, ~1e-3).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from meshrun.comm.mesh import ParallelDims
from meshrun.config import ConfigError, ParallelConfig
from meshrun.models.gpt import GPT, SIZES
from meshrun.models.gpt_spec import GPT_SPEC
from meshrun.parallel.context_parallel import SequenceShards, check_context_parallel

SEQ = 16
CP_CONFIG = replace(SIZES["tiny"], n_layers=1, seq_len=SEQ)


def no_attention_gpt() -> GPT:
    """The GPT without its block: embedding, final norm and head, so no attention runs (see the module docstring)."""
    model = GPT(CP_CONFIG)
    del model.layers["0"]
    return model


def dims_for(world: int, model=None, **parallel) -> ParallelDims:
    return ParallelDims.from_config(ParallelConfig(**parallel), world_size=world, gpus_per_node=8, model=model,
                                    spec=GPT_SPEC)


# ---- pure logic --------------------------------------------------------------------------------------------------

def test_cp_sits_between_dp_shard_and_tp_in_rank_order():
    dims = dims_for(16, dp_replicate=2, dp_shard=2, cp=2, tp=2)
    assert dims.coords(13) == (0, 1, 1, 0, 1) and dims.coords(13)._fields[3] == "cp"
    assert all(dims.rank_of(dims.coords(r)) == r for r in range(16))
    assert dims.group("tp", 13) == [12, 13] and dims.group("cp", 13) == [13, 15]
    assert dims.group("dp_shard_cp", 13) == [9, 11, 13, 15]  # FSDP shards over dp_shard x cp
    assert dims.dp_rank(13) == dims.dp_rank(15) == 3, "cp peers read the same samples"
    assert dims.dp_size == 4 and dims.degrees() == {"pp": 1, "dp_replicate": 2, "dp_shard": 2, "cp": 2, "tp": 2}


def test_cp_mesh_on_a_fake_process_group_matches_the_arithmetic():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dims = dims_for(16, dp_replicate=2, dp_shard=2, cp=2, tp=2)
    dist.init_process_group("fake", store=FakeStore(), rank=13, world_size=16)
    try:
        mesh = dims.build_mesh("cpu")
        assert mesh.mesh_dim_names == ("dp_replicate", "dp_shard", "cp", "tp")
        for name in ("cp", "dp_shard_cp", "dp", "tp"):
            assert dims.get_mesh(name).mesh.flatten().tolist() == dims.group(name, 13), name
        hsdp = dims.get_mesh(("dp_replicate", "dp_shard_cp"))  # FSDP's 2-D mesh under HSDP x CP
        assert hsdp.mesh.tolist() == [[1, 3, 5, 7], [9, 11, 13, 15]]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("parallel, model_change, message", [
    ({"cp": 2, "pp": 2}, {}, "parallel.cp=2 with parallel.pp=2: context parallelism does not run inside pipeline"),
    ({"cp": 3}, {"seq_len": 64}, "parallel.cp=3 needs model.seq_len=64 divisible by 2 x cp = 6"),
    ({"cp": 2}, {"dropout": 0.1}, "parallel.cp=2 with model.dropout=0.1"),
    ({"cp": 0}, {}, "parallel.cp=0 is not a degree"),
])
def test_bad_cp_layouts_name_the_option(parallel, model_change, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        world = 2 * parallel["cp"] if parallel["cp"] > 0 else 2
        dims_for(world, model=replace(SIZES["tiny"], **model_change), dp_replicate=-1, **parallel)


def test_cp_is_refused_where_the_ring_cannot_run():
    with pytest.raises(ConfigError, match="parallel.cp=2 needs CUDA GPUs.*this run is on cpu"):
        check_context_parallel(cp=2, device=torch.device("cpu"), spec=GPT_SPEC, attention="auto")
    with pytest.raises(ConfigError, match="train.attention=math: ring attention runs the flash, efficient, cudnn"):
        check_context_parallel(cp=2, device=torch.device("cuda"), spec=GPT_SPEC, attention="math")
    with pytest.raises(ConfigError, match="model.arch='plain' does not say which buffers are indexed by position"):
        check_context_parallel(cp=2, device=torch.device("cuda"), spec=replace(GPT_SPEC, arch="plain",
                                                                               sequence_buffers=None),
                               attention="auto")
    with pytest.raises(ConfigError, match="parallel.cp=2 with fp32 compute.*train in bf16"):
        check_context_parallel(cp=2, device=torch.device("cuda"), spec=GPT_SPEC, attention="auto", fp32=True)
    check_context_parallel(cp=1, device=torch.device("cpu"), spec=GPT_SPEC, attention="math")  # cp=1: nothing


def test_plan_shows_cp_groups_activations_and_ring_traffic(capsys):
    import json

    from meshrun import planner

    def plan(*extra):
        assert planner.main(["--gpus-per-node", "4", "--model", "1b", "--seq", "8192", "--micro-batch", "1",
                             "--dp-replicate", "1", "--json", *extra]) == 0
        return json.loads(capsys.readouterr().out)

    fsdp, cp = plan("--dp-shard", "4"), plan("--dp-shard", "2", "--cp", "2")
    assert cp["parallel"]["cp"] == 2 and cp["groups"]["cp"] == [[0, 1], [2, 3]]
    assert cp["groups"]["dp_shard_cp"] == [[0, 1, 2, 3]] and cp["data_parallel"]["mode"] == "fsdp"
    assert "2 data-parallel ranks (4 GPUs / (tp 1 x cp 2 x pp 1))" in cp["batch"]["formula"]
    acts = lambda p: p["memory"][0]["bytes"]["activations"]  # noqa: E731
    assert acts(cp) == pytest.approx(acts(fsdp) / 2), "each GPU holds half of every sequence"
    assert cp["memory"][0]["params_local"] == fsdp["memory"][0]["params_local"], "FSDP shards over dp_shard x cp"
    ring = {row["dim"]: row for row in cp["communication"]}["cp"]
    # 1b: 16 kv heads x 128; one rank's K and V of 4096 tokens in bf16, twice (forward, backward) + fp32 gradients
    kv = 4096 * 2 * 16 * 128
    assert ring["bytes_per_step"] == pytest.approx(kv * (2 * 2 + 4) * 18) and not ring["crosses_nodes"]


# ---- 2 gloo ranks: sequence sharding, loss and gradient reduction, checkpoints -----------------------------------

def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 256, (2, SEQ + 1), generator=torch.Generator().manual_seed(3))
    return tokens[:, :-1], tokens[:, 1:]


def _reference() -> dict:
    torch.manual_seed(0)
    model = no_attention_gpt()
    model.init_weights()
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    inputs, targets = _batch()
    logits = model(inputs)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    (loss / targets.numel()).backward()
    return {"initial": initial, "loss_sum": loss.item(), "tokens": targets.numel(),
            "grads": {k: p.grad.clone() for k, p in model.named_parameters()}}


def _cp_worker(rank: int, world_size: int, initial: dict, ckpt: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_model_state_dict

    from meshrun.parallel.data_parallel import apply_fsdp
    from meshrun.parallel.sharded import ShardedEngine

    dims = dims_for(2, model=CP_CONFIG, dp_replicate=1, cp=2)
    dims.build_mesh("cpu")
    cp_mesh = dims.get_mesh("cp")
    shards = SequenceShards(cp_mesh, GPT_SPEC)

    # what each rank sees inside the context: positions as tokens show which chunk it holds
    model = no_attention_gpt()
    model.init_weights()
    full_rope = model.rope.clone()
    positions = torch.arange(SEQ).expand(2, SEQ)
    with shards(model, positions, positions + 100) as (inputs, targets):
        seen = {"inputs": inputs.clone(), "targets": targets.clone(), "rope": model.rope.clone()}
    seen["rope_restored"] = torch.equal(model.rope, full_rope)
    seen["full_rope"] = full_rope

    # the engine's CP path: FSDP over the cp ranks, one step, gradients gathered whole
    with torch.device("meta"):
        model = no_attention_gpt()
    apply_fsdp(model, dims.get_mesh("dp_shard_cp"), compute_dtype=None, reshard_after_forward=True,
               blocks=GPT_SPEC.block_modules(model))
    model.to_empty(device="cpu")
    model.init_weights()
    set_model_state_dict(model, dict(initial), options=StateDictOptions(full_state_dict=True))
    engine = ShardedEngine(model, dp_rank=dims.dp_rank(rank), dp_size=dims.dp_size, reports_loss=True, fsdp=True,
                           loss_parallel=False, autocast_dtype=None, sequence_shards=shards)
    loss_sum, tokens = engine.forward_backward([_batch()])
    totals = torch.stack([loss_sum, tokens])
    dist.all_reduce(totals)  # the trainer's world-wide SUM
    grads = {k: p.grad.full_tensor() for k, p in model.named_parameters()}
    own = {k: p.to_local().numel() for k, p in model.named_parameters()}

    # checkpoints across cp: cp 2 saves model and AdamW state; one process (cp 1) loads them in the test process
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    optimizer.step()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=ckpt)
    model_full, optim_full = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    saved = {"model": model_full, "optim": optim_full["state"]}
    return {"seen": seen, "local": (float(loss_sum), float(tokens)), "totals": totals.tolist(), "grads": grads,
            "own": own, "saved": saved}


@pytest.fixture(scope="module")
def cp_results(tmp_path_factory):
    reference = _reference()
    ckpt = str(tmp_path_factory.mktemp("cp_checkpoint"))
    return reference, run_distributed(_cp_worker, 2, reference["initial"], ckpt, timeout=240), ckpt


@pytest.mark.slow
def test_inputs_targets_and_positions_are_sharded_alike(cp_results):
    _, ranks, _ = cp_results
    chunk = SEQ // 4  # 2 x cp chunks; rank r keeps chunks r and 3 - r (causal load balance)
    for r, result in enumerate(ranks):
        seen = result["seen"]
        expected = torch.cat([torch.arange(r * chunk, (r + 1) * chunk), torch.arange((3 - r) * chunk, (4 - r) * chunk)])
        assert seen["inputs"].tolist() == [expected.tolist()] * 2, f"rank {r}"
        assert torch.equal(seen["targets"], seen["inputs"] + 100), "targets follow their tokens"
        assert torch.equal(seen["rope"], seen["full_rope"][expected]), "each token keeps its own RoPE position"
        assert seen["rope_restored"], "the model's RoPE table is whole again after the step"


@pytest.mark.slow
def test_loss_and_gradients_reduce_exactly_over_the_sequence_shards(cp_results):
    reference, ranks, _ = cp_results
    locals_ = [r["local"] for r in ranks]
    assert [tokens for _, tokens in locals_] == [SEQ, SEQ], "each rank counts its half of 2 x 16 tokens"
    assert locals_[0][0] != pytest.approx(locals_[1][0]), "the ranks hold different tokens"
    for result in ranks:
        loss_sum, tokens = result["totals"]
        assert tokens == reference["tokens"]
        assert loss_sum == pytest.approx(reference["loss_sum"], rel=1e-6)
        assert set(result["grads"]) == set(reference["grads"])
        for key, expected in reference["grads"].items():
            torch.testing.assert_close(result["grads"][key], expected, rtol=0, atol=1e-6,
                                       msg=lambda m: f"gradient of {key}: {m}")
    weight = "tok_embeddings.weight"
    assert ranks[0]["own"][weight] == reference["grads"][weight].numel() // 2, "FSDP shards over the cp ranks"


@pytest.mark.slow
def test_a_cp_checkpoint_loads_into_one_process(cp_results):
    """Model and AdamW state saved by cp 2 (FSDP shards over the cp ranks) arrive whole in one process (cp 1)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    _, ranks, ckpt = cp_results
    model = no_attention_gpt()
    model.init_weights()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model_state, optim_state = get_state_dict(model, optimizer)  # creates the empty AdamW state to load into
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=ckpt, no_dist=True)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    saved = ranks[0]["saved"]
    for key, value in saved["model"].items():
        assert torch.equal(model.state_dict()[key], value), f"{key} changed between cp 2 and one process"
    loaded = get_state_dict(model, optimizer)[1]["state"]
    assert set(loaded) == set(saved["optim"]) and saved["optim"]
    for key, moments in saved["optim"].items():
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(loaded[key][name], moments[name]), f"AdamW {name} of {key} changed on the way"
        assert moments["exp_avg"].abs().sum() > 0, "the step before saving filled the moments"
