"""Pure logic behind `meshrun runs`, summary.json, `meshrun plan --tokens` and the TensorBoard scalars (no
process group, no training)."""

import json

import pytest

from meshrun.planner.step_time import parse_count, time_estimate
from meshrun.report.load import load_run, status_of
from meshrun.train.summary import compute_summary


def _records(*, restart_at: int | None = None):
    """A small run as metrics.jsonl holds it: 2 ranks, 4 log intervals, evaluations and checkpoints."""
    t, out = 1000.0, [{"time": 1000.0, "kind": "start", "step": 0, "world_size": 2, "nodes": 1,
                        "layout": "pp 1 x dp_replicate 2 x dp_shard 1 x tp 1 = 2 ranks | DDP", "global_batch": 16,
                        "tokens_per_step": 1024}]
    for i, step in enumerate((10, 20, 30, 40)):
        t += 10
        if restart_at == step:
            out.append({"time": t, "kind": "start", "step": step - 10, "world_size": 2, "global_batch": 16})
        out.append({"time": t, "kind": "train", "step": step, "loss": 5.0 - i, "tokens_seen": step * 1024,
                    "tokens_per_s": [100.0, 2000.0, 2200.0, 2100.0][i], "mfu": None, "lr": 1e-3})
        out.append({"time": t, "kind": "ranks", "step": step, "work_s": [0.01, 0.02], "data_s": [0.0, 0.01],
                    "rest_s": [0.02, 0.01], "peak_mem_gib": [0.5, 0.75]})
        if step % 20 == 0:
            out.append({"time": t, "kind": "eval", "step": step, "loss": [9, 2.5, 9, 2.75][i]})
            out.append({"time": t, "kind": "checkpoint", "step": step, "final": step == 40})
    return out


def test_summary_numbers_from_the_records():
    s = compute_summary(_records())
    assert (s["steps"], s["tokens"], s["wall_time_s"]) == (40, 40 * 1024, 40.0)
    assert (s["final_train_loss"], s["final_val_loss"], s["best_val_loss"]) == (2.0, 2.75, 2.5)
    assert s["tokens_per_s"] == 2100.0  # median after the first (warm-up) interval, not dragged down by it
    assert s["peak_mem_gib"] == 0.75 and s["restarts"] == 0 and s["last_checkpoint_step"] == 40
    assert compute_summary(_records(restart_at=30))["restarts"] == 1


def test_validation_loss_against_tokens(tmp_path):
    from meshrun.report.plots import _eval_by_tokens

    run = load_run(_write_run(tmp_path / "a", _records()))
    assert _eval_by_tokens(run) == ([20 * 1024, 40 * 1024], [2.5, 2.75])


def _write_run(path, records, summary=None):
    path.mkdir()
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"half-written')
    if summary is not None:
        (path / "summary.json").write_text(json.dumps(summary))
    return path


def test_status_from_summary_recent_writes_or_silence(tmp_path):
    ended = _write_run(tmp_path / "a", _records(), {"time": 2000.0, "status": "stopped early", "exit_reason": "SIGTERM"})
    run = load_run(ended)  # the half-written last line is skipped
    assert run.summary["status"] == "stopped early" and run.summary["steps"] == 40
    records = _records(restart_at=30)  # a start after the summary was written: running again
    assert status_of(ended, records, {"time": 1025.0, "status": "finished"}, now=1e12)[0] == "failed"
    mtime = (ended / "metrics.jsonl").stat().st_mtime
    assert status_of(ended, records, {"time": 1025.0, "status": "finished"}, now=mtime + 5)[0] == "running"
    assert status_of(ended, records, None, now=mtime + 3600)[0] == "failed"


def test_runs_json_lists_each_run_directory(tmp_path, capsys):
    from meshrun.report.runs import main

    _write_run(tmp_path / "a", _records(), {"time": 2000.0, "status": "finished", "exit_reason": "done"})
    _write_run(tmp_path / "b", _records()[:3])
    (tmp_path / "not_a_run").mkdir()
    assert main([str(tmp_path), "--json"]) == 0
    rows = {r["run"].rsplit("/", 1)[1]: r for r in json.loads(capsys.readouterr().out)}
    assert sorted(rows) == ["a", "b"]
    assert rows["a"]["status"] == "finished" and rows["a"]["best_val_loss"] == 2.5
    assert rows["b"]["status"] == "running" and rows["b"]["steps"] == 10
    assert main([str(tmp_path)]) == 0 and "DDP (2 ranks)" in capsys.readouterr().out


def test_time_estimate_for_100b_parameters_and_1t_tokens():
    est = time_estimate(params=parse_count("100B", "--params"), tokens=parse_count("1T", "--tokens"), gpus=128,
                        peak_flops=989e12, mfu=0.4, tokens_per_s=45_000)
    assert est["flops"] == pytest.approx(6e23)
    assert est["seconds_at_mfu"] / 86400 == pytest.approx(137.1, abs=0.1)  # 6e23 / (0.4 x 128 x 989e12)
    assert est["seconds_at_throughput"] / 86400 == pytest.approx(257.2, abs=0.1)  # 1e12 / 45,000
    assert est["implied_mfu"] == pytest.approx(0.213, abs=0.001)


def test_plan_prints_the_arithmetic(capsys):
    from meshrun.planner import main

    assert main(["--nodes", "2", "--model", "124m", "--ranks", "1", "--params", "100B", "--tokens", "1T",
                 "--tokens-per-s", "45000"]) == 0
    out = capsys.readouterr().out
    assert "training FLOPs = 6 x 1e+11 x 1e+12 = 6e+23" in out and "16 GPUs x 989 TFLOP/s" in out
    assert "= 1,097.1 days" in out and "= 257.2 days" in out and "170.6% MFU" in out
    assert "warning: above 100% MFU, so this throughput is impossible" in out
    assert main(["--tokens", "lots"]) == 2 and "--tokens 'lots'" in capsys.readouterr().err


def test_tensorboard_gets_per_rank_step_times(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is an optional extra (.[tensorboard]), not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from meshrun.train.metrics import MetricsSink

    sink = MetricsSink(tmp_path, total_steps=10, progress="lines", tensorboard=True, enabled=True)
    sink.record({"kind": "ranks", "step": 5, "work_s": [0.01, 0.25], "data_s": [0.0, 0.2]})
    sink.close()
    events = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    assert events.Scalars("ranks/work_s/rank_1")[0].value == pytest.approx(0.25)
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["work_s"] == [0.01, 0.25]


def test_report_of_a_run_that_has_only_started(tmp_path):
    pytest.importorskip("matplotlib", reason="meshrun report needs matplotlib (pip install -e '.[test]')")
    from meshrun.report.cli import write_report

    run = _write_run(tmp_path / "young", _records(restart_at=30)[:2])  # a start and one train record so far
    page = write_report([run], tmp_path / "out").read_text()
    assert 'src="loss.svg"' in page and 'src="ranks_0.svg"' not in page  # no per-rank record yet: no heatmap
    assert '<td class="text status">running</td>' in page


def test_the_forward_plot_shows_the_gpus_and_the_hosts_time_of_a_gpu_run(tmp_path):
    """The slowest rank's forward on the GPU (work minus data wait) and the host's time issuing it; a CPU run,
    whose forward is timed on the host's clock, and a run without the host's time get no plot."""
    pytest.importorskip("matplotlib", reason="meshrun report needs matplotlib (pip install -e '.[test]')")
    from meshrun.report.plots import forward_times, plot_forward

    records = _records()
    records[0]["device"] = "cuda:0"
    for r, host in zip((r for r in records if r["kind"] == "ranks"), (0.05, 0.044, 0.043, 0.03)):
        r["forward_host_s"] = [host, host - 0.01]
    run = load_run(_write_run(tmp_path / "gpu", records))
    steps, gpu, host = forward_times(run)
    assert steps == [10, 20, 30, 40] and gpu == pytest.approx([10.0] * 4)  # rank 0: 10 - 0, rank 1: 20 - 10 ms
    assert host == pytest.approx([50.0, 44.0, 43.0, 30.0])
    assert plot_forward(run, tmp_path, "forward_0.svg").stat().st_size > 5000
    cpu = load_run(_write_run(tmp_path / "cpu", [{**r, "device": "cpu"} if r["kind"] == "start" else r
                                                 for r in records]))
    older = load_run(_write_run(tmp_path / "old", _records()))
    assert forward_times(cpu) == forward_times(older) == ([], [], [])
    assert plot_forward(cpu, tmp_path, "cpu.svg") is None


def test_runs_table_shows_a_short_layout_cell_with_the_degrees_and_a_right_plural():
    from meshrun.comm.mesh import ParallelDims
    from meshrun.config import ParallelConfig
    from meshrun.parallel.apply import describe_layout
    from meshrun.report.runs import short_layout

    def cell(world_size: int, **degrees) -> str:
        dims = ParallelDims.from_config(ParallelConfig(**degrees), world_size=world_size)
        return short_layout(describe_layout(dims))

    assert cell(2, pp=2, pp_schedule="1f1b", pp_microbatches=4) == "PP 2 1f1b (2 ranks)"
    assert cell(16, pp=2, tp=2, dp_shard=2, dp_replicate=-1, pp_schedule="1f1b", pp_microbatches=4) == \
        "PP 2 1f1b + TP 2 + HSDP (16 ranks)"
    assert cell(2) == "DDP (2 ranks)" and cell(1) == "single process"
    assert short_layout("pp 1 x dp_replicate 1 x dp_shard 1 x tp 1 = 1 ranks") == "1 rank"  # an older run's line
    assert short_layout(None) == "-"


def _dims(world_size: int, **degrees):
    from meshrun.comm.mesh import ParallelDims
    from meshrun.config import ParallelConfig

    return ParallelDims.from_config(ParallelConfig(**degrees), world_size=world_size)


LAYOUTS = [(2, {"pp": 2, "pp_schedule": "1f1b", "pp_microbatches": 4}),
           (16, {"pp": 2, "tp": 2, "dp_shard": 2, "dp_replicate": -1, "pp_schedule": "interleaved1f1b",
                 "pp_microbatches": 4}),
           (8, {"cp": 2, "dp_shard": -1}), (4, {"tp": 2, "dp_replicate": 2}), (2, {}), (1, {})]


@pytest.mark.parametrize("world_size, degrees", LAYOUTS)
def test_the_start_records_layout_data_gives_the_cell_the_layout_line_gives(world_size, degrees):
    """The start record's ``parallel`` entry (what a run writes now) and its layout line (all an older run wrote)
    give one cell for the same layout."""
    from meshrun.parallel.apply import describe_layout
    from meshrun.report.runs import layout_cell, short_layout
    from meshrun.train.header import parallel_record

    dims = _dims(world_size, **degrees)
    parallel = json.loads(json.dumps(parallel_record(dims)))  # as metrics.jsonl holds it
    assert layout_cell(parallel, None) == short_layout(describe_layout(dims)) != "-"
    assert parallel["world_size"] == world_size and parallel["pp"] == dims.pp and parallel["tp"] == dims.tp


def _start(**fields) -> dict:
    return {"time": 1000.0, "kind": "start", "step": 0, "world_size": 2, "nodes": 1, "global_batch": 16, **fields}


def test_runs_reads_the_layout_cell_from_the_start_records_data_and_an_older_runs_line(tmp_path, monkeypatch,
                                                                                        capsys):
    """A run folder whose start record holds the layout as data shows the cell from it, whatever its layout line
    says; one written before (the line alone) shows the cell read out of the line; one with neither shows '-'."""
    from meshrun.parallel.apply import describe_layout
    from meshrun.report.runs import main
    from meshrun.train.header import parallel_record

    dims = _dims(2, pp=2, pp_schedule="1f1b", pp_microbatches=4)
    train = _records()[1:]
    _write_run(tmp_path / "new", [_start(layout="a line in words this version no longer reads back",
                                         parallel=parallel_record(dims)), *train])
    _write_run(tmp_path / "old", [_start(layout=describe_layout(_dims(4, tp=2, dp_shard=-1))), *train])
    _write_run(tmp_path / "neither", [_start(), *train])
    _write_run(tmp_path / "odd", [_start(layout=describe_layout(_dims(2)), parallel={"parallelisms": "PP"}), *train])
    monkeypatch.chdir(tmp_path)
    assert main([".", "--json"]) == 0
    rows = {r["run"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["new"]["parallel"]["parallelisms"] == ["PP"] and rows["old"]["parallel"] is None
    assert main(["."]) == 0
    out = capsys.readouterr().out
    cells = {line.split("│")[1].strip(): line.split("│")[7].strip() for line in out.splitlines()
             if line.count("│") == 10}
    assert cells == {"new": "PP 2 1f1b (2 ranks)", "old": "TP 2 + FSDP (4 ranks)", "neither": "-",
                     "odd": "DDP (2 ranks)"}, out
