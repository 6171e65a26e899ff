"""Process-layout detection from torchrun and SLURM variables (pure logic)."""

import pytest

from meshrun.env import ClusterEnv, expand_nodelist


def test_torchrun_variables():
    env = ClusterEnv.detect({"RANK": "9", "LOCAL_RANK": "1", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8",
                             "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29501"})
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (9, 1, 16, 8)
    assert (env.node_rank, env.num_nodes, env.master_addr, env.master_port) == (1, 2, "10.0.0.5", 29501)
    assert env.source == "torchrun" and env.is_distributed and not env.is_rank_zero


def test_slurm_variables_with_compressed_nodelist():
    env = ClusterEnv.detect({"SLURM_PROCID": "13", "SLURM_LOCALID": "5", "SLURM_NTASKS": "32",
                             "SLURM_NNODES": "4", "SLURM_NODEID": "1", "SLURM_TASKS_PER_NODE": "8(x4)",
                             "SLURM_JOB_NODELIST": "gpu[07-08,11],gpu20", "SLURM_JOB_ID": "123456"})
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (13, 5, 32, 8)
    assert (env.node_rank, env.num_nodes, env.master_addr) == (1, 4, "gpu07")
    assert env.master_port == 15000 + 3456 and env.source == "slurm"


def test_torchrun_wins_over_slurm():
    env = ClusterEnv.detect({"RANK": "0", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "4",
                             "SLURM_JOB_NODELIST": "a"})
    assert env.source == "torchrun" and env.world_size == 2


def test_single_process():
    env = ClusterEnv.detect({})
    assert (env.rank, env.world_size, env.source, env.is_distributed) == (0, 1, "single", False)


@pytest.mark.parametrize("nodelist, hosts", [
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("a,b", ["a", "b"]),
    ("rack[1-2]-n[08-09]", ["rack1-n08", "rack1-n09", "rack2-n08", "rack2-n09"]),
    ("gpu[9-11]", ["gpu9", "gpu10", "gpu11"]),
    ("single", ["single"]),
])
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


def test_bad_layouts_name_the_variable():
    with pytest.raises(ValueError, match="rank 4 is outside world size 4"):
        ClusterEnv.detect({"RANK": "4", "WORLD_SIZE": "4"})
    with pytest.raises(ValueError, match="WORLD_SIZE='x' is not an integer"):
        ClusterEnv.detect({"RANK": "0", "WORLD_SIZE": "x"})
    with pytest.raises(ValueError, match="unmatched"):
        expand_nodelist("node[01-02")
