"""Config refusals of `meshrun train` on several ranks: one that every rank of a node meets alike is said once per
node, by its local rank 0; one that only some ranks meet (or that differs) is said by each, with its rank."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshrun.comm.process_group import choose_device
from meshrun.config import ConfigError, JobConfig, load_config
from meshrun.env import ProcessPlacement
from meshrun.train import cli, plan
from meshrun.train.plan import refused_alike_on_node, resolve_on_node, validated

REFUSAL = "train.global_batch=3 is not divisible by train.micro_batch=8 x 2 data-parallel ranks = 16"


def _rank(rank: int) -> ProcessPlacement:
    """Rank ``rank`` of one node of 2 ranks."""
    return ProcessPlacement(rank=rank, local_rank=rank, world_size=2, local_world_size=2, node_rank=0, num_nodes=1,
                            master_addr="127.0.0.1", master_port=29500, source="torchrun")


def _refusal(job: JobConfig, env: ProcessPlacement) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        resolve_on_node(validated(job), env=env, vocab_size=256)
    return caught.value


def test_a_refusal_that_reads_no_rank_is_the_node_leaders_to_say():
    job = load_config(None, ["--train.global_batch=3", "--dist.device=cpu"])  # on CPU: no rank is refused a GPU
    refusal = _refusal(job, _rank(1))
    assert str(refusal).startswith(REFUSAL) and refusal.same_on_node
    with pytest.raises(ConfigError) as caught, refused_alike_on_node():  # the options alone: validation
        validated(load_config(None, ["--train.lr=-1"]))
    assert caught.value.same_on_node
    assert not ConfigError("raised elsewhere").same_on_node, "each rank says its own unless known otherwise"


def test_a_refusal_of_this_ranks_gpu_alone_stays_this_ranks(monkeypatch):
    """A node with one GPU and 2 ranks: local rank 1 has no GPU, local rank 0 has one; rank 1 says its refusal."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    refusal = _refusal(load_config(None, ["--dist.device=cuda", "--train.compile=false"]), _rank(1))
    assert str(refusal).startswith("rank 1: local rank 1 needs GPU 1 but this node has 1")
    assert not refusal.same_on_node


def _cyclic(rank: int) -> ProcessPlacement:
    """Rank ``rank`` of 4 on 2 nodes of 2, as srun's cyclic distribution places them: ranks 0 and 2 on node 0, ranks
    1 and 3 on node 1 (rank 2 is local rank 1 of node 0, whose local rank 0 is rank 0, not rank 2 - 1)."""
    return ProcessPlacement(rank=rank, local_rank=rank // 2, world_size=4, local_world_size=2, node_rank=rank % 2,
                            num_nodes=2, master_addr="127.0.0.1", master_port=29500, source="slurm")


def _one_gpu_per_node(monkeypatch, selected: list) -> None:
    """CUDA as a node with one GPU shows it, without touching a GPU; the GPUs selected are kept in ``selected``."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", selected.append)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))


def test_ranks_that_do_not_fill_the_nodes_in_order_are_judged_by_their_nodes_leader(monkeypatch):
    """Under srun's cyclic distribution a rank's node leader is not rank - local rank: the refusal every rank meets
    is still the leader's to say, and one of a rank's own GPU still its own. The plan is resolved only as placements
    that exist: the leader's needs no global rank."""
    placements = {(env.rank, env.local_rank, env.node_rank) for env in map(_cyclic, range(4))}
    resolved = []

    def recording(env, cfg):
        resolved.append((env.rank, env.local_rank, env.node_rank))
        return choose_device(env, cfg)

    monkeypatch.setattr(plan, "choose_device", recording)
    shared = load_config(None, ["--train.global_batch=3", "--dist.device=cpu"])
    for rank in (2, 3):  # local rank 1 of node 0, and of node 1
        refusal = _refusal(shared, _cyclic(rank))
        assert str(refusal).startswith("train.global_batch=3 is not divisible") and refusal.same_on_node
    selected = []
    _one_gpu_per_node(monkeypatch, selected)
    own = _refusal(load_config(None, ["--dist.device=cuda", "--train.compile=false"]), _cyclic(2))
    assert str(own).startswith("rank 2: local rank 1 needs GPU 1 but this node has 1") and not own.same_on_node
    assert set(resolved) <= placements, f"resolved as {sorted(set(resolved) - placements)}, which no rank is"
    assert selected == []


def test_the_node_leaders_plan_is_judged_without_selecting_a_gpu(monkeypatch):
    """Local rank 1 on a node of 2 GPUs meets a refusal that local rank 0 meets too. Finding that out selects no GPU:
    selecting GPU 0 would make a CUDA context there (hundreds of MB) in a rank about to exit. Its own plan selected
    its own GPU, 1, as a start does."""
    selected = []
    _one_gpu_per_node(monkeypatch, selected)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    refusal = _refusal(load_config(None, ["--train.global_batch=3", "--dist.device=cuda", "--train.compile=false"]),
                       _rank(1))
    assert str(refusal).startswith(REFUSAL) and refusal.same_on_node
    assert selected == [1]


def _run_as(rank: int, monkeypatch, tmp_path: Path, *overrides: str) -> int:
    for name, value in {**_rank(rank).export(), "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(cli, "NODE_LEADER_GRACE_S", 0.0)
    job = load_config(None, [f"--run.dir={tmp_path / 'run'}", f"--data.source={pytest.__file__}", "--dist.device=cpu",
                             *overrides])
    return cli.run(job)


def test_local_rank_1_leaves_a_shared_refusal_to_local_rank_0(monkeypatch, tmp_path, capsys):
    assert _run_as(1, monkeypatch, tmp_path, "--train.global_batch=3") == 2
    assert capsys.readouterr().err == ""
    assert _run_as(0, monkeypatch, tmp_path, "--train.global_batch=3") == 2
    assert capsys.readouterr().err.startswith(f"meshrun train: error: {REFUSAL}")
    assert not (tmp_path / "run").exists()


def _second_node(monkeypatch, local_rank: int) -> None:
    """The environment of local rank ``local_rank`` on the second of 2 nodes of 2 ranks, as torch's agent sets it."""
    placement = ProcessPlacement(rank=2 + local_rank, local_rank=local_rank, world_size=4, local_world_size=2,
                                 node_rank=1, num_nodes=2, master_addr="127.0.0.1", master_port=29500,
                                 source="torchrun")
    for name, value in placement.export().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(cli, "NODE_LEADER_GRACE_S", 0.0)


def test_the_second_nodes_leader_says_a_shared_refusal_without_a_rank_of_its_own(monkeypatch, tmp_path, capsys):
    _second_node(monkeypatch, 0)
    job = load_config(None, [f"--run.dir={tmp_path / 'run'}", f"--data.source={pytest.__file__}", "--dist.device=cpu",
                             "--train.global_batch=3"])
    assert cli.run(job) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshrun train: error: train.global_batch=3 is not divisible") and "rank 2:" not in err


def test_a_command_line_refusal_is_said_by_each_nodes_leader_under_a_launcher(monkeypatch, capsys):
    _second_node(monkeypatch, 0)
    assert cli.main(["--train.lr=-1"]) == 2
    assert capsys.readouterr().err.startswith("meshrun train: error: train.lr")
    _second_node(monkeypatch, 1)
    assert cli.main(["--train.lr=-1"]) == 2
    assert capsys.readouterr().err == ""  # the node's local rank 0 says it on this node's console


def _launch(tmp_path: Path, target: list[str], *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "meshrun", "launch", "--nproc-per-node", "2", *target, "--model.name=tiny",
           "--train.steps=2", "--dist.device=cpu", f"--data.source={pytest.__file__}", f"--run.dir={tmp_path / 'run'}",
           *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


ONE_GPU_WORKER = '''\
"""`meshrun train` as on a node with one GPU: local rank 1 is refused its GPU (the same refusal as choose_device's),
local rank 0 goes on (to wait at init for rank 1, until the launcher stops it)."""
import sys

from meshrun.config import ConfigError
from meshrun.train import plan
from meshrun.train.cli import main

choose_device = plan.choose_device


def one_gpu(env, cfg):
    if env.local_rank >= 1:
        raise ConfigError(f"rank {env.rank}: local rank {env.local_rank} needs GPU {env.local_rank} but this node "
                          "has 1; use --nproc-per-node 1 or fewer")
    return choose_device(env, cfg)


plan.choose_device = one_gpu
sys.exit(main(sys.argv[1:]))
'''


@pytest.mark.slow
def test_two_ranks_say_a_shared_refusal_once_and_a_rank_s_own_with_its_rank(tmp_path):
    """`meshrun launch --nproc-per-node 2 train` with a global batch that does not split: the refusal once (rank 0's),
    no 'rank 1:' copy, exit code 2 from the launcher naming rank 0. A refusal only local rank 1 meets is still
    said, naming rank 1."""
    shared = _launch(tmp_path, ["train"], "--train.global_batch=3")
    assert shared.returncode == 2, shared.stderr[-3000:]
    assert shared.stderr.count(REFUSAL) == 1, shared.stderr[-3000:]
    assert f"meshrun train: error: {REFUSAL}" in shared.stderr and "rank 1:" not in shared.stderr
    assert "meshrun launch: worker rank 0 (local rank 0" in shared.stderr, shared.stderr[-3000:]
    worker = tmp_path / "one_gpu_worker.py"
    worker.write_text(ONE_GPU_WORKER)
    own = _launch(tmp_path, [str(worker)])
    assert own.returncode == 2, own.stderr[-3000:]
    said = [line for line in own.stderr.splitlines() if line.startswith("meshrun train: error:")]
    assert said == ["meshrun train: error: rank 1: local rank 1 needs GPU 1 but this node has 1; use "
                    "--nproc-per-node 1 or fewer"], own.stderr[-3000:]  # its rank named once


def test_print_config_under_a_launcher_is_printed_by_each_nodes_first_rank(monkeypatch, capsys):
    _second_node(monkeypatch, 1)
    assert cli.main(["--print-config"]) == 0
    assert capsys.readouterr().out == ""
    _second_node(monkeypatch, 0)
    assert cli.main(["--print-config"]) == 0
    assert "[model]" in capsys.readouterr().out
