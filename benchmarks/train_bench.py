"""Training throughput of meshrun against the plain DDP baseline and its peers, in one run on the same GPUs.

For each case (model size x number of GPUs x gradient-clipping value) it runs, all through `meshrun launch`:
  - the baseline, benchmarks/baseline_ddp_gpt.py: plain DDP, bf16 autocast, SDPA, fused AdamW, torch.compile,
    once per DDP graph setting (--baseline-graphs; compiled: one graph, baseline-ddp, and split at DDP's buckets,
    baseline-ddp-split, which overlaps the all-reduce with backward), as a user would try both and keep the faster;
  - the peers (--peers) whose library is installed: benchmarks/peer_accelerate.py (Hugging Face Accelerate) and
    benchmarks/peer_fabric.py (Lightning Fabric), which train the baseline's model on the same tokens;
  - `meshrun train` once per layout (--layouts), and once more per layout for each --variant (LAYOUT/NAME: for that
    layout only); with --src, all of
    those again from another copy of meshrun (an older checkout's src), to compare two versions of the code;
  - with --tune, one more meshrun row per layout for each documented setting its defaults choose between (TUNE,
    TUNE_COMPILED when compiling, TUNE_BF16 with bf16 compute, TUNE_CUDA on GPUs, BATCHED_COPY for DDP where torch has
    it), and a line per layout saying whether the defaults are within 3% of the fastest of them;
  - with --session, the baseline's GPT through meshrun's `Session.prepare_model` (benchmarks/session_gpt.py, as
    docs/api.md shows: a user's own model) per layout given (ddp, fsdp).
Every row reports tokens/s per GPU, MFU, peak memory, vs_baseline (its tokens/s over the faster baseline row of its
case), vs_best_peer (over the fastest of the baseline rows and the peers of its case) and wall_s (the run's wall
time, start-up and compilation included). Prints a line per run as it finishes, then a table, and writes JSON.

    PYTHONPATH=src python3 benchmarks/train_bench.py --sizes 124m --gpus 1,2 --grad-clip 0,1 --json out.json
    PYTHONPATH=src python3 benchmarks/train_bench.py --sizes 124m --gpus 2 --peers '' \\
        --extra --train.fused_optimizer=false --variant ac:--parallel.activation_checkpoint=selective
    PYTHONPATH=src python3 benchmarks/train_bench.py --sizes 1b --gpus 2 --peers '' --no-baseline \
        --layouts fsdp,cp --extra '--model.seq_len=8192 --train.micro_batch=1' --steps 30   (long sequences: CP)
    git worktree add /tmp/old HEAD~3 && python3 benchmarks/train_bench.py --sizes 1b --gpus 2 --layouts pp \
        --no-baseline --peers '' --src old:/tmp/old/src --repeat 3      (this code against an older one, interleaved)

--extra and --variant take meshrun overrides; the word after them is always their value, even when it starts with
`--` (`--extra --train.x=1` and `--extra=--train.x=1` are the same). Several overrides go in one quoted value.
--launch-args takes `meshrun launch` options the same way, for every row (baseline and peers included), e.g.
`--launch-args '--numa-binding node'`: every side is launched alike. --launch-variant NAME:OPTIONS adds a meshrun row
per layout launched with more options, interleaved with the others, e.g. `--launch-variant 'excl:--numa-binding
exclusive'` (each worker on CPU cores of its own) beside the defaults. --env-variant NAME:VAR=VALUE[,VAR=VALUE]
does the same with environment variables for that row's processes, e.g. `--env-variant ctas:NCCL_MIN_CTAS=32`
(NCCL's settings, which have no meshrun option).
Gradient clipping is set with --grad-clip only, so that it is equal on every side.

Every row is timed alike: the tokens of the steps after the warm-up third of --steps over their wall time. The
scripts time those steps themselves; meshrun logs at a divisor of the warm-up, so that its intervals after it cover
the same steps, and its row also lists each interval's tokens/s (intervals) and what the machine did in it
(machine: GPU utilisation, lowest SM clock, CPU utilisation, throttle reasons), and where each interval's steps
went (ranks: the slowest rank's data wait and forward passes, GPU-timed, the rest of its step, and the host's time
inside the forward passes, in ms per step).
Without a GPU, --gpus counts CPU
processes (gloo, fp32, no compile): a smoke test of the harness, not a measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MICRO = {"124m": (16, 1024), "1b": (4, 2048), "tiny": (8, 64), "small": (8, 256)}  # (micro-batch, seq)
LAYOUTS = {  # meshrun overrides for a layout on G GPUs
    "ddp": [],
    "fsdp": ["--parallel.dp_shard=-1", "--parallel.dp_replicate=1"],
    "tp": ["--parallel.tp=-1", "--parallel.dp_replicate=1", "--model.tie_embeddings=false"],
    "pp": ["--parallel.pp=-1", "--parallel.dp_replicate=1"],
    "cp": ["--parallel.cp=-1", "--parallel.dp_replicate=1"],  # FSDP over the cp ranks, as torchtitan
}
TUNE = {  # --tune: the documented settings each layout's defaults choose between (docs/performance.md), one row each
    "ddp": {"whole": "--parallel.ddp_graph=whole", "b25": "--parallel.ddp_bucket_mb=25",
            "b200": "--parallel.ddp_bucket_mb=200", "launched": "--train.cuda_graphs=false",
            # DDP sums in fp32 by default (on GPUs the linear layers' bf16 copies in bf16: fp32-reduce turns them
            # off); the 1b model's FSDP2 (by size) in bf16 on one node
            "bf16-reduce": "--parallel.grad_reduce_dtype=bf16", "fp32-reduce": "--parallel.grad_reduce_dtype=fp32",
            # DDP and FSDP2: parallel.data_parallel=auto picks one by model size (FSDP2 from 1B parameters on GPUs)
            "dp-ddp": "--parallel.data_parallel=ddp", "dp-fsdp": "--parallel.data_parallel=fsdp"},
    # FSDP2: units of blocks; the whole model one unit (on GPUs the small models' default, recorded as CUDA graphs:
    # "launched" is the previous default there, all blocks one unit with launched kernels)
    "fsdp": {"u1": "--parallel.fsdp_unit_blocks=1", "u2": "--parallel.fsdp_unit_blocks=2",
             "u3": "--parallel.fsdp_unit_blocks=3", "whole": "--parallel.fsdp_unit_blocks=-1",
             "launched": "--train.cuda_graphs=false", "reshard": "--parallel.fsdp_reshard_after_forward=true",
             "keep": "--parallel.fsdp_reshard_after_forward=false", "fp32-reduce": "--parallel.grad_reduce_dtype=fp32"},
    "tp": {"sp": "--parallel.sequence_parallel=true", "launched": "--train.cuda_graphs=false",
           "inductor-order": "--parallel.comm_reorder=false"},
    "pp": {"mb4": "--parallel.pp_microbatches=4", "mb16": "--parallel.pp_microbatches=16",
           "1f1b": "--parallel.pp_schedule=1f1b",
           "interleaved": "--parallel.pp_schedule=interleaved1f1b", "gpipe": "--parallel.pp_schedule=gpipe",
           "even": "--parallel.pp_balance=blocks", "launched": "--train.cuda_graphs=false"},
}  # cp: none yet (its one speed setting, activation checkpointing, trades speed for memory)
TUNE_COMPILED = {"autotune": "--train.compile_mode=max-autotune"}  # every layout, when the run compiles
# the hidden state between blocks under autocast: bf16 by default for DDP, TP and pipelines, against fp32
FP32_STREAM = {"fp32-stream": "--train.residual_dtype=fp32"}
TUNE_BF16 = {"pp": {"casts": "--parallel.pp_cast_once=false"} | FP32_STREAM, "ddp": FP32_STREAM, "tp": FP32_STREAM}
# with bf16 compute (GPUs, or --extra --train.dtype=bf16): a pipeline's weights cast per micro-batch, against the
# default's once per step on GPUs; the residual stream in fp32 against the default's bf16 (not FSDP2: bf16 there)
# on CUDA GPUs: torch's cross-entropy against meshrun's Triton kernel (train.cross_entropy=auto); TP's loss on
# vocabulary shards has its own
CE_TORCH = {"ce-torch": "--train.cross_entropy=torch"}
# and FSDP2's all-gathers on the copy engines (parallel.fsdp_symm_mem: NCCL 2.28+, a torch that has it); for DDP
# autocast's casts and fp32 all-reduce against the linear layers' bf16 copies (train.weight_copies, Triton AdamW)
TUNE_CUDA = {"ddp": CE_TORCH | {"casts": "--train.weight_copies=false"},
             "fsdp": CE_TORCH | {"symm-mem": "--parallel.fsdp_symm_mem=true"}, "pp": CE_TORCH}
# DDP's gradient copies batched per bucket (parallel.ddp_batched_copy), where this torch's DDP has batched_grad_copy
BATCHED_COPY = {"batched": "--parallel.ddp_batched_copy=true"}


def ddp_batches_copies() -> bool:
    """Does the torch the rows run with (this process's) give DistributedDataParallel ``batched_grad_copy``?"""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    return "batched_grad_copy" in inspect.signature(DistributedDataParallel).parameters


DEFAULTS_WITHIN = 0.03  # the defaults should be within 3% of the best setting --tune finds
WORKLOAD_OPTIONS = ("--model.", "--train.micro_batch", "--train.grad_accum", "--train.global_batch")
"""Overrides that change what a step trains (the model or the samples per step): a variant with one of them is a
different workload, not a setting the defaults choose between, so it is left out of that comparison."""
VALUE_OPTIONS = ("--extra", "--variant", "--launch-args", "--launch-variant")  # options whose value may start with "--"


@dataclass(frozen=True)
class Script:
    """A training script that prints one JSON row: the baseline or a peer."""

    impl: str  # the row's name
    path: str  # relative to the repository root
    module: str  # the library it needs, checked before it is launched ('' for none)
    args: tuple[str, ...] = ()  # arguments of its own


BASELINES = {  # the baseline in each of its DDP graph settings: a ratio is over the faster one of its case
    "whole": Script("baseline-ddp", "benchmarks/baseline_ddp_gpt.py", "", ("--ddp-graph", "whole")),
    "split": Script("baseline-ddp-split", "benchmarks/baseline_ddp_gpt.py", "", ("--ddp-graph", "split"))}
BASELINE_IMPLS = {s.impl for s in BASELINES.values()}
PEERS = {"accelerate": Script("accelerate-ddp", "benchmarks/peer_accelerate.py", "accelerate"),
         "fabric": Script("fabric-ddp", "benchmarks/peer_fabric.py", "lightning")}
SESSION = {layout: Script(f"session-{layout}", "benchmarks/session_gpt.py", "", ("--layout", layout))
           for layout in ("ddp", "fsdp")}
SESSION["ddp-graphs"] = Script("session-ddp-graphs", "benchmarks/session_gpt.py", "",
                               ("--layout", "ddp", "--cuda-graphs"))  # prepare_model(cuda_graphs=True)
SESSION["ddp-graphs-bf16-stream"] = Script("session-ddp-graphs-bf16-stream", "benchmarks/session_gpt.py", "",
                                           ("--layout", "ddp", "--cuda-graphs", "--residual-dtype", "bf16"))
SESSION["fsdp-graphs"] = Script("session-fsdp-graphs", "benchmarks/session_gpt.py", "",
                                ("--layout", "fsdp", "--cuda-graphs"))  # the whole model one unit, as CUDA graphs
SESSION["fsdp-autotune"] = Script("session-fsdp-autotune", "benchmarks/session_gpt.py", "",
                                  ("--layout", "fsdp", "--compile-mode", "max-autotune"))  # compile_mode=...
REFERENCES = BASELINE_IMPLS | {s.impl for s in PEERS.values()}  # what vs_best_peer compares against


@dataclass(frozen=True)
class Case:
    """What rows are compared within: only rows of one case share a baseline and a best peer."""

    size: str
    gpus: int
    grad_clip: float


@dataclass(frozen=True)
class Plan:
    """Everything that is the same for every case of one run."""

    steps: int
    compile: bool
    baseline: bool
    peers: list[Script]
    layouts: list[str]
    variants: list[tuple[str, list[str]]]  # (name, meshrun overrides)
    extra: list[str]  # meshrun overrides for every meshrun row
    repeat: int = 1  # runs of every row; the row reports their median and min-max
    session: tuple[Script, ...] = ()  # meshrun's Session rows (not references)
    sources: tuple[tuple[str, str], ...] = ()  # (name, folder holding another meshrun): rows meshrun-<layout>@name
    keep_runs: str = ""  # a folder that keeps each meshrun run's folder (metrics, profiler traces); '' = temporary
    baseline_graphs: tuple[str, ...] = ("whole",)  # the baseline's DDP graph settings (BASELINES), one row each
    run_timeout: float = 1200.0  # seconds one run may take before it is stopped and becomes an error row
    launch_args: tuple[str, ...] = ()  # `meshrun launch` options for every row (baseline, peers and meshrun alike)
    launch_variants: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (name, more launch options): meshrun rows
    env_variants: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = ()  # (name, environment): meshrun rows


def launch(gpus: int, target: list[str], env: dict[str, str], timeout: float = 1200.0,
           launch_args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """One run through `meshrun launch` (with ``launch_args``, the launcher's own options), in a session of its own.
    A run still going after ``timeout`` seconds is stopped (see stop_run) and comes back as exit code 124 with a last
    line saying so, so that it becomes an error row and the next row runs on free GPUs. Ctrl-C stops the run too (the
    terminal's SIGINT does not reach its session) before it ends the harness, and so does SIGTERM once main has set
    stop_runs_on_sigterm."""
    cmd = [sys.executable, "-m", "meshrun", "launch", "--standalone", f"--nproc-per-node={gpus}", *launch_args,
           *target]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out, err = stop_run(proc)
        note = f"train_bench: the run timed out after {timeout:g} s (--run-timeout); its processes were stopped"
        return subprocess.CompletedProcess(cmd, 124, out, f"{err}\n{note}")
    except BaseException:
        stop_run(proc)
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def stop_run(proc: subprocess.Popen) -> tuple[str, str]:
    """Stops a launched run and returns what it printed. SIGTERM to the launcher's process group first: torchrun's
    agent then stops its workers, which run in sessions of their own (SIGTERM, then SIGKILL after 30 s); a SIGKILL
    to the launcher would leave them holding the GPUs. SIGKILL after 45 s."""
    out, err = "", ""
    for sig, wait_s in ((signal.SIGTERM, 45), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            out, err = proc.communicate(timeout=wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    with contextlib.suppress(ProcessLookupError):  # whatever of the launcher's group is still alive
        os.killpg(proc.pid, signal.SIGKILL)
    return out, err


def failure(proc: subprocess.CompletedProcess) -> dict:
    return {"error": (proc.stderr or proc.stdout)[-2000:]}


def run_script(script: Script, case: Case, plan: Plan, env: dict[str, str]) -> dict:
    """The row the baseline or a peer prints for this case."""
    mb, seq = MICRO[case.size]
    proc = launch(case.gpus, [script.path, "--size", case.size, "--micro-batch", str(mb), "--seq", str(seq),
                              "--steps", str(plan.steps), "--warmup", str(warmup_steps(plan.steps)),
                              "--grad-clip", str(case.grad_clip), "--compile" if plan.compile else "--no-compile",
                              *script.args], env, plan.run_timeout, plan.launch_args)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        return failure(proc)
    # the row is named by the harness: one script runs as several rows (the baseline's graph settings)
    return {**json.loads(lines[-1]), "impl": script.impl}


def warmup_steps(steps: int) -> int:
    """The untimed first steps of every row: the first third (compilation, allocator growth, CUDA graph capture)."""
    return steps // 3


def log_every(steps: int) -> int:
    """meshrun's log interval in the harness: the longest up to its default (train.log_every=10, so that the log
    steps' work costs what it costs a user) that divides both the warm-up and the run, so that its logged intervals
    after the warm-up cover exactly the steps the scripts time."""
    warm = warmup_steps(steps)
    return next(d for d in range(10, 0, -1) if warm % d == 0 and steps % d == 0)


def meshrun_args(case: Case, layout: str, plan: Plan, run_dir: str, overrides: list[str]) -> list[str]:
    """`meshrun train` arguments; the user's overrides come last, so they win over the harness's."""
    mb, seq = MICRO[case.size]
    args = ["train", f"--model.name={case.size}", f"--model.seq_len={seq}", f"--train.micro_batch={mb}",
            f"--train.steps={plan.steps}", f"--train.log_every={log_every(plan.steps)}", "--train.eval_every=0",
            f"--train.compile={str(plan.compile).lower()}", f"--train.grad_clip={case.grad_clip}",
            "--checkpoint.final=false", "--run.progress=lines", f"--run.dir={run_dir}", *LAYOUTS[layout]]
    if layout == "pp":
        args.append(f"--train.grad_accum={2 * case.gpus}")  # micro-batches >= stages for the schedule
    return [*args, *overrides]


def kept_run_dir(plan: Plan, case: Case, impl: str, repeat: int) -> Path:
    """Where --keep-runs keeps one meshrun run's folder: one per row, case and repeat."""
    return Path(plan.keep_runs).resolve() / f"{impl}_{case.size}_{case.gpus}gpu_clip{case.grad_clip:g}_r{repeat}"


def run_meshrun(case: Case, layout: str, plan: Plan, env: dict[str, str], overrides: list[str],
                run_dir: Path | None = None, launch_extra: tuple[str, ...] = ()) -> dict:
    """A meshrun row for this case, timed as the scripts time themselves (see window_speed). The run's folder is
    ``run_dir`` (kept: --keep-runs) or a temporary one; ``launch_extra``: launcher options of this row alone
    (--launch-variant), after --launch-args."""
    with (contextlib.nullcontext(str(run_dir)) if run_dir else tempfile.TemporaryDirectory()) as folder:
        proc = launch(case.gpus, meshrun_args(case, layout, plan, folder, overrides), env, plan.run_timeout,
                      (*plan.launch_args, *launch_extra))
        metrics = Path(folder, "metrics.jsonl")
        records = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    train = [r for r in records if r.get("kind") == "train"]
    warm = warmup_steps(plan.steps)
    if proc.returncode or not any(r["step"] > warm for r in train):
        return failure(proc)
    machine = machine_window([r for r in records if r.get("kind") == "system"], warm)
    ranks = ranks_window([r for r in records if r.get("kind") == "ranks"], warm)
    slowdown = [{k: v for k, v in r.items() if k not in ("kind", "time")}  # run.profile_on_slowdown's finding
                for r in records if r.get("kind") == "slowdown"]
    return {**window_speed(train, warm), **({"machine": machine} if machine else {}),
            **({"ranks": ranks} if ranks else {}),
            **({"slowdown": slowdown[0]} if slowdown else {}), "overrides": overrides}


def window_speed(train: list[dict], warm: int) -> dict:
    """tokens/s per GPU over the steps after ``warm``: their tokens over their wall time, as the scripts measure
    (not a median of intervals, which would drop a slow stretch the scripts count), with MFU scaled alike, the last
    loss, the peak memory, and each logged interval's tokens/s (``intervals``: is a slow run one stall or slow
    throughout?). ``train`` is the run's train records in step order; each covers the steps since the one before."""
    tokens = seconds = 0.0
    timed = []
    for before, record in zip([{"step": 0}, *train], train):
        if record["step"] > warm:
            elapsed = record["step_time_s"] * (record["step"] - before["step"])
            tokens += record["tokens_per_s_per_device"] * elapsed
            seconds += elapsed
            timed.append(record)
    speed = tokens / seconds
    first = timed[0]  # MFU is proportional to tokens/s; None where the peak is unknown (CPU)
    peak = [r["peak_mem_gib"] for r in timed if r.get("peak_mem_gib") is not None]
    return {"tokens_per_s_per_gpu": speed,
            "mfu": first["mfu"] * speed / first["tokens_per_s_per_device"] if first.get("mfu") is not None else None,
            "loss": timed[-1]["loss"], "peak_mem_gib": max(peak) if peak else None,
            "intervals": [round(r["tokens_per_s_per_device"]) for r in timed]}


def machine_window(system: list[dict], warm: int) -> dict:
    """What the machine did in the timed steps, from the run's ``system`` records (one per node and logged interval,
    sampled off the training thread): per interval, the GPUs' mean utilisation, their lowest SM clock and the CPUs'
    utilisation, and any clock-throttle reason named. A slow run with a low clock or a busy CPU says why; {} where
    nothing was sampled (CPU runs have no GPU fields)."""
    timed = [r for r in system if r["step"] > warm]
    out: dict = {}
    for key, field, across_gpus in (("gpu_util_pct", "util_pct", statistics.fmean),
                                    ("sm_clock_mhz", "sm_clock_mhz", min)):
        values = [[g[field] for g in r.get("gpus", []) if field in g] for r in timed]  # per interval, per GPU
        if any(values):
            out[key] = [round(across_gpus(v)) if v else None for v in values]
    if any("cpu_util_pct" in r for r in timed):
        out["cpu_util_pct"] = [round(r["cpu_util_pct"]) if "cpu_util_pct" in r else None for r in timed]
    reasons = sorted({g["throttle"] for r in timed for g in r.get("gpus", []) if g.get("throttle")})
    if reasons:
        out["throttle"] = reasons
    return out


def ranks_window(ranks: list[dict], warm: int) -> dict:
    """Where the timed steps went, from the run's ``ranks`` records (one per logged interval, every rank's mean
    per step): per interval, the slowest rank's ``work_s`` (its data wait and forward passes, the forward timed on
    the GPU by CUDA events), ``rest_s`` (backward, optimizer and waiting in collectives) and, where the run records
    it, ``forward_host_s`` (the host's time inside the forward passes), in ms. A slow run whose work grew while the
    rest held points at the forward passes, and a host time near the work says the GPU waited on the host to issue
    them; {} where the run logged none."""
    timed = [r for r in ranks if r["step"] > warm and r.get("work_s") and r.get("rest_s")]
    if not timed:
        return {}
    out = {"work_ms": [round(max(r["work_s"]) * 1e3, 1) for r in timed],
           "rest_ms": [round(max(r["rest_s"]) * 1e3, 1) for r in timed]}
    if all(r.get("forward_host_s") for r in timed):
        out["host_ms"] = [round(max(r["forward_host_s"]) * 1e3, 1) for r in timed]
    return out


def source_env(env: dict[str, str], folder: str) -> dict[str, str]:
    """``env`` with ``folder`` (which holds a ``meshrun`` package, e.g. another checkout's src) first on PYTHONPATH."""
    return {**env, "PYTHONPATH": f"{Path(folder).resolve()}:{env.get('PYTHONPATH', '')}"}


def imported_from(env: dict[str, str]) -> Path:
    """The meshrun package a child process with ``env`` imports (asked in that child, from the repository root)."""
    code = "import os, meshrun; print(os.path.dirname(os.path.realpath(meshrun.__file__)))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    return Path(proc.stdout.strip() or "?")


def run_case(case: Case, plan: Plan, env: dict[str, str]) -> Iterator[dict]:
    """The rows of one case, as each finishes: baseline, peers, Session rows, then meshrun per layout and variant
    (and again per --src). With plan.repeat > 1 the whole sequence runs that many times (interleaved, so that a
    machine's slow minute does not land on one row's repeats) and each row reports the median of its runs and their
    min-max."""
    baselines = [BASELINES[graph] for graph in plan.baseline_graphs] if plan.baseline else []
    # FSDP needs two GPUs or more; on one GPU nothing is all-reduced, and the split graph only adds graphs
    scripts = [s for s in baselines + plan.peers + list(plan.session)
               if case.gpus > 1 or ("fsdp" not in s.args and s is not BASELINES["split"])]
    jobs = [(script.impl, lambda _, s=script: run_script(s, case, plan, env)) for script in scripts]
    tags: dict[str, dict] = {}  # a meshrun row's layout, setting (variant) and source, for --tune's comparison
    for layout in plan.layouts:
        if layout != "ddp" and case.gpus == 1:
            continue  # FSDP, TP, PP and CP need two GPUs or more
        for source, folder in [("", ""), *plan.sources]:
            src_env = source_env(env, folder) if folder else env
            rows = [("", [], (), ()), *((name, o, (), ()) for name, o in variants_for(layout, plan.variants)),
                    *((name, [], opts, ()) for name, opts in plan.launch_variants),
                    *((name, [], (), variables) for name, variables in plan.env_variants)]
            for name, overrides, launch_extra, variables in rows:
                impl = (f"meshrun-{layout}-{name}" if name else f"meshrun-{layout}") + (f"@{source}" if source else "")
                tags[impl] = {"layout": layout, "setting": name or "defaults", "source": source,
                              "same_workload": not any(o.startswith(WORKLOAD_OPTIONS) for o in overrides),
                              **({"env": dict(variables)} if variables else {})}
                row_env = {**src_env, **dict(variables)}
                jobs.append((impl, lambda i, o=[*plan.extra, *overrides], lay=layout, e=row_env, name=impl,
                             more=launch_extra: run_meshrun(case, lay, plan, e, o, launch_extra=more,
                                                            run_dir=kept_run_dir(plan, case, name, i)
                                                            if plan.keep_runs else None)))
    runs: dict[str, list[dict]] = {impl: [] for impl, _ in jobs}
    for i in range(plan.repeat):
        for impl, job in jobs:
            started = time.monotonic()
            result = job(i + 1)
            runs[impl].append({**result, "wall_s": round(time.monotonic() - started, 1)})  # start-up and compile in
            # each run as it finishes: a call cut off by its time limit still shows the runs it finished
            print(json.dumps({"impl": impl, "repeat": i + 1, **runs[impl][-1]}), flush=True)
    for impl, _ in jobs:
        yield {**labelled(case, impl, combine(runs[impl])), **tags.get(impl, {})}


def variants_for(layout: str, variants: list[tuple[str, list[str]]]) -> list[tuple[str, list[str]]]:
    """The variants that run for ``layout``: every plain NAME, and LAYOUT/NAME only for its layout (as NAME)."""
    chosen = []
    for name, overrides in variants:
        only, _, short = name.rpartition("/")
        if not only or only == layout:
            chosen.append((short, overrides))
    return chosen


def combine(results: list[dict]) -> dict:
    """One row from repeated runs of it: the median run's figures, with min, max and spread of tokens/s (spread =
    (max - min) / median). Any failed run makes the row an error: a row that fails sometimes is not a result."""
    failed = [r for r in results if "error" in r]
    if failed or len(results) == 1:
        return (failed or results)[0]
    speeds = sorted(r["tokens_per_s_per_gpu"] for r in results)
    median = statistics.median(speeds)
    row = min(results, key=lambda r: abs(r["tokens_per_s_per_gpu"] - median))
    return {**row, "tokens_per_s_per_gpu": median, "runs": len(results), "min": speeds[0], "max": speeds[-1],
            "spread": (speeds[-1] - speeds[0]) / median}


def labelled(case: Case, impl: str, result: dict) -> dict:
    """A row: its name and case first, then what the run measured (or its error)."""
    return {"impl": impl, "size": case.size, "gpus": case.gpus, "grad_clip": case.grad_clip, **result}


def add_ratios(rows: list[dict]) -> None:
    """Sets vs_baseline and baseline, vs_best_peer and best_peer on every row that ran, against the rows of its own
    case: the faster of the baseline's rows (its DDP graph settings: whichever a user would keep), and the fastest of
    the baseline rows and the peers (so vs_best_peer >= 1 means it beat them all). With repeats the medians are
    compared, and vs_baseline_worst and vs_best_peer_worst set the row's slowest run against the fastest run of that
    baseline row and of any reference row: 1 or more means every run of the row beat every run of theirs."""
    cases: dict[tuple, list[dict]] = {}
    for row in rows:
        if "error" not in row:
            cases.setdefault((row["size"], row["gpus"], row["grad_clip"]), []).append(row)
    for group in cases.values():
        refs = [r for r in group if r["impl"] in REFERENCES]
        base = max((r for r in refs if r["impl"] in BASELINE_IMPLS), key=lambda r: r["tokens_per_s_per_gpu"],
                   default=None)
        best = max(refs, key=lambda r: r["tokens_per_s_per_gpu"], default=None)
        for row in group:
            if base is not None:
                row["vs_baseline"] = row["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"]
                row["vs_baseline_worst"] = run_extreme(row, "min") / run_extreme(base, "max")
                row["baseline"] = base["impl"]
            if best is not None:
                row["vs_best_peer"] = row["tokens_per_s_per_gpu"] / best["tokens_per_s_per_gpu"]
                row["vs_best_peer_worst"] = run_extreme(row, "min") / max(run_extreme(r, "max") for r in refs)
                row["best_peer"] = best["impl"]


def run_extreme(row: dict, which: str) -> float:
    """The tokens/s of a row's slowest ("min") or fastest ("max") run: combine sets them on rows of several runs; a
    row of one run is both."""
    return row.get(which, row["tokens_per_s_per_gpu"])


def defaults_against_best(rows: list[dict]) -> list[str]:
    """For each case, layout and source with settings beside its defaults (--tune, --variant): sets vs_best_setting
    and best_setting on the defaults' row (its tokens/s over the fastest row of that group) and returns one line per
    group saying whether the defaults are within DEFAULTS_WITHIN of the best. Variants that change the workload
    (WORKLOAD_OPTIONS: another model or batch) are not settings of the same run and stay out."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        if "error" not in row and "layout" in row and row.get("same_workload", True):
            key = (row["size"], row["gpus"], row["grad_clip"], row["layout"], row["source"])
            groups.setdefault(key, []).append(row)
    lines = []
    for (size, gpus, clip, layout, source), group in groups.items():
        defaults = next((r for r in group if r["setting"] == "defaults"), None)
        if defaults is None or len(group) < 2:
            continue
        best = max(group, key=lambda r: r["tokens_per_s_per_gpu"])
        ratio = defaults["tokens_per_s_per_gpu"] / best["tokens_per_s_per_gpu"]
        defaults["vs_best_setting"], defaults["best_setting"] = ratio, best["impl"]
        verdict = "within" if ratio >= 1 - DEFAULTS_WITHIN else "NOT within"
        lines.append(f"{size} on {gpus}, clip {clip:g}: {defaults['impl']} (defaults) at {ratio:.3f}x of the best of "
                     f"{len(group)} settings, {best['impl']}: {verdict} {DEFAULTS_WITHIN:.0%}")
    return lines


def installed_peers(names: list[str]) -> tuple[list[Script], list[str]]:
    """The peers whose library imports here, and a reason for each one skipped."""
    peers, skipped = [], []
    for name in names:
        script = PEERS[name]
        if importlib.util.find_spec(script.module) is None:
            skipped.append(f"{script.impl} skipped: {script.module} not installed (pip install {script.module})")
        else:
            peers.append(script)
    return peers, skipped


def versions(plan: Plan) -> str:
    """The versions every row depends on, and the launcher options every row ran with, for the record beside the
    numbers (the table's caption)."""
    names = ["torch", *(s.module for s in plan.peers)]
    line = ", ".join(f"{name} {importlib.metadata.version(name)}" for name in names)
    return line + (f"; every row launched with {shlex.join(plan.launch_args)}" if plan.launch_args else "")


def probe_device(env: dict[str, str]) -> str:
    """The GPU's name, or 'cpu'. Asked in a child process, so that this one holds no CUDA context on GPU 0."""
    code = "import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    return proc.stdout.strip() or "unknown"


def attach_values(argv: list[str]) -> list[str]:
    """Turns `--extra VALUE` into `--extra=VALUE` (and so for --variant). argparse refuses a separate value that
    starts with `--`, taking it for an option, and meshrun overrides always do."""
    out: list[str] = []
    it = iter(argv)
    for arg in it:
        out.append(f"{arg}={next(it, '')}" if arg in VALUE_OPTIONS else arg)
    return out


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="124m", help=f"comma list of {', '.join(MICRO)}")
    p.add_argument("--gpus", default="1,2", help="comma list of GPU counts (CPU processes without a GPU)")
    p.add_argument("--layouts", default="ddp", help=f"comma list of {', '.join(LAYOUTS)}")
    p.add_argument("--peers", default=",".join(PEERS), help=f"comma list of {', '.join(PEERS)} ('' for none)")
    p.add_argument("--session", default="", help=f"comma list of {', '.join(SESSION)}: Session.prepare_model rows")
    p.add_argument("--grad-clip", default="0", help="comma list of clip values, each run on every side (0 = off)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile on every side (default: on with a GPU, off on CPU)")
    p.add_argument("--no-baseline", action="store_true")
    p.add_argument("--baseline-graphs", default=None, metavar="LIST",
                   help="comma list of the baseline's DDP graph settings, one row each: whole (one compiled graph, "
                        "all-reduce after backward: baseline-ddp), split (graph split at DDP's buckets, torch's "
                        "default, all-reduce overlapped with backward: baseline-ddp-split); vs baseline is over the "
                        "faster. Default: both when compiling, whole otherwise (the setting only matters compiled)")
    p.add_argument("--extra", action="append", default=[], help="meshrun overrides for every meshrun row")
    p.add_argument("--variant", action="append", default=[], metavar="[LAYOUT/]NAME:OVERRIDES",
                   help="one more meshrun row per layout, meshrun-<layout>-NAME, with these overrides; "
                        "LAYOUT/NAME adds it for that layout only")
    p.add_argument("--tune", action="store_true",
                   help="one more row per layout for each documented setting its defaults choose between (ddp "
                        "graphs, buckets and batched gradient copies where torch has them, DDP or FSDP2 for the "
                        "data-parallel layout, FSDP units and resharding, TP sequence parallelism, PP micro-batches, schedule and cut, CUDA graphs off, torch's "
                        "cross-entropy), and say whether the defaults are within 3%% of the best")
    p.add_argument("--src", action="append", default=[], metavar="NAME:FOLDER",
                   help="meshrun rows again with the meshrun package in FOLDER (e.g. an older checkout's src), "
                        "named meshrun-<layout>@NAME, interleaved with this checkout's")
    p.add_argument("--repeat", type=int, default=1, help="run every row N times; report the median and min-max")
    p.add_argument("--launch-args", action="append", default=[], metavar="OPTIONS",
                   help="`meshrun launch` options for every row, baseline and peers included (e.g. "
                        "'--numa-binding node')")
    p.add_argument("--launch-variant", action="append", default=[], metavar="NAME:OPTIONS",
                   help="one more meshrun row per layout, meshrun-<layout>-NAME, launched with these `meshrun "
                        "launch` options as well (e.g. 'excl:--numa-binding exclusive'), interleaved with the others")
    p.add_argument("--env-variant", action="append", default=[], metavar="NAME:VAR=VALUE[,VAR=VALUE]",
                   help="one more meshrun row per layout, meshrun-<layout>-NAME, whose processes get these environment "
                        "variables (e.g. 'ctas:NCCL_MIN_CTAS=32'), interleaved with the others")
    p.add_argument("--run-timeout", type=float, default=1200.0, metavar="SECONDS",
                   help="stop a run (all its processes) that takes longer and report it as an error row, so that "
                        "the rows after it still run (default 1200)")
    p.add_argument("--keep-runs", default="", metavar="DIR",
                   help="keep each meshrun run's folder (metrics.jsonl, profiler traces of --run.profile_steps) in "
                        "DIR/<row>_<size>_<G>gpu_clip<C>_r<repeat>, to read with `meshrun trace` or `meshrun report`")
    p.add_argument("--json", help="write all rows here")
    args = p.parse_args(attach_values(argv))
    check_args(p, args)
    return args


def env_pairs(variables: str) -> tuple[tuple[str, str | None], ...]:
    """``VAR=VALUE[,VAR=VALUE]`` of --env-variant as (VAR, VALUE) pairs; VALUE None where the '=' is missing."""
    pairs = (pair.partition("=") for pair in variables.split(","))
    return tuple((var.strip(), value if sep else None) for var, sep, value in pairs)


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuses, naming the value given, what would otherwise fail in the middle of a long run."""
    for option, given, known in (("--sizes", args.sizes, MICRO), ("--layouts", args.layouts, LAYOUTS),
                                 ("--peers", args.peers, PEERS), ("--session", args.session, SESSION),
                                 ("--baseline-graphs", args.baseline_graphs or "", BASELINES)):
        unknown = [x for x in split(given) if x not in known]
        if unknown:
            p.error(f"{option} {given!r}: unknown {', '.join(unknown)}; choose from {', '.join(known)}")
    for variant in args.variant:
        if not variant.partition(":")[0] or ":" not in variant:
            p.error(f"--variant {variant!r}: expected NAME:OVERRIDES, e.g. ac:--parallel.activation_checkpoint=full")
        only = variant.partition(":")[0].rpartition("/")[0]
        if only and only not in split(args.layouts):
            p.error(f"--variant {variant!r}: {only!r} is not one of --layouts {args.layouts!r}; give LAYOUT/NAME "
                    "for a layout that runs, or NAME for all of them")
    for variant in args.launch_variant:
        name, _, options = variant.partition(":")
        if not name or "/" in name or not options.strip():
            p.error(f"--launch-variant {variant!r}: expected NAME:OPTIONS, e.g. excl:'--numa-binding exclusive'")
    for variant in args.env_variant:
        name, _, variables = variant.partition(":")
        if not name or "/" in name or not all(var and value is not None for var, value in env_pairs(variables)):
            p.error(f"--env-variant {variant!r}: expected NAME:VAR=VALUE[,VAR=VALUE], e.g. ctas:NCCL_MIN_CTAS=32")
    for value in [*args.extra, *args.variant]:
        if "--train.grad_clip" in value:
            p.error(f"{value!r} sets --train.grad_clip for meshrun alone; use --grad-clip, which clips every side")
    for source in args.src:
        name, _, folder = source.partition(":")
        if not name or not folder or not (Path(folder) / "meshrun" / "__init__.py").is_file():
            p.error(f"--src {source!r}: expected NAME:FOLDER where FOLDER holds the meshrun package (FOLDER/meshrun/"
                    "__init__.py), e.g. old:/tmp/old-checkout/src")
    if args.repeat < 1:
        p.error(f"--repeat {args.repeat}: needs at least 1")
    if args.run_timeout <= 0:
        p.error(f"--run-timeout {args.run_timeout:g}: needs a number of seconds above 0")
    if args.steps < 3:
        p.error(f"--steps {args.steps}: needs at least 3 (the first third is warm-up)")


def split(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def make_plan(args: argparse.Namespace, device: str) -> tuple[Plan, list[str]]:
    """The run's plan from the arguments, and the reasons for the peers it skips."""
    peers, skipped = installed_peers(split(args.peers))
    variants = [(name, shlex.split(overrides)) for name, _, overrides in (v.partition(":") for v in args.variant)]
    compiled = device != "cpu" if args.compile is None else args.compile
    extra = [x for value in args.extra for x in shlex.split(value)]
    bf16 = device != "cpu" or "--train.dtype=bf16" in extra
    if args.tune:
        variants += [(f"{layout}/{name}", shlex.split(overrides)) for layout in split(args.layouts)
                     for name, overrides in (TUNE.get(layout, {}) | (TUNE_COMPILED if compiled else {})
                                             | (TUNE_BF16.get(layout, {}) if bf16 else {})
                                             | (TUNE_CUDA.get(layout, {}) if device == "cuda" else {})
                                             | (BATCHED_COPY if layout == "ddp" and ddp_batches_copies() else {})
                                             ).items()]
    plan = Plan(steps=args.steps, compile=compiled,
                baseline=not args.no_baseline, peers=peers, session=tuple(SESSION[x] for x in split(args.session)),
                layouts=split(args.layouts), variants=variants, extra=extra, repeat=args.repeat,
                sources=tuple((name, folder) for name, _, folder in (x.partition(":") for x in args.src)),
                keep_runs=args.keep_runs, run_timeout=args.run_timeout,
                launch_args=tuple(x for value in args.launch_args for x in shlex.split(value)),
                launch_variants=tuple((name, tuple(shlex.split(options))) for name, _, options
                                      in (v.partition(":") for v in args.launch_variant)),
                env_variants=tuple((name, env_pairs(variables))
                                   for name, _, variables in (v.partition(":") for v in args.env_variant)),
                baseline_graphs=tuple(split(args.baseline_graphs) if args.baseline_graphs is not None
                                      else BASELINES if compiled else ["whole"]))
    return plan, skipped


def stop_runs_on_sigterm() -> None:
    """SIGTERM (`timeout`, a scheduler) ends the harness as Ctrl-C does: through launch's stop_run, so that the run
    it waits for, in a session of its own, does not outlive it."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    stop_runs_on_sigterm()
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{os.environ.get('PYTHONPATH', '')}"}
    device = probe_device(env)
    plan, skipped = make_plan(args, device)
    notes = [versions(plan), *skipped]
    for name, folder in [("", str(ROOT / "src")), *plan.sources]:
        # this checkout's src goes first on the children's PYTHONPATH: without --src, a PYTHONPATH of the caller's
        # never changes which meshrun the rows run; with it, check that the rows import the folder's
        found = imported_from(source_env(env, folder) if name else env)
        if found != (Path(folder) / "meshrun").resolve():
            print(f"train_bench: error: the {'@' + name if name else 'meshrun'} rows would import meshrun from "
                  f"{found}, not {folder}", file=sys.stderr)
            return 2
        notes.append(f"meshrun{'@' + name if name else ''}: {found}")
    print("\n".join(notes), flush=True)
    rows = []
    for size in split(args.sizes):
        for gpus in map(int, split(args.gpus)):
            for clip in map(float, split(args.grad_clip)):
                for row in run_case(Case(size, gpus, clip), plan, env):
                    rows.append({**row, "device": row.get("device", device)})
                    print(json.dumps(rows[-1]), flush=True)
    add_ratios(rows)
    print_table(rows, device, notes)
    for line in defaults_against_best(rows):
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 1 if any("error" in r for r in rows) else 0


def print_table(rows: list[dict], device: str, notes: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"training throughput on {device}", caption="\n".join(notes))
    for col in ("impl", "size", "gpus", "grad clip", "tok/s per GPU", "min-max (spread)", "MFU", "peak GiB",
                "vs baseline", "vs best peer"):
        table.add_column(col)
    for r in rows:
        spread = f"{r['min']:,.0f}-{r['max']:,.0f} ({r['spread']:.1%})" if r.get("runs", 1) > 1 else "-"
        cells = ["error", "", "", "", "", ""] if "error" in r else [
            f"{r['tokens_per_s_per_gpu']:,.0f}", spread, fmt(r.get("mfu"), "{:.1%}"),
            fmt(r.get("peak_mem_gib"), "{:.1f}"), ratio(r, "vs_baseline"), ratio(r, "vs_best_peer")]
        table.add_row(r["impl"], r["size"], str(r["gpus"]), f"{r['grad_clip']:g}", *cells)
    Console(width=shutil.get_terminal_size((150, 24)).columns).print(table)  # 150 when piped


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else spec.format(value)


def ratio(row: dict, key: str) -> str:
    """A ratio cell: the medians' ratio, and with repeats the worst case beside it (the row's slowest run over the
    fastest run compared with), e.g. '1.019x (worst 1.001x)'."""
    worst = f" (worst {row[key + '_worst']:.3f}x)" if row.get("runs", 1) > 1 and key + "_worst" in row else ""
    return fmt(row.get(key), "{:.3f}x") + worst


if __name__ == "__main__":
    sys.exit(main())
