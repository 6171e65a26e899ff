"""doctor's check rows as pure logic (each fault injected into the gathered facts), the storage probes on a real
folder, and the GEMM / memory-bandwidth measurement on the CPU (the same code runs on each GPU)."""

from __future__ import annotations

import pytest
import torch

from meshrun.diag import clock, devices, gpu_health, ifname, rows, storage
from meshrun.diag.rows import FAIL, PASS, WARN


def test_dataset_missing_or_of_another_size_names_the_host(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"x" * 100)
    here = storage.data_facts(str(tmp_path), node=0, host="a", deep=True)
    assert (here.exists, here.size, here.files) == (True, 100, 1) and len(here.digest) == 16
    same = storage.judge_data("/d", [here, storage.DataFacts(**{**here.__dict__, "node": 1, "host": "b"}),
                                     storage.DataFacts(**{**here.__dict__, "node": 2, "host": "c"})])
    assert same.status == PASS and "100 B in 1 file(s) on all 3 node(s), sha256" in same.detail
    missing = storage.data_facts(str(tmp_path / "nope"), node=1, host="b", deep=False)
    smaller = storage.DataFacts(node=2, host="c", exists=True, size=60, files=1, digest="0" * 16)
    row = storage.judge_data("/d", [here, missing, smaller, storage.DataFacts(**{**here.__dict__, "node": 3})])
    assert row.status == FAIL and row.hosts == ("b", "c")
    assert "node 1 (host b): missing; node 2 (host c): 60 B in 1 file(s), sha256 0000" in row.detail
    assert "the others: 100 B in 1 file(s)" in row.detail and "b, c" in row.fix


def test_checkpoint_folder_probe_files_and_the_not_shared_row(tmp_path):
    assert storage.write_probe(tmp_path / "ck", "tok", 0) is None
    assert storage.seen_probes(tmp_path / "ck", "tok", 2) == (0,)
    (tmp_path / "file").write_text("")
    assert "cannot write there" in storage.write_probe(tmp_path / "file" / "ck", "tok", 0)
    facts = [storage.FolderFacts(node=0, host="a", writable=True, error=None, free=10**9, seen=(0, 2)),
             storage.FolderFacts(node=1, host="b", writable=True, error=None, free=10**6, seen=(1,)),
             storage.FolderFacts(node=2, host="c", writable=True, error=None, free=10**9, seen=(0, 2))]
    room, shared = storage.judge_folder("/ck", facts, needed=10**7)
    assert room.status == FAIL and room.hosts == ("b",) and "node 1 (host b) has 976.6 KiB free" in room.detail
    assert shared.status == FAIL and shared.hosts == ("b",)
    assert "node 0 (host a), node 2 (host c) see the files of node(s) 0, 2; node 1 (host b) see the files of " \
           "node(s) 1" in shared.detail
    ok = [storage.FolderFacts(node=n, host=h, writable=True, error=None, free=10**9, seen=(0, 1))
          for n, h in enumerate("ab")]
    assert [r.status for r in storage.judge_folder("/ck", ok, needed=10**7)] == [PASS, PASS]


def test_clock_skew_warns_naming_the_node_and_the_hook_shifts_the_clock(monkeypatch):
    monkeypatch.setenv(clock.FAKE_OFFSET_VAR, "100")
    import time
    assert clock.wall_time() - time.time() == pytest.approx(100, abs=1)
    row = clock.judge_clock({(0, "a"): 0.0, (1, "b"): 2.5, (2, "c"): 0.01}, max_skew_s=0.5)
    assert row.status == WARN and row.hosts == ("b",) and row.detail.startswith("node 1 (host b) is +2.50 s")
    assert clock.judge_clock({(0, "a"): 0.0, (1, "b"): 0.002}, max_skew_s=0.5).status == PASS


def _gpus(node: int, host: str, count: int, name: str = "H100", driver: str = "550.54", cuda: str = "12.4"):
    return devices.GpuInventory(node=node, host=host, names=(name,) * count, driver=driver if count else None,
                                cuda=cuda if count else None)


def test_gpu_count_below_nproc_per_node_names_the_host():
    row = devices.judge_gpus([_gpus(0, "a", 8), _gpus(1, "b", 6)], nproc_per_node=8)
    assert row.status == FAIL and row.hosts == ("b",)
    assert "--nproc-per-node 8 needs 8 GPUs on every node: node 1 (host b) sees 6" in row.detail
    mixed = devices.judge_gpus([_gpus(0, "a", 8), _gpus(1, "b", 8, driver="535.1"), _gpus(2, "c", 8)],
                               nproc_per_node=8)
    assert mixed.status == WARN and mixed.hosts == ("b",) and mixed.detail.startswith("driver differ")
    assert devices.judge_gpus([_gpus(0, "a", 0), _gpus(1, "b", 0)], nproc_per_node=4).status == PASS
    assert devices.judge_gpus([_gpus(0, "a", 8)], nproc_per_node=4).status == WARN  # idle GPUs


def test_socket_ifname_rules_of_nccl_and_gloo():
    ifaces = ["lo", "eth0", "eth1", "docker0", "ib0"]
    assert ifname.nccl_matches("eth", ifaces) == ["eth0", "eth1"]
    assert ifname.nccl_matches("^lo,docker", ifaces) == ["eth0", "eth1", "ib0"]
    assert ifname.nccl_matches("=eth", ifaces) == [] and ifname.nccl_matches("^=eth0", ifaces) == [
        "lo", "eth1", "docker0", "ib0"]
    assert "NCCL's '^' syntax" in ifname.gloo_error("^lo", ifaces)
    assert ifname.gloo_error("eth0,eth1", ifaces) is None and "no interface eth9" in ifname.gloo_error("eth9", ifaces)
    good = ifname.IfnameFacts(node=0, host="a", interfaces=tuple(ifaces), nccl="eth", gloo="eth0",
                              routes=((1, "10.0.0.2", "eth0"),))
    bad = ifname.IfnameFacts(node=1, host="b", interfaces=tuple(ifaces), nccl="ib", gloo="^lo",
                             routes=((0, "10.0.0.1", "eth0"),))
    assert ifname.judge_ifnames([good]).status == PASS
    row = ifname.judge_ifnames([good, bad])
    assert row.status == FAIL and row.hosts == ("b",)
    assert "node 1 (host b): GLOO_SOCKET_IFNAME=^lo uses NCCL's '^' syntax" in row.detail
    assert "its route to node 0 (10.0.0.1) leaves through eth0, which NCCL_SOCKET_IFNAME=ib excludes" in row.detail
    assert row.fix.startswith("set GLOO_SOCKET_IFNAME to one exact interface name (b: eth0, the interfaces of their "
                              "routes to the other nodes)")  # the name that works there, not a guess


def test_repair_gloo_keeps_doctor_running_and_returns_the_refused_value():
    environ = {"GLOO_SOCKET_IFNAME": "^lo"}
    assert ifname.repair_gloo(environ, master_addr="127.0.0.1") == "^lo"
    assert environ.get("GLOO_SOCKET_IFNAME") in (None, "lo")
    assert ifname.repair_gloo({"GLOO_SOCKET_IFNAME": "lo"}, master_addr="127.0.0.1") is None


def _health(rank: int, host: str, gemm: float, mem: float, nvml: dict | None = None) -> gpu_health.GpuHealth:
    return gpu_health.GpuHealth(rank=rank, node=rank // 2, host=host, device=f"cuda:{rank % 2}", name="H100",
                                gemm_tflops=gemm, mem_gbps=mem, nvml=nvml or {})


def test_gpu_more_than_the_threshold_below_the_median_is_named_with_its_clocks():
    hot = {"sm_clock_mhz": 1100, "max_sm_clock_mhz": 1980, "temperature_c": 91, "power_w": 700.0,
           "throttle": "hardware thermal slowdown"}
    results = [_health(0, "a", 700, 3000), _health(1, "a", 690, 2950), _health(2, "b", 450, 2990, hot),
               _health(3, "b", 705, 2000)]
    row = gpu_health.judge_health(results, threshold=0.15)
    assert row.status == WARN and row.hosts == ("b",)
    assert "cuda:0 on node 1 (host b, H100): GEMM 450 TFLOP/s (65% of median); SM clock 1100/1980 MHz, 91 C, " \
           "700 W, throttled: hardware thermal slowdown" in row.detail
    assert "cuda:1 on node 1 (host b, H100): memory 2e+03 GB/s (67% of median)" in row.detail
    assert gpu_health.judge_health(results[:2], threshold=0.15).status == PASS


def test_gemm_and_memory_bandwidth_measure_on_the_cpu():
    cpu = torch.device("cpu")
    tflops = gpu_health.gemm_tflops(cpu, n=64, iters=2)
    gbps = gpu_health.memory_gbps(cpu, nbytes=1 << 20, iters=2)
    assert 1e-6 < tflops < 100 and 0.01 < gbps < 10_000  # a CPU core does MFLOP/s..TFLOP/s, copies MB/s..TB/s


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU, which doctor does measure")
def test_doctor_measures_no_cpu_speed_and_says_there_is_no_gpu():
    # CPU ranks share their host's cores: a GEMM figure of each (0.0002 TFLOP/s) would compare nothing
    assert gpu_health.my_devices(local_rank=1, local_world_size=2) == []
    assert gpu_health.measure_local(rank=0, node=0, host="h", local_rank=0, local_world_size=1) == []
    row = gpu_health.judge_health([], threshold=0.15)
    assert row.status == PASS and row.detail.startswith("no GPUs: nothing to measure") and "TFLOP" not in row.detail


def test_next_steps_put_failures_first_and_network_before_storage():
    table = [rows.CheckRow("dataset", FAIL, "d", next_command="ls data"),
             rows.CheckRow("clock skew", WARN, "c", next_command="chronyc tracking"),
             rows.CheckRow("socket interface", FAIL, "s", next_command="ip -br addr"),
             rows.CheckRow("GPUs per node", PASS, "ok")]
    assert rows.next_steps(table) == ["1. socket interface (fail): ip -br addr", "2. dataset (fail): ls data",
                                      "3. clock skew (warn): chronyc tracking"]


def test_doctor_reads_the_jobs_data_checkpoint_folder_and_size_from_its_config(tmp_path):
    from meshrun.diag import doctor, doctor_checks
    from meshrun.models.build import model_shape, model_spec
    from meshrun.config import load_config

    cfg = tmp_path / "job.toml"
    cfg.write_text(f'[model]\nname = "tiny"\n[data]\nsource = "{tmp_path}/tokens.bin"\n[run]\ndir = "{tmp_path}/run"\n')
    args = doctor.build_parser().parse_args(["--config", str(cfg)])
    data, folder, needed = doctor_checks.job_targets(args)
    assert (data, folder) == (f"{tmp_path}/tokens.bin", f"{tmp_path}/run/checkpoints")
    job = load_config(cfg)
    assert needed == 12 * model_spec(job).count_params(model_shape(job)) > 0
    explicit = doctor.build_parser().parse_args(["--config", str(cfg), "--ckpt-dir", "/x", "--ckpt-bytes", "2G"])
    assert doctor_checks.job_targets(explicit)[1:] == ("/x", 2 * 2**30)


def test_nvml_fields_are_read_and_a_missing_one_is_left_out(monkeypatch):
    import sys
    import types

    fake = types.SimpleNamespace(
        NVML_CLOCK_SM=1, NVML_TEMPERATURE_GPU=0, nvmlInit=lambda: None,
        nvmlDeviceGetClockInfo=lambda h, kind: 1100, nvmlDeviceGetMaxClockInfo=lambda h, kind: 1980,
        nvmlDeviceGetTemperature=lambda h, kind: 91, nvmlDeviceGetPowerUsage=lambda h: 700_000,
        nvmlDeviceGetCurrentClocksEventReasons=lambda h: 0x40 | 0x1)  # hardware thermal slowdown, and idle
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(gpu_health, "_nvml_handle", lambda pynvml, index: f"handle{index}")
    state = gpu_health.nvml_state(3)
    assert state == {"sm_clock_mhz": 1100, "max_sm_clock_mhz": 1980, "temperature_c": 91, "power_w": 700.0,
                     "throttle": "hardware thermal slowdown"}
    del fake.nvmlDeviceGetPowerUsage
    assert gpu_health.describe_nvml(gpu_health.nvml_state(3)) == (
        "SM clock 1100/1980 MHz, 91 C, throttled: hardware thermal slowdown")
