"""Stragglers, hangs and the flight recorder: pure logic first, then gloo runs with a slow or silent rank."""

from __future__ import annotations

import dataclasses
import json
import socket
import time

import numpy as np
import torch
import pytest
import torch.distributed as dist

from dist_utils import run_distributed
from meshrun.env import ProcessPlacement
from meshrun.watch import hang, stragglers
from meshrun.watch.flight_recorder import enable_flight_recorder
from meshrun.watch.hang import Heartbeat, HangWatchdog, RankView, diagnose_hang
from meshrun.watch.stragglers import RankInfo, StragglerDetector, find_stragglers


def _ranks(n: int) -> list[RankInfo]:
    return [RankInfo(rank=r, host="a" if r < 2 else "b", local_rank=r % 2) for r in range(n)]


# ---- stragglers: pure ----------------------------------------------------------------------------------------

def test_slow_rank_is_named_with_its_cause():
    times = np.array([[0.21, 0.01], [0.20, 0.01], [0.22, 0.01], [0.42, 0.336]])
    found = find_stragglers(times, _ranks(4), threshold=1.5, min_gap_s=0.005)
    assert [s.who.rank for s in found] == [3]
    assert found[0].describe() == ("rank 3 (host b, local 1) is a straggler: step 0.42 s vs median 0.21 s (2.0x), "
                                   "80% of it waiting for data")
    compute = find_stragglers(np.array([[0.2, 0.0], [0.2, 0.0], [0.5, 0.05]]), _ranks(3), threshold=1.5,
                              min_gap_s=0.0)
    assert "compute dominates (data loading 10%)" in compute[0].describe()


def test_slow_gpu_is_told_apart_from_slow_data_by_the_gemm_rerun_and_clocks():
    # columns: step s, data s, SM clock MHz, max SM clock MHz, temperature C
    times = np.array([[0.2, 0.01, 1980, 1980, 60], [0.2, 0.01, 1980, 1980, 61], [0.45, 0.01, 1100, 1980, 91]])
    found = find_stragglers(times, _ranks(3), threshold=1.5, min_gap_s=0.0)
    assert found[0].gpu_state == "SM clock 1100/1980 MHz, 91 C"
    slow_gpu = dataclasses.replace(found[0], gemm_tflops=400.0, gemm_median=700.0)
    assert slow_gpu.describe() == ("rank 2 (host b, local 0) is a straggler: step 0.45 s vs median 0.2 s (2.2x), its "
                                   "GPU is slow: a GEMM re-run gives 400 TFLOP/s, 57% of the ranks' median 700; GPU SM "
                                   "clock 1100/1980 MHz, 91 C")
    fine_gpu = dataclasses.replace(found[0], gemm_tflops=690.0, gemm_median=700.0, gpu_state="")
    assert "compute dominates (data loading 2%); its GPU runs a GEMM at 99% of the median, so not the GPU itself" \
        in fine_gpu.describe()
    slow_data = dataclasses.replace(found[0], data_s=0.4, gemm_tflops=400.0, gemm_median=700.0)
    assert "89% of it waiting for data" in slow_data.describe()  # the loader first: it explains the step
    no_nvml = find_stragglers(np.array([[0.2, 0.0, np.nan, np.nan, np.nan], [0.5, 0.0] + [np.nan] * 3]), _ranks(2),
                              threshold=1.5, min_gap_s=0.0)
    assert no_nvml[0].gpu_state == "" and "GPU" not in no_nvml[0].describe()


def test_a_slow_cpu_rank_is_blamed_on_its_cpu_never_on_a_gpu():
    found = find_stragglers(np.array([[0.2, 0.01], [0.2, 0.01], [0.45, 0.01]]), _ranks(3), threshold=1.5,
                            min_gap_s=0.0)
    busy = dataclasses.replace(found[0], gemm_tflops=0.000642, gemm_median=0.0016, device="CPU")
    text = busy.describe()
    assert "its CPU is slow: a matmul re-run gives 0.642 GFLOP/s, 40% of the ranks' median 1.6" in text, text
    assert "GPU" not in text and "TFLOP/s" not in text
    fine = dataclasses.replace(busy, gemm_tflops=0.00158)
    assert "its CPU runs a matmul at 99% of the median, so not the CPU itself" in fine.describe()
    assert "GPU" not in fine.describe()


def test_a_straggler_is_said_once_then_on_a_change_or_after_the_repeat_interval():
    now = [0.0]
    notices = stragglers.StragglerNotices(repeat_s=300, clock=lambda: now[0])
    slow = find_stragglers(np.array([[0.2, 0.01], [0.5, 0.4]]), _ranks(2), threshold=1.5, min_gap_s=0.0)
    compute = find_stragglers(np.array([[0.2, 0.01], [0.5, 0.01]]), _ranks(2), threshold=1.5, min_gap_s=0.0)
    said = []
    for step in range(10, 410, 10):  # 40 log steps, rank 1 slow on data at each, 1 s apart
        now[0] += 1.0
        said.append(notices.to_say(step, stragglers.StragglerReport(step=step, stragglers=slow)))
    lines = [line for line in said if line]
    assert len(lines) == 1 and lines[0].startswith("step 10: rank 1 (host a, local 1) is a straggler")
    assert "waiting for data" in lines[0] and "said again when it changes, or after 5 min" in lines[0]
    now[0] += 300.0
    again = notices.to_say(410, stragglers.StragglerReport(step=410, stragglers=slow))
    assert again.startswith("step 410: rank 1") and again.endswith("(unchanged since step 10)")
    changed = notices.to_say(420, stragglers.StragglerReport(step=420, stragglers=compute))  # another cause
    assert changed.startswith("step 420: rank 1") and "compute dominates" in changed
    assert notices.to_say(430, None) == "step 430: no straggler now (rank 1 was one since step 420)"
    assert notices.to_say(440, None) is None


def test_two_ranks_compare_against_each_other_and_noise_is_ignored():
    assert [s.who.rank for s in find_stragglers(np.array([[0.1, 0], [0.2, 0]]), _ranks(2), threshold=1.5,
                                                min_gap_s=0.0)] == [1]
    flat = np.array([[0.100, 0], [0.101, 0], [0.099, 0]])
    assert find_stragglers(flat, _ranks(3), threshold=1.5, min_gap_s=0.0) == []
    tiny = np.array([[0.001, 0], [0.001, 0], [0.003, 0]])  # 3x, but 2 ms is below min_gap_s
    assert find_stragglers(tiny, _ranks(3), threshold=1.5, min_gap_s=0.005) == []


def test_leave_one_out_median_matches_numpy():
    rng = np.random.default_rng(0)
    for n in (2, 3, 4, 7, 10):
        values = np.sort(rng.random(n))
        for i in range(n):
            assert stragglers._median_without(values, i) == pytest.approx(float(np.median(np.delete(values, i))))


# ---- hangs: pure ---------------------------------------------------------------------------------------------

def _view(rank: int, step: int, phase: str, age: float, *, silent: float = 1.0, host: str = "a",
          index: int = 0, done: bool = False) -> RankView:
    beat = Heartbeat(rank=rank, host=host, step=step, phase=phase, age_s=age - silent, limit_s=60.0, seq=1,
                     index=index, done=done)
    return RankView(rank=rank, beat=beat, silent_s=silent)


def test_hang_names_the_rank_behind_and_where_the_others_wait():
    views = [_view(0, 42, "all_reduce", 90), _view(1, 41, "forward", 95, host="b"),
             _view(2, 42, "all_reduce", 91), _view(3, 42, "all_reduce", 90)]
    assert diagnose_hang(views, timeout_s=60) == (
        "hang: rank 1 (host b) last seen at step 41 'forward' 95 s ago; ranks 0,2,3 are waiting at step 42 "
        "'all_reduce'")


def test_same_step_different_phase_and_silent_and_healthy_cases():
    # rank 1 beat 'forward' last, later than rank 0's 'all_reduce': the beat index, not the clock, decides
    same_step = [_view(0, 7, "all_reduce", 80, index=2), _view(1, 7, "forward", 70, index=0, host="b")]
    assert diagnose_hang(same_step, timeout_s=60) == (
        "hang: rank 1 (host b) last seen at step 7 'forward' 70 s ago; rank 0 is waiting at step 7 'all_reduce'")
    silent = [_view(0, 7, "all_reduce", 70), _view(1, 7, "forward", 75, silent=75, host="b")]
    assert diagnose_hang(silent, timeout_s=60).startswith(
        "hang: rank 1 (host b) stopped publishing heartbeats 75 s ago")
    assert diagnose_hang([_view(0, 7, "forward", 5), _view(1, 7, "forward", 6)], timeout_s=60) is None
    everyone = [_view(r, 3, "all_reduce", 70) for r in range(4)]
    assert diagnose_hang(everyone, timeout_s=60).startswith("hang: all 4 ranks stalled at step 3 'all_reduce'")
    finished = [_view(0, 9, "done", 500, done=True), _view(1, 9, "forward", 5)]
    assert diagnose_hang(finished, timeout_s=60) is None
    never = [_view(0, 1, "forward", 70), RankView(rank=1, beat=None, silent_s=70)]
    assert "rank 1 has published no heartbeat in 70 s" in diagnose_hang(never, timeout_s=60)


def test_rank_stuck_outside_a_collective_is_told_from_ranks_waiting_in_one():
    def at(rank: int, inside: str) -> RankView:
        beat = Heartbeat(rank=rank, host=f"h{rank}", step=5, phase="forward_backward", age_s=69, limit_s=60.0,
                         seq=1, inside=inside)
        return RankView(rank=rank, beat=beat, silent_s=1.0)

    views = [at(0, "collective: wait (torch/distributed/distributed_c10d.py:3000)"),
             at(1, "code: forward (models/gpt.py:160)"), at(2, "backward: _engine_run_backward (x)")]
    assert diagnose_hang(views, timeout_s=60) == (
        "hang: rank 1 (host h1) is stuck at step 5 'forward_backward' outside any collective, 70 s in forward "
        "(models/gpt.py:160); ranks 0,2 are waiting for it in a collective (_engine_run_backward (x); wait "
        "(torch/distributed/distributed_c10d.py:3000))")
    # everyone in a collective, or nobody known to be: no rank is blamed
    assert diagnose_hang([at(0, "collective: a"), at(1, "collective: b")], timeout_s=60).startswith("hang: all 2")
    assert diagnose_hang([at(0, "code: f (x:1)"), at(1, "")], timeout_s=60).startswith("hang: all 2")


def test_where_is_reads_another_threads_stack():
    import threading

    release = threading.Event()

    def stuck_in_user_code() -> None:
        release.wait(30)

    thread = threading.Thread(target=stuck_in_user_code, daemon=True)
    thread.start()
    time.sleep(0.3)
    try:
        assert hang.where_is(thread.ident).startswith("code: wait (")  # threading's Event.wait: not torch
        assert hang.where_is(None) == ""
    finally:
        release.set()


def test_rank_lists_are_compact():
    assert hang._ranks_text([3]) == "rank 3"
    assert hang._ranks_text([0, 1, 2, 5, 7, 8]) == "ranks 0-2,5,7,8"


def test_watchdog_in_one_process_names_a_silent_peer_and_dumps_its_own_stacks(tmp_path):
    store = dist.HashStore()
    env = ProcessPlacement(rank=0, local_rank=0, world_size=2, local_world_size=2, node_rank=0, num_nodes=1,
                     master_addr="127.0.0.1", master_port=0, source="torchrun")
    peer = Heartbeat(rank=1, host="b", step=4, phase="forward", age_s=0.0, limit_s=0.6, seq=1)
    store.set(hang._heartbeat_key(1), json.dumps(peer.__dict__))  # then never again
    stacks = tmp_path / "stacks.txt"
    logged: list[str] = []
    watchdog = HangWatchdog(env=env, timeout_s=0.6, store=store, publish_every_s=0.1, stack_file=stacks,
                            log=logged.append).start()
    time.sleep(0.3)  # rank 1 has been silent since start; this rank still beats
    watchdog.beat(5, "all_reduce")
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and len(watchdog.reports) < 2:
        time.sleep(0.05)
    watchdog.stop()
    assert any(r.startswith("hang: rank 1 (host b) stopped publishing heartbeats") and "step 4 'forward'" in r
               for r in watchdog.reports), watchdog.reports
    assert any(r.startswith("hang: this rank (rank 0") and "step 5 'all_reduce'" in r for r in watchdog.reports)
    assert "test_watchdog_in_one_process" in stacks.read_text()  # the main thread's frame is in the dump
    assert logged == watchdog.reports


# ---- flight recorder -----------------------------------------------------------------------------------------

def test_flight_recorder_defaults_respect_the_user(tmp_path):
    environ = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "50"}  # the user's choice, in the older spelling
    applied = enable_flight_recorder(environ, run_dir=tmp_path, new_names=True)
    assert environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "50" and "TORCH_FR_BUFFER_SIZE" not in environ
    assert applied == {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                       "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "nccl_trace" / "rank_")}
    assert (tmp_path / "nccl_trace").is_dir()


def test_flight_recorder_sets_only_the_names_this_torch_reads(tmp_path):
    """torch >= 2.9 warns about every TORCH_NCCL_* flight-recorder name it finds; 2.8 reads only those."""
    fresh: dict[str, str] = {}
    enable_flight_recorder(fresh, run_dir=tmp_path, buffer_size=123, new_names=True)
    assert fresh["TORCH_FR_BUFFER_SIZE"] == "123" and not {"TORCH_NCCL_TRACE_BUFFER_SIZE",
                                                         "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"} & set(fresh)
    old: dict[str, str] = {}
    enable_flight_recorder(old, run_dir=tmp_path, buffer_size=123, new_names=False)
    assert old["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "123" and "TORCH_FR_BUFFER_SIZE" not in old
    assert old["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(tmp_path / "nccl_trace" / "rank_")
    default: dict[str, str] = {}
    enable_flight_recorder(default, run_dir=tmp_path)
    assert ("TORCH_FR_BUFFER_SIZE" in default) == (tuple(map(int, torch.__version__.split(".")[:2])) >= (2, 9))


# ---- one 3-rank gloo run: rank 2 is slow, then rank 1 stops beating -------------------------------------------

STEPS = 3


def _straggler_phase(rank: int, env: ProcessPlacement):
    detector = StragglerDetector(env=env, threshold=1.5, window=2, gemm_check=True)
    measured, reports = [], []
    for step in range(STEPS):
        start = time.perf_counter()
        time.sleep(0.15 if rank == 2 else 0.01)  # "waiting for data": rank 2's loader is slow
        data = time.perf_counter() - start
        time.sleep(0.03)  # "compute"
        measured.append([time.perf_counter() - start, data])
        reports.append(detector.observe(step, measured[-1][0], measured[-1][1]))
    return measured, reports, detector.summary()


def _watchdog_phase(rank: int, env: ProcessPlacement, stacks_dir: str) -> list[str]:
    watchdog = HangWatchdog(env=env, timeout_s=2.0, publish_every_s=0.25, stack_file=f"{stacks_dir}/rank{rank}.txt",
                            log=lambda message: None).start()
    for step in range(3):
        watchdog.beat(step, "forward")
        if rank == 1 and step == 2:
            time.sleep(4.5)  # rank 1 stops beating "inside forward"; the others wait in the all-reduce
        watchdog.beat(step, "all_reduce")
        dist.barrier()
    watchdog.stop()
    return watchdog.reports


def _health_worker(rank: int, world_size: int, stacks_dir: str):
    env = ProcessPlacement.detect()
    return _straggler_phase(rank, env), _watchdog_phase(rank, env, stacks_dir)


@pytest.fixture(scope="module")
def health_run(tmp_path_factory):
    stacks = tmp_path_factory.mktemp("stacks")
    return run_distributed(_health_worker, 3, str(stacks), timeout=120), stacks


@pytest.mark.slow
def test_straggler_detector_names_the_slow_rank(health_run):
    results = [straggler for straggler, _ in health_run[0]]
    assert all(r is None for _, reports, _ in results[1:] for r in reports)  # only rank 0 reports
    measured = np.array([m for m, _, _ in results])  # (ranks, steps, 2)
    who = results[0][1][0].stragglers[0].who
    assert (who.rank, who.host, who.local_rank) == (2, socket.gethostname(), 2)
    for step, report in enumerate(results[0][1]):
        # reference: the same rule applied in this process to the numbers each rank measured
        expected = find_stragglers(measured[:, max(0, step - 1):step + 1].mean(axis=1), _ranks(3), threshold=1.5,
                                   min_gap_s=0.005)
        assert [s.who.rank for s in report.stragglers] == [s.who.rank for s in expected] == [2]
        assert report.stragglers[0].step_s == pytest.approx(expected[0].step_s)
        assert "waiting for data" in str(report)
        # every rank re-ran the GEMM once rank 2 was flagged; the report carries rank 2's figure and the median
        assert report.stragglers[0].gemm_tflops > 0 and report.stragglers[0].gemm_median > 0
    summary = results[0][2]
    assert [row["rank"] for row in summary] == [0, 1, 2]
    assert summary[2]["max_step_s"] == pytest.approx(measured[2, :, 0].max())


@pytest.mark.slow
def test_watchdog_on_rank_zero_names_the_rank_that_stopped_beating(health_run):
    reports = [watchdog for _, watchdog in health_run[0]]
    host = socket.gethostname()
    named = [r for r in reports[0] if r.startswith("hang: rank 1")]
    assert named, reports[0]
    assert named[0].startswith(f"hang: rank 1 (host {host}) last seen at step 2 'forward' ")
    assert named[0].endswith("ranks 0,2 are waiting at step 2 'all_reduce'")
    assert int(named[0].split("'forward' ")[1].split(" s ago")[0]) <= 4  # caught within the stall, not after
    assert any(r.startswith("hang: this rank (rank 1") for r in reports[1])
    assert "_watchdog_phase" in (health_run[1] / "rank1.txt").read_text()  # rank 1's own stack dump
