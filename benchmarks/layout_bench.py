"""Parallel layouts side by side: the same model, data and global batch trained under each layout in one run.

For each layout it runs `meshrun train` through `meshrun launch` on the same GPUs, then reports tokens/s per GPU,
MFU, the measured peak memory beside `meshrun plan`'s estimate for that rank layout, and how closely the loss curve
tracks the first layout's (the reference, normally plain DDP): the largest relative difference of the logged losses
after the first fifth of the steps. Every layout trains the same untied model from the same seed on the same global
batch (GPUs x micro-batch samples per optimizer step), so the curves differ only by the order of floating-point sums.

Layouts are named by their degrees, joined with '-', outermost first (any order is accepted):
  ddp             plain data parallel over every GPU
  dpN             parallel.dp_replicate=N (replicated data parallel)
  fsdpN           parallel.dp_shard=N (FSDP2); dpN-fsdpM is HSDP
  tpN, ppN        tensor and pipeline degrees
  interleaved, gpipe, 1f1b   the pipeline schedule (default 1f1b)
A data-parallel degree left out is inferred from the GPU count.

    PYTHONPATH=src python3 benchmarks/layout_bench.py --size 1b --gpus 4 --steps 200 \\
        --layouts ddp,dp2-tp2,fsdp2-tp2,pp2-dp2,pp2-dp2-interleaved,dp2-fsdp2 --json layouts.json

Without a GPU the processes run on CPU with gloo and no compile: a check that the script works, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from train_bench import MICRO, attach_values, probe_device  # noqa: E402 - the harness's sizes and helpers
SCHEDULES = {"1f1b": "1f1b", "gpipe": "gpipe", "interleaved": "interleaved1f1b"}
DEGREE = re.compile(r"(dp|fsdp|tp|pp)(\d+)$")
PLAN_FLAGS = {"dp_replicate": "--dp-replicate", "dp_shard": "--dp-shard", "tp": "--tp", "pp": "--pp"}


@dataclass
class Layout:
    """One named layout: its mesh degrees (-1 inferred) and pipeline schedule."""

    name: str
    degrees: dict[str, int] = field(default_factory=dict)
    schedule: str = "1f1b"

    def train_overrides(self) -> list[str]:
        degrees = {"dp_replicate": -1, "dp_shard": 1, "tp": 1, "pp": 1}
        if "dp_shard" in self.degrees and "dp_replicate" not in self.degrees:
            degrees["dp_replicate"] = 1  # fsdpN alone: shard over the data-parallel ranks
        degrees.update(self.degrees)
        out = [f"--parallel.{k}={v}" for k, v in degrees.items()]
        return [*out, f"--parallel.pp_schedule={self.schedule}"] if degrees["pp"] > 1 else out

    def plan_flags(self) -> list[str]:
        pairs = (o.removeprefix("--parallel.").split("=") for o in self.train_overrides())
        return [f"{PLAN_FLAGS.get(k, '--pp-schedule')}={v}" for k, v in pairs]


def parse_layout(name: str) -> Layout:
    """'pp2-fsdp2-interleaved' -> Layout(pp=2, dp_shard=2, interleaved1f1b). Refuses unknown words by name."""
    layout = Layout(name)
    for word in name.split("-"):
        if word == "ddp":
            continue
        if word in SCHEDULES:
            layout.schedule = SCHEDULES[word]
            continue
        m = DEGREE.match(word)
        if not m:
            raise ValueError(f"--layouts: {word!r} in {name!r} is not a layout word; use ddp, dpN, fsdpN, tpN, ppN "
                             f"or a schedule ({', '.join(SCHEDULES)}), e.g. dp2-tp2 or pp2-fsdp2-interleaved")
        key = {"dp": "dp_replicate", "fsdp": "dp_shard"}.get(m[1], m[1])
        layout.degrees[key] = int(m[2])
    return layout


def train_args(layout: Layout, args: argparse.Namespace, run_dir: str, compile_: bool) -> list[str]:
    mb, seq = MICRO[args.size]
    return ["train", f"--model.name={args.size}", f"--model.seq_len={seq}", "--model.tie_embeddings=false",
            f"--train.micro_batch={mb}", f"--train.global_batch={mb * args.gpus}", f"--train.steps={args.steps}",
            f"--train.log_every={args.log_every}", "--train.eval_every=0", f"--train.compile={str(compile_).lower()}",
            "--checkpoint.final=false", "--run.progress=lines", f"--run.dir={run_dir}",
            *layout.train_overrides(), *(x for value in args.extra for x in shlex.split(value))]


def plan_estimate_gib(layout: Layout, args: argparse.Namespace, env: dict[str, str]) -> float | None:
    """`meshrun plan`'s per-GPU memory estimate for this layout (the largest pipeline stage), in GiB."""
    mb, seq = MICRO[args.size]
    cmd = [sys.executable, "-m", "meshrun", "plan", "--model", args.size, "--seq", str(seq), "--untied",
           "--nodes", "1", f"--gpus-per-node={args.gpus}", f"--micro-batch={mb}", f"--global-batch={mb * args.gpus}",
           *layout.plan_flags(), "--json"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode:
        return None
    return max(stage["total_bytes"] for stage in json.loads(proc.stdout)["memory"]) / 2**30


def run_layout(layout: Layout, args: argparse.Namespace, env: dict[str, str], compile_: bool) -> dict:
    """One layout's row: throughput after the warm-up third, peak memory and the logged loss curve."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "meshrun", "launch", "--standalone", f"--nproc-per-node={args.gpus}",
               *train_args(layout, args, tmp, compile_)]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
        metrics = Path(tmp, "metrics.jsonl")
        records = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    train = [r for r in records if r.get("kind") == "train"]
    timed = [r for r in train if r["step"] > args.steps // 3]
    if proc.returncode or not timed:
        return {"layout": layout.name, "error": (proc.stderr or proc.stdout)[-2000:]}
    mfu = [r["mfu"] for r in timed if r.get("mfu") is not None]
    peak = [r["peak_mem_gib"] for r in timed if r.get("peak_mem_gib") is not None]
    return {"layout": layout.name, "overrides": layout.train_overrides(),
            "tokens_per_s_per_gpu": statistics.median(r["tokens_per_s_per_device"] for r in timed),
            "mfu": statistics.median(mfu) if mfu else None, "peak_mem_gib": max(peak) if peak else None,
            "losses": {r["step"]: r["loss"] for r in train}, "final_loss": train[-1]["loss"]}


def compare_losses(rows: list[dict], steps: int) -> None:
    """Sets loss_max_rel_diff on each row: the largest |loss - reference| / reference over the logged steps after
    the first fifth, the reference being the first row that ran; and vs_reference for throughput."""
    ok = [r for r in rows if "error" not in r]
    if not ok:
        return
    ref = ok[0]
    for row in ok:
        common = [s for s in row["losses"] if s in ref["losses"] and s > steps // 5]
        diffs = [abs(row["losses"][s] - ref["losses"][s]) / abs(ref["losses"][s]) for s in common]
        row["loss_max_rel_diff"] = max(diffs) if diffs else None
        row["vs_reference"] = row["tokens_per_s_per_gpu"] / ref["tokens_per_s_per_gpu"]


def print_table(rows: list[dict], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("layout", "tok/s per GPU", "vs first", "MFU", "peak GiB", "plan GiB", "final loss", "loss diff"):
        table.add_column(col)
    for r in rows:
        if "error" in r:
            table.add_row(r["layout"], "error", *[""] * 6)
            continue
        table.add_row(r["layout"], f"{r['tokens_per_s_per_gpu']:,.0f}", fmt(r.get("vs_reference"), "{:.3f}x"),
                      fmt(r["mfu"], "{:.1%}"), fmt(r["peak_mem_gib"], "{:.1f}"), fmt(r.get("plan_gib"), "{:.1f}"),
                      f"{r['final_loss']:.4f}", fmt(r.get("loss_max_rel_diff"), "{:.2%}"))
    Console(width=150).print(table)


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else spec.format(value)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="1b", choices=list(MICRO))
    p.add_argument("--gpus", type=int, default=4, help="GPUs (CPU processes without a GPU)")
    p.add_argument("--layouts", default="ddp,dp2-tp2,fsdp2-tp2,pp2-dp2,pp2-dp2-interleaved,dp2-fsdp2")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--timeout", type=int, default=900, help="seconds for one layout's run")
    p.add_argument("--extra", action="append", default=[], help="meshrun overrides for every layout (several in one quoted value)")
    p.add_argument("--json", help="write the rows here (rewritten after each layout)")
    args = p.parse_args(attach_values(argv))
    if args.steps < 2 * args.log_every:
        p.error(f"--steps {args.steps}: needs at least two log intervals of --log-every {args.log_every}")
    try:
        args.layouts = [parse_layout(name) for name in args.layouts.split(",") if name]
    except ValueError as e:
        p.error(str(e))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{os.environ.get('PYTHONPATH', '')}"}
    device = probe_device(env)
    rows = []
    for layout in args.layouts:
        row = {**run_layout(layout, args, env, compile_=device != "cpu"), "size": args.size, "gpus": args.gpus,
               "device": device, "plan_gib": plan_estimate_gib(layout, args, env)}
        rows.append(row)
        compare_losses(rows, args.steps)
        print(json.dumps({k: v for k, v in row.items() if k != "losses"}), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2))
    print_table(rows, f"{args.size} on {args.gpus} x {device}, {args.steps} steps, same global batch")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
