"""A 2-node rehearsal watched from outside: `meshrun launch --simulate-nodes 2 --nproc-per-node 1 train` with
run.tracker=mlflow,wandb,tensorboard (all three at once, W&B offline) and a Prometheus endpoint per node, against a
1-process run of the same job.

Checks what a user would look at: each node's endpoint answers over HTTP while it trains, metrics.jsonl, the MLflow
file store, the W&B offline run and the TensorBoard event files hold the training losses and both nodes' system
metrics, `meshrun report --compare` finds the
two runs agree (the same global batch, split 1 x 2 micro-batches or 2 x 1), and the report of both draws each
node's system plot on a page of its own.
"""

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from meshrun.launch.net import free_port

pytestmark = pytest.mark.slow
pytest.importorskip("mlflow", reason="the mlflow extra (.[mlflow], mlflow-skinny) is not installed")
pytest.importorskip("wandb", reason="the wandb extra (.[wandb]) is not installed")
pytest.importorskip("tensorboard", reason="the tensorboard extra (.[tensorboard]) is not installed")
pytest.importorskip("prometheus_client", reason="the prometheus extra (.[prometheus]) is not installed")
pytest.importorskip("matplotlib", reason="meshrun report needs matplotlib (pip install -e '.[test]')")

STEPS, LOG_EVERY = 8, 2
JOB = [f"--train.steps={STEPS}", f"--train.log_every={LOG_EVERY}", "--train.eval_every=4", "--train.eval_samples=16",
       "--train.micro_batch=8", "--train.global_batch=16", "--data.max_bytes=100000", "--run.progress=lines",
       "--health.straggler_threshold=0", "--checkpoint.final=false", "--run.system_sample_s=0.2"]


SCRAPED_PORTS = 8
"""Ports scraped from run.prometheus_port up: each node serves on the first free one from there (both simulated
nodes race for it), and another test running beside this one may hold one of them meanwhile."""


def _scrape_until(port: int, done: threading.Event, seen: dict) -> None:
    """Scrape ``port`` until it answers with a node's metrics, or the job ended. One thread per port: a node whose
    endpoint answers slowly on a loaded machine must not use up the short time the other one serves (8 steps).
    An answer may take long (the endpoint's thread shares the GIL with training): a CI run on a loaded machine once
    saw node 0 never answer within a 2 s timeout while it trained, so a request waits up to 20 s."""
    while not done.is_set() and port not in seen:
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=20).read().decode()
        except OSError:
            time.sleep(0.05)
            continue
        if re.search(r'meshrun_cpu_utilization_percent\{node="(\d)"\}', text):
            seen[port] = text
        time.sleep(0.05)


def _records(run_dir, kind):
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("rehearsal")
    two, one = root / "two_nodes", root / "one_process"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    env.pop("MLFLOW_TRACKING_URI", None)
    port = free_port(count=SCRAPED_PORTS)
    seen: dict = {}
    done = threading.Event()
    scrapers = [threading.Thread(target=_scrape_until, args=(p, done, seen), daemon=True)
                for p in range(port, port + SCRAPED_PORTS)]
    for scraper in scrapers:
        scraper.start()
    started = time.monotonic()
    single = subprocess.Popen([sys.executable, "-m", "meshrun", "train", f"--run.dir={one}", *JOB],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    launched = subprocess.run([sys.executable, "-m", "meshrun", "launch", "--simulate-nodes", "2",
                               "--nproc-per-node", "1", "train", f"--run.dir={two}",
                               "--run.tracker=mlflow,wandb,tensorboard",
                               f"--run.prometheus_port={port}", *JOB],
                              capture_output=True, text=True, timeout=300, env=env)
    done.set()
    for scraper in scrapers:
        scraper.join()
    _, single_err = single.communicate(timeout=300)
    print(f"\nrehearsal and 1-process run, side by side: {time.monotonic() - started:.0f} s", file=sys.stderr)
    assert launched.returncode == 0, launched.stderr[-3000:]
    assert single.returncode == 0, single_err[-3000:]
    return two, one, seen


def test_each_node_serves_its_metrics_over_http_while_training(runs):
    _, _, seen = runs
    nodes = {re.search(r'meshrun_cpu_utilization_percent\{node="(\d)"\}', text).group(1): text
             for text in seen.values()}
    assert sorted(nodes) == ["0", "1"], f"endpoints that answered: {list(seen)}"
    assert 'meshrun_host_memory_used_gib{node="1"}' in nodes["1"]
    assert "\nmeshrun_train_loss{" not in nodes["1"]  # training metrics come from rank 0's node only
    assert re.search(r'meshrun_network_sent_mb_per_second\{comm="true",iface="lo",node="0"\}', nodes["0"])


def test_metrics_file_holds_each_nodes_system_record_at_every_log_step(runs):
    two, _, _ = runs
    system = _records(two, "system")
    assert sorted((r["step"], r["node"], r["rank"]) for r in system) == [
        (step, node, node) for step in range(LOG_EVERY, STEPS + 1, LOG_EVERY) for node in (0, 1)]
    for record in system:
        lo = record["net"]["lo"]  # the launcher chose 127.0.0.1 for both simulated nodes: gloo talks over lo
        assert record["comm_iface"] == "lo" and lo["comm"] is True
        assert 0 < record["host_mem_used_gib"] < record["host_mem_total_gib"] and "gpus" not in record
    assert sum(r["net"]["lo"]["sent_bytes"] for r in system) > 0  # gradients went over the link
    ports = {r["node"]: r["prometheus"] for r in system}
    assert ports[0] != ports[1] and all(url.startswith("http://127.0.0.1:") for url in ports.values())


def test_mlflow_run_holds_training_and_both_nodes_system_metrics(runs, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for it to read its file store

    two, _, _ = runs
    run_id = json.loads((two / "tracker.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=(two / "mlruns").as_uri())
    run = client.get_run(run_id)
    assert run.data.params["world_size"] == "2" and run.data.params["nodes"] == "2"
    assert run.data.params["train.global_batch"] == "16"
    assert run.data.params["run.tracker"] == "mlflow,wandb,tensorboard"
    losses = [(r["step"], r["loss"]) for r in _records(two, "train")]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "train/loss")] == losses
    for node in (0, 1):
        history = client.get_metric_history(run_id, f"system/node_{node}/host_mem_used_gib")
        assert sorted(m.step for m in history) == list(range(LOG_EVERY, STEPS + 1, LOG_EVERY))
        assert client.get_metric_history(run_id, f"system/node_{node}/comm_net/sent_mb_s")


def test_tensorboard_and_wandb_runs_hold_training_and_both_nodes_system_metrics(runs):
    """The same records reach the other two trackers of the run (one tracker interface, fanned out)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from test_watch import _wandb_records

    two, _, _ = runs
    losses = [(r["step"], r["loss"]) for r in _records(two, "train")]
    events = EventAccumulator(str(two / "tensorboard")).Reload()
    assert [(e.step, round(e.value, 5)) for e in events.Scalars("train/loss")] == [(s, round(v, 5)) for s, v in losses]
    for node in (0, 1):
        assert len(events.Scalars(f"system/node_{node}/host_mem_used_gib")) == STEPS // LOG_EVERY
    run_id = json.loads((two / "tracker.json").read_text())["wandb"]
    (log,) = two.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb")
    deadline = time.monotonic() + 60  # wandb-core (its own process) may still be writing
    while not any(r.WhichOneof("record_type") == "exit" for r in _wandb_records(log)):
        assert time.monotonic() < deadline, "the W&B offline run never closed"
        time.sleep(0.5)
    keys = {item.key or "/".join(item.nested_key) for r in _wandb_records(log)
            if r.WhichOneof("record_type") == "history" for item in r.history.item}
    assert {"train/loss", "system/node_0/host_mem_used_gib", "system/node_1/host_mem_used_gib"} <= keys, keys


def test_compare_finds_one_process_and_two_nodes_agree(runs, capsys):
    from meshrun.report.cli import main

    two, one, _ = runs
    assert main(["--compare", str(one), str(two), "--tolerance", "1e-4"]) == 0
    out = capsys.readouterr().out
    assert f"training loss: {STEPS // LOG_EVERY} matching points" in out and "validation loss: 2 matching" in out
    assert out.splitlines()[-1].startswith("agree: largest ")
    largest = float(out.splitlines()[-1].split()[2])
    assert largest < 1e-4  # fp32 on CPU: the same sums in another order
    # below the difference, the verdict turns (exit code 1): the tolerance is what decides
    if largest > 0:
        assert main(["--compare", str(one), str(two), "--tolerance", f"{largest / 2:g}"]) == 1
        assert capsys.readouterr().out.splitlines()[-1].startswith("DIFFER: largest ")


def test_report_of_both_runs_draws_each_nodes_system_plot_on_its_own_page(runs):
    from meshrun.report.cli import main

    two, one, _ = runs
    assert main([str(two), "--sample-tokens", "0"]) == 0
    assert main([str(one), str(two), "--sample-tokens", "0"]) == 0
    own, both = two / "report" / "index.html", two.parent / "report-two_nodes-vs-one_process"
    assert not both.exists()
    both = two.parent / "report-one_process-vs-two_nodes"
    assert own.is_file() and (both / "index.html").is_file()  # the comparison left the run's own page alone
    svg = (two / "report" / "system_0.svg").read_text()
    assert "node 0" in svg and "node 1" in svg and "NCCL/gloo interface" in svg
    page = own.read_text()
    assert "MFU" not in page  # a CPU run has no peak FLOP/s
    assert "global_batch = 16" in page  # the run's config on the page
