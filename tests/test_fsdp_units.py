"""parallel.fsdp_unit_blocks: consecutive blocks share one FSDP2 unit (one all-gather, one reduce-scatter), on a fake
process group so no other process is needed; -1, the whole model one unit compiled as one graph, on 2 gloo ranks.
Numerical parity of grouped layouts with one process is in tests/test_parallel_layouts.py (fsdp2_units2, which
also prefetches, and fsdp2_whole_compiled)."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from meshrun.config import ConfigError, load_config
from meshrun.parallel.data_parallel import apply_fsdp


class Blocks(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.layers = nn.ModuleDict({str(i): nn.Linear(4, 4) for i in range(n)})


def _units(model: Blocks) -> list[list[str]]:
    """Block names grouped by the FSDP2 parameter group that gathers them."""
    from torch.distributed.fsdp import FSDPModule

    groups: dict[int, list[str]] = {}
    for name, block in model.layers.items():
        assert isinstance(block, FSDPModule), name
        group = block._get_fsdp_state()._fsdp_param_group
        groups.setdefault(id(group), []).append(name)
    return list(groups.values())


@pytest.fixture
def fake_mesh():
    """A 2-rank 1-D CPU mesh on a fake process group (this process is rank 0; collectives do nothing)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("unit_blocks, expected", [(1, [["0"], ["1"], ["2"], ["3"], ["4"]]),
                                                   (2, [["0", "1"], ["2", "3"], ["4"]]),
                                                   (8, [["0", "1", "2", "3", "4"]])])
def test_blocks_are_grouped_into_units_of_the_given_size(unit_blocks, expected, fake_mesh):
    model = Blocks(5)
    apply_fsdp(model, fake_mesh, compute_dtype=None, reshard_after_forward=True,
               blocks=list(model.layers.values()), unit_blocks=unit_blocks)
    assert _units(model) == expected
    assert [p.to_local().shape[0] for p in model.layers["0"].parameters()] == [2, 2]  # sharded over 2 ranks


def test_whole_model_leaves_no_unit_of_blocks(fake_mesh):
    """-1: only the root is an FSDP2 unit; it gathers every parameter, the blocks' too."""
    from torch.distributed.fsdp import FSDPModule

    model = Blocks(3)
    apply_fsdp(model, fake_mesh, compute_dtype=None, reshard_after_forward=True,
               blocks=list(model.layers.values()), unit_blocks=-1)
    assert isinstance(model, FSDPModule) and not any(isinstance(b, FSDPModule) for b in model.layers.values())
    gathered = model._get_fsdp_state()._fsdp_param_group.fsdp_params
    assert len(gathered) == len(list(model.parameters())) == 8


def test_unit_size_below_minus_one_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"parallel.fsdp_unit_blocks must be >= -1 \(blocks per FSDP2 unit; 0: "
                                          r"auto; -1: the whole model one unit\), got -2"):
        load_config(None, ["--parallel.fsdp_unit_blocks=-2"])


@pytest.mark.parametrize("degree", ["--parallel.tp=2", "--parallel.pp=2"])
def test_whole_model_unit_with_tp_or_pp_is_refused_with_the_fix(degree):
    from meshrun.comm.mesh import ParallelDims
    from meshrun.models.gpt import gpt_config
    from meshrun.models.spec import get_model_spec
    from meshrun.parallel.checks import check_layout

    job = load_config(None, ["--model.name=tiny", "--model.tie_embeddings=false", "--parallel.dp_replicate=1",
                             "--parallel.dp_shard=2", degree, "--parallel.fsdp_unit_blocks=-1"])
    spec, shape = get_model_spec("gpt"), gpt_config("tiny", n_layers=4)
    dims = ParallelDims.from_config(job.parallel, world_size=4, model=shape, spec=spec)
    with pytest.raises(ConfigError, match=r"^parallel.fsdp_unit_blocks=-1 makes the whole model one FSDP2 unit.* "
                                          r"give a number of blocks per unit, or drop --parallel.fsdp_unit_blocks"):
        check_layout(job, spec, shape, dims, device=torch.device("cpu"), compute_dtype=None)


def _compiled_regions(rank: int, world_size: int, unit_blocks: int) -> dict:
    """Build the compiled tiny model (2 blocks) on FSDP2 over 2 ranks, train two steps, then count the compiled
    regions one step enters (the profiler names each entry "Torch-Compiled Region: ...")."""
    import torch._dynamo.utils as dynamo_utils
    from torch.profiler import profile

    import test_parallel_layouts as layouts

    parallel = {"dp_replicate": 1, "dp_shard": 2, "fsdp_unit_blocks": unit_blocks}
    _, engine = layouts.build(layouts.model_config(tied=True), parallel, grad_accum=1, train={"compile": "true"})
    batch = layouts.rank_share(0, engine.dp_rank, engine.dp_size)
    for _ in range(2):
        engine.forward_backward([batch])
    with profile() as prof:
        engine.forward_backward([batch])
    regions = [e.name for e in prof.events() if e.name.startswith("Torch-Compiled Region")]
    return {"regions": len(regions), "breaks": sum(dynamo_utils.counters["graph_break"].values())}


def _compiled_regions_by_unit(rank: int, world_size: int) -> dict:
    """_compiled_regions with the whole model one unit (-1), then one unit per block (1), on the same 2 ranks
    (starting them took a fifth of the test); each from a reset dynamo, counting its own graph breaks."""
    import torch._dynamo.utils as dynamo_utils

    out = {}
    for unit_blocks in (-1, 1):
        torch._dynamo.reset()
        dynamo_utils.counters.clear()
        out[unit_blocks] = _compiled_regions(rank, world_size, unit_blocks)
    return out


@pytest.mark.slow
def test_whole_model_unit_enters_one_compiled_region_for_the_model():
    """-1 compiles the model's forward as one graph: a step enters it once, and the compiled loss once, where
    compiling block by block (one unit per block) enters one region per block and the loss's; no graph break.
    That it trains like one process is tests/test_parallel_layouts.py::fsdp2_whole_compiled."""
    from dist_utils import run_distributed

    by_unit = run_distributed(_compiled_regions_by_unit, 2, timeout=600, threads=1)
    whole, per_block = [r[-1] for r in by_unit], [r[1] for r in by_unit]
    assert [r["regions"] for r in whole] == [2, 2], whole
    assert [r["regions"] for r in per_block] == [3, 3], per_block  # 2 blocks and the loss
    assert [r["breaks"] for r in whole + per_block] == [0] * 4


def test_auto_units_put_a_small_models_blocks_in_one_unit_on_gpus_only():
    from meshrun.parallel.apply import unit_blocks
    from meshrun.parallel.data_parallel import FSDP_ONE_UNIT_PARAMS

    small = Blocks(5)
    blocks = list(small.layers.values())
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")  # only the device's type is read
    assert unit_blocks(0, small, blocks, device=gpu) == 5  # one unit: 376.8k against 226.4k tokens/s on 2x H100
    assert unit_blocks(0, small, blocks, device=cpu) == 1 and unit_blocks(0, small, blocks, device=None) == 1
    assert unit_blocks(2, small, blocks, device=gpu) == 2  # a number given is kept
    with torch.device("meta"):
        large = nn.Linear(FSDP_ONE_UNIT_PARAMS // 1000, 1000)  # as big as the threshold, on the meta device
    assert unit_blocks(0, large, [large], device=gpu) == 1


def test_auto_units_of_a_large_model_hold_enough_parameters_to_hide_the_hosts_work_per_unit():
    """1b's 18 blocks of 51M parameters: 3 a unit (the host took longer to issue one-block units' forward than the
    GPU took to run it); blocks of the threshold's size or more: one each; on CPU one each, and a number given wins."""
    from meshrun.parallel.apply import unit_blocks
    from meshrun.parallel.data_parallel import FSDP_ONE_UNIT_PARAMS, FSDP_UNIT_PARAMS

    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    with torch.device("meta"):
        blocks = [nn.Linear(51_000, 1000) for _ in range(18)]  # 51M each: 918M in all
        big = [nn.Linear(FSDP_UNIT_PARAMS // 1000, 1000) for _ in range(4)]
    model, large = nn.ModuleList(blocks), nn.ModuleList(big)
    assert sum(p.numel() for p in model.parameters()) >= FSDP_ONE_UNIT_PARAMS
    assert unit_blocks(0, model, blocks, device=gpu) == 3
    assert unit_blocks(0, model, blocks, device=cpu) == 1 and unit_blocks(2, model, blocks, device=gpu) == 2
    assert unit_blocks(0, large, big, device=gpu) == 1


def test_auto_makes_a_small_models_whole_model_one_unit_where_the_step_runs_as_cuda_graphs():
    """parallel.fsdp_unit_blocks=0 resolves to the whole model (-1) for FSDP2 alone, compiled on a GPU, below the
    size threshold, with CUDA graphs left on; block by block anywhere else (and -1 or a number given is kept)."""
    from meshrun.comm.mesh import ParallelDims
    from meshrun.parallel.checks import whole_model_unit
    from meshrun.parallel.data_parallel import FSDP_ONE_UNIT_PARAMS

    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")

    def whole(*args, params=124_000_000, device=gpu, compiled=True, world_size=2, **degrees):
        job = load_config(None, ["--parallel.dp_replicate=1", *args,
                                 *(f"--parallel.{name}={degree}" for name, degree in degrees.items())])
        dims = ParallelDims.from_config(job.parallel, world_size=world_size, gpus_per_node=world_size)
        return whole_model_unit(job, dims, params=params, device=device, compiled=compiled)

    assert whole(dp_shard=2)  # the 124m model on 2 GPUs: 361k tokens/s block by block, 495k as one graph
    assert not whole(dp_shard=2, device=cpu) and not whole(dp_shard=2, compiled=False)
    assert not whole(dp_shard=2, params=FSDP_ONE_UNIT_PARAMS)  # the 1b model keeps its per-block units
    assert not whole("--train.cuda_graphs=false", dp_shard=2)  # launched kernels: block by block overlaps more
    for untested in ("--train.float8=true", "--train.loss=chunked"):  # not yet run as graphs on a GPU
        assert not whole(untested, dp_shard=2), untested
    assert not whole(dp_shard=2, tp=2, world_size=4) and not whole(dp_shard=2, pp=2, world_size=4)
    assert not whole(dp_replicate=2)  # DDP: no FSDP2 unit at all
    assert whole("--parallel.fsdp_unit_blocks=-1", dp_shard=2, device=cpu, compiled=False)  # asked for
    assert not whole("--parallel.fsdp_unit_blocks=2", dp_shard=2)


def _gathered_addresses(rank: int, world_size: int, pooled: bool) -> list[list[int]]:
    """Where each parameter of a whole-model FSDP2 unit sits when its forward runs, step by step, with tensors of
    other sizes allocated and freed between the steps as a training step's activations are."""
    from datetime import timedelta

    from torch.distributed.fsdp import fully_shard

    from meshrun.parallel.data_parallel import gather_in_pool

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", timeout=timedelta(seconds=120), device_id=torch.device("cuda", rank))
    try:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(256 + 64 * i, 256 + 64 * (i + 1)) for i in range(4)]).cuda()
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if pooled:
            gather_in_pool(model)
        seen: list[list[int]] = []  # registered after FSDP2's hook: it runs once the parameters are gathered
        model.register_forward_pre_hook(lambda m, args: seen.append([p.data_ptr() for p in m.parameters()]))
        held = []
        for step in range(6):
            held.append(torch.empty(1_000_000 * (step % 3 + 1), device="cuda"))  # the shared cache's other users
            if step % 2:
                held.pop(0)
            model(torch.randn(8, 256, device="cuda")).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        torch.cuda.synchronize()
        return seen
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_whole_model_gathers_its_parameters_at_the_same_addresses_every_step():
    """gather_in_pool (the whole model one FSDP2 unit, as CUDA graphs): FSDP2 frees the gathered parameters after each
    backward; gathered again in a pool of their own they come back at the same addresses every step, so inductor's
    CUDA graphs, which take them as fixed addresses, need not record again."""
    from dist_utils import run_distributed

    for seen in run_distributed(_gathered_addresses, 2, True, init_pg=False, timeout=200):
        assert all(step == seen[0] for step in seen), seen
        assert all(ptr for ptr in seen[0])  # gathered: FSDP2 frees a resharded parameter's storage (address 0)


def _gathers_per_forward(rank: int, world_size: int) -> dict:
    """gather_in_pool on 2 gloo ranks, the CUDA pool replaced by a profiler range (CPU has no CUDA pool): FSDP2's
    all-gathers of each forward, how many ran inside that range, and the losses against the same model without the
    hook."""
    import contextlib

    from torch.distributed.fsdp import fully_shard
    from torch.profiler import profile, record_function

    from meshrun.parallel import data_parallel

    @contextlib.contextmanager
    def marked_pool(pool):
        with record_function("test::pool"):
            yield

    out = {}
    for hooked in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        fully_shard(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        if hooked:
            torch.cuda.MemPool, torch.cuda.use_mem_pool = object, marked_pool  # in this spawned process only
            data_parallel.gather_in_pool(model)
        losses, gathers, pooled = [], [], []
        for step in range(3):
            with profile() as prof:
                loss = model(torch.full((4, 8), 0.1 * (step + rank + 1))).square().mean()
            pools = [e.time_range for e in prof.events() if e.name == "test::pool"]
            ranges = [e.time_range for e in prof.events() if e.name == "FSDP::all_gather"]  # the root's
            gathers.append(len(ranges))
            pooled.append(sum(any(p.start <= r.start and r.end <= p.end for p in pools) for r in ranges))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        out[hooked] = {"losses": losses, "gathers": gathers, "pooled": pooled}
    return out


@pytest.mark.slow
def test_the_pooled_gather_runs_before_fsdp2s_own_and_replaces_it():
    """The pooled gather is a forward pre-hook ahead of FSDP2's: each forward all-gathers once, inside the pool, and
    trains exactly as FSDP2's own gather does (the same losses); a hook that ran after FSDP2's would find the
    parameters gathered outside the pool."""
    from dist_utils import run_distributed

    for result in run_distributed(_gathers_per_forward, 2, timeout=200):
        assert result[True]["gathers"] == [1, 1, 1] == result[False]["gathers"], result
        assert result[True]["pooled"] == [1, 1, 1] and result[False]["pooled"] == [0, 0, 0], result
        assert result[True]["losses"] == result[False]["losses"]


class Chain(Blocks):
    def forward(self, x):
        x = self.embed(x)
        for block in self.layers.values():
            x = block(x)
        return x


@pytest.mark.parametrize("depth, ahead", [(0, []), (1, [1]), (2, [1, 2])])
def test_each_unit_gathers_the_next_units_before_it_runs(depth, ahead, fake_mesh):
    """parallel.fsdp_prefetch: while a block runs (a forward pre-hook that runs after FSDP2's own), the all-gathers
    of the next ``depth`` units are already issued (pending), and not those of the units after them; with 0 none is,
    FSDP2 gathering each unit only when the host reaches it. (The losses with prefetching match one process's in
    tests/test_parallel_layouts.py, fsdp2_units2.)"""
    model = Chain(4)
    blocks = list(model.layers.values())
    apply_fsdp(model, fake_mesh, compute_dtype=None, reshard_after_forward=True, blocks=blocks, unit_blocks=1,
               prefetch=depth)
    seen: dict[int, list[int]] = {}

    def pending(i):
        def hook(module, args):
            seen[i] = [j - i for j in range(i + 1, len(blocks))
                       if blocks[j]._get_fsdp_state()._fsdp_param_group._all_gather_result is not None]
        return hook

    for i, block in enumerate(blocks):
        block.register_forward_pre_hook(pending(i))
    model(torch.randn(2, 4)).sum().backward()
    assert seen == {i: [a for a in ahead if i + a < len(blocks)] for i in range(len(blocks))}


def test_negative_prefetch_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"parallel.fsdp_prefetch must be >= 0 \(FSDP2 units each unit gathers "
                                          r"ahead; 0: FSDP2's own order\), got -1"):
        load_config(None, ["--parallel.fsdp_prefetch=-1"])


@pytest.mark.parametrize(("unit_blocks", "line"), [
    (1, "FSDP2: the root and 5 units of 1 block"),
    (2, "FSDP2: the root and 3 units of 1-2 blocks"),
    (5, "FSDP2: the root and 1 unit of 5 blocks"),
    (-1, "FSDP2: the whole model one unit"),
])
def test_the_start_up_line_says_how_fsdp2_grouped_the_blocks(unit_blocks, line, fake_mesh):
    """What parallel.fsdp_unit_blocks (0: auto, chosen by size) made of the model, as the speed line shows it."""
    from meshrun.parallel.data_parallel import describe_units
    from meshrun.parallel.kernels import describe_speed

    model = Blocks(5)
    assert describe_units([model]) == ""
    apply_fsdp(model, fake_mesh, compute_dtype=None, reshard_after_forward=True,
               blocks=list(model.layers.values()), unit_blocks=unit_blocks)
    assert describe_units([model]) == line
    speed = describe_speed(load_config(None, ["--model.name=tiny"]), torch.device("cpu"), None, fsdp=True,
                           fsdp_units=line)
    assert speed.endswith(f" | {line}"), speed


def test_the_start_up_line_counts_each_pipeline_stages_root(fake_mesh):
    """Two stages on one rank (an interleaved pipeline with FSDP2), each its own root over units of 2 blocks."""
    from meshrun.parallel.data_parallel import describe_units

    stages = [Blocks(4), Blocks(4)]
    for stage in stages:
        apply_fsdp(stage, fake_mesh, compute_dtype=None, reshard_after_forward=True,
                   blocks=list(stage.layers.values()), unit_blocks=2)
    assert describe_units(stages) == "FSDP2: 2 stage roots and 4 units of 2 blocks"


class Stack(nn.Module):
    """Six blocks after an input layer, each a linear layer and a GELU."""

    def __init__(self, n: int = 6):
        from fsdp_steps import WIDTH

        super().__init__()
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(n))

    def forward(self, x):
        x = self.embed(x)
        for block in self.layers:
            x = block(x)
        return x


def _losses_by_unit_size(rank: int, world_size: int) -> dict[int, list[float]]:
    """5 bf16 steps of the same 6-block model on NCCL with FSDP2 units of 1 and of 3 blocks (what
    parallel.fsdp_unit_blocks=0 makes for the 1b model), from the same start."""
    from fsdp_steps import nccl_fsdp_losses

    return nccl_fsdp_losses(rank, world_size, {1: {"unit_blocks": 1}, 3: {"unit_blocks": 3}}, make_model=Stack)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_units_of_three_blocks_train_like_units_of_one_on_two_gpus():
    """Grouping blocks into larger FSDP2 units changes only how many collectives carry the same bytes: each
    all-gather is a copy and each reduce-scatter sums the same two ranks' values, so the losses agree to 1e-6."""
    from dist_utils import run_distributed

    for losses in run_distributed(_losses_by_unit_size, 2, init_pg=False, timeout=300):
        assert losses[3] == pytest.approx(losses[1], rel=1e-6), losses
