"""meshrun's process-group teardown: a gloo job whose DDP model outlives the group still exits.

torch frees a gloo group in a C++ destructor that holds the GIL; when a DDP Reducer is the group's last owner and a
gloo worker thread is still releasing the last collective's tensors, the process hangs at exit (seen in CI as a
finished example that never exited). Before the fix, about one cycle in ten hung; 20 cycles per rank here.
"""

from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from meshrun.dist.process_group import shutdown
from dist_utils import free_port, run_distributed

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
