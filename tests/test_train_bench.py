"""benchmarks/train_bench.py: the ratios and the command line (pure logic), and a whole run on CPU with gloo."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HARNESS = ROOT / "benchmarks" / "train_bench.py"


def load_harness():
    """The harness as a module (benchmarks/ is no package); registered first, as dataclasses need."""
    spec = importlib.util.spec_from_file_location("train_bench", HARNESS)
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_bench"] = module
    spec.loader.exec_module(module)
    return module


tb = load_harness()


def row(impl: str, tps: float, gpus: int = 1, clip: float = 0.0, **extra) -> dict:
    return {"impl": impl, "size": "124m", "gpus": gpus, "grad_clip": clip, "tokens_per_s_per_gpu": tps, **extra}


# --- ratios ------------------------------------------------------------------------------------------------------


def test_ratios_compare_within_one_case_against_baseline_and_fastest_reference():
    rows = [row("baseline-ddp", 400.0), row("accelerate-ddp", 500.0), row("fabric-ddp", 450.0),
            row("meshrun-ddp", 600.0), row("meshrun-ddp-ac", 300.0),
            row("baseline-ddp", 100.0, gpus=2), row("meshrun-ddp", 50.0, gpus=2),
            row("baseline-ddp", 200.0, clip=1.0), row("meshrun-ddp", 100.0, clip=1.0)]
    tb.add_ratios(rows)
    assert [r["vs_baseline"] for r in rows[:5]] == pytest.approx([1.0, 1.25, 1.125, 1.5, 0.75])
    assert [r["vs_best_peer"] for r in rows[:5]] == pytest.approx([0.8, 1.0, 0.9, 1.2, 0.6])
    assert {r["best_peer"] for r in rows[:5]} == {"accelerate-ddp"}
    assert (rows[6]["vs_baseline"], rows[6]["vs_best_peer"]) == (pytest.approx(0.5), pytest.approx(0.5))
    assert (rows[8]["vs_baseline"], rows[8]["best_peer"]) == (pytest.approx(0.5), "baseline-ddp")


def test_worst_case_ratios_set_the_slowest_run_against_the_fastest_run_compared_with():
    # round 10's 1b case: every meshrun run beat every run of the faster baseline, by 0.1% at worst
    rows = [row("baseline-ddp", 64_997.0, runs=3, min=64_922.0, max=65_188.0),
            row("baseline-ddp-split", 66_663.0, runs=3, min=66_523.0, max=66_750.0),
            row("accelerate-ddp", 66_000.0),  # one run: its only run is its fastest
            row("meshrun-fsdp", 67_953.0, runs=3, min=66_819.0, max=72_484.0), row("meshrun-tp", 70_000.0)]
    tb.add_ratios(rows)
    mesh = rows[3]
    assert (mesh["vs_baseline"], mesh["baseline"]) == (pytest.approx(67_953 / 66_663), "baseline-ddp-split")
    assert mesh["vs_baseline_worst"] == pytest.approx(66_819 / 66_750)
    assert mesh["vs_best_peer_worst"] == pytest.approx(66_819 / 66_750)
    assert rows[4]["vs_baseline_worst"] == pytest.approx(70_000 / 66_750)  # one run against the baseline's fastest
    assert tb.ratio(mesh, "vs_baseline") == "1.019x (worst 1.001x)"
    assert tb.ratio(rows[4], "vs_baseline") == "1.050x"  # one run: no worst case to show
    assert tb.ratio({}, "vs_baseline") == "-"


def test_the_baseline_is_the_faster_of_its_ddp_graph_settings_in_each_case():
    rows = [row("baseline-ddp", 400.0), row("baseline-ddp-split", 500.0), row("meshrun-ddp", 550.0),
            row("baseline-ddp", 300.0, gpus=2), row("baseline-ddp-split", 200.0, gpus=2),
            row("meshrun-ddp", 330.0, gpus=2)]
    tb.add_ratios(rows)
    assert (rows[2]["vs_baseline"], rows[2]["baseline"]) == (pytest.approx(1.1), "baseline-ddp-split")
    assert (rows[5]["vs_baseline"], rows[5]["baseline"]) == (pytest.approx(1.1), "baseline-ddp")
    assert rows[2]["best_peer"] == "baseline-ddp-split"


def test_both_baseline_graph_settings_run_when_compiling_and_each_passes_its_setting(monkeypatch):
    compiled, _ = tb.make_plan(tb.parse_args(["--peers", "", "--layouts", ""]), "NVIDIA H100 80GB HBM3")
    eager, _ = tb.make_plan(tb.parse_args(["--peers", "", "--layouts", ""]), "cpu")
    chosen, _ = tb.make_plan(tb.parse_args(["--peers", "", "--layouts", "", "--baseline-graphs", "split"]), "cpu")
    assert (compiled.baseline_graphs, eager.baseline_graphs, chosen.baseline_graphs) == (
        ("whole", "split"), ("whole",), ("split",))
    calls = []
    monkeypatch.setattr(tb, "run_script", lambda script, case, plan, env: calls.append((script.impl, script.args))
                        or {"tokens_per_s_per_gpu": 1.0})
    list(tb.run_case(tb.Case("tiny", 2, 0.0), compiled, {}))
    assert calls == [("baseline-ddp", ("--ddp-graph", "whole")), ("baseline-ddp-split", ("--ddp-graph", "split"))]
    calls.clear()
    list(tb.run_case(tb.Case("tiny", 1, 0.0), compiled, {}))  # one GPU: nothing to overlap, one graph only
    assert calls == [("baseline-ddp", ("--ddp-graph", "whole"))]
    with pytest.raises(SystemExit):
        tb.parse_args(["--baseline-graphs", "whole,fused"])


def test_launch_args_reach_every_rows_launcher_and_the_caption(monkeypatch):
    plan, _ = tb.make_plan(tb.parse_args(["--peers", "", "--layouts", "ddp", "--launch-args", "--numa-binding node",
                                          "--launch-args=--max-restarts 0"]), "NVIDIA H100 80GB HBM3")
    assert plan.launch_args == ("--numa-binding", "node", "--max-restarts", "0")
    assert tb.versions(plan).endswith("; every row launched with --numa-binding node --max-restarts 0")
    launched = []

    class FakePopen:  # what launch would start: the launcher's own options go before the script and its arguments
        def __init__(self, cmd, **kwargs):
            launched.append(cmd)
            self.returncode, self.pid = 1, 0

        def communicate(self, timeout=None):
            return "", "failed on purpose"

    monkeypatch.setattr(tb.subprocess, "Popen", FakePopen)
    list(tb.run_case(tb.Case("tiny", 2, 0.0), plan, {}))
    assert [cmd[cmd.index("launch"):][:6] for cmd in launched] == [
        ["launch", "--standalone", "--nproc-per-node=2", "--numa-binding", "node", "--max-restarts"]] * 3
    assert [cmd[cmd.index("launch") + 7] for cmd in launched] == ["benchmarks/baseline_ddp_gpt.py"] * 2 + ["train"]


def test_a_launch_variant_is_a_meshrun_row_launched_with_more_options(monkeypatch):
    plan, _ = tb.make_plan(tb.parse_args(["--peers", "", "--layouts", "ddp", "--no-baseline", "--launch-args",
                                          "--max-restarts 0", "--launch-variant", "excl:--numa-binding exclusive"]),
                           "NVIDIA H100 80GB HBM3")
    assert plan.launch_variants == (("excl", ("--numa-binding", "exclusive")),)
    launched = []

    class FakePopen:
        def __init__(self, cmd, **kwargs):
            launched.append(cmd[cmd.index("launch"):cmd.index("train")])
            self.returncode, self.pid = 1, 0

        def communicate(self, timeout=None):
            return "", "failed on purpose"

    monkeypatch.setattr(tb.subprocess, "Popen", FakePopen)
    rows = list(tb.run_case(tb.Case("tiny", 2, 0.0), plan, {}))
    assert [r["impl"] for r in rows] == ["meshrun-ddp", "meshrun-ddp-excl"]
    assert rows[1]["setting"] == "excl" and rows[1]["same_workload"]
    assert launched == [["launch", "--standalone", "--nproc-per-node=2", "--max-restarts", "0"],
                        ["launch", "--standalone", "--nproc-per-node=2", "--max-restarts", "0", "--numa-binding",
                         "exclusive"]]


def test_an_env_variant_is_a_meshrun_row_whose_processes_get_those_variables(monkeypatch):
    plan, _ = tb.make_plan(tb.parse_args(["--peers", "", "--layouts", "ddp", "--no-baseline",
                                          "--env-variant", "ctas:NCCL_MIN_CTAS=32,NCCL_PROTO=Simple"]),
                           "NVIDIA H100 80GB HBM3")
    assert plan.env_variants == (("ctas", (("NCCL_MIN_CTAS", "32"), ("NCCL_PROTO", "Simple"))),)
    envs = []

    class FakePopen:
        def __init__(self, cmd, env=None, **kwargs):
            envs.append({k: env.get(k) for k in ("NCCL_MIN_CTAS", "NCCL_PROTO", "KEPT")})
            self.returncode, self.pid = 1, 0

        def communicate(self, timeout=None):
            return "", "failed on purpose"

    monkeypatch.setattr(tb.subprocess, "Popen", FakePopen)
    rows = list(tb.run_case(tb.Case("tiny", 2, 0.0), plan, {"KEPT": "1"}))
    assert [r["impl"] for r in rows] == ["meshrun-ddp", "meshrun-ddp-ctas"]
    assert rows[1]["setting"] == "ctas" and rows[1]["same_workload"]
    assert rows[1]["env"] == {"NCCL_MIN_CTAS": "32", "NCCL_PROTO": "Simple"} and "env" not in rows[0]
    assert envs == [{"NCCL_MIN_CTAS": None, "NCCL_PROTO": None, "KEPT": "1"},
                    {"NCCL_MIN_CTAS": "32", "NCCL_PROTO": "Simple", "KEPT": "1"}]


@pytest.mark.parametrize("value", ["ctas", "ctas:", ":NCCL_MIN_CTAS=32", "ctas:NCCL_MIN_CTAS", "ctas:=32",
                                   "tp/ctas:NCCL_MIN_CTAS=32"])
def test_a_malformed_env_variant_is_refused(value, capsys):
    with pytest.raises(SystemExit):
        tb.parse_args(["--env-variant", value])
    assert f"--env-variant {value!r}: expected NAME:VAR=VALUE" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["excl", ":--numa-binding node", "excl:", "fsdp/excl:--numa-binding node"])
def test_a_malformed_launch_variant_is_refused(value, capsys):
    with pytest.raises(SystemExit):
        tb.parse_args(["--launch-variant", value])
    assert f"--launch-variant {value!r}: expected NAME:OPTIONS" in capsys.readouterr().err


def test_each_baseline_row_is_named_by_its_graph_setting_not_by_the_script(monkeypatch, capsys):
    # the one script prints "impl": "baseline-ddp" whichever graph it runs; the rows must still tell them apart
    out = json.dumps({"impl": "baseline-ddp", "tokens_per_s_per_gpu": 1.0})
    monkeypatch.setattr(tb, "launch", lambda *a, **k: subprocess.CompletedProcess([], 0, out + "\n", ""))
    plan, _ = tb.make_plan(tb.parse_args(["--peers", "", "--layouts", ""]), "NVIDIA H100 80GB HBM3")
    rows = list(tb.run_case(tb.Case("tiny", 2, 0.0), plan, {}))
    assert [r["impl"] for r in rows] == ["baseline-ddp", "baseline-ddp-split"]
    printed = [json.loads(line)["impl"] for line in capsys.readouterr().out.splitlines()]
    assert printed == ["baseline-ddp", "baseline-ddp-split"]


def test_ratios_skip_failed_rows_and_cases_without_references():
    rows = [row("baseline-ddp", 0.0, error="boom"), row("accelerate-ddp", 500.0), row("meshrun-ddp", 250.0),
            row("meshrun-ddp", 10.0, gpus=4)]
    tb.add_ratios(rows)
    assert "vs_baseline" not in rows[0] and "vs_baseline" not in rows[2]  # the baseline failed
    assert rows[2]["vs_best_peer"] == pytest.approx(0.5)
    assert "vs_best_peer" not in rows[3]  # nothing to compare with at 4 GPUs


# --- command line ------------------------------------------------------------------------------------------------


def test_extra_and_variant_take_values_that_start_with_dashes():
    args = tb.parse_args(["--extra", "--train.compile=false", "--extra=--train.lr=1e-3 --train.min_lr=1e-4",
                          "--variant", "ac:--parallel.activation_checkpoint=full", "--peers", ""])
    plan, skipped = tb.make_plan(args, "cpu")
    assert plan.extra == ["--train.compile=false", "--train.lr=1e-3", "--train.min_lr=1e-4"]
    assert plan.variants == [("ac", ["--parallel.activation_checkpoint=full"])]
    assert (plan.peers, skipped, plan.compile) == ([], [], False)
    assert plan.run_timeout == 1200 and tb.make_plan(tb.parse_args(["--run-timeout", "90"]), "cpu")[0].run_timeout == 90


@pytest.mark.parametrize("argv, message", [
    (["--extra", "--train.grad_clip=0"], "use --grad-clip"),
    (["--variant", "noclip"], "expected NAME:OVERRIDES"),
    (["--peers", "accelerate,deepspeed"], "unknown deepspeed"),
    (["--session", "ddp,tp"], "--session 'ddp,tp': unknown tp"),
    (["--baseline-graphs", "whole,fused"], "--baseline-graphs 'whole,fused': unknown fused"),
    (["--run-timeout", "0"], "--run-timeout 0: needs a number of seconds above 0"),
])
def test_bad_arguments_are_refused_naming_the_value(argv, message, capsys):
    with pytest.raises(SystemExit):
        tb.parse_args(argv)
    assert message in capsys.readouterr().err


def test_session_rows_run_the_session_script_per_layout_and_fsdp_only_on_several_gpus(monkeypatch):
    plan, _ = tb.make_plan(tb.parse_args(["--session", "ddp,fsdp", "--peers", "", "--no-baseline", "--layouts", ""]),
                           "cpu")
    assert [s.impl for s in plan.session] == ["session-ddp", "session-fsdp"]
    calls = []
    monkeypatch.setattr(tb, "run_script", lambda script, case, plan, env: calls.append((script.args, case.gpus)) or {})
    for gpus in (1, 2):
        list(tb.run_case(tb.Case("tiny", gpus, 0.0), plan, {}))
    assert calls == [(("--layout", "ddp"), 1), (("--layout", "ddp"), 2), (("--layout", "fsdp"), 2)]
    assert not {"session-ddp", "session-fsdp"} & tb.REFERENCES, "Session rows are meshrun's, not references"


def _session_row_calls(monkeypatch, row: str) -> list[tuple[tuple[str, ...], int]]:
    """(script arguments, GPUs) of each run of Session row ``row`` on 1 and then 2 GPUs."""
    plan, _ = tb.make_plan(tb.parse_args(["--session", row, "--peers", "", "--no-baseline", "--layouts", ""]), "cpu")
    assert [s.impl for s in plan.session] == [f"session-{row}"]
    calls = []
    monkeypatch.setattr(tb, "run_script", lambda script, case, plan, env: calls.append((script.args, case.gpus)) or {})
    for gpus in (1, 2):
        list(tb.run_case(tb.Case("tiny", gpus, 0.0), plan, {}))
    return calls


def test_session_fsdp_autotune_row_passes_the_compile_mode_and_needs_two_gpus(monkeypatch):
    assert _session_row_calls(monkeypatch, "fsdp-autotune") == [(("--layout", "fsdp", "--compile-mode",
                                                                   "max-autotune"), 2)]


def test_session_ddp_row_with_the_bf16_stream_passes_graphs_and_the_residual_dtype(monkeypatch):
    args = ("--layout", "ddp", "--cuda-graphs", "--residual-dtype", "bf16")
    assert _session_row_calls(monkeypatch, "ddp-graphs-bf16-stream") == [(args, 1), (args, 2)]


@pytest.mark.slow
def test_session_script_names_its_row_by_the_residual_dtype_on_one_cpu_process():
    proc = subprocess.run([sys.executable, "benchmarks/session_gpt.py", "--size", "tiny", "--micro-batch", "2",
                           "--seq", "32", "--steps", "3", "--warmup", "1", "--no-compile", "--residual-dtype", "bf16"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    assert result["impl"] == "session-ddp-bf16-stream" and result["tokens_per_s_per_gpu"] > 0


@pytest.mark.slow
def test_session_script_trains_the_baseline_model_with_fsdp_on_two_cpu_processes():
    proc = subprocess.run([sys.executable, "-m", "meshrun", "launch", "--standalone", "--nproc-per-node=2",
                           "benchmarks/session_gpt.py", "--size", "tiny", "--micro-batch", "2", "--seq", "32",
                           "--steps", "3", "--warmup", "1", "--grad-clip", "1", "--no-compile", "--layout", "fsdp"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    assert result["impl"] == "session-fsdp" and result["gpus"] == 2 and result["tokens_per_s_per_gpu"] > 0
    assert "FSDP over 2 rank(s) on cpu; compute fp32" in proc.stdout


def test_meshrun_clips_as_asked_and_user_overrides_come_last():
    plan = tb.Plan(steps=6, compile=False, baseline=True, peers=[], layouts=["ddp"], variants=[], extra=[])
    args = tb.meshrun_args(tb.Case("tiny", 2, 1.0), "ddp", plan, "/tmp/run", ["--train.lr=1e-3"])
    assert "--train.grad_clip=1.0" in args and "--train.compile=false" in args
    assert args[-1] == "--train.lr=1e-3"


def test_meshrun_logs_at_a_divisor_of_the_warm_up_and_the_run():
    for steps, every in ((24, 8), (45, 5), (60, 10), (30, 10), (6, 2), (7, 1)):
        assert tb.log_every(steps) == every
        assert tb.warmup_steps(steps) % every == 0 and steps % every == 0  # intervals after it: the timed steps


def test_meshrun_speed_is_tokens_over_wall_time_of_the_timed_steps_as_the_scripts_measure():
    def rec(step, tps, step_time, mfu=None):
        return {"kind": "train", "step": step, "tokens_per_s_per_device": tps, "step_time_s": step_time,
                "mfu": mfu, "loss": step / 100, "peak_mem_gib": step / 10}
    # 4-step intervals, warm-up 8: steps 9-24 are timed; one slow stretch (100 tokens/s) among fast ones (400)
    train = [rec(4, 50.0, 4.0), rec(8, 100.0, 2.0), rec(12, 400.0, 0.5, 0.4), rec(16, 400.0, 0.5, 0.4),
             rec(20, 100.0, 2.0, 0.1), rec(24, 400.0, 0.5, 0.4)]
    out = tb.window_speed(train, 8)
    # 4 x 4 steps of 200 tokens each (tps x step time), over 4 x (3 x 0.5 + 2.0) seconds: 3200 / 14
    assert out["tokens_per_s_per_gpu"] == pytest.approx(3200 / 14)  # the median of intervals would say 400
    assert out["mfu"] == pytest.approx(0.4 * (3200 / 14) / 400)
    assert out["intervals"] == [400, 400, 100, 400]
    assert (out["loss"], out["peak_mem_gib"]) == (0.24, 2.4)


def test_a_meshrun_row_carries_its_runs_slowdown(monkeypatch):
    # with --extra '--run.profile_on_slowdown=...' the row says which interval slowed and what the machine did then
    slow = {"kind": "slowdown", "step": 12, "steps": 3, "step_s": 0.9, "median_step_s": 0.1, "profile_steps": [14, 15],
            "gpu_util_pct": 91.0, "time": 1.0}
    train = [{"kind": "train", "step": s, "step_time_s": 0.1, "tokens_per_s_per_device": 100.0, "loss": 1.0}
             for s in (3, 6, 9, 12)]

    def fake_launch(gpus, target, env, timeout, launch_args):
        folder = next(a.partition("=")[2] for a in target if a.startswith("--run.dir="))
        (Path(folder) / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in [*train, slow]) + "\n")
        return subprocess.CompletedProcess([], 0, "", "")

    monkeypatch.setattr(tb, "launch", fake_launch)
    plan = tb.Plan(steps=12, compile=False, baseline=False, peers=[], layouts=["ddp"], variants=[], extra=[])
    row = tb.run_meshrun(tb.Case("tiny", 2, 0.0), "ddp", plan, {}, [])
    assert row["slowdown"] == {"step": 12, "steps": 3, "step_s": 0.9, "median_step_s": 0.1, "profile_steps": [14, 15],
                               "gpu_util_pct": 91.0}
    assert row["intervals"] == [100, 100, 100]  # steps 5-12, after the warm-up third


def test_a_run_keeps_what_the_machine_did_in_its_timed_steps():
    def system(step, clocks, utils, cpu, throttle=""):
        return {"kind": "system", "step": step, "cpu_util_pct": cpu,
                "gpus": [{"index": i, "sm_clock_mhz": c, "util_pct": u, **({"throttle": throttle} if throttle else {})}
                         for i, (c, u) in enumerate(zip(clocks, utils))]}
    records = [system(8, [1000, 1000], [10.0, 20.0], 90.0),  # warm-up: left out
               system(12, [1980, 1755], [99.0, 97.0], 12.4), system(16, [1980, 1980], [98.0, 100.0], 13.0, "power cap")]
    assert tb.machine_window(records, 8) == {"gpu_util_pct": [98, 99], "sm_clock_mhz": [1755, 1980],
                                             "cpu_util_pct": [12, 13], "throttle": ["power cap"]}
    cpu_only = [{"kind": "system", "step": 12, "cpu_util_pct": 50.2}]
    assert tb.machine_window(cpu_only, 8) == {"cpu_util_pct": [50]} and tb.machine_window([], 8) == {}


def test_a_run_says_where_its_timed_steps_went():
    """The slowest rank's forward (work) and the rest of its step per timed interval: a slow run of round 25 on 2
    H200s spent 44-48 ms per step in its forward passes where fast runs spent 36-39, the rest level."""
    records = [{"kind": "ranks", "step": 8, "work_s": [1.5, 1.4], "rest_s": [1.4, 1.5]},  # warm-up: left out
               {"kind": "ranks", "step": 12, "work_s": [0.0455, 0.0446], "rest_s": [0.0745, 0.0754]},
               {"kind": "ranks", "step": 16, "work_s": [0.0370, 0.0365], "rest_s": [0.0759, 0.0764]}]
    assert tb.ranks_window(records, 8) == {"work_ms": [45.5, 37.0], "rest_ms": [75.4, 76.4]}
    assert tb.ranks_window([], 8) == {} and tb.ranks_window(records[:1], 8) == {}
    for r, host in zip(records, (0.9, 0.0441, 0.0123)):  # the host's time inside the forward passes, where recorded
        r["forward_host_s"] = [host, host / 2]
    assert tb.ranks_window(records, 8)["host_ms"] == [44.1, 12.3]


def test_each_run_is_printed_as_it_finishes(monkeypatch, capsys):
    monkeypatch.setattr(tb, "run_script", lambda s, c, p, e: {"tokens_per_s_per_gpu": 1.0})
    monkeypatch.setattr(tb, "run_meshrun", lambda c, lay, p, e, o, run_dir, launch_extra=(): print("meshrun ran") or
                        {"tokens_per_s_per_gpu": 2.0})
    plan = tb.Plan(steps=6, compile=False, baseline=True, peers=[], layouts=["ddp"], variants=[], extra=[])
    next(tb.run_case(tb.Case("tiny", 2, 0.0), plan, {}))
    lines = capsys.readouterr().out.splitlines()
    # the baseline's run is printed before meshrun's starts (a call cut off by its limit keeps what finished)
    assert lines[1] == "meshrun ran" and len(lines) == 3, lines
    first, last = json.loads(lines[0]), json.loads(lines[2])
    assert (first["impl"], first["repeat"], first["tokens_per_s_per_gpu"]) == ("baseline-ddp", 1, 1.0)
    assert (last["impl"], last["repeat"], last["tokens_per_s_per_gpu"]) == ("meshrun-ddp", 1, 2.0)
    assert first["wall_s"] >= 0 and last["wall_s"] >= 0


def test_repeated_runs_report_the_median_run_and_its_spread():
    runs = [{"tokens_per_s_per_gpu": v, "loss": v / 1000} for v in (410.0, 400.0, 420.0)]
    row = tb.combine(runs)
    assert row["tokens_per_s_per_gpu"] == 410.0 and row["loss"] == 0.41  # the median run's own figures
    assert (row["runs"], row["min"], row["max"]) == (3, 400.0, 420.0)
    assert row["spread"] == pytest.approx(20 / 410)
    assert "error" in tb.combine([*runs, {"error": "boom"}])  # a row that fails once is not a result


def test_repeat_runs_every_row_that_many_times_interleaved(monkeypatch):
    calls = []
    monkeypatch.setattr(tb, "run_script", lambda s, c, p, e: calls.append(s.impl) or {"tokens_per_s_per_gpu": 1.0})
    kept = []
    monkeypatch.setattr(tb, "run_meshrun", lambda c, lay, p, e, o, run_dir, launch_extra=(): kept.append(run_dir) or
                        calls.append(f"m{o}") or {"tokens_per_s_per_gpu": 2.0})
    plan = tb.Plan(steps=6, compile=False, baseline=True, peers=[], layouts=["ddp"], variants=[("v", ["--x=1"])],
                   extra=[], repeat=2)
    rows = list(tb.run_case(tb.Case("tiny", 2, 0.0), plan, {}))
    assert calls == ["baseline-ddp", "m[]", "m['--x=1']"] * 2
    assert kept == [None] * 4  # temporary run folders without --keep-runs
    assert [r["impl"] for r in rows] == ["baseline-ddp", "meshrun-ddp", "meshrun-ddp-v"]
    assert all(r["runs"] == 2 for r in rows)
    assert tb.combine([{"tokens_per_s_per_gpu": 1.0}]) == {"tokens_per_s_per_gpu": 1.0}  # one run: as it is


def test_a_layout_scoped_variant_runs_for_its_layout_only(monkeypatch):
    plan, _ = tb.make_plan(tb.parse_args(["--layouts", "ddp,pp", "--peers", "", "--no-baseline",
                                          "--variant", "pp/m16:--parallel.pp_microbatches=16",
                                          "--variant", "v:--x=1"]), "cpu")
    calls = []
    monkeypatch.setattr(tb, "run_meshrun", lambda c, lay, p, e, o, run_dir, launch_extra=(): calls.append((lay, o)) or
                        {"tokens_per_s_per_gpu": 2.0})
    rows = list(tb.run_case(tb.Case("tiny", 2, 0.0), plan, {}))
    assert [r["impl"] for r in rows] == ["meshrun-ddp", "meshrun-ddp-v", "meshrun-pp", "meshrun-pp-m16",
                                         "meshrun-pp-v"]
    assert ("pp", ["--parallel.pp_microbatches=16"]) in calls and len(calls) == 5
    assert all(r["same_workload"] for r in rows)  # a pipeline setting, not another batch
    plan, _ = tb.make_plan(tb.parse_args(["--layouts", "pp", "--peers", "", "--no-baseline",
                                          "--variant", "pp/ga8:--train.grad_accum=8"]), "cpu")
    assert [r["same_workload"] for r in tb.run_case(tb.Case("tiny", 2, 0.0), plan, {})] == [True, False]
    with pytest.raises(SystemExit):  # a layout that does not run is named up front
        tb.parse_args(["--layouts", "ddp", "--variant", "tp/x:--y=1"])


def test_tune_adds_each_layouts_documented_settings_and_tags_meshrun_rows(monkeypatch):
    monkeypatch.setattr(tb, "ddp_batches_copies", lambda: False)
    plan, _ = tb.make_plan(tb.parse_args(["--layouts", "ddp,tp", "--peers", "", "--tune"]), "cpu")
    assert [name for name, _ in plan.variants] == [f"ddp/{n}" for n in tb.TUNE["ddp"]] + [
        f"tp/{n}" for n in tb.TUNE["tp"]]
    monkeypatch.setattr(tb, "ddp_batches_copies", lambda: True)  # a torch whose DDP batches the copies: one row more
    batched, _ = tb.make_plan(tb.parse_args(["--layouts", "ddp,tp", "--peers", "", "--tune"]), "cpu")
    assert dict(batched.variants)["ddp/batched"] == ["--parallel.ddp_batched_copy=true"]
    assert "tp/batched" not in dict(batched.variants)
    monkeypatch.setattr(tb, "ddp_batches_copies", lambda: False)
    compiled, _ = tb.make_plan(tb.parse_args(["--layouts", "fsdp", "--peers", "", "--tune"]), "cuda")
    assert [name for name, _ in compiled.variants] == [f"fsdp/{n}" for n in tb.TUNE["fsdp"]] + [
        "fsdp/autotune", "fsdp/ce-torch", "fsdp/symm-mem"]
    assert compiled.variants[-3][1] == ["--train.compile_mode=max-autotune"]  # compiling only: it needs compile
    assert compiled.variants[-2][1] == ["--train.cross_entropy=torch"]  # CUDA only: the Triton loss runs there
    assert compiled.variants[-1][1] == ["--parallel.fsdp_symm_mem=true"]  # CUDA only: NCCL's copy engines
    pp_cpu, _ = tb.make_plan(tb.parse_args(["--layouts", "pp", "--peers", "", "--tune"]), "cpu")
    pp_gpu, _ = tb.make_plan(tb.parse_args(["--layouts", "pp", "--peers", "", "--tune"]), "cuda")
    assert "pp/casts" not in dict(pp_cpu.variants), "fp32 on CPU: parallel.pp_cast_once has nothing to cast"
    assert dict(pp_gpu.variants)["pp/casts"] == ["--parallel.pp_cast_once=false"]
    ddp_gpu, _ = tb.make_plan(tb.parse_args(["--layouts", "ddp", "--peers", "", "--tune"]), "cuda")
    assert dict(ddp_gpu.variants)["ddp/casts"] == ["--train.weight_copies=false"]  # CUDA only: the Triton AdamW
    monkeypatch.setattr(tb, "run_script", lambda s, c, p, e: {"tokens_per_s_per_gpu": 1.0})
    monkeypatch.setattr(tb, "run_meshrun",
                        lambda c, lay, p, e, o, run_dir, launch_extra=(): {"tokens_per_s_per_gpu": 2.0})
    rows = list(tb.run_case(tb.Case("tiny", 2, 0.0), plan, {}))
    tp = [r for r in rows if r.get("layout") == "tp"]
    assert [(r["impl"], r["setting"]) for r in tp] == [("meshrun-tp", "defaults"), ("meshrun-tp-sp", "sp"),
                                                       ("meshrun-tp-launched", "launched"),
                                                       ("meshrun-tp-inductor-order", "inductor-order")]
    assert "layout" not in rows[0] and rows[0]["impl"] == "baseline-ddp"  # references carry no tags


def test_defaults_are_compared_with_the_best_setting_of_their_layout_and_source():
    def meshrun(impl, tps, layout, setting, source="", **extra):
        return row(impl, tps, gpus=2, layout=layout, setting=setting, source=source, **extra)

    rows = [row("baseline-ddp", 500.0, gpus=2),  # faster, but not a setting of meshrun's: not compared
            meshrun("meshrun-ddp", 100.0, "ddp", "defaults"), meshrun("meshrun-ddp-b25", 98.0, "ddp", "b25"),
            meshrun("meshrun-fsdp", 90.0, "fsdp", "defaults"), meshrun("meshrun-fsdp-u2", 100.0, "fsdp", "u2"),
            meshrun("meshrun-fsdp-u3", 1e9, "fsdp", "u3", error="boom"),  # a failed row is no best
            meshrun("meshrun-fsdp@old", 200.0, "fsdp", "defaults", source="old"),  # alone in its group
            meshrun("meshrun-tp", 80.0, "tp", "defaults"),
            meshrun("meshrun-ddp-ga8", 900.0, "ddp", "ga8", same_workload=False)]  # another batch: left out
    lines = tb.defaults_against_best(rows)
    assert lines == [
        "124m on 2, clip 0: meshrun-ddp (defaults) at 1.000x of the best of 2 settings, meshrun-ddp: within 3%",
        "124m on 2, clip 0: meshrun-fsdp (defaults) at 0.900x of the best of 2 settings, meshrun-fsdp-u2: NOT "
        "within 3%"]
    assert rows[3]["vs_best_setting"] == pytest.approx(0.9) and rows[3]["best_setting"] == "meshrun-fsdp-u2"
    assert "vs_best_setting" not in rows[6] and "vs_best_setting" not in rows[7]


def test_src_rows_run_another_meshrun_first_on_the_path_interleaved(monkeypatch, tmp_path):
    old = tmp_path / "old" / "src"
    (old / "meshrun").mkdir(parents=True)
    (old / "meshrun" / "__init__.py").write_text("")
    plan, _ = tb.make_plan(tb.parse_args(["--src", f"old:{old}", "--peers", "", "--no-baseline",
                                          "--variant", "v:--x=1"]), "cpu")
    assert plan.sources == (("old", str(old)),)
    calls = []
    monkeypatch.setattr(tb, "run_meshrun", lambda c, lay, p, e, o, run_dir, launch_extra=():
                        calls.append((o, e["PYTHONPATH"])) or {"tokens_per_s_per_gpu": 2.0})
    rows = list(tb.run_case(tb.Case("tiny", 2, 0.0), plan, {"PYTHONPATH": "/here/src"}))
    assert [r["impl"] for r in rows] == ["meshrun-ddp", "meshrun-ddp-v", "meshrun-ddp@old", "meshrun-ddp-v@old"]
    assert calls == [([], "/here/src"), (["--x=1"], "/here/src"), ([], f"{old.resolve()}:/here/src"),
                     (["--x=1"], f"{old.resolve()}:/here/src")]
    # the child really imports the folder's package, and a folder without one is refused up front
    assert tb.imported_from(tb.source_env({"PYTHONPATH": str(ROOT / "src")}, str(old))) == (old / "meshrun").resolve()
    with pytest.raises(SystemExit):
        tb.parse_args(["--src", f"old:{tmp_path}"])


# --- a whole run -------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_cpu_run_has_a_row_per_case_and_ratios_to_its_baseline(tmp_path):
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, str(HARNESS), "--sizes", "tiny", "--gpus", "1,2", "--steps", "6",
                           "--grad-clip", "0,1", "--json", str(out), "--keep-runs", str(tmp_path / "runs")],
                          cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = {(r["impl"], r["gpus"], r["grad_clip"]): r for r in json.loads(out.read_text())}
    for gpus in (1, 2):
        for clip in (0.0, 1.0):
            base, mesh = rows[("baseline-ddp", gpus, clip)], rows[("meshrun-ddp", gpus, clip)]
            assert mesh["tokens_per_s_per_gpu"] > 0 and mesh["device"] == "cpu"
            assert 0 < base["wall_s"] < 400 and 0 < mesh["wall_s"] < 400, "each run's wall time, to plan GPU calls"
            assert mesh["vs_baseline"] == pytest.approx(mesh["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"])
            # where each timed interval's steps went (the run's own per-rank record), one value per interval
            assert len(mesh["ranks"]["work_ms"]) == len(mesh["ranks"]["rest_ms"]) == len(mesh["intervals"]) > 0
            # the rest is the step less the work, 0 where a CPU interval's forward took the whole step
            assert all(ms > 0 for ms in mesh["ranks"]["work_ms"]), mesh["ranks"]
            assert all(ms >= 0 for ms in mesh["ranks"]["rest_ms"]), mesh["ranks"]
    kept = sorted(p.name for p in (tmp_path / "runs").iterdir())  # --keep-runs: each meshrun run's folder
    assert kept == [f"meshrun-ddp_tiny_{g}gpu_clip{c}_r1" for g in (1, 2) for c in (0, 1)], kept
    assert all((tmp_path / "runs" / name / "metrics.jsonl").is_file() for name in kept)
    for impl in ("accelerate-ddp", "fabric-ddp"):  # installed: a row per case; else one line that says why not
        ran = [key for key in rows if key[0] == impl]
        skipped = [line for line in proc.stdout.splitlines() if line.startswith(f"{impl} skipped:")]
        assert len(ran) == 4 or (not ran and len(skipped) == 1 and "not installed" in skipped[0]), proc.stdout


def hanging_worker(tmp_path) -> tuple[Path, str]:
    """A worker script that never ends and has a child of its own, and a marker naming that child (for pgrep)."""
    marker = f"train-bench-hang-{os.getpid()}-{time.time_ns()}"
    script = tmp_path / "hang.py"
    script.write_text("import subprocess, sys, time\n"
                      f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', {marker!r}])\n"
                      "print('training', flush=True)\ntime.sleep(600)\n")
    return script, marker


def left_running(marker: str) -> str:
    """The processes still running whose command line holds ``marker`` ('' when none)."""
    time.sleep(2)
    return subprocess.run(["pgrep", "-af", marker], capture_output=True, text=True).stdout


@pytest.mark.slow
def test_a_run_past_its_timeout_is_stopped_with_its_workers_and_becomes_an_error(tmp_path):
    script, marker = hanging_worker(tmp_path)
    started = time.monotonic()
    proc = tb.launch(1, [str(script)], dict(os.environ), timeout=15)
    assert proc.returncode == 124 and time.monotonic() - started < 120
    error = tb.failure(proc)["error"]
    assert error.endswith("the run timed out after 15 s (--run-timeout); its processes were stopped"), error
    assert not left_running(marker)  # the worker's own child went too


@pytest.mark.slow
@pytest.mark.parametrize("sig, ends_with", [(signal.SIGINT, "KeyboardInterrupt"), (signal.SIGTERM, "exit code 143")])
def test_ctrl_c_or_sigterm_on_the_harness_stops_the_run_it_waits_for(tmp_path, sig, ends_with):
    """The run has a session of its own, which the terminal's SIGINT (or a SIGTERM to the harness alone) does not
    reach: the harness stops it before it ends. (The driver sets Python's Ctrl-C handler itself: a process started
    in the background of a script, as CI is, inherits SIGINT ignored, and Python then installs none.)"""
    script, marker = hanging_worker(tmp_path)
    driver = tmp_path / "driver.py"
    driver.write_text(f"import os, signal, sys\nsys.path.insert(0, {str(ROOT / 'tests')!r})\n"
                      "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
                      "from test_train_bench import load_harness\n"
                      "harness = load_harness()\nharness.stop_runs_on_sigterm()\n"
                      f"harness.launch(1, [{str(script)!r}], dict(os.environ), timeout=600)\n")
    harness = subprocess.Popen([sys.executable, str(driver)], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not subprocess.run(["pgrep", "-f", marker], capture_output=True).stdout and time.monotonic() < deadline:
            time.sleep(0.5)  # until the worker's child runs
        harness.send_signal(sig)
        _, err = harness.communicate(timeout=120)
        ended = "KeyboardInterrupt" if "KeyboardInterrupt" in err else f"exit code {harness.returncode}"
        assert ended == ends_with, err[-2000:]
        assert not left_running(marker)
    finally:  # a failed check leaves nothing running behind it
        harness.kill()
        for pattern in (str(script), marker):  # the launcher and worker, then the worker's child
            subprocess.run(["pkill", "-f", pattern])
