"""meshrun's process-group teardown: a gloo job whose DDP model outlives the group still exits.

torch frees a gloo group in a C++ destructor that holds the GIL; when a DDP Reducer is the group's last owner and a
gloo worker thread is still releasing the last collective's tensors, the process hangs at exit (seen in CI as a
finished example that never exited). Before the fix, about one cycle in ten hung; 20 cycles per rank here.
A script that never calls ``Session.close()`` must exit cleanly too.
"""

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from meshrun.comm.process_group import shutdown
from dist_utils import free_port, mesh_group_timeouts, run_distributed

ROOT = Path(__file__).resolve().parents[1]
CYCLES = 20


def _start_train_stop(rank, world_size, ports):
    for port in ports:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=30))
        model = DDP(nn.Linear(8, 8))
        model(torch.randn(4, 8)).sum().backward()
        total = torch.ones(1)
        dist.all_reduce(total)  # the last collective, as Session.sum_metrics before Session.close
        shutdown()
        del model  # frees the Reducer, now the group's last owner
    return len(ports)


def test_a_ddp_model_freed_after_shutdown_does_not_hang_the_process():
    ports = [free_port() for _ in range(CYCLES)]
    assert run_distributed(_start_train_stop, 2, ports, init_pg=False, timeout=60) == [CYCLES, CYCLES]


SCRIPT_WITHOUT_CLOSE = '''
import torch, meshrun
from torch import nn
session = meshrun.Session(seed=0)
model = session.prepare_model(nn.Linear(8, 8))  # a module-level DDP model, freed during interpreter exit
model(torch.randn(4, 8, device=session.device)).sum().backward()
session.print("sum", session.sum_metrics(x=1.0)["x"])
'''


def _start_job(script, env):
    port = str(free_port())
    return [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env={**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(rank),
                                  "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"})
            for rank in range(2)]


@pytest.mark.slow
def test_a_session_script_that_never_calls_close_exits_cleanly(tmp_path):
    """Without init_distributed's exit hook 3 of 10 such jobs aborted at exit ('terminate called without an active
    exception'): the group was destroyed during interpreter finalization. 10 two-rank jobs, one after another."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT_WITHOUT_CLOSE)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    for _ in range(10):
        procs = _start_job(script, env)
        outputs = [proc.communicate(timeout=120)[0] for proc in procs]
        assert [proc.returncode for proc in procs] == [0, 0], "\n".join(outputs)
        assert "sum 2.0" in outputs[0]


def _mesh_timeout_worker(rank, world_size, parallel):
    return mesh_group_timeouts(parallel, 42.0)


@pytest.mark.slow
def test_a_data_parallel_mesh_creates_no_group_and_gets_the_training_timeout():
    # DDP on 2 ranks: building every mesh dimension made this rank a member of 3 new groups (pp, dp_shard and tp
    # of one rank each; 6 new_group calls in all); only the dimensions above 1 now, and that one is the default
    # group. Without set_mesh_timeouts mesh groups would keep torch's 30-minute gloo default.
    for made, count, timeouts in run_distributed(_mesh_timeout_worker, 2, {"dp_replicate": -1}):
        assert made == 0 and count == 1 and timeouts == {timedelta(seconds=42)}


def _graphs_freed_first(rank, world_size, port):
    import torch._inductor.cudagraph_trees  # noqa: F401 - what a run with train.cuda_graphs has imported

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=30))
    order = []
    reset, destroy = torch.compiler.reset, dist.destroy_process_group
    torch.compiler.reset = lambda: (order.append("free CUDA graphs"), reset())[1]
    dist.destroy_process_group = lambda *a, **k: (order.append("destroy the group"), destroy(*a, **k))[1]
    try:
        shutdown()
    finally:
        torch.compiler.reset, dist.destroy_process_group = reset, destroy
    return order


def test_cuda_graphs_are_freed_before_the_process_group_is_destroyed():
    """NCCL's communicator destroy waits for every CUDA graph that captured one of its collectives (TP blocks under
    train.cuda_graphs): shutdown frees torch.compile's graphs first, or the process would hang at exit."""
    order = run_distributed(_graphs_freed_first, 2, free_port(), init_pg=False, timeout=60)
    assert order == [["free CUDA graphs", "destroy the group"]] * 2
