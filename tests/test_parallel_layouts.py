"""Every parallel layout trains exactly like a single process (CPU, gloo, fp32), and checkpoints move between layouts.

Each layout runs the tiny model (2 layers, 4 for the pipelines with 2 stages per rank; seq 32) for 10 AdamW steps (lr 3e-3, gradient clipping at 0.5, so
clipping is active and a wrong global norm changes the trajectory) on a global batch of 8 random sequences, from
the single-process reference's initial weights. Compared with the reference:

* loss per step: atol 1e-5 (losses are ~5.5; layouts differ from the reference only in the order of floating-
  point sums, seen up to 1.5e-6);
* gradient norm per step: rtol 1e-4 (seen up to 7e-6);
* every final parameter: atol 1e-4 (seen up to 3.2e-5, in one element of 16384 whose gradient is near zero,
  where AdamW's m / sqrt(v) amplifies rounding; one AdamW step moves parameters by up to 3e-3, and the weights
  move by more than 1e-2 in total, so a missing gradient sync, a wrong shard or a wrong scale is far outside);
* the validation loss after training (eval_loss): atol 1e-5.

The pipeline schedules run 4 layers where they place 2 stages per rank (interleaved1f1b, interleavedzb: input and
weight gradients as separate passes, loopedbfs). Layouts are grouped into one spawn per world size (2 and 4 ranks) to keep the suite fast; each layout is still
its own test. Pipeline layouts use untied embeddings (pipelines untie them), the others tied ones. The same two
spawns then move one checkpoint FSDP 4 -> TP 2 x DP 2 -> PP 2 x DP 2 and -> DDP 2 with plain DCP, and check that
every parameter arrives bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from dist_utils import mesh_group_timeouts, run_distributed
from meshrun.config import JobConfig, load_config
from meshrun.comm.mesh import ParallelDims
from meshrun.models.gpt import GPT, SIZES, GPTConfig
from meshrun.models.gpt_spec import GPT_SPEC
from meshrun.parallel.apply import build_engine
from meshrun.parallel.engine import LocalEngine
from meshrun.parallel.pipeline import effective_model_config, layer_ranges, split_stage, stage_ids

STEPS = 10
GLOBAL_BATCH = 8
SEQ = 32
MAX_NORM = 0.5
LOSS_ATOL, NORM_RTOL, PARAM_ATOL = 1e-5, 1e-4, 1e-4


# ---- the shared harness (runs in the test process and in every spawned rank) ---------------------------------------

def model_config(*, tied: bool, n_layers: int = 2) -> GPTConfig:
    return replace(SIZES["tiny"], n_layers=n_layers, seq_len=SEQ, tie_embeddings=tied)


def job_for(*, grad_accum: int, micro_batch: int, parallel: dict, train: dict | None = None) -> JobConfig:
    overrides = [f"--train.grad_accum={grad_accum}", f"--train.micro_batch={micro_batch}", "--train.seed=7"]
    overrides += [f"--parallel.{k}={v}" for k, v in parallel.items()]
    overrides += [f"--train.{k}={v}" for k, v in (train or {}).items()]
    return load_config(None, overrides)


def step_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of one step, (GLOBAL_BATCH, SEQ) inputs and targets, identical on every rank."""
    tokens = torch.randint(0, 256, (GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1000 + step))
    return tokens[:, :-1], tokens[:, 1:]


def rank_share(step: int, dp_rank: int, dp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    inputs, targets = step_batch(step)
    per_rank = GLOBAL_BATCH // dp_size
    mine = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    return inputs[mine], targets[mine]


def global_mean(loss_sum: torch.Tensor, tokens: torch.Tensor) -> float:
    sums = torch.stack([loss_sum.detach().float(), tokens.float()])
    if dist.is_initialized():
        dist.all_reduce(sums)  # exact only if one rank per replica reports its sums (the engine contract)
    return float(sums[0] / sums[1])


def train(engine, *, grad_accum: int, device: torch.device = torch.device("cpu")) -> dict:
    params = [p for part in engine.model_parts for p in part.parameters()]
    # foreach=True as on GPU: the multi-tensor kernels refuse a mix of DTensor and plain parameters
    optimizer = torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)
    losses, norms = [], []
    for step in range(STEPS):
        inputs, targets = (t.to(device) for t in rank_share(step, engine.dp_rank, engine.dp_size))
        batches = list(zip(inputs.chunk(grad_accum), targets.chunk(grad_accum)))
        loss_sum, tokens = engine.forward_backward(batches)
        norms.append(float(engine.clip_grad_norm(MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(global_mean(loss_sum, tokens))
    val = global_mean(*engine.eval_loss(*(t.to(device) for t in rank_share(STEPS, engine.dp_rank, engine.dp_size))))
    return {"losses": losses, "norms": norms, "val": val}


def reference_run(tied: bool, n_layers: int = 2, device: torch.device = torch.device("cpu")) -> dict:
    torch.manual_seed(0)
    model = GPT(model_config(tied=tied, n_layers=n_layers))
    model.init_weights()
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.to(device)
    result = train(LocalEngine(model), grad_accum=1, device=device)
    return result | {"initial": initial, "state": {k: v.detach().cpu() for k, v in model.state_dict().items()}}


def full_state(engine) -> dict[str, torch.Tensor]:
    """All parameters of this rank's model parts, gathered whole (collective over the mesh)."""
    state = {}
    for part in engine.model_parts:
        state.update(get_model_state_dict(part, options=StateDictOptions(full_state_dict=True)))
    return {k: v.detach().cpu().clone() for k, v in state.items()}


def build(cfg: GPTConfig, parallel: dict, *, grad_accum: int, train: dict | None = None,
          device: torch.device = torch.device("cpu"), compute_dtype: torch.dtype | None = None):
    world = dist.get_world_size()
    probe = ParallelDims.from_config(job_for(grad_accum=1, micro_batch=1, parallel=parallel).parallel,
                                     world_size=world)
    job = job_for(grad_accum=grad_accum, micro_batch=GLOBAL_BATCH // probe.dp_size // grad_accum, parallel=parallel,
                  train=train)
    dims = ParallelDims.from_config(job.parallel, world_size=world, model=cfg, spec=GPT_SPEC)
    mesh = dims.build_mesh(device.type)
    engine = build_engine(job=job, model_cfg=cfg, dims=dims, mesh=mesh, device=device, compute_dtype=compute_dtype)
    return dims, engine


def load_full(engine, state: dict[str, torch.Tensor]) -> None:
    for part in engine.model_parts:
        # a fresh dict each time: set_model_state_dict replaces the values of the dict it is given
        set_model_state_dict(part, dict(state), options=StateDictOptions(full_state_dict=True, strict=False))


@dataclass(frozen=True)
class Layout:
    tied: bool
    grad_accum: int
    parallel: dict = field(default_factory=dict)
    train: dict = field(default_factory=dict)
    n_layers: int = 2

    @property
    def model(self) -> tuple[bool, int]:
        """Which reference run this layout is compared with."""
        return self.tied, self.n_layers


def run_layout(layout: Layout, initial: dict, *, device: torch.device = torch.device("cpu"),
               compute_dtype: torch.dtype | None = None) -> dict:
    cfg = model_config(tied=layout.tied, n_layers=layout.n_layers)
    dims, engine = build(cfg, layout.parallel, grad_accum=layout.grad_accum, train=layout.train, device=device,
                         compute_dtype=compute_dtype)
    own_init = full_state(engine)  # the layout's own meta-device initialisation, before the reference is loaded
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                for part in engine.model_parts for p in part.parameters())
    load_full(engine, initial)
    result = train(engine, grad_accum=layout.grad_accum, device=device)
    final = full_state(engine)  # collective: every rank gathers
    coords = dims.coords(dist.get_rank())
    reporter = coords.tp == 0 and coords.dp_shard == 0  # one rank per (stage, replica) returns weights
    return result | {"dp": (engine.dp_rank, engine.dp_size), "coords": coords, "local_params": local,
                     "state": final if reporter else None,
                     "own_init": own_init if reporter else None, "parts": len(engine.model_parts)}


def _four_rank_worker(rank: int, world_size: int, layouts: dict[str, Layout], initials: dict, ckpt: str) -> dict:
    out = {name: run_layout(layout, initials[layout.model]) for name, layout in layouts.items()}
    return {"layouts": out, "checkpoint": save_and_reshard(f"{ckpt}/fsdp4", f"{ckpt}/tp2xdp2"),
            "hsdp_mesh_timeouts": mesh_group_timeouts({"dp_replicate": 2, "dp_shard": 2}, 600.0)}


def _two_rank_worker(rank: int, world_size: int, layouts: dict[str, Layout], initials: dict, ckpt: str) -> dict:
    out = {name: run_layout(layout, initials[layout.model]) for name, layout in layouts.items()}
    return {"layouts": out, "checkpoint": load_as_ddp(f"{ckpt}/tp2xdp2")}


# ---- the layouts -------------------------------------------------------------------------------------------------------

TWO_RANKS = {
    "ddp2": Layout(tied=True, grad_accum=2, parallel={"dp_replicate": 2}),
    "fsdp2": Layout(tied=True, grad_accum=2, parallel={"dp_replicate": 1, "dp_shard": 2}),
    # units of 2 blocks, each gathering the next unit ahead (parallel.fsdp_prefetch)
    "fsdp2_units2": Layout(tied=True, grad_accum=1, parallel={"dp_replicate": 1, "dp_shard": 2,
                                                            "fsdp_unit_blocks": 2, "fsdp_prefetch": 1}),
    # the whole model one FSDP2 unit, its forward compiled as one graph
    "fsdp2_whole_compiled": Layout(tied=True, grad_accum=2, parallel={"dp_replicate": 1, "dp_shard": 2,
                                                                    "fsdp_unit_blocks": -1}, train={"compile": "true"}),
    "tp2": Layout(tied=True, grad_accum=1, parallel={"dp_replicate": 1, "tp": 2}),
    # compiled blocks under TP: torch 2.12-2.14 dropped the gradient of a compiled block's async-collective input
    "tp2_compiled": Layout(tied=True, grad_accum=1, parallel={"dp_replicate": 1, "tp": 2}, train={"compile": "true"}),
    "tp2_sequence_parallel": Layout(tied=True, grad_accum=2, parallel={"dp_replicate": 1, "tp": 2,
                                                                        "sequence_parallel": "true"}),
    "pp2_gpipe": Layout(tied=False, grad_accum=1, parallel={"dp_replicate": 1, "pp": 2, "pp_schedule": "gpipe",
                                                            "pp_microbatches": 4}),
    "pp2_1f1b": Layout(tied=False, grad_accum=2, parallel={"dp_replicate": 1, "pp": 2, "pp_microbatches": 4}),
    "pp2_interleaved": Layout(tied=False, grad_accum=1, n_layers=4, parallel={
        "dp_replicate": 1, "pp": 2, "pp_microbatches": 4, "pp_schedule": "interleaved1f1b"}),
    "pp2_interleaved_zero_bubble": Layout(tied=False, grad_accum=1, n_layers=4, parallel={
        "dp_replicate": 1, "pp": 2, "pp_microbatches": 4, "pp_schedule": "interleavedzb"}),
    # compiled blocks with their weights eager (the linear layers, and on torch 2.8 the norms too), so the
    # zero-bubble schedule can split each backward
    "pp2_interleaved_zero_bubble_compiled": Layout(tied=False, grad_accum=1, n_layers=4, parallel={
        "dp_replicate": 1, "pp": 2, "pp_microbatches": 4, "pp_schedule": "interleavedzb"}, train={"compile": "true"}),
    "pp2_looped_bfs": Layout(tied=False, grad_accum=2, n_layers=4, parallel={
        "dp_replicate": 1, "pp": 2, "pp_microbatches": 0, "pp_schedule": "loopedbfs"}),
}
FOUR_RANKS = {
    "fsdp2_tp2": Layout(tied=True, grad_accum=2, parallel={"dp_replicate": 1, "dp_shard": 2, "tp": 2,
                                                           "sequence_parallel": "true"}),
    "pp2_dp2": Layout(tied=False, grad_accum=2, parallel={"dp_replicate": 2, "pp": 2, "pp_microbatches": 2}),
    "tp2_pp2": Layout(tied=False, grad_accum=1, parallel={"dp_replicate": 1, "tp": 2, "pp": 2, "pp_microbatches": 4,
                                                          "activation_checkpoint": "full"}),
    "hsdp2x2": Layout(tied=True, grad_accum=1, parallel={"dp_replicate": 2, "dp_shard": 2,
                                                         "activation_checkpoint": "selective"}),
    # HSDP with the whole model one unit, compiled as one graph, every block recomputed in backward
    "hsdp2x2_whole_compiled_full_ac": Layout(tied=True, grad_accum=1, parallel={
        "dp_replicate": 2, "dp_shard": 2, "fsdp_unit_blocks": -1, "activation_checkpoint": "full"},
        train={"compile": "true"}),
}


@pytest.fixture(scope="module")
def references() -> dict[tuple[bool, int], dict]:
    models = {layout.model for layout in (*TWO_RANKS.values(), *FOUR_RANKS.values())}
    return {model: reference_run(*model) for model in sorted(models)}


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("layout_checkpoints"))


@pytest.fixture(scope="module")
def four_rank_results(references, checkpoint_dir):
    """One 4-rank spawn: the 4-rank layouts, then FSDP 4 -> save -> TP 2 x DP 2 / PP 2 x DP 2 (-> save)."""
    return _spawn(_four_rank_worker, FOUR_RANKS, 4, references, checkpoint_dir)


@pytest.fixture(scope="module")
def two_rank_results(references, checkpoint_dir, four_rank_results):
    """One 2-rank spawn: the 2-rank layouts, then DDP 2 loads the TP 2 x DP 2 checkpoint (so it runs second)."""
    return _spawn(_two_rank_worker, TWO_RANKS, 2, references, checkpoint_dir)


def _spawn(worker, layouts: dict[str, Layout], world: int, references, ckpt: str) -> dict:
    initials = {model: ref["initial"] for model, ref in references.items()}
    # one torch thread per rank (dist_utils): with one per core the 4-rank TP layouts trained several times slower
    per_rank = run_distributed(worker, world, layouts, initials, ckpt, timeout=420, threads=1)
    results = {name: [per_rank[r]["layouts"][name] for r in range(world)] for name in layouts}
    return results | {"checkpoint": [per_rank[r]["checkpoint"] for r in range(world)],
                      "hsdp_mesh_timeouts": [per_rank[r].get("hsdp_mesh_timeouts") for r in range(world)]}


def assert_matches_reference(name: str, ranks: list[dict], reference: dict) -> None:
    for r, result in enumerate(ranks):
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"]), rtol=0,
                                   atol=LOSS_ATOL, msg=lambda m: f"{name} rank {r}: losses differ: {m}")
        torch.testing.assert_close(torch.tensor(result["norms"]), torch.tensor(reference["norms"]), rtol=NORM_RTOL,
                                   atol=0, msg=lambda m: f"{name} rank {r}: gradient norms differ: {m}")
        assert result["val"] == pytest.approx(reference["val"], abs=LOSS_ATOL), name
    gathered: dict[str, torch.Tensor] = {}
    for result in ranks:
        if result["state"] is not None and result["coords"].dp_replicate == 0:
            gathered.update(result["state"])
    assert set(gathered) == set(reference["state"]), f"{name}: parameter names differ from the model's"
    for key, expected in reference["state"].items():
        torch.testing.assert_close(gathered[key], expected, rtol=0, atol=PARAM_ATOL,
                                   msg=lambda m: f"{name}: parameter {key} differs: {m}")


def test_reference_learns_and_moves_weights(references):
    for ref in references.values():
        moved = max((ref["state"][k] - ref["initial"][k]).abs().max().item() for k in ref["state"])
        assert moved > 100 * PARAM_ATOL, "the comparison would be meaningless if the weights barely moved"
        assert ref["norms"][0] > MAX_NORM, "clipping must be active for the norm to matter"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TWO_RANKS))
def test_two_rank_layout_equals_single_process(name, two_rank_results, references):
    assert_matches_reference(name, two_rank_results[name], references[TWO_RANKS[name].model])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FOUR_RANKS))
def test_four_rank_layout_equals_single_process(name, four_rank_results, references):
    assert_matches_reference(name, four_rank_results[name], references[FOUR_RANKS[name].model])


@pytest.mark.slow
def test_data_parallel_ranks_reported_to_the_sampler(two_rank_results, four_rank_results):
    assert [r["dp"] for r in two_rank_results["ddp2"]] == [(0, 2), (1, 2)]
    assert [r["dp"] for r in two_rank_results["tp2"]] == [(0, 1), (0, 1)]  # TP peers read the same data
    assert [r["dp"] for r in four_rank_results["pp2_dp2"]] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    assert [r["dp"] for r in four_rank_results["hsdp2x2"]] == [(0, 4), (1, 4), (2, 4), (3, 4)]
    for name in ("pp2_interleaved", "pp2_interleaved_zero_bubble", "pp2_looped_bfs"):
        assert [r["parts"] for r in two_rank_results[name]] == [2, 2], name  # two virtual stages per rank


@pytest.mark.slow
def test_sharded_layouts_initialise_distinct_shards_and_identical_replicas(two_rank_results, four_rank_results):
    """Meta-device init: each rank allocates only its shards, draws distinct values per shard, and dp replicas
    (which must agree) draw the same values."""
    total = GPT(model_config(tied=True)).num_params()
    for name in ("fsdp2", "tp2"):
        ranks = two_rank_results[name]
        assert all(r["local_params"] < 0.6 * total for r in ranks), f"{name}: a rank holds the whole model"
        wq = ranks[0]["own_init"]["layers.0.attention.wq.weight"]  # (64, 64); shards split the rows
        assert not torch.equal(wq[:32], wq[32:]), f"{name}: both shards drew the same values"
        assert 0.015 < wq.std().item() < 0.025, f"{name}: init_weights' std 0.02 was not applied"
    hsdp = four_rank_results["hsdp2x2"]
    replicas = [r["own_init"] for r in hsdp if r["own_init"] is not None]
    assert len(replicas) == 2
    for key, value in replicas[0].items():
        assert torch.equal(value, replicas[1][key]), f"HSDP replicas start from different {key}"


# ---- checkpoints across layouts ----------------------------------------------------------------------------------------
# Run inside the layout spawns (they already pay for starting the ranks): plain torch.distributed.checkpoint with
# get_model_state_dict / set_model_state_dict over engine.model_parts, as the checkpointer does.

def save_and_reshard(first: str, second: str) -> dict:
    """4 ranks: FSDP 4 saves; TP 2 x DP 2 and PP 2 x DP 2 load it; TP 2 x DP 2 saves again."""
    import torch.distributed.checkpoint as dcp

    tied = model_config(tied=True, n_layers=4)
    _, fsdp = build(tied, {"dp_replicate": 1, "dp_shard": 4}, grad_accum=1)
    expected = full_state(fsdp)
    dcp.save(get_model_state_dict(fsdp.model_parts[0]), checkpoint_id=first)
    loaded = {}
    for name, cfg, parallel in (("tp2_dp2", tied, {"dp_replicate": 2, "tp": 2}),
                                ("pp2_dp2", effective_model_config(tied, pp=2), {"dp_replicate": 2, "pp": 2})):
        _, engine = build(cfg, parallel, grad_accum=1)
        for part in engine.model_parts:
            state = get_model_state_dict(part)
            dcp.load(state, checkpoint_id=first)  # reads only this rank's shards, whatever layout saved them
            set_model_state_dict(part, state)
        loaded[name] = full_state(engine)
        if name == "tp2_dp2":
            dcp.save(get_model_state_dict(engine.model_parts[0]), checkpoint_id=second)
    return {"expected": expected, "loaded": loaded}


def load_as_ddp(second: str) -> dict:
    """2 ranks: DDP 2 loads what TP 2 x DP 2 saved."""
    import torch.distributed.checkpoint as dcp

    _, engine = build(model_config(tied=True, n_layers=4), {"dp_replicate": 2}, grad_accum=1)
    state = get_model_state_dict(engine.model_parts[0])
    dcp.load(state, checkpoint_id=second)
    set_model_state_dict(engine.model_parts[0], state)
    return {"loaded": full_state(engine), "engine": type(engine).__name__}


@pytest.mark.slow
def test_checkpoint_moves_fsdp4_to_tp2xdp2_to_pp2xdp2_and_ddp2(four_rank_results, two_rank_results):
    saved = four_rank_results["checkpoint"]
    expected = saved[0]["expected"]
    assert "output.weight" in expected and "layers.3.feed_forward.w2.weight" in expected
    assert not torch.equal(expected["layers.0.attention.wq.weight"], expected["layers.1.attention.wq.weight"])
    for r, result in enumerate(saved):
        for name, state in result["loaded"].items():
            for key, value in state.items():
                assert torch.equal(value, expected[key]), f"rank {r} {name}: {key} changed on the way"
        pp_keys = set(result["loaded"]["pp2_dp2"])
        stage = 0 if r < 2 else 1  # ranks 0, 1 hold pipeline stage 0; ranks 2, 3 stage 1
        owned = {f"layers.{i}." for i in layer_ranges(4, 2)[stage]}
        assert all(k.split(".")[0] != "layers" or any(k.startswith(o) for o in owned) for k in pp_keys), pp_keys
        assert ("tok_embeddings.weight" in pp_keys) == (stage == 0) and ("output.weight" in pp_keys) == (stage == 1)
    for result in two_rank_results["checkpoint"]:
        assert result["engine"] == "LocalEngine"
        assert set(result["loaded"]) == set(expected)
        for key, value in result["loaded"].items():
            assert torch.equal(value, expected[key]), f"DDP 2: {key} changed on the way"


# ---- pure logic: stage splitting -------------------------------------------------------------------------------------

def test_layer_ranges_split_by_count_with_extras_first():
    assert layer_ranges(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert [len(r) for r in layer_ranges(10, 4)] == [3, 3, 2, 2]
    assert stage_ids(1, pp=4, virtual_stages=2) == [1, 5]


def test_split_stage_keeps_original_names_and_owners():
    with torch.device("meta"):
        whole = GPT(replace(model_config(tied=False), n_layers=6))
    first, middle, last = (split_stage(whole, s, 3, spec=GPT_SPEC) for s in range(3))
    assert list(middle.layers.keys()) == ["2", "3"]
    assert "layers.2.attention.wq.weight" in dict(middle.named_parameters())
    assert first.tok_embeddings is not None and first.output is None and first.norm is None
    assert middle.tok_embeddings is None and middle.output is None
    assert last.output is not None and last.norm is not None and last.tok_embeddings is None
    names = set().union(*(dict(p.named_parameters()).keys() for p in (first, middle, last)))
    assert names == set(dict(whole.named_parameters()).keys())


def test_zero_bubble_refuses_blocks_compiled_in_place_unless_their_weights_stay_eager():
    from types import SimpleNamespace

    from meshrun.config import ConfigError
    from meshrun.parallel.apply import keep_weights_eager
    from meshrun.parallel.pipeline import check_split_backward

    plain, compiled = torch.nn.Sequential(torch.nn.Linear(2, 2)), torch.nn.Sequential(torch.nn.Linear(2, 2))
    compiled[0].compile()  # as meshrun compiles blocks: in place, no OptimizedModule for torch's own check to see
    check_split_backward([SimpleNamespace(submod=plain)])
    with pytest.raises(ConfigError, match="parallel.pp_schedule=interleavedzb.*train.compile=false"):
        check_split_backward([SimpleNamespace(submod=compiled)])
    split = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.GELU()))
    keep_weights_eager(split[0], only_linears=False)
    split[0].compile()
    check_split_backward([SimpleNamespace(submod=split)])


def test_compiled_zero_bubble_keeps_norms_eager_on_a_torch_whose_weight_pass_cannot_run_a_graph_again(monkeypatch):
    """The weight pass of torch's zero-bubble split must give each output of a node with several outputs (a compiled
    graph's backward) its own saved gradient before a norm's weight may stay inside a graph. torch 2.8 asserted one
    output; later versions summed them into the first (pytorch#170277). The probe says no to both; then blocks
    prepared with only their linear layers eager are refused, naming torch, and parallelize keeps every weight
    eager instead."""
    import inspect
    from types import SimpleNamespace

    import torch.distributed.pipelining._backward as split
    from torch.autograd.graph import GradientEdge

    from meshrun.config import ConfigError
    from meshrun.parallel.apply import keep_weights_eager
    from meshrun.parallel.pipeline import check_split_backward, split_backward_routes_each_output

    def summed_into_the_first(weights, param_groups, retain_graph=False):  # the code pytorch#175705 fixed
        by_node = {split._get_grad_fn_or_grad_acc(w): w for w in weights}
        for group in param_groups:
            edges, grads = [], []
            for grads_tuple, intermediate in zip(group["grads"], group["intermediates"]):
                present = [g for g in grads_tuple if g is not None]
                if present:
                    edges.append(GradientEdge(intermediate, 0))
                    grads.append(sum(present))
            params = list(group["params"])
            for node, dw in zip(params, torch.autograd.grad(edges, [GradientEdge(p, 0) for p in params],
                                                           grad_outputs=grads, retain_graph=retain_graph)):
                by_node[node].grad = dw

    def one_output_only(weights, param_groups, retain_graph=False):  # torch 2.8
        assert all(len(g) == 1 for group in param_groups for g in group["grads"])

    def prepared(only_linears: bool) -> SimpleNamespace:
        block = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.GELU()))
        keep_weights_eager(block[0], only_linears=only_linears)
        block[0].compile()
        return SimpleNamespace(submod=block)

    split_backward_routes_each_output.cache_clear()
    try:
        fixed = "GradientEdge(intermediate, i)" in inspect.getsource(split.stage_backward_weight)  # its edge per output
        assert split_backward_routes_each_output() is fixed
        for broken in (summed_into_the_first, one_output_only):
            monkeypatch.setattr(split, "stage_backward_weight", broken)
            split_backward_routes_each_output.cache_clear()
            assert not split_backward_routes_each_output(), broken.__name__
            with pytest.raises(ConfigError, match=r"interleavedzb: blocks compiled with only their linear layers "
                                                  r"eager need torch's zero-bubble weight pass .* torch "):
                check_split_backward([prepared(only_linears=True)])
            check_split_backward([prepared(only_linears=False)])
    finally:
        split_backward_routes_each_output.cache_clear()


def _graph_nodes(out: torch.Tensor) -> list:
    """Every autograd node behind ``out``."""
    nodes, todo, seen = [], [out.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        nodes.append(node)
        todo.extend(child for child, _ in node.next_functions)
    return nodes


def _weight_consumers(out: torch.Tensor) -> dict[int, set[str]]:
    """id(parameter) -> the names of the autograd nodes whose backward feeds the parameter's gradient."""
    consumers: dict[int, set[str]] = {}
    for node in _graph_nodes(out):
        for child, _ in node.next_functions:
            if hasattr(child, "variable"):
                consumers.setdefault(id(child.variable), set()).add(type(node).__name__)
    return consumers


@pytest.mark.parametrize("only_linears", [True, False])
def test_blocks_compiled_for_zero_bubble_leave_weight_gradients_to_eager_nodes(only_linears):
    """keep_weights_eager: the compiled block's graphs end at its linear layers, so each linear weight's gradient
    comes from an eager matmul node, which autograd can run for the weight alone (the zero-bubble weight pass); a
    norm's weight hangs off a graph's backward with only_linears, off an eager node without. Same outputs as the
    block run eagerly."""
    from meshrun.models.gpt import Block, rope_cache
    from meshrun.parallel.apply import keep_weights_eager

    torch.manual_seed(0)
    cfg = model_config(tied=False)
    block = Block(cfg)
    reference = Block(cfg)
    reference.load_state_dict(block.state_dict())
    keep_weights_eager(block, only_linears=only_linears)
    torch._dynamo.reset()
    block.compile(backend="aot_eager")
    x, rope = torch.randn(2, SEQ, cfg.dim, requires_grad=True), rope_cache(SEQ, cfg.head_dim, cfg.rope_theta)
    out = block(x, rope)
    torch.testing.assert_close(out, reference(x, rope))
    by_param = _weight_consumers(out)
    linears = [m.weight for m in block.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 7
    for weight in linears:
        assert not any("Compiled" in name for name in by_param[id(weight)]), by_param[id(weight)]
    norm = by_param[id(block.attention_norm.weight)]
    assert any("Compiled" in name for name in norm) is only_linears, norm
    assert any("Compiled" in type(n).__name__ for n in _graph_nodes(out)), "the block compiled nothing"


def test_pipelines_untie_embeddings_only_when_split():
    tied = model_config(tied=True)
    assert effective_model_config(tied, pp=1) is tied
    assert effective_model_config(tied, pp=2).tie_embeddings is False


@pytest.mark.slow
def test_every_group_of_a_two_dimensional_mesh_gets_the_training_timeout(four_rank_results):
    # HSDP 2 x 2 makes its own replicate and shard groups (two per rank); without set_mesh_timeouts they would keep
    # torch's 30-minute gloo default whatever dist.timeout_s says
    for rank, (made, count, timeouts) in enumerate(four_rank_results["hsdp_mesh_timeouts"]):
        assert made >= 2 and count >= 2 and timeouts == {timedelta(seconds=600)}, (rank, made, count, timeouts)
