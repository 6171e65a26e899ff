"""One gather per log interval: the ``ranks`` record and the straggler detector read the same per-rank numbers,
and the non-finite report names hosts from the list gathered at start. Checked in one process on a fake 2-rank
process group, with torch.distributed's gathers replaced by a stand-in that plays rank 1 and counts the calls."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from meshrun.watch.stragglers import RankInfo, StragglerDetector
from meshrun.env import ProcessPlacement
from meshrun.train.nonfinite import NonFiniteGuard
from meshrun.train.rank_timing import FIELDS, log_rank_timing
from meshrun.watch.health import JobHealth

RANK1_SLOWDOWN = 4.0  # rank 1's working time, as a multiple of rank 0's


@pytest.fixture
def two_rank_world(monkeypatch):
    """A fake 2-rank group (this process is rank 0); ``calls`` counts gathers, rank 1's rows are rank 0's with
    the working time x RANK1_SLOWDOWN."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    calls = {"all_gather": 0, "all_gather_object": 0}

    def all_gather(parts, mine, group=None):
        calls["all_gather"] += 1
        parts[0].copy_(mine)
        parts[1].copy_(mine)
        if mine.dtype == torch.float64:
            parts[1][0] *= RANK1_SLOWDOWN
        else:  # the non-finite guard's first bad step: rank 1 went bad at step 3
            parts[1].fill_(3)

    def all_gather_object(out, mine, group=None):
        calls["all_gather_object"] += 1
        out[:] = [mine] * len(out)

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    monkeypatch.setattr(dist, "all_gather", all_gather)
    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    try:
        yield calls
    finally:
        dist.destroy_process_group()


def _env() -> ProcessPlacement:
    return ProcessPlacement(rank=0, local_rank=0, world_size=2, local_world_size=2, node_rank=0, num_nodes=1,
                      master_addr="127.0.0.1", master_port=0, source="torchrun")


def test_each_log_interval_gathers_once_for_the_record_and_the_detector(two_rank_world):
    infos = [RankInfo(rank=r, host=f"h{r}", local_rank=r) for r in range(2)]
    detector = StragglerDetector(env=_env(), threshold=1.5, window=1, min_gap_s=0.0, ranks=infos)
    assert two_rank_world["all_gather_object"] == 0, "the rank infos were given: no gather of host names"
    records, printed = [], []
    work = iter([(0.1, 0.02, 0.07), (0.2, 0.05, 0.14)])
    health = JobHealth(env=_env(), device=torch.device("cpu"), parts=[], straggler_threshold=0)
    health.timer, health.stragglers = SimpleNamespace(take=lambda steps: next(work)), detector
    trainer = SimpleNamespace(health=health, env=_env(), device=torch.device("cpu"), start_step=0, step=3,
                              job=SimpleNamespace(train=SimpleNamespace(log_every=3)), beat=lambda phase: None,
                              sink=SimpleNamespace(record=records.append, print=printed.append))
    for step in (3, 6):  # the first interval is warm-up: recorded, not compared
        trainer.step = step
        before = two_rank_world["all_gather"]
        log_rank_timing(trainer, 3, 0.9)
        assert two_rank_world["all_gather"] - before == 1, f"step {step}: one gather per log interval"
    assert [r["step"] for r in records] == [3, 6] and all(set(FIELDS) <= set(r) for r in records)
    assert records[1]["work_s"] == [0.2, round(0.2 * RANK1_SLOWDOWN, 6)] and records[1]["data_s"] == [0.05, 0.05]
    assert records[1]["rest_s"] == [0.1, 0.1] and records[1]["step_s"] == pytest.approx(0.3)
    assert records[1]["forward_host_s"] == [0.14, 0.14]
    (times,) = detector._recent  # (2, 5) from the same gather: work, data, 3 NaN clock columns on CPU
    assert times[:, :2].tolist() == [[0.2, 0.05], [0.2 * RANK1_SLOWDOWN, 0.05]] and times.shape == (2, 5)
    assert len(printed) == 1 and "step 6: rank 1 (host h1, local 1) is a straggler" in printed[0]


def test_the_nonfinite_report_names_hosts_without_gathering_them_again(two_rank_world):
    guard = NonFiniteGuard("skip", device=torch.device("cpu"), rank=0, fused_optimizer=False,
                           hosts=["node-a", "node-b"])
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    assert not guard.allow_step(3, torch.tensor(float("nan")), torch.tensor(1.0), optimizer)
    report = guard.check(4, world_size=2)
    assert "the loss first went non-finite on rank 1 (host node-b) at step 3" in report, report
    assert two_rank_world == {"all_gather": 1, "all_gather_object": 0}


def test_the_work_timer_times_the_forward_passes_and_the_hosts_time_inside_them():
    """On CPU the forward passes run on the host: work is the data wait plus them, and the host forward is them."""
    import time

    from meshrun.watch.stragglers import WorkTimer

    class Slow(torch.nn.Module):
        def forward(self, x):
            time.sleep(0.02)
            return x

    model = Slow()
    timer = WorkTimer([model], torch.device("cpu"))
    for _ in range(2):
        model(torch.ones(1))
    timer.add_data(0.01)
    work, data, host = timer.take(2)
    assert data == pytest.approx(0.005) and 0.02 <= host < 0.2 and work == pytest.approx(data + host)
    assert timer.take(1) == (0.0, 0.0, 0.0), "each interval starts afresh"
