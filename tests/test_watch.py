"""System metrics (sampler, verdicts), the trackers in their local modes, and the Prometheus endpoint over HTTP.

The trackers are the real packages: TensorBoard's event files, an MLflow file store and a W&B offline run are read
back after the sink wrote to them. Each skips, saying which package is missing, where its extra is not installed.
"""

import json
import struct
import sys
import time
import urllib.request

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from meshrun.config import ConfigError, load_config
from meshrun.placement.process import ProcessPlacement
from meshrun.report.trackers import open_tracker, record_metrics
from meshrun.train.metrics import MetricsSink
from meshrun.watch.node import SystemWatch, bind_address, comm_interface
from meshrun.watch.system import SystemSampler
from meshrun.watch.verdicts import SystemVerdicts

NODE_RECORD = {"kind": "system", "step": 4, "node": 1, "rank": 2, "host": "b", "interval_s": 2.0,
               "cpu_util_pct": 50.0, "host_mem_used_gib": 3.0,
               "gpus": [{"index": 0, "util_pct": 40.0, "power_w": 300.0, "throttle": ""}],
               "net": {"eth0": {"sent_mb_s": 1.0, "recv_mb_s": 2.0, "sent_bytes": 2, "recv_bytes": 4, "comm": True},
                       "docker0": {"sent_mb_s": 0.5, "recv_mb_s": 0.0, "sent_bytes": 1, "recv_bytes": 0,
                                   "comm": False}}}


def _fake_proc(root, *, busy, idle, sent, recv, mem_available_kib):
    (root / "net").mkdir(parents=True, exist_ok=True)
    (root / "stat").write_text(f"cpu  {busy} 0 0 {idle} 0 0 0 0 0 0\ncpu0 1 0 0 1 0 0 0 0 0 0\n")
    (root / "meminfo").write_text(f"MemTotal: 8388608 kB\nMemFree: 1 kB\nMemAvailable: {mem_available_kib} kB\n")
    (root / "net" / "dev").write_text(
        "Inter-|   Receive                                                |  Transmit\n"
        " face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets\n"
        f"    lo: 100 1 0 0 0 0 0 0 100 1 0 0 0 0 0 0\n"
        f"  eth0: {recv} 5 0 0 0 0 0 0 {sent} 5 0 0 0 0 0 0\n")


def test_sampler_turns_proc_counters_into_an_interval_record_without_gpu_rows(tmp_path):
    proc, sys_net = tmp_path / "proc", tmp_path / "sys"
    (sys_net / "eth0").mkdir(parents=True)
    (sys_net / "eth0" / "speed").write_text("10000\n")  # 10 Gb/s
    _fake_proc(proc, busy=100, idle=100, sent=1_000, recv=2_000, mem_available_kib=4 * 2**20)
    sampler = SystemSampler(interval_s=60, gpus=[], comm_iface="eth0", proc=proc, sys_net=sys_net)
    _fake_proc(proc, busy=130, idle=110, sent=5_001_000, recv=2_000, mem_available_kib=6 * 2**20)
    time.sleep(0.2)  # an interval long enough for its rounding (ms) not to matter
    sampler.sample()
    record = sampler.take()
    assert record["cpu_util_pct"] == 75.0  # 30 busy of 40 jiffies
    assert record["host_mem_used_gib"] == 2.0 and record["host_mem_total_gib"] == 8.0
    eth0 = record["net"]["eth0"]
    assert eth0["sent_bytes"] == 5_000_000 and eth0["recv_bytes"] == 0 and eth0["comm"] is True
    assert eth0["speed_mb_s"] == 1250.0 and eth0["sent_mb_s"] == pytest.approx(5 / record["interval_s"], rel=0.01)
    assert "lo" not in record["net"]  # no traffic in the interval, and not the NCCL/gloo interface
    assert record["comm_iface"] == "eth0"
    assert "gpus" not in record  # no GPU: the rows are absent, not zero


def test_sampler_thread_reads_this_machine():
    sampler = SystemSampler(interval_s=0.01, gpus=[], comm_iface="lo").start()
    try:
        while sampler._sums.samples < 3:
            pass
    finally:
        sampler.stop()
    record = sampler.take()
    assert 0 < record["host_mem_used_gib"] < record["host_mem_total_gib"]
    assert record["net"]["lo"]["comm"] is True and 0 <= record.get("cpu_util_pct", 0) <= 100


def test_verdicts_name_the_node_once_the_condition_has_lasted():
    verdicts = SystemVerdicts(persist_s=5.0)
    busy = {**NODE_RECORD, "gpus": [{"index": 0, "util_pct": 95.0}]}
    assert verdicts.observe(NODE_RECORD) == [] and verdicts.observe(NODE_RECORD) == []  # 4 s
    assert verdicts.observe(busy) == []  # recovered: the episode starts again
    found = [verdicts.observe(NODE_RECORD) for _ in range(4)]  # 2, 4, 6, 8 s
    assert found[:2] == [[], []] and found[3] == []  # once per episode
    assert found[2] == ["node 1 (host b): GPU 0 below 70% busy for 6 s (mean 40%): it waits on data, the host "
                        "or the network; compare the nodes' system plots in `meshrun report`"]
    link = {**NODE_RECORD, "gpus": [], "net": {"ib0": {"sent_mb_s": 12_000.0, "recv_mb_s": 1.0, "comm": True,
                                                       "speed_mb_s": 12_500.0}}}
    saturated = [line for _ in range(3) for line in verdicts.observe(link)]
    assert len(saturated) == 1 and saturated[0].startswith(
        "node 1 (host b): ib0 (the NCCL/gloo interface) at 96% of its 100 Gb/s for 6 s: the link is saturated")
    assert verdicts.observe({**link, "net": {"ib0": {**link["net"]["ib0"], "sent_mb_s": 11_000.0}}}) == []


def test_system_record_becomes_per_node_tracker_metrics():
    metrics = record_metrics(NODE_RECORD)
    assert metrics["system/node_1/cpu_util_pct"] == 50.0
    assert metrics["system/node_1/gpu_0/util_pct"] == 40.0 and metrics["system/node_1/gpu_0/power_w"] == 300.0
    assert metrics["system/node_1/comm_net/recv_mb_s"] == 2.0  # the NCCL/gloo interface, whatever its name
    assert metrics["system/node_1/net/docker0/sent_mb_s"] == 0.5
    assert not any(key.endswith(("/rank", "/index", "/comm", "/throttle")) for key in metrics)
    ranks = record_metrics({"kind": "ranks", "step": 3, "work_s": [0.1, 0.2], "step_s": 0.5})
    assert ranks == {"ranks/step_s": 0.5, "ranks/work_s/rank_0": 0.1, "ranks/work_s/rank_1": 0.2}
    slowdown = record_metrics({"kind": "slowdown", "step": 12, "steps": 3, "step_s": 0.9, "median_step_s": 0.1,
                               "profile_steps": [14, 15]})
    assert slowdown == {"slowdown/steps": 3.0, "slowdown/step_s": 0.9, "slowdown/median_step_s": 0.1}


def _write_run(tmp_path, tracker_name, monkeypatch):
    """A sink with the tracker ``tracker_name`` fed a start, two train records and one system record per node."""
    job = load_config(None, [f"--run.dir={tmp_path}", f"--run.tracker={tracker_name}", "--model.dim=48"])
    sink = MetricsSink(tmp_path, total_steps=6, progress="lines", enabled=True,
                       tracker=open_tracker(job, tmp_path))
    sink.record({"kind": "start", "step": 0, "layout": "DDP (2 ranks)", "world_size": 2, "nodes": 2})
    for step, loss in ((3, 2.5), (6, 2.0)):
        sink.record({"kind": "train", "step": step, "loss": loss, "tokens_per_s": 100.0 * step})
        for node in (0, 1):
            sink.record({**NODE_RECORD, "step": step, "node": node, "cpu_util_pct": 10.0 * node + step})
    sink.close()
    return json.loads((tmp_path / "tracker.json").read_text()).get(tracker_name)


def test_tensorboard_event_files_hold_training_and_each_nodes_metrics(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard", reason="the tensorboard extra (.[tensorboard]) is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    job = load_config(None, [f"--run.dir={tmp_path}", "--run.tracker=tensorboard"])
    sink = MetricsSink(tmp_path, total_steps=6, progress="lines", enabled=True, tracker=open_tracker(job, tmp_path))
    sink.record({"kind": "train", "step": 3, "loss": 2.5})
    sink.record({**NODE_RECORD, "step": 3})
    sink.close()
    events = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(3, 2.5)]
    assert [e.value for e in events.Scalars("system/node_1/gpu_0/util_pct")] == [40.0]
    assert "params/text_summary" in events.Tags()["tensors"]


def test_mlflow_file_store_holds_params_training_and_each_nodes_metrics(tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason="the mlflow extra (.[mlflow], mlflow-skinny) is not installed")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_id = _write_run(tmp_path, "mlflow", monkeypatch)
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    run = client.get_run(run_id)
    assert run.data.params["model.dim"] == "48" and run.data.params["layout"] == "DDP (2 ranks)"
    assert run.data.params["world_size"] == "2" and run.info.status == "FINISHED"
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "train/loss")] == [(3, 2.5), (6, 2.0)]
    for node in (0, 1):
        history = client.get_metric_history(run_id, f"system/node_{node}/cpu_util_pct")
        assert sorted((m.step, m.value) for m in history) == [(3, 10.0 * node + 3), (6, 10.0 * node + 6)]
    again = _write_run(tmp_path, "mlflow", monkeypatch)  # a restarted job continues the same run
    assert again == run_id and len(client.get_metric_history(run_id, "train/loss")) == 4


def _wandb_records(path):
    """The records of a W&B transaction log (.wandb): 32 KiB blocks of chunks with a 7-byte header (CRC, length,
    type: 1 full, 2 first, 3 middle, 4 last), each record a wandb_internal Record protobuf."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, chunks = 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:
            pos += 32768 - pos % 32768  # block trailer
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == kind == 0 or pos + 7 + length > len(data):
            break  # the end, or a chunk still being written
        chunks = data[pos + 7:pos + 7 + length] if kind in (1, 2) else chunks + data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            yield record


@pytest.mark.slow
def test_wandb_offline_run_holds_params_training_and_each_nodes_metrics(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="the wandb extra (.[wandb]) is not installed")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_id = _write_run(tmp_path, "wandb", monkeypatch)
    (log,) = tmp_path.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb")
    deadline = time.monotonic() + 60  # wandb-core (its own process) may still be writing when finish() returns
    while not any(r.WhichOneof("record_type") == "exit" for r in _wandb_records(log)):
        assert time.monotonic() < deadline, "W&B wrote no exit record to its transaction log within 60 s"
        time.sleep(0.2)
    history, config = [], {}
    for record in _wandb_records(log):
        if record.WhichOneof("record_type") == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})
        elif record.WhichOneof("record_type") in ("config", "run"):  # early updates may ride in the run record
            updates = record.config.update if record.HasField("config") else record.run.config.update
            config.update({item.key or ".".join(item.nested_key): json.loads(item.value_json) for item in updates})
    assert config["model.dim"] == 48 and config["layout"] == "DDP (2 ranks)"
    rows = {row["_step"]: row for row in history}
    assert rows[3]["train/loss"] == 2.5 and rows[6]["train/loss"] == 2.0
    assert rows[6]["system/node_0/cpu_util_pct"] == 6.0 and rows[6]["system/node_1/cpu_util_pct"] == 16.0


def test_a_missing_tracker_package_is_one_line_naming_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if mlflow were not installed
    monkeypatch.setitem(sys.modules, "mlflow.tracking", None)
    job = load_config(None, [f"--run.dir={tmp_path}", "--run.tracker=mlflow"])
    with pytest.raises(ConfigError) as err:
        open_tracker(job, tmp_path)
    assert str(err.value) == ("run.tracker=mlflow needs the mlflow package: pip install 'meshrun[mlflow]' "
                              "(or set run.tracker=none)")
    with pytest.raises(ConfigError, match="run.tracker='comet' is not one of none, tensorboard, wandb, mlflow"):
        load_config(None, ["--run.tracker=comet"])
    with pytest.raises(ConfigError, match="give none, or one or a comma list of the others"):
        load_config(None, ["--run.tracker=none,mlflow"])
    assert load_config(None, ["--run.tracker=mlflow, tensorboard"]).run.tracker == "mlflow, tensorboard"


def test_prometheus_endpoint_answers_on_loopback_and_moves_up_from_a_taken_port():
    pytest.importorskip("prometheus_client", reason="the prometheus extra (.[prometheus]) is not installed")
    import socket

    from meshrun.watch.prometheus import MetricsEndpoint

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        endpoint = MetricsEndpoint(addr="127.0.0.1", port=port, node=1)
    try:
        assert endpoint.port > port and endpoint.url == f"http://127.0.0.1:{endpoint.port}/metrics"
        endpoint.update_system(NODE_RECORD)
        endpoint.update_train({"kind": "train", "step": 6, "loss": 2.25, "tokens_per_s": 1e4})
        text = urllib.request.urlopen(endpoint.url, timeout=10).read().decode()
    finally:
        endpoint.close()
    assert 'meshrun_gpu_utilization_percent{gpu="0",node="1"} 40.0' in text
    assert 'meshrun_network_received_mb_per_second{comm="true",iface="eth0",node="1"} 2.0' in text
    assert 'meshrun_train_loss{node="1"} 2.25' in text and 'meshrun_cpu_utilization_percent{node="1"} 50.0' in text


def test_the_nccl_or_gloo_interface_is_the_one_their_variables_select():
    interfaces = ["lo", "docker0", "eth0", "ib0"]
    nccl_only = {"NCCL_SOCKET_IFNAME": "^docker,lo"}  # NCCL's exclusion syntax
    assert comm_interface(nccl_only, gpu=True, interfaces=interfaces) == "eth0"
    both = {"NCCL_SOCKET_IFNAME": "=ib0", "GLOO_SOCKET_IFNAME": "eth0"}
    assert comm_interface(both, gpu=True, interfaces=interfaces) == "ib0"
    assert comm_interface(both, gpu=False, interfaces=interfaces) == "eth0"
    assert comm_interface({"MESHRUN_LOCAL_ADDR": "127.0.0.1"}, gpu=False, interfaces=interfaces) == "lo"
    assert comm_interface({}, gpu=False, interfaces=interfaces) is None


def test_endpoint_binds_the_launchers_address_and_never_every_interface_by_default():
    run = load_config(None, []).run
    assert bind_address(run, {}) == "127.0.0.1"
    assert bind_address(run, {"MESHRUN_LOCAL_ADDR": "10.1.2.3"}) == "10.1.2.3"
    run.prometheus_addr = "0.0.0.0"  # only when asked for
    assert bind_address(run, {"MESHRUN_LOCAL_ADDR": "10.1.2.3"}) == "0.0.0.0"


@pytest.mark.gpu
def test_sampler_reads_each_gpu_through_nvml():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU on this machine")
    pytest.importorskip("pynvml", reason="nvidia-ml-py (the gpu extra) is not installed")
    x = torch.randn(8192, 8192, device="cuda")  # (n, n), 256 MiB
    sampler = SystemSampler(interval_s=0.05, gpus=list(range(torch.cuda.device_count())), comm_iface=None).start()
    for _ in range(200):
        x @ x  # keeps GPU 0 busy while the sampler reads
    torch.cuda.synchronize()
    sampler.stop()
    rows = sampler.take()["gpus"]
    assert [row["index"] for row in rows] == list(range(torch.cuda.device_count()))
    assert rows[0]["util_pct"] > 50 and rows[0]["mem_used_gib"] > 0.25 and rows[0]["power_w"] > 0
    assert rows[0]["sm_clock_mhz"] > 0 and isinstance(rows[0]["throttle"], str)


def _collect_on_one_node(rank, world_size):
    """Both ranks on one node: rank 0 samples and keeps its record; no rank enters a gather."""
    def no_gather(*args, **kwargs):
        raise AssertionError("gather_object on one node")

    dist.gather_object = no_gather
    env = ProcessPlacement(rank=rank, local_rank=rank, world_size=world_size, local_world_size=world_size,
                           node_rank=0, num_nodes=1, master_addr="127.0.0.1", master_port=0, source="torchrun")
    watch = SystemWatch(load_config(None, ["--run.system_sample_s=0.05"]).run, env=env, device=torch.device("cpu"))
    try:
        return [watch.collect(step)[0] for step in (10, 20)]
    finally:
        watch.close()


@pytest.mark.slow
def test_a_one_node_job_keeps_rank_zeros_record_without_a_gather():
    rank0, rank1 = run_distributed(_collect_on_one_node, 2)
    assert [[(r["step"], r["node"], r["rank"]) for r in records] for records in rank0] == [[(10, 0, 0)], [(20, 0, 0)]]
    assert all("host_mem_used_gib" in records[0] for records in rank0)  # the sampled record itself
    assert rank1 == [[], []]
