"""Process-layout detection from torchrun and SLURM variables (pure logic)."""

import pytest

from meshrun.config import ConfigError, ParallelConfig
from meshrun.comm.mesh import ParallelDims
from meshrun.env import ProcessPlacement
from meshrun.placement.slurm_lists import expand_nodelist, expand_tasks_per_node


def test_torchrun_variables():
    env = ProcessPlacement.detect({"RANK": "9", "LOCAL_RANK": "1", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8",
                             "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29501"})
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (9, 1, 16, 8)
    assert (env.node_rank, env.num_nodes, env.master_addr, env.master_port) == (1, 2, "10.0.0.5", 29501)
    assert env.source == "torchrun" and env.is_distributed and not env.is_rank_zero


def test_slurm_variables_with_compressed_nodelist():
    env = ProcessPlacement.detect({"SLURM_PROCID": "13", "SLURM_LOCALID": "5", "SLURM_NTASKS": "32",
                             "SLURM_NNODES": "4", "SLURM_NODEID": "1", "SLURM_TASKS_PER_NODE": "8(x4)",
                             "SLURM_JOB_NODELIST": "gpu[07-08,11],gpu20", "SLURM_JOB_ID": "123456", "SLURM_STEP_ID": "0"})
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (13, 5, 32, 8)
    assert (env.node_rank, env.num_nodes, env.master_addr) == (1, 4, "gpu07")
    assert env.master_port == 15000 + 123456 % 16384 and env.source == "slurm"


def test_torchrun_wins_over_slurm():
    env = ProcessPlacement.detect({"RANK": "0", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "4",
                             "SLURM_JOB_NODELIST": "a"})
    assert env.source == "torchrun" and env.world_size == 2


def test_single_process():
    env = ProcessPlacement.detect({})
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
        ProcessPlacement.detect({"RANK": "4", "WORLD_SIZE": "4"})
    with pytest.raises(ValueError, match="WORLD_SIZE='x' is not an integer"):
        ProcessPlacement.detect({"RANK": "0", "WORLD_SIZE": "x"})
    with pytest.raises(ValueError, match="unmatched"):
        expand_nodelist("node[01-02")


# ---- per-node task counts of the step (srun -N2 -n3, uneven nodes) ---------------------------------------------

def slurm_env(node_id: int, proc_id: int, local_id: int, **extra: str) -> dict[str, str]:
    return {"SLURM_PROCID": str(proc_id), "SLURM_LOCALID": str(local_id), "SLURM_NODEID": str(node_id),
            "SLURM_JOB_NODELIST": "n[1-4]", "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", **extra}


@pytest.mark.parametrize("value, counts", [("2(x3),1", [2, 2, 2, 1]), ("3,1", [3, 1]), ("2,1", [2, 1]),
                                           ("8(x4)", [8, 8, 8, 8]), ("", [])])
def test_expand_tasks_per_node(value, counts):
    assert expand_tasks_per_node(value) == counts


@pytest.mark.parametrize("step_counts, node_id, local", [("2(x3),1", 3, 1), ("2(x3),1", 2, 2), ("3,1", 0, 3),
                                                         ("3,1", 1, 1), ("1,3", 1, 3)])
def test_local_world_size_is_this_nodes_count_in_the_step(step_counts, node_id, local):
    counts = expand_tasks_per_node(step_counts)
    rank = sum(counts[:node_id])  # this node's first task
    # the job was allocated with --ntasks-per-node=2 (SLURM_NTASKS_PER_NODE), which the step overrides
    env = ProcessPlacement.detect(slurm_env(node_id, rank, 0, SLURM_NTASKS=str(sum(counts)),
                                      SLURM_NNODES=str(len(counts)), SLURM_NTASKS_PER_NODE="2",
                                      SLURM_TASKS_PER_NODE="2(x4)", SLURM_STEP_TASKS_PER_NODE=step_counts))
    assert (env.node_rank, env.local_world_size, env.world_size) == (node_id, local, sum(counts))


def test_srun_n3_on_2_nodes_no_longer_claims_2_per_node_on_both():
    base = dict(SLURM_NTASKS="3", SLURM_NNODES="2", SLURM_TASKS_PER_NODE="2(x2)", SLURM_STEP_TASKS_PER_NODE="2,1")
    assert ProcessPlacement.detect(slurm_env(0, 1, 1, **base)).local_world_size == 2
    assert ProcessPlacement.detect(slurm_env(1, 2, 0, **base)).local_world_size == 1
    # outside a step (no SLURM_STEP_TASKS_PER_NODE) the job's list is indexed by node, not its first entry
    job = dict(SLURM_NTASKS="4", SLURM_NNODES="2", SLURM_TASKS_PER_NODE="3,1")
    assert ProcessPlacement.detect(slurm_env(1, 3, 0, **job)).local_world_size == 1


def test_step_counts_that_contradict_ntasks_are_refused():
    with pytest.raises(ValueError, match=r"SLURM_STEP_TASKS_PER_NODE='2,2' places 4 tasks on 2 nodes, but "
                                         r"SLURM_NTASKS=3"):
        ProcessPlacement.detect(slurm_env(0, 0, 0, SLURM_NTASKS="3", SLURM_NNODES="2", SLURM_STEP_TASKS_PER_NODE="2,2"))


def test_tp_across_the_network_is_refused_with_one_task_per_node_in_the_step():
    # sbatch --nodes=2 --ntasks-per-node=2; srun -n 2 (one task on each node); --parallel.tp=2 --parallel.dp_replicate=1
    env = ProcessPlacement.detect(slurm_env(1, 1, 0, SLURM_NTASKS="2", SLURM_NNODES="2", SLURM_NTASKS_PER_NODE="2",
                                      SLURM_TASKS_PER_NODE="2(x2)", SLURM_STEP_TASKS_PER_NODE="1(x2)"))
    assert env.local_world_size == 1
    with pytest.raises(ConfigError, match="parallel.tp=2 is larger than the 1 GPUs of one node"):
        ParallelDims.from_config(ParallelConfig(tp=2, dp_replicate=1), world_size=env.world_size,
                                 gpus_per_node=env.local_world_size)


# ---- a master host that resolves to loopback (Debian's '127.0.1.1 <hostname>') ----------------------------------

def two_node_env(**extra: str) -> ProcessPlacement:
    return ProcessPlacement.detect(slurm_env(0, 0, 0, SLURM_NTASKS="2", SLURM_NNODES="2", SLURM_JOB_NODELIST="node[01-02]",
                                       SLURM_STEP_TASKS_PER_NODE="1(x2)", **extra))


def test_master_host_resolving_to_loopback_is_refused_with_what_resolved_to_what():
    env = two_node_env()
    with pytest.raises(ValueError, match=r"'node01' \(first host of the job's nodelist\) resolves to 127\.0\.1\.1 on "
                                         r".* \(node 0\), a loopback address.*set MASTER_ADDR"):
        env.check_master_address({}, resolve={"node01": "127.0.1.1"}.__getitem__)


def test_master_host_check_passes_routable_addresses_user_choices_and_single_nodes(monkeypatch):
    env = two_node_env()
    env.check_master_address({}, resolve={"node01": "10.1.2.3"}.__getitem__)
    env.check_master_address({"MASTER_ADDR": "node01"}, resolve=lambda host: "127.0.1.1")  # the user's choice

    def unknown(host: str) -> str:
        raise OSError(f"cannot resolve {host}")

    env.check_master_address({}, resolve=unknown)  # left to init, which names the address
    one_node = ProcessPlacement.detect(slurm_env(0, 0, 0, SLURM_NTASKS="2", SLURM_NNODES="1", SLURM_JOB_NODELIST="node01"))
    one_node.check_master_address({}, resolve=lambda host: "127.0.1.1")
    # the default resolver is the module's: a monkeypatched one is what init_distributed's call would use
    monkeypatch.setattr("meshrun.placement.process.resolve_ipv4_first", lambda host: "127.0.1.1")
    with pytest.raises(ValueError, match="resolves to 127.0.1.1"):
        env.check_master_address({})


def test_direct_slurm_init_refuses_a_loopback_master_before_joining(monkeypatch):
    from meshrun.config import DistConfig
    from meshrun.comm.process_group import init_distributed

    monkeypatch.setattr("meshrun.placement.process.resolve_ipv4_first", lambda host: "127.0.1.1")
    for name in ("MASTER_ADDR", "RANK", "WORLD_SIZE"):  # init_distributed exports them; keep this process clean
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    with pytest.raises(ValueError, match="'node01' .* resolves to 127.0.1.1"):
        init_distributed(two_node_env(), DistConfig(device="cpu", init_timeout_s=1.0))


def test_meshrun_train_in_the_batch_script_itself_says_use_srun_instead_of_waiting(monkeypatch, capsys):
    # the variables of an sbatch script (-N 2 --ntasks-per-node=2) on Slurm 22.05: no SLURM_STEP_ID, and
    # SLURM_NTASKS counts the job's 4 tasks; rank 0 of 4 would wait for 3 ranks that never start
    from meshrun.train.cli import main as train_main

    batch = {"SLURM_JOB_ID": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
             "SLURM_NTASKS": "4", "SLURM_NNODES": "2", "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_JOB_NODELIST": "n[1-2]"}
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "LOCAL_RANK", "SLURM_STEP_ID", "SLURM_STEPID"):
        monkeypatch.delenv(key, raising=False)
    for key, value in batch.items():
        monkeypatch.setenv(key, value)
    assert train_main(["--model.name=tiny", "--train.steps=1"]) == 2
    first = capsys.readouterr().err.splitlines()[0]
    assert first.startswith("meshrun train: error: SLURM: this is the batch script of job 1") and "srun" in first
    assert "3 ranks that never start" in first


def test_srun_tasks_print_a_command_line_refusal_once(monkeypatch, capsys):
    from meshrun.train.cli import main as train_main

    step = {"SLURM_NTASKS": "2", "SLURM_NNODES": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
            "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0"}
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(key, raising=False)
    for procid, printed in (("1", False), ("0", True)):
        for key, value in dict(step, SLURM_PROCID=procid, SLURM_NODEID=procid).items():
            monkeypatch.setenv(key, value)
        assert train_main(["--train.stepz=3"]) == 2
        assert ("meshrun train: error: " in capsys.readouterr().err) is printed


def test_describe_nodes_for_even_and_uneven_nodes():
    """8 + 4 + 4 = 16: the header must not claim nodes x this node's count."""
    def env(world: int, local: int, nodes: int) -> ProcessPlacement:
        return ProcessPlacement(rank=0, local_rank=0, world_size=world, local_world_size=local, node_rank=0,
                          num_nodes=nodes, master_addr="a", master_port=1, source="slurm")

    assert env(16, 8, 2).describe_nodes() == "2 node(s) x 8 process(es) = world size 16"
    assert not env(16, 8, 2).nodes_differ
    assert env(16, 8, 3).describe_nodes() == "3 node(s) of different sizes = world size 16 (8 process(es) on this node)"
    assert env(16, 4, 3).nodes_differ


def test_job_ids_10000_apart_get_different_ports_below_the_ephemeral_range():
    from meshrun.placement.slurm_lists import slurm_port

    assert slurm_port("7") != slurm_port("10007") != slurm_port("20007")
    assert slurm_port("123_4") == slurm_port("123")  # an array task's id
    assert all(15000 <= slurm_port(str(job)) < 32768 for job in (0, 9999, 16383, 16384, 10**9))


def test_the_earlier_name_of_the_placement_record_still_imports():
    from meshrun.env import ClusterEnv

    assert ClusterEnv is ProcessPlacement
