"""Health from a user script: Session.watch_health + one heartbeat per step name a slow rank and a stopped rank
with their hosts, as the trainer does (2 gloo ranks, rank 1 slowed down on purpose)."""

from __future__ import annotations

import time

import pytest
import torch
from torch.utils.data import TensorDataset

from dist_utils import run_distributed


class SlowOnRank1(TensorDataset):
    """Each sample takes 50 ms to read on rank 1: a slow disk on its node."""

    def __init__(self, rank: int):
        super().__init__(torch.randn(64, 4), torch.randn(64, 1))
        self.delay_s = 0.05 if rank == 1 else 0.0

    def __getitem__(self, i):
        time.sleep(self.delay_s)
        return super().__getitem__(i)


def _worker(rank: int, world_size: int) -> dict:
    from meshrun import Session

    session = Session(seed=0)
    model = session.prepare_model(torch.nn.Linear(4, 1), layout="ddp")
    hangs: list[str] = []
    session.watch_health(model, hang_timeout_s=1.0, straggler_threshold=1.5, every=2, on_hang=hangs.append)
    batches = session.step_batches(SlowOnRank1(rank), micro_batch=2)
    reports = []
    for step in range(1, 9):
        for x, y in batches.next_step():
            torch.nn.functional.mse_loss(model(x), y).backward()
        reports.append(session.heartbeat(step))
    if rank == 1:
        time.sleep(3)  # stops before step 9: rank 0 waits for it in the all-reduce below
    session.heartbeat(9)
    session.sum_metrics(done=1.0)  # collective: rank 0 blocks here until rank 1 arrives
    session.close()
    return {"reports": [r for r in reports if r], "hangs": hangs}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_session_names_the_slow_rank_and_the_stopped_rank():
    rank0, rank1 = run_distributed(_worker, 2, init_pg=False)
    assert rank0["reports"] and all("rank 1 (host" in r and "straggler" in r for r in rank0["reports"])
    assert not rank1["reports"]  # reports come from rank 0 only
    assert any("rank 1" in message for message in rank0["hangs"]), rank0["hangs"]
