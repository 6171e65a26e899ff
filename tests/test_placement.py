"""Cluster environments as plug-ins: the ordered list, Open MPI's layout, and a registered environment reaching
both ProcessPlacement.detect() and meshrun launch's plan, also when named as module:Class (pure logic, fake environ
mappings only)."""

from __future__ import annotations

import os
from typing import Mapping

import pytest

from meshrun.env import ProcessPlacement
from meshrun.launch.args import LaunchUsageError, parse_launch_args
from meshrun.launch.launcher import launch
from meshrun.launch.rendezvous import format_plan, make_plan
from meshrun.placement import ClusterEnvironment, NodePlacement, register_environment
from meshrun.placement import registry as environments

# mpirun -np 8 --npernode 4 on two nodes: rank 5 is the second process of node 1
OMPI = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "MASTER_ADDR": "node01", "MASTER_PORT": "29511"}


def test_default_order_puts_torchrun_first_and_the_single_process_last():
    assert [env.name for env in environments.ENVIRONMENTS] == ["torchrun", "slurm", "openmpi", "single"]
    both = dict(OMPI, RANK="2", WORLD_SIZE="4", SLURM_PROCID="0", SLURM_NTASKS="4", SLURM_JOB_NODELIST="a")
    assert ProcessPlacement.detect(both).source == "torchrun"  # mpirun torchrun / srun torchrun: torchrun's variables
    assert ProcessPlacement.detect({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1"}).source == "single"


def test_open_mpi_layout_derives_the_node_from_the_rank():
    env = ProcessPlacement.detect(OMPI)
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (5, 1, 8, 4)
    assert (env.node_rank, env.num_nodes, env.master_addr, env.master_port) == (1, 2, "node01", 29511)
    assert env.source == "openmpi" and env.export()["GROUP_RANK"] == "1"


@pytest.mark.parametrize("change, message", [
    ({"MASTER_ADDR": ""}, r"Open MPI: MASTER_ADDR is not set.*mpirun -x MASTER_ADDR="),
    ({"OMPI_COMM_WORLD_SIZE": "7"}, r"OMPI_COMM_WORLD_SIZE=7 is not a multiple of OMPI_COMM_WORLD_LOCAL_SIZE=4"),
    ({"OMPI_COMM_WORLD_LOCAL_RANK": "0"}, r"rank 5 has local rank 0.*--map-by slot"),
    ({"OMPI_COMM_WORLD_RANK": "9", "OMPI_COMM_WORLD_LOCAL_RANK": "1"},
     r"rank 9 is outside world size 8; check OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE"),
])
def test_open_mpi_refusals_name_the_variable_and_the_fix(change, message):
    with pytest.raises(ValueError, match=message):
        ProcessPlacement.detect(dict(OMPI, **change))


class FakeKubernetes(ClusterEnvironment):
    """A JobSet-like environment: one pod per node, ranks from JOB_COMPLETION_INDEX."""

    name, title = "k8s", "Kubernetes"

    def detect(self, environ: Mapping[str, str]) -> bool:
        return "JOB_COMPLETION_INDEX" in environ

    def placement(self, environ: Mapping[str, str]) -> ProcessPlacement:
        index = int(environ["JOB_COMPLETION_INDEX"])
        return ProcessPlacement(rank=index, local_rank=0, world_size=3, local_world_size=1, node_rank=index, num_nodes=3,
                          master_addr="job-0.svc", master_port=23456, source=self.name)

    def node_placement(self, environ: Mapping[str, str], *, command: str) -> NodePlacement | None:
        if not self.detect(environ):
            return None
        return NodePlacement(source=self.name, title=self.title, job_id="train-7", num_nodes=3,
                             node_rank=int(environ["JOB_COMPLETION_INDEX"]), endpoint_host="127.0.0.1",
                             endpoint_port=23456, hosts="from the job's headless service",
                             busy_port_fix="set MASTER_PORT in the pod spec.")


@pytest.fixture
def registry(monkeypatch):
    monkeypatch.setattr(environments, "ENVIRONMENTS", environments.ENVIRONMENTS)  # restored after the test


def test_registered_environment_is_detected_and_placed_for_the_launcher(registry):
    pod = {"JOB_COMPLETION_INDEX": "2", "RANK": "0", "WORLD_SIZE": "2"}
    register_environment(FakeKubernetes())  # default: after the built-in ones, before the single process
    assert [env.name for env in environments.ENVIRONMENTS][-2:] == ["k8s", "single"]
    assert ProcessPlacement.detect(pod).source == "torchrun"
    assert ProcessPlacement.detect({"JOB_COMPLETION_INDEX": "2"}).node_rank == 2
    plan = make_plan(parse_launch_args(["--nproc-per-node", "2", "train"]), environ={"JOB_COMPLETION_INDEX": "1"})
    assert (plan.origin, plan.rdzv_id, plan.max_nodes, plan.endpoint) == ("k8s", "k8s-train-7", 3, "127.0.0.1:23456")
    assert plan.store_here is False and plan.store_reason.startswith("Kubernetes node 0 hosts it")
    assert "from Kubernetes Kubernetes job train-7: node 1 of 3" in format_plan(plan)


def test_register_before_torchrun_takes_precedence_and_bad_calls_name_the_choices(registry):
    register_environment(FakeKubernetes(), before="torchrun")
    assert ProcessPlacement.detect({"JOB_COMPLETION_INDEX": "0", "RANK": "1", "WORLD_SIZE": "2"}).source == "k8s"
    with pytest.raises(ValueError, match="named 'k8s' is already registered"):
        register_environment(FakeKubernetes())
    with pytest.raises(ValueError, match=r"before='lsf' names no registered environment; choose one of k8s, torch"):
        register_environment(type("Lsf", (FakeKubernetes,), {"name": "lsf"})(), before="lsf")


PLUGIN = """
from meshrun import ProcessPlacement, ClusterEnvironment


class LsfEnvironment(ClusterEnvironment):
    name, title = "lsf", "LSF"

    def detect(self, environ):
        return "LSB_JOBID" in environ

    def placement(self, environ):
        rank = int(environ["LSF_PM_TASKID"])
        return ProcessPlacement(rank=rank, local_rank=rank % 2, world_size=4, local_world_size=2, node_rank=rank // 2,
                          num_nodes=2, master_addr="lsf-0", master_port=29400, source=self.name)
"""


@pytest.fixture
def plugin_module(tmp_path, monkeypatch, registry):
    (tmp_path / "my_lsf_envs.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(environments.ENV_VAR, "unset-after-the-test")
    monkeypatch.delenv(environments.ENV_VAR)  # launch() exports it: restored to absent afterwards


def test_environment_named_as_module_and_class_is_loaded_before_detection(plugin_module):
    job = {"LSB_JOBID": "88", "LSF_PM_TASKID": "3"}
    assert ProcessPlacement.detect(job).source == "single", "not loaded: nothing detects LSF"
    env = ProcessPlacement.detect({**job, environments.ENV_VAR: "my_lsf_envs:LsfEnvironment"})
    assert (env.source, env.rank, env.node_rank, env.master_addr) == ("lsf", 3, 1, "lsf-0")
    assert [e.name for e in environments.ENVIRONMENTS][-2:] == ["lsf", "single"]
    again = environments.load_environment("my_lsf_envs:LsfEnvironment")  # loading twice registers it once
    assert again is environments.environment_named("lsf")


def test_launch_environment_flag_loads_it_and_exports_it_to_the_workers(plugin_module, capsys):
    largs = parse_launch_args(["--environment", "my_lsf_envs:LsfEnvironment", "--nproc-per-node", "2", "--dry-run",
                               "train"])
    assert environments.environment_named("lsf") is not None, "the parser loads it: a typo fails before any agent"
    assert launch(largs) == 0
    assert os.environ[environments.ENV_VAR] == "my_lsf_envs:LsfEnvironment"  # inherited by every worker


@pytest.mark.parametrize("value, message", [
    ("my_lsf_envs", r"--environment='my_lsf_envs': give module:Class, e.g. my_envs:LSFEnvironment"),
    ("no_such_envs_module:Env", r"--environment='no_such_envs_module:Env': cannot import 'no_such_envs_module'"),
    ("my_lsf_envs:Missing", r"my_lsf_envs.Missing is missing; give a subclass of meshrun.ClusterEnvironment"),
    ("my_lsf_envs:ProcessPlacement",
     r"my_lsf_envs.ProcessPlacement is type; give a subclass of meshrun.ClusterEnvironment"),
])
def test_a_bad_environment_flag_names_the_option_and_the_fix(plugin_module, value, message):
    with pytest.raises(LaunchUsageError, match=message):
        parse_launch_args(["--environment", value, "train"])
