"""`meshrun launch` command line and decisions (pure logic: no process starts, only local route lookups)."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess

import pytest

from meshrun.launch.args import (LaunchUsageError, apply_target, check_numa_binding, check_target, parse_launch_args,
                                 parse_nnodes)
from meshrun.launch.cli import main
from meshrun.launch.net import EndpointError
from meshrun.launch.rendezvous import apply_plan, format_plan, make_plan, parse_rdzv_conf
from meshrun.launch.simulate import agent_command, split_gpus, threads_note
from meshrun.placement.slurm import SlurmLayoutError, detect_slurm


def plan_for(argv: list[str], environ: dict[str, str] | None = None):
    return make_plan(parse_launch_args(argv), environ=environ or {})


# --- flags -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [["--nproc-per-node", "4", "s.py"], ["--nproc_per_node=4", "s.py"],
                                  ["--nproc_per_node", "4", "s.py"], ["--nproc-per-node=4", "s.py"]])
def test_nproc_per_node_both_spellings(argv):
    largs = parse_launch_args(argv)
    assert largs.ns.nproc_per_node == "4" and "nproc_per_node" in largs.given


@pytest.mark.parametrize("value", ["0", "-1"])
def test_nproc_per_node_below_one_is_a_usage_error(value, capsys):
    assert main(["--nproc-per-node", value, "train"]) == 2
    assert f"--nproc-per-node {value}: give 1 or more workers per node" in capsys.readouterr().err
    assert parse_launch_args(["--nproc-per-node", "auto", "s.py"]).ns.nproc_per_node == "auto"


def test_torchrun_tutorial_line_parses_in_underscore_spelling():
    largs = parse_launch_args(["--nnodes=4", "--nproc_per_node=8", "--node_rank=1", "--master_addr=10.0.0.5",
                               "--master_port=29500", "--max_restarts=3", "--rdzv_id=job7", "train.py", "--lr", "1"])
    ns = largs.ns
    assert (ns.nnodes, ns.nproc_per_node, ns.node_rank, ns.master_addr, ns.master_port) == (
        "4", "8", 1, "10.0.0.5", 29500)
    assert ns.max_restarts == 3 and ns.rdzv_id == "job7"
    assert {"nnodes", "nproc_per_node", "node_rank", "master_addr", "master_port"} <= largs.given
    assert largs.target.kind == "script" and largs.target.args == ("--lr", "1")


def test_defaults_do_not_count_as_given():
    # torch 2.8 defaults --master-port to 29500: only typed flags may steer decisions.
    largs = parse_launch_args(["s.py"])
    assert "master_port" not in largs.given and "nnodes" not in largs.given
    assert parse_launch_args(["--master-port", "29500", "s.py"]).given >= {"master_port"}


def test_nnodes_min_max():
    assert parse_nnodes("2") == (2, 2)
    assert parse_nnodes("1:4") == (1, 4)
    for bad in ("0", "3:2", "a", "1:2:3", ""):
        with pytest.raises(LaunchUsageError, match="--nnodes"):
            parse_nnodes(bad)
    plan = plan_for(["--nnodes", "1:3", "--rdzv-endpoint", "127.0.0.1:29400", "s.py"])
    assert (plan.min_nodes, plan.max_nodes) == (1, 3)


def test_target_kinds_and_train_rewrite():
    train = parse_launch_args(["--nproc-per-node", "2", "train", "--train.steps=20"])
    assert train.target.kind == "meshrun" and train.target.args == ("--train.steps=20",)
    apply_target(train.ns, train.target)
    assert (train.ns.module, train.ns.training_script, train.ns.training_script_args) == (
        True, "meshrun", ["train", "--train.steps=20"])
    module = parse_launch_args(["-m", "pkg.main", "--x", "1"])
    assert (module.target.kind, module.target.name, module.target.args) == ("module", "pkg.main", ("--x", "1"))
    program = parse_launch_args(["--no-python", "hostname"])
    assert program.target.kind == "program"
    script = parse_launch_args(["./train", "a"])  # a local file called train needs a path
    assert script.target.kind == "script" and script.target.name == "./train"
    bench = parse_launch_args(["bench", "allreduce"])
    apply_target(bench.ns, bench.target)
    assert (bench.ns.module, bench.ns.training_script, bench.ns.training_script_args) == (
        True, "meshrun", ["bench", "allreduce"])


def test_option_tokens_stop_at_the_target():
    largs = parse_launch_args(["--nproc_per_node=2", "-m", "mod", "--nproc_per_node=9"])
    assert largs.option_tokens == ("--nproc_per_node=2", "-m")
    assert largs.ns.nproc_per_node == "2" and largs.target.args == ("--nproc_per_node=9",)


def test_missing_script_is_reported_before_launch(tmp_path):
    with pytest.raises(LaunchUsageError, match="nope.py.*not found"):
        check_target(parse_launch_args([str(tmp_path / "nope.py")]).target)
    assert main([str(tmp_path / "nope.py")]) == 2


@pytest.mark.parametrize("misplaced", ["--nproc-per-node", "--nproc_per_node=2", "--nnodes", "--rdzv-endpoint"])
def test_a_launch_option_after_a_meshrun_command_is_refused_naming_where_it_goes(misplaced, tmp_path):
    with pytest.raises(LaunchUsageError, match=rf"^{misplaced.split('=')[0]} comes after `train`, so it would go to "
                                               r"every worker.*put launch options before the command"):
        check_target(parse_launch_args(["train", "--train.steps=2", misplaced, "2"]).target)
    check_target(parse_launch_args(["train", "--dry-run", "--world-size", "2"]).target)  # train's own --dry-run
    script = tmp_path / "s.py"
    script.write_text("")
    check_target(parse_launch_args([str(script), "--nnodes", "2"]).target)  # a user's script may take any option


def test_rdzv_conf_parsing():
    assert parse_rdzv_conf("join_timeout=5, is_host=1") == {"join_timeout": "5", "is_host": "1"}
    with pytest.raises(LaunchUsageError, match="--rdzv-conf"):
        parse_rdzv_conf("oops")


def test_bad_endpoint_names_the_endpoint():
    with pytest.raises(EndpointError, match="'127.0.0.1:http'"):
        plan_for(["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:http", "s.py"])


# --- decisions ---------------------------------------------------------------------------------------------------


def test_single_node_is_standalone_on_loopback_and_sets_no_socket_env():
    plan = plan_for(["--nproc-per-node", "2", "s.py"])
    assert plan.origin == "standalone" and plan.backend == "c10d" and plan.endpoint == "127.0.0.1:0"
    assert plan.store_here and plan.local_addr == "127.0.0.1" and plan.single_host
    assert plan.env_set == {"OMP_NUM_THREADS": "1"}  # no GLOO/NCCL_SOCKET_IFNAME on one host
    assert plan.rdzv_conf["is_host"] == "1" and plan.rdzv_conf["join_timeout"] == "120"
    assert plan_for(["--standalone", "s.py"]).origin == "standalone"


def test_multi_node_without_endpoint_says_what_to_add():
    with pytest.raises(LaunchUsageError, match="--nnodes 2 needs a rendezvous endpoint.*--rdzv-endpoint"):
        plan_for(["--nnodes", "2", "s.py"])
    with pytest.raises(LaunchUsageError, match="--standalone"):
        plan_for(["--standalone", "--nnodes", "2", "s.py"])


def test_pasted_torchrun_line_keeps_static_rendezvous_and_node_rank():
    plan = plan_for(["--nnodes=2", "--node_rank=1", "--master_addr=127.0.0.1", "--master_port=29555", "s.py"])
    assert (plan.backend, plan.endpoint, plan.node_rank, plan.store_here) == ("static", "127.0.0.1:29555", 1, False)
    assert plan.rdzv_conf["timeout"] == "120"
    plan0 = plan_for(["--nnodes=2", "--node_rank=0", "--master_addr=127.0.0.1", "--master_port=29555", "s.py"])
    assert plan0.store_here


def test_c10d_endpoint_on_this_host_hosts_the_store_with_timeout():
    plan = plan_for(["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29431", "--rdzv-timeout", "30", "s.py"])
    assert plan.backend == "c10d" and plan.store_here and plan.rdzv_conf == {"join_timeout": "30", "is_host": "1"}
    user_says = plan_for(["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29431", "--rdzv-conf", "is_host=0", "s.py"])
    assert user_says.store_here is False and user_says.probe_first


def test_restartable_jobs_get_a_fresh_worker_store_per_attempt():
    var = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
    assert var not in plan_for(["--nproc-per-node", "1", "s.py"]).env_set
    assert plan_for(["--max-restarts", "2", "s.py"]).env_set[var] == "1"
    assert plan_for(["--nnodes", "1:3", "--rdzv-endpoint", "127.0.0.1:29435", "s.py"]).env_set[var] == "1"
    kept = plan_for(["--max-restarts", "2", "s.py"], {var: "0"})
    assert var not in kept.env_set and kept.env_kept[var] == "0"


def test_apply_plan_fills_torchrun_namespace():
    largs = parse_launch_args(["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29432", "train", "--a=1"])
    plan = make_plan(largs, environ={})
    apply_plan(largs.ns, plan)
    ns = largs.ns
    assert (ns.rdzv_backend, ns.rdzv_endpoint, ns.local_addr, ns.nnodes) == ("c10d", "127.0.0.1:29432",
                                                                            "127.0.0.1", "2:2")
    assert "is_host=1" in ns.rdzv_conf and "join_timeout=120" in ns.rdzv_conf
    assert ns.module and ns.training_script_args == ["train", "--a=1"]


def _own_non_loopback_ipv4() -> tuple[str, str] | None:
    """(interface, address) from `ip -o -4 addr` (a different parser from meshrun's own)."""
    try:
        out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    for line in out.splitlines():
        fields = line.split()
        if fields[1] != "lo" and "inet" in fields:
            return fields[1], fields[fields.index("inet") + 1].split("/")[0]
    return None


def test_multi_host_endpoint_on_own_nic_pins_socket_interfaces_unless_user_set_them():
    own = _own_non_loopback_ipv4()
    if own is None:
        pytest.skip("iproute2 (`ip`) is not installed" if shutil.which("ip") is None
                    else "this machine has no non-loopback IPv4 address")
    iface, addr = own
    plan = plan_for(["--nnodes", "2", "--rdzv-endpoint", f"{addr}:29433", "s.py"])
    assert (plan.local_addr, plan.iface, plan.store_here, plan.single_host) == (addr, iface, True, False)
    assert plan.env_set == {"GLOO_SOCKET_IFNAME": iface, "NCCL_SOCKET_IFNAME": iface}
    kept = plan_for(["--nnodes", "2", "--rdzv-endpoint", f"{addr}:29433", "s.py"], {"NCCL_SOCKET_IFNAME": "ib0"})
    assert kept.env_set == {"GLOO_SOCKET_IFNAME": iface} and kept.env_kept == {"NCCL_SOCKET_IFNAME": "ib0"}
    block = format_plan(kept)
    assert f"GLOO_SOCKET_IFNAME={iface}" in block and "NCCL_SOCKET_IFNAME=ib0 (yours)" in block
    assert any(note.startswith("NCCL_SOCKET_IFNAME=ib0 matches no interface of ") and f"set it to {iface}" in note
               for note in kept.notes)
    with pytest.raises(LaunchUsageError, match=rf"^GLOO_SOCKET_IFNAME=nosuch0: no interface nosuch0 on "
                       rf"{re.escape(socket.gethostname())} \(it has .*\); set it to {iface}, the interface of this "
                       rf"host's route to {re.escape(addr)}, or unset it"):
        plan_for(["--nnodes", "2", "--rdzv-endpoint", f"{addr}:29433", "s.py"], {"GLOO_SOCKET_IFNAME": "nosuch0"})


def test_a_gloo_interface_this_host_lacks_is_refused_on_one_host_too():
    with pytest.raises(LaunchUsageError, match=r"^GLOO_SOCKET_IFNAME=eth9: no interface eth9 on .*; unset it"):
        plan_for(["--standalone", "--nproc-per-node", "2", "s.py"], {"GLOO_SOCKET_IFNAME": "eth9"})
    assert plan_for(["--standalone", "--nproc-per-node", "2", "s.py"],
                    {"GLOO_SOCKET_IFNAME": "lo"}).env_kept["GLOO_SOCKET_IFNAME"] == "lo"


# --- SLURM -------------------------------------------------------------------------------------------------------

SLURM_TWO_NODES = {"SLURM_JOB_NODELIST": "localhost,node02", "SLURM_NODEID": "1", "SLURM_NNODES": "2",
                   "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0"}


def test_slurm_allocation_gives_nodes_endpoint_and_id():
    placement = detect_slurm(SLURM_TWO_NODES)
    assert placement is not None
    assert (placement.num_nodes, placement.node_rank, placement.endpoint_host) == (2, 1, "localhost")
    plan = plan_for(["--nproc-per-node", "8", "train"], SLURM_TWO_NODES)
    assert plan.origin == "slurm" and (plan.min_nodes, plan.max_nodes) == (2, 2)
    assert plan.endpoint_host == "localhost" and plan.endpoint_port == placement.endpoint_port
    assert plan.rdzv_id == "slurm-4242" and "from SLURM  SLURM job 4242: node 1 of 2" in format_plan(plan)


def test_slurm_is_ignored_when_flags_name_the_layout():
    plan = plan_for(["--nnodes", "1", "s.py"], SLURM_TWO_NODES)
    assert plan.origin == "standalone" and plan.placement is None
    assert detect_slurm({"SLURM_JOB_NODELIST": "a", "SLURM_NODEID": "0", "SLURM_NNODES": "1",
                         "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) is None


def test_slurm_with_one_task_per_gpu_is_refused_with_an_srun_line_that_works_there(capsys):
    environ = dict(SLURM_TWO_NODES, SLURM_NTASKS="4", SLURM_PROCID="3", SLURM_STEP_TASKS_PER_NODE="2(x2)")
    with pytest.raises(SlurmLayoutError) as refused:
        detect_slurm(environ, command="meshrun launch --nproc-per-node 2 train")
    # srun inherits SLURM_NTASKS=4 in a --ntasks-per-node=2 allocation, so `srun --ntasks-per-node=1` alone fails
    # the same way: the suggestion pins the task count
    assert "runs 4 tasks on 2 nodes (tasks per node 2(x2))" in str(refused.value)
    assert "Run `srun -n 2 --ntasks-per-node=1 meshrun launch --nproc-per-node 2 train`" in str(refused.value)
    assert not refused.value.speaker  # task 3 of 4: only task 0 prints the refusal
    plan_env = dict(environ, SLURM_PROCID="0")
    assert detect_slurm_refusal(plan_env).speaker and detect_slurm_refusal(environ).speaker is False


def detect_slurm_refusal(environ):
    with pytest.raises(SlurmLayoutError) as refused:
        detect_slurm(environ)
    return refused.value


def test_launch_prints_a_slurm_refusal_once_per_step(monkeypatch, capsys):
    environ = dict(SLURM_TWO_NODES, SLURM_NTASKS="4", SLURM_STEP_TASKS_PER_NODE="2(x2)")
    for procid, printed in (("3", False), ("0", True)):
        for key, value in dict(environ, SLURM_PROCID=procid).items():
            monkeypatch.setenv(key, value)
        assert main(["--nproc-per-node", "2", "train"]) == 2
        err = capsys.readouterr().err
        assert ("srun -n 2 --ntasks-per-node=1 meshrun launch --nproc-per-node 2 train" in err) is printed, err


def test_launch_in_the_batch_script_of_a_multi_node_job_says_use_srun():
    batch = {key: value for key, value in SLURM_TWO_NODES.items() if key != "SLURM_STEP_ID"}
    batch.update(SLURM_NODEID="0", SLURM_PROCID="0")
    with pytest.raises(SlurmLayoutError, match=r"batch script of job 4242 on 2 nodes, not a job step.*Use srun: "
                                               r"`srun -n 2 --ntasks-per-node=1 meshrun launch"):
        detect_slurm(batch)
    assert detect_slurm(dict(batch, SLURM_NNODES="1", SLURM_NTASKS="1")) is None  # one node: a standalone launch


def test_slurm_plan_block_is_prefixed_with_the_node(monkeypatch):
    block = format_plan(plan_for(["--nproc-per-node", "8", "train"], SLURM_TWO_NODES))
    assert all(line.startswith("[node 1 ") for line in block.splitlines()), block


def test_slurm_node_0_refuses_a_port_another_job_holds(monkeypatch):
    import socket as socketlib

    with socketlib.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        environ = dict(SLURM_TWO_NODES, SLURM_NODEID="0", SLURM_PROCID="0", MASTER_PORT=str(port))
        with pytest.raises(LaunchUsageError, match=f"SLURM job 4242: rendezvous port {port} on .* is already in use"):
            plan_for(["--nproc-per-node", "1", "train"], environ)
        joined = plan_for(["--nproc-per-node", "1", "train"], dict(environ, SLURM_NODEID="1", SLURM_PROCID="1"))
        assert joined.store_here is False and "SLURM node 0 hosts it" in joined.store_reason


# --- simulate-nodes ----------------------------------------------------------------------------------------------


def test_simulated_agents_share_a_loopback_rendezvous_and_one_hosts_it():
    largs = parse_launch_args(["--simulate-nodes", "3", "--nproc_per_node=2", "--rdzv-conf", "x=1", "s.py", "a"])
    commands = [agent_command(largs, index=i, nodes=3, port=29434, run_id="sim-t") for i in range(3)]
    for i, command in enumerate(commands):
        relaunched = parse_launch_args(command[command.index("launch") + 1:])
        assert relaunched.ns.simulate_nodes == 0 and relaunched.ns.nnodes == "3"
        assert relaunched.ns.rdzv_endpoint == "127.0.0.1:29434" and relaunched.ns.rdzv_id == "sim-t"
        assert parse_rdzv_conf(relaunched.ns.rdzv_conf) == {"x": "1", "is_host": "1" if i == 0 else "0"}
        assert relaunched.ns.nproc_per_node == "2" and relaunched.target.args == ("a",)


def test_simulate_refuses_flags_it_sets_itself(capsys):
    assert main(["--simulate-nodes", "2", "--rdzv-endpoint", "10.0.0.1:1", "s.py"]) == 2
    assert "drop --rdzv-endpoint" in capsys.readouterr().err
    assert main(["--simulate-nodes", "2", "--nnodes", "3", "s.py"]) == 2
    assert "drop --nnodes" in capsys.readouterr().err
    assert main(["--simulate-nodes", "1", "s.py"]) == 2
    assert "--simulate-nodes 1: give 2 or more" in capsys.readouterr().err


def test_simulated_nodes_get_disjoint_gpus_when_there_are_enough():
    assert split_gpus(nodes=2, nproc="2", visible=["0", "1", "2", "3"]) == ["0,1", "2,3"]
    assert split_gpus(nodes=2, nproc="1", visible=["4", "6", "7"]) == ["4", "6"]  # the caller's own selection
    assert split_gpus(nodes=2, nproc="2", visible=["0", "1"]) is None  # too few: leave the devices alone
    assert split_gpus(nodes=2, nproc="1", visible=[]) is None
    assert split_gpus(nodes=2, nproc="gpu", visible=["0", "1"]) is None


def test_simulated_nodes_share_the_cores_so_each_agent_sets_one_omp_thread():
    # 2 simulated nodes x 1 worker are 2 processes on this host's cores: torchrun's rule for several workers per node
    largs = parse_launch_args(["--simulate-nodes", "2", "--nproc-per-node", "1", "s.py"])
    command = agent_command(largs, index=1, nodes=2, port=29434, run_id="sim-t")
    plan = plan_for(command[command.index("launch") + 1:])
    assert plan.env_set["OMP_NUM_THREADS"] == "1"
    block = format_plan(plan)
    assert "OMP_NUM_THREADS=1 (2 workers share this host's" in block and "env set     nothing" not in block
    assert plan_for(command[command.index("launch") + 1:], {"OMP_NUM_THREADS": "4"}).env_kept == {
        "OMP_NUM_THREADS": "4"}
    assert "OMP_NUM_THREADS=1 in every worker: 2 x 1 workers share" in threads_note(nodes=2, nproc="1", environ={})
    assert threads_note(nodes=2, nproc="1", environ={"OMP_NUM_THREADS": "2"}).endswith("(yours)")
    assert "OMP_NUM_THREADS" not in plan_for(["--nproc-per-node", "1", "s.py"]).env_set  # one worker: its cores


def _torchrun_has_numa_binding() -> bool:
    from torch.distributed.run import get_args_parser

    return any("--numa-binding" in action.option_strings for action in get_args_parser()._actions)


def test_numa_binding_is_refused_where_no_gpu_would_be_bound():
    check_numa_binding("node", "8", gpus=8)  # one worker per GPU: torch binds each near its GPU
    check_numa_binding("node", "gpu", gpus=8)
    check_numa_binding(None, "4", gpus=0)  # not asked for: nothing to check
    with pytest.raises(LaunchUsageError, match=r"^--numa-binding node: .* this node has no CUDA GPU; drop"):
        check_numa_binding("node", "2", gpus=0)
    with pytest.raises(LaunchUsageError, match=r"^--numa-binding socket: .* 2 GPU\(s\) for --nproc-per-node 4; give "
                                               r"--nproc-per-node 2 or fewer"):
        check_numa_binding("socket", "4", gpus=2)


@pytest.mark.skipif(not _torchrun_has_numa_binding(), reason="this torch's torchrun has no --numa-binding (torch 2.9+)")
def test_numa_binding_on_a_node_without_gpus_fails_at_the_command_line(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(LaunchUsageError, match="no CUDA GPU"):
        parse_launch_args(["--numa-binding", "node", "--nproc-per-node", "2", "train"])


def test_a_store_host_that_went_away_is_named_as_such():
    """A RendezvousError while the store's host no longer accepts connections (its node died mid-job) names that
    host and the way out, not an --rdzv-id typo; torch's C++ frames after the error's first line are left out."""
    import dataclasses

    from torch.distributed.elastic.rendezvous.api import RendezvousError

    from meshrun.launch.launcher import rendezvous_error_message
    from meshrun.launch.net import free_port

    port = free_port()  # nothing listens there: the store's host is gone
    plan = dataclasses.replace(plan_for(["--standalone", "s.py"]), endpoint_host="127.0.0.1", endpoint_port=port,
                               store_here=False)
    error = RendezvousError("Failed to recv, got 0 bytes\nException raised from recvBytes at tcputils.hpp:133\n"
                            "frame #0: c10::Error::Error")
    line = rendezvous_error_message(plan, error, ran_s=42.0)
    assert line.startswith(f"the rendezvous store at 127.0.0.1:{port} stopped answering 42s into the job, seen from ")
    assert "127.0.0.1, the node that hosts it, went away" in line and "--rdzv-endpoint on a surviving node" in line
    assert "frame #0" not in line and "Failed to recv, got 0 bytes" in line
    here = dataclasses.replace(plan, store_here=True)  # this host serves it: the usual suspects
    assert rendezvous_error_message(here, error, ran_s=1.0).endswith(
        "check that every node uses the same --rdzv-endpoint and --rdzv-id.")
