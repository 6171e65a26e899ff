"""Training throughput of meshrun against the plain DDP baseline, in the same run on the same machine.

For each case (model size x number of GPUs x meshrun layout) it runs the baseline script
(benchmarks/baseline_ddp_gpt.py, the seeds' DDP pattern with bf16, SDPA, fused AdamW, torch.compile) and
`meshrun train`, both through `meshrun launch`, and reports tokens/s per GPU, MFU, peak memory and the ratio
meshrun / baseline. Prints a table and writes JSON.

    PYTHONPATH=src python3 benchmarks/train_bench.py --sizes 124m --gpus 1,2 --layouts ddp --json out.json

Throughput is the median of the logged intervals after the warm-up (compilation) steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MICRO = {"124m": (16, 1024), "1b": (4, 2048), "tiny": (8, 64), "small": (8, 256)}
LAYOUTS = {  # meshrun overrides for a layout on G GPUs
    "ddp": [],
    "fsdp": ["--parallel.dp_shard=-1", "--parallel.dp_replicate=1"],
    "tp": ["--parallel.tp=-1", "--parallel.dp_replicate=1", "--model.tie_embeddings=false"],
    "pp": ["--parallel.pp=-1", "--parallel.dp_replicate=1", "--parallel.pp_schedule=1f1b"],
}


def launch(gpus: int, target: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "meshrun", "launch", "--standalone", f"--nproc-per-node={gpus}", *target]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)


def run_baseline(size: str, gpus: int, steps: int, env: dict[str, str]) -> dict:
    mb, seq = MICRO[size]
    proc = launch(gpus, ["benchmarks/baseline_ddp_gpt.py", "--size", size, "--micro-batch", str(mb), "--seq",
                         str(seq), "--steps", str(steps), "--warmup", str(steps // 3)], env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        return {"error": (proc.stderr or proc.stdout)[-2000:]}
    return json.loads(lines[-1])


def run_meshrun(size: str, gpus: int, layout: str, steps: int, env: dict[str, str], extra: list[str]) -> dict:
    mb, seq = MICRO[size]
    with tempfile.TemporaryDirectory() as tmp:
        args = ["train", f"--model.name={size}", f"--model.seq_len={seq}", f"--train.micro_batch={mb}",
                f"--train.steps={steps}", "--train.log_every=5", "--train.eval_every=0", "--train.compile=true",
                "--checkpoint.final=false", "--run.progress=lines", f"--run.dir={tmp}", *LAYOUTS[layout], *extra]
        if layout == "pp":
            args.append(f"--train.grad_accum={2 * gpus}")  # micro-batches >= stages for the schedule
        proc = launch(gpus, args, env)
        metrics = Path(tmp, "metrics.jsonl")
        records = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    train = [r for r in records if r.get("kind") == "train" and r["step"] > steps // 3]
    if proc.returncode or not train:
        return {"error": (proc.stderr or proc.stdout)[-2000:]}
    return {"impl": f"meshrun-{layout}", "size": size, "gpus": gpus,
            "tokens_per_s_per_gpu": statistics.median(r["tokens_per_s_per_device"] for r in train),
            "mfu": statistics.median(r["mfu"] or 0 for r in train), "loss": train[-1]["loss"],
            "peak_mem_gib": max(r.get("peak_mem_gib") or 0 for r in train)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="124m")
    p.add_argument("--gpus", default="1,2")
    p.add_argument("--layouts", default="ddp", help=f"comma list of {', '.join(LAYOUTS)}")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--no-baseline", action="store_true")
    p.add_argument("--extra", default="", help="extra meshrun overrides, space separated")
    p.add_argument("--json", help="write all rows here")
    args = p.parse_args()
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{os.environ.get('PYTHONPATH', '')}"}
    rows = []
    for size in args.sizes.split(","):
        for gpus in map(int, args.gpus.split(",")):
            base = None if args.no_baseline else run_baseline(size, gpus, args.steps, env)
            if base:
                rows.append(base)
                print(json.dumps(base), flush=True)
            for layout in args.layouts.split(","):
                if layout != "ddp" and gpus == 1:
                    continue
                row = run_meshrun(size, gpus, layout, args.steps, env, args.extra.split())
                if base and "error" not in base and "error" not in row:
                    row["vs_baseline"] = row["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"]
                rows.append(row)
                print(json.dumps(row), flush=True)
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


def print_table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"training throughput ({rows[0].get('device', '') if rows else ''})")
    for col in ("impl", "size", "gpus", "tok/s per GPU", "MFU", "peak GiB", "vs baseline"):
        table.add_column(col)
    for r in rows:
        if "error" in r:
            table.add_row(r.get("impl", "?"), r.get("size", ""), str(r.get("gpus", "")), "error", "", "", "")
            continue
        table.add_row(r["impl"], r["size"], str(r["gpus"]), f"{r['tokens_per_s_per_gpu']:,.0f}",
                      f"{100 * r['mfu']:.1f}%", f"{r['peak_mem_gib']:.1f}",
                      f"{r['vs_baseline']:.3f}x" if "vs_baseline" in r else "")
    Console().print(table)


if __name__ == "__main__":
    sys.exit(main())
