"""Nodes with different worker counts (8 + 4 + 4 in production; 2 + 1 here): each node's own --nproc-per-node,
joined by torch's c10d rendezvous, forms one world whose size is the sum."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshrun.env import ClusterEnv

WORKER = """
import json, os, sys
import torch
import torch.distributed as dist
from meshrun.env import ClusterEnv
env = ClusterEnv.detect()
dist.init_process_group("gloo")
total = torch.tensor([float(env.rank)])
dist.all_reduce(total)  # every rank must reach this
with open(os.path.join(sys.argv[1], f"rank{env.rank}.json"), "w") as f:
    json.dump({"rank": env.rank, "world": env.world_size, "node": env.node_rank, "local_world": env.local_world_size,
               "sum": total.item(), "describe": env.describe_nodes()}, f)
dist.destroy_process_group()
"""


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_launchers_with_different_nproc_form_one_world_of_their_sum(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).parents[1] / "src"),
                                                                    os.environ.get("PYTHONPATH")])))
    procs = [subprocess.Popen([sys.executable, "-m", "meshrun", "launch", "--nnodes", "2", "--nproc-per-node",
                               str(nproc), "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "uneven",
                               "--rdzv-conf", f"is_host={int(index == 0)}", "--rdzv-timeout", "60", str(script),
                               str(tmp_path)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for index, nproc in enumerate((2, 1))]
    outs = [proc.communicate(timeout=150)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], "\n".join(outs)
    assert "2 node(s), 2 proc(s) on this node (world size: the sum over nodes, 4 if every node runs 2)" in outs[0]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    assert {r["world"] for r in ranks} == {3}
    assert all(r["sum"] == 0 + 1 + 2 for r in ranks)  # the all-reduce over three ranks, computed by hand
    by_node = sorted((r["node"], r["local_world"]) for r in ranks)
    assert sorted(set(by_node)) in ([(0, 2), (1, 1)], [(0, 1), (1, 2)]), by_node  # c10d numbers nodes as they join
    assert all("2 node(s) of different sizes = world size 3" in r["describe"] for r in ranks)


def test_describe_nodes_for_even_and_uneven_nodes():
    def env(world: int, local: int, nodes: int) -> ClusterEnv:
        return ClusterEnv(rank=0, local_rank=0, world_size=world, local_world_size=local, node_rank=0,
                          num_nodes=nodes, master_addr="a", master_port=1, source="slurm")

    assert env(16, 8, 2).describe_nodes() == "2 node(s) x 8 process(es) = world size 16"
    assert not env(16, 8, 2).nodes_differ
    assert env(16, 8, 3).describe_nodes() == "3 node(s) of different sizes = world size 16 (8 process(es) on this node)"
    assert env(16, 4, 3).nodes_differ
