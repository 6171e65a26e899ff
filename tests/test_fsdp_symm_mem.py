"""parallel.fsdp_symm_mem: FSDP2's all-gathers into symmetric-memory buffers, with NCCL's zero-CTA policy so that
within a node the copy engines do them. On CPU: where it is refused and why, the policy set before NCCL starts,
the speed line, and that every FSDP2 unit is switched once (on a fake process group). On 2 GPUs (marked gpu):
training with it is bitwise training without it (an all-gather is a copy, wherever it runs)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from torch import nn

from meshrun.comm.mesh import ParallelDims
from meshrun.config import ConfigError
from meshrun.config_load import load_config
from meshrun.models.gpt import gpt_config
from meshrun.models.spec import get_model_spec
from meshrun.parallel.checks import check_layout, symm_mem_refusal
from meshrun.parallel.comm_overlap import CTA_VAR, ZERO_CTA, set_zero_cta
from meshrun.parallel.kernels import describe_speed


def _job_dims(*overrides: str):
    job = load_config(None, ["--model.name=tiny", "--parallel.fsdp_symm_mem=true", *overrides])
    dims = ParallelDims.from_config(job.parallel, world_size=2, model=gpt_config("tiny", n_layers=4),
                                    spec=get_model_spec("gpt"))
    return job, dims


FSDP = ("--parallel.dp_replicate=1", "--parallel.dp_shard=2")


@pytest.mark.parametrize(("overrides", "device", "nccl", "message"), [
    (("--parallel.dp_replicate=2",), "cuda", (2, 28, 9),
     r"^parallel.fsdp_symm_mem=true gathers FSDP2's parameters through symmetric memory, and .* has no FSDP2 "
     r"\(parallel.dp_shard=1\): shard the parameters \(--parallel.dp_shard=-1\), or drop --parallel.fsdp_symm_mem$"),
    (FSDP, "cpu", None,
     r"^parallel.fsdp_symm_mem=true needs NCCL on CUDA GPUs, and this run is on cpu: drop --parallel.fsdp_symm_mem$"),
    (FSDP, "cuda", (2, 27, 7),
     r"^parallel.fsdp_symm_mem=true needs NCCL 2.28 or newer for copy-engine all-gathers, and torch uses NCCL 2.27.7: "
     r"install a torch built with a newer NCCL, or drop --parallel.fsdp_symm_mem$"),
    (FSDP, "cuda", (2, 28, 9), None),
])
def test_refused_without_fsdp2_on_gpus_and_nccl_2_28(overrides, device, nccl, message):
    _, dims = _job_dims(*overrides)
    refusal = symm_mem_refusal(dims, torch.device(device), nccl=nccl)
    if message is None:
        assert refusal is None
    else:
        assert refusal is not None
        assert re.match(message, refusal), refusal


def test_refused_by_a_torch_with_neither_way(monkeypatch):
    """torch 2.13's own method, or (torch 2.11) FSDP2's custom all-gather with torch's symmetric memory pool: a
    torch with neither is refused; one with either is not."""
    from torch.distributed.fsdp import FSDPModule

    _, dims = _job_dims(*FSDP)
    monkeypatch.delattr(FSDPModule, "set_symm_mem_for_comm")
    assert symm_mem_refusal(dims, torch.device("cuda"), nccl=(2, 28, 9)) is None  # the custom all-gather serves
    monkeypatch.delattr(FSDPModule, "set_custom_all_gather")
    refusal = symm_mem_refusal(dims, torch.device("cuda"), nccl=(2, 28, 9))
    assert refusal == ("parallel.fsdp_symm_mem=true needs FSDP2's symmetric-memory all-gather (torch 2.13's "
                       "FSDPModule.set_symm_mem_for_comm, or a custom all-gather and torch's symmetric memory pool, "
                       f"torch 2.11), which torch {torch.__version__} lacks: install a newer torch, or drop "
                       "--parallel.fsdp_symm_mem")


def test_a_cpu_run_is_refused_before_it_starts():
    """check_layout (which RunPlan runs before the process group exists) raises the refusal as the first line."""
    job, dims = _job_dims(*FSDP)
    with pytest.raises(ConfigError, match=r"^parallel.fsdp_symm_mem=true needs NCCL on CUDA GPUs"):
        check_layout(job, get_model_spec("gpt"), gpt_config("tiny", n_layers=4), dims, device=torch.device("cpu"),
                     compute_dtype=None)


def test_the_zero_cta_policy_is_set_unless_the_user_chose_one():
    environ: dict[str, str] = {}
    assert set_zero_cta(environ) == ZERO_CTA == "2" and environ == {CTA_VAR: "2"}
    environ = {CTA_VAR: "1"}  # the efficiency policy: symmetric kernels instead of the copy engines
    assert set_zero_cta(environ) == "1" and environ == {CTA_VAR: "1"}


def test_the_speed_line_says_where_fsdp2_gathers():
    job, _ = _job_dims(*FSDP)
    line = describe_speed(job, torch.device("cpu"), None, fsdp=True, cta_policy="2")
    assert line.endswith("FSDP2 all-gathers on symmetric memory (NCCL_CTA_POLICY=2: copy engines)"), line
    line = describe_speed(job, torch.device("cpu"), None, fsdp=True, cta_policy="1")
    assert line.endswith("FSDP2 all-gathers on symmetric memory (NCCL_CTA_POLICY=1)"), line
    assert "symmetric" not in describe_speed(load_config(None, []), torch.device("cpu"), None, fsdp=True)


class Chain(nn.Module):
    def __init__(self, n: int, width: int = 4):
        super().__init__()
        self.embed = nn.Linear(width, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(n))

    def forward(self, x):
        x = self.embed(x)
        for block in self.layers:
            x = block(x)
        return x


@pytest.mark.parametrize(("unit_blocks", "states"), [(1, 6), (2, 4), (-1, 1)])
def test_every_fsdp2_unit_is_switched_once(monkeypatch, unit_blocks, states):
    """use_symm_mem calls FSDP2's own switch once per FSDP2 state: 5 blocks in units of 1 are 5 units and the root,
    in units of 2 (a unit of several blocks is one state) 3 and the root, the whole model one unit 1. The switch
    itself is torch's; it needs NCCL, so here it only records where it was called (the GPU test below runs it)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from meshrun.parallel.data_parallel import apply_fsdp

    switched: list[int] = []
    monkeypatch.setattr(FSDPModule, "set_symm_mem_for_comm",
                        lambda self, backend="NCCL": switched.append(id(self._get_fsdp_state())), raising=True)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        model = Chain(5)
        apply_fsdp(model, init_device_mesh("cpu", (2,)), compute_dtype=None, reshard_after_forward=True,
                   blocks=list(model.layers), unit_blocks=unit_blocks, symm_mem=True)
        assert len(switched) == len(set(switched)) == states
        assert id(model._get_fsdp_state()) in switched
    finally:
        dist.destroy_process_group()


def test_an_older_torch_gets_the_custom_all_gather_on_every_unit(monkeypatch):
    """Without set_symm_mem_for_comm (torch 2.11, the GPU machine's), each FSDP2 state gets a SymmMemAllGather
    through FSDP2's set_custom_all_gather, after torch's symmetric memory is set to its NCCL backend once."""
    from torch.distributed import _symmetric_memory as symm_mem
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from meshrun.parallel.data_parallel import SymmMemAllGather, apply_fsdp

    monkeypatch.delattr(FSDPModule, "set_symm_mem_for_comm")
    backends: list[str] = []
    monkeypatch.setattr(symm_mem, "set_backend", backends.append)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        model = Chain(5)
        apply_fsdp(model, init_device_mesh("cpu", (2,)), compute_dtype=None, reshard_after_forward=True,
                   blocks=list(model.layers), unit_blocks=2, symm_mem=True)
        comms = {id(m._get_fsdp_state()): m._get_fsdp_state()._fsdp_param_group._all_gather_comm
                 for m in model.modules() if isinstance(m, FSDPModule)}
        assert len(comms) == 4 and all(isinstance(c, SymmMemAllGather) for c in comms.values()), comms
        assert len({id(c) for c in comms.values()}) == 4  # one each
        assert backends == ["NCCL"]
    finally:
        dist.destroy_process_group()


def _losses(rank: int, world_size: int) -> dict[bool, list[float]]:
    """5 steps of a 6-unit FSDP2 model in bf16 on NCCL with the zero-CTA policy, all-gathering through symmetric
    memory and without, from the same start."""
    import os

    from fsdp_steps import WIDTH, nccl_fsdp_losses

    os.environ[CTA_VAR] = ZERO_CTA
    return nccl_fsdp_losses(rank, world_size, {False: {"symm_mem": False}, True: {"symm_mem": True}},
                            make_model=lambda: Chain(5, width=WIDTH))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_symmetric_memory_gathers_train_bitwise_like_nccls_own():
    from dist_utils import run_distributed

    from meshrun.parallel.checks import symm_mem_refusal as refusal

    dims = ParallelDims.from_config(load_config(None, list(FSDP)).parallel, world_size=2)
    reason = refusal(dims, torch.device("cuda"))
    if reason:
        pytest.skip(reason)
    for result in run_distributed(_losses, 2, init_pg=False, timeout=300):
        assert result[True] == result[False], result
