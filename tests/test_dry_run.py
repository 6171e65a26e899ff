"""``meshrun train --dry-run`` refuses what a real start and ``meshrun plan`` refuse, with their message: all three go
through parallel.checks.resolve_layout. No process group, no model: each case takes well under a second."""

from __future__ import annotations

import pytest

from meshrun.config import ConfigError, load_config
from meshrun.env import ProcessPlacement
from meshrun.parallel.dryrun import dry_run
from meshrun.planner import main as plan_main
from meshrun.train.cli import main as train_main
from meshrun.train.plan import RunPlan, validated

MODEL = ("--model.name=tiny", "--model.n_layers=4")  # 4 blocks: PP 2 x 2 virtual stages has one each

REFUSED = {
    "fsdp whole unit with TP": ("--parallel.tp=2", "--parallel.dp_shard=2", "--parallel.fsdp_unit_blocks=-1"),
    "weight copies with TP": ("--train.weight_copies=true", "--parallel.tp=2"),
    "cast once with FSDP2": ("--parallel.pp=2", "--parallel.pp_cast_once=true", "--parallel.dp_shard=2"),
    "graphs of an interleaved schedule": ("--parallel.pp=2", "--parallel.pp_schedule=interleaved1f1b",
                                          "--train.cuda_graphs=true"),
    "cp in fp32": ("--parallel.cp=2", "--train.dtype=fp32"),
    "cp with math attention": ("--parallel.cp=2", "--train.attention=math"),
    "symmetric memory under DDP": ("--parallel.fsdp_symm_mem=true",),
    "chunked loss with TP": ("--train.loss=chunked", "--parallel.tp=2"),
}
"""Layouts of 4 ranks that the dry run passed before it ran the start's checks (a user walkthrough)."""

DEVICE_FREE = ("fsdp whole unit with TP", "weight copies with TP", "graphs of an interleaved schedule",
               "symmetric memory under DDP", "chunked loss with TP")
"""The cases whose refusal reads no device: a CPU run here refuses them alike."""


def refusal(capsys, code: int, prefix: str) -> str:
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith(prefix), err
    return err.removeprefix(prefix)


@pytest.mark.parametrize("case", REFUSED)
def test_the_dry_run_refuses_what_meshrun_plan_refuses(capsys, case):
    """The dry run checks for GPUs (as meshrun plan does) by default: the same message, under meshrun train's
    prefix."""
    options = [*MODEL, *REFUSED[case]]
    dry = refusal(capsys, train_main([*options, "--dry-run", "--world-size", "4", "--gpus-per-node", "4"]),
                  "meshrun train: error: ")
    planned = refusal(capsys, plan_main([*options, "--nodes", "1", "--gpus-per-node", "4"]), "meshrun plan: error: ")
    assert dry == planned


@pytest.mark.parametrize("case", DEVICE_FREE)
def test_the_dry_run_of_a_cpu_job_refuses_what_its_start_refuses(capsys, tmp_path, case):
    """--dist.device=cpu: the dry run checks CPU processes, as the real start on this machine resolves its plan
    (RunPlan.resolve, before any process group) for 4 ranks."""
    options = [*MODEL, *REFUSED[case], "--dist.device=cpu", f"--run.dir={tmp_path}"]
    dry = refusal(capsys, train_main([*options, "--dry-run", "--world-size", "4"]), "meshrun train: error: ")
    four_ranks = ProcessPlacement(rank=0, local_rank=0, world_size=4, local_world_size=4, node_rank=0, num_nodes=1,
                                  master_addr="127.0.0.1", master_port=0, source="torchrun")
    with pytest.raises(ConfigError) as start:
        RunPlan.resolve(validated(load_config(None, options)), env=four_ranks, vocab_size=256)
    assert dry == str(start.value)


def test_the_dry_run_says_which_device_it_checked_for(capsys):
    job = load_config(None, [*MODEL, "--parallel.dp_shard=2"])
    assert dry_run(job, world_size=2, gpus_per_node=2) == 0
    assert "checked for CUDA GPUs of a recent generation, 2 per node" in capsys.readouterr().out
    assert dry_run(job, world_size=2, gpus_per_node=0) == 0
    assert "checked for CPU processes" in capsys.readouterr().out
    cp = load_config(None, [*MODEL, "--parallel.cp=2"])
    assert dry_run(cp, world_size=2, gpus_per_node=2) == 0  # context parallelism runs on GPUs ...
    assert dry_run(cp, world_size=2, gpus_per_node=0) == 2  # ... and not on CPU
    assert "parallel.cp=2 needs CUDA GPUs" in capsys.readouterr().err
    cuda = load_config(None, [*MODEL, "--dist.device=cuda"])
    assert dry_run(cuda, world_size=2, gpus_per_node=0) == 2
    assert "--gpus-per-node 0 describes nodes without GPUs" in capsys.readouterr().err


@pytest.mark.parametrize("option", ["--world-size", "--gpus-per-node"])
def test_dry_run_options_without_dry_run_are_refused(capsys, tmp_path, option):
    """Without --dry-run they would be ignored, and a real one-process run would start."""
    code = train_main([*MODEL, f"--run.dir={tmp_path}", option, "4"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"meshrun train: error: {option} 4 ") and "add --dry-run" in err
    assert not any(tmp_path.iterdir())  # nothing started


def test_the_dry_run_and_the_planner_check_the_targets_gpus_not_this_hosts(monkeypatch, capsys):
    """On a host with an older GPU (a login node's T4, compute capability 7.5, here faked), a real start there would
    turn bf16 off and refuse float8; the dry run and `meshrun plan` check the target's GPUs, taken as a recent
    generation as on a machine without GPUs. Outside them this host's GPU is asked."""
    import torch

    from meshrun.parallel import kernels
    from meshrun.parallel.float8 import check_float8

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    cuda = torch.device("cuda")
    assert kernels.cuda_capability(cuda) == (7, 5) and not kernels.bf16_by_default(cuda)
    with pytest.raises(ConfigError, match=r"^train.float8=true needs an NVIDIA GPU with float8 matmuls"):
        check_float8(cuda, tp=1)
    with kernels.gpus_elsewhere():
        assert kernels.cuda_capability(cuda) is None and kernels.bf16_by_default(cuda)
        assert kernels.resolve_attention("auto", cuda) == "cudnn"
    assert kernels.cuda_capability(cuda) == (7, 5)  # the block restores it
    seen = []
    real = kernels.cuda_capability
    monkeypatch.setattr(kernels, "cuda_capability", lambda device: seen.append(real(device)) or real(device))
    assert dry_run(load_config(None, [*MODEL, "--parallel.dp_shard=2"]), world_size=2, gpus_per_node=2) == 0
    assert plan_main(["--model", "tiny", "--nodes", "1", "--gpus-per-node", "2"]) == 0
    capsys.readouterr()
    assert seen and set(seen) == {None}, "asked this host's GPU inside the dry run or the planner"
