"""Where a training step's time goes: meshrun's engine against the plain baseline model, one process, one GPU.

Each variant builds its model, compiles it, runs ``--warmup`` steps, times ``--steps`` steps (CUDA-synchronised
wall clock), then profiles two steps with torch.profiler and prints the kernels that took the most GPU time.
The baseline is the GPT-2 model of benchmarks/baseline_ddp_gpt.py; meshrun variants are the engine that
``meshrun train`` builds, with config overrides per variant. Prints one JSON line per variant and a table.

    PYTHONPATH=src python3 benchmarks/step_profile.py --size 124m --variants baseline,meshrun,meshrun:train.grad_clip=0

A variant is ``baseline`` or ``meshrun[:section.key=value[,...]]`` (overrides separated by '+').
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

MICRO = {"124m": (16, 1024), "1b": (4, 2048), "tiny": (8, 64), "small": (8, 256)}


def baseline_step(size: str, mb: int, seq: int, device: torch.device):
    import baseline_ddp_gpt as base

    dim, layers, heads, vocab = base.SIZES[size]
    model = base.GPT(dim, layers, heads, vocab, seq).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=device.type == "cuda")
    model = torch.compile(model)
    x = torch.randint(0, vocab, (mb, seq + 1), device=device)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def meshrun_step(size: str, mb: int, seq: int, device: torch.device, overrides: list[str]):
    from meshrun.config import load_config
    from meshrun.comm.mesh import ParallelDims
    from meshrun.models.build import model_shape
    from meshrun.parallel.apply import build_engine
    from meshrun.train.trainer import compute_dtype

    job = load_config(None, [f"model.name={size}", f"model.seq_len={seq}", f"train.micro_batch={mb}",
                             "train.compile=true", *overrides])
    cfg = model_shape(job)
    dims = ParallelDims.from_config(job.parallel, world_size=1, gpus_per_node=1, model=cfg)
    engine = build_engine(job=job, model_cfg=cfg, dims=dims, mesh=None, device=device,
                          compute_dtype=compute_dtype(job, device))
    params = [p for part in engine.model_parts for p in part.parameters()]
    opt = torch.optim.AdamW(params, lr=3e-4, weight_decay=0.1, fused=device.type == "cuda")
    x = torch.randint(0, cfg.vocab_size, (mb, seq + 1), device=device)
    clip = job.train.grad_clip

    def step():
        engine.forward_backward([(x[:, :-1], x[:, 1:])])
        if clip:
            engine.clip_grad_norm(clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def measure(step, *, warmup: int, steps: int, tokens: int, trace: Path | None) -> dict:
    for _ in range(warmup):
        step()
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    elapsed = time.perf_counter() - start
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step()
        sync()
    if trace:
        prof.export_chrome_trace(str(trace))
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70)
    return {"tokens_per_s": steps * tokens / elapsed, "step_ms": 1000 * elapsed / steps, "table": table,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="124m")
    p.add_argument("--variants", default="baseline,meshrun")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--trace-dir", help="write a Chrome trace per variant here")
    p.add_argument("--tables", action="store_true", help="print the profiler's kernel table per variant")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = True
    mb, seq = MICRO[args.size]
    rows = []
    for i, variant in enumerate(args.variants.split(",")):
        name, _, rest = variant.partition(":")
        torch.manual_seed(0)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        step = (baseline_step(args.size, mb, seq, device) if name == "baseline"
                else meshrun_step(args.size, mb, seq, device, [o for o in rest.split("+") if o]))
        trace = Path(args.trace_dir) / f"trace_{i}.json" if args.trace_dir else None
        result = measure(step, warmup=args.warmup, steps=args.steps, tokens=mb * seq, trace=trace)
        row = {"variant": variant, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", **{k: v for k, v in result.items()
                                                                               if k != "table"}}
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.tables:
            print(result["table"], flush=True)
        torch._dynamo.reset()
    base = next((r for r in rows if r["variant"] == "baseline"), None)
    for r in rows:
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.3f}x" if base else ""
        print(f"{r['variant']:<60} {r['tokens_per_s']:>10,.0f} tok/s {r['step_ms']:7.2f} ms "
              f"{r['peak_gib']:5.1f} GiB {ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
