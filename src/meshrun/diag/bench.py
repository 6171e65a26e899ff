"""``meshrun bench``: collective bandwidth between the workers of a launch.

    meshrun launch --nproc-per-node 8 bench allreduce --sizes 1M,16M,256M,1G --json bench.json

Bandwidths follow the nccl-tests convention (GB = 1e9 bytes): ``algbw = size / time``; ``busbw`` scales algbw so
that it compares with the link speed whatever the rank count: ``x 2(n-1)/n`` for all-reduce and ``x (n-1)/n`` for
all-gather and reduce-scatter, whose ``size`` is the whole (gathered / scattered) buffer. The time per operation
is the slowest rank's mean over ``--iters`` timed runs after ``--warmup`` untimed ones.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from meshrun.env import ClusterEnv

OPS = ("allreduce", "allgather", "reducescatter")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30}


@dataclass(frozen=True)
class BenchRow:
    op: str
    size_bytes: int
    count: int
    """Elements in the whole buffer (the gathered output / the scattered input)."""
    time_us: float
    algbw_gbps: float
    busbw_gbps: float


def bus_factor(op: str, world_size: int) -> float:
    """nccl-tests' bus bandwidth factor: 2(n-1)/n for all-reduce, (n-1)/n for all-gather and reduce-scatter."""
    n = world_size
    return 2 * (n - 1) / n if op == "allreduce" else (n - 1) / n


def parse_size(text: str) -> int:
    """'1M' -> 1048576 bytes; '64K', '1G', '4096' work too (binary units, as nccl-tests)."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)B?\s*", text.upper())
    if not match:
        raise ValueError(f"--sizes: {text!r} is not a size; use e.g. 64K, 16M, 1G")
    return int(match.group(1)) * _UNITS[match.group(2)]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshrun bench", description=__doc__.splitlines()[0])
    parser.add_argument("op", choices=(*OPS, "all"), help="collective to measure (all: each in turn)")
    parser.add_argument("--sizes", help="comma-separated buffer sizes (default 1M,16M,256M,1G on GPU, "
                                        "64K,1M,8M on CPU)")
    parser.add_argument("--iters", type=int, default=0, help="timed runs per size (default 20 on GPU, 5 on CPU)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs per size first (default 3)")
    parser.add_argument("--dtype", choices=DTYPES, help="element type (default bf16 on GPU, fp32 on CPU)")
    parser.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto",
                        help="auto: nccl with CUDA, else gloo")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON (rank 0)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    env = ClusterEnv.detect()
    console = Console(highlight=False, soft_wrap=True)
    if not env.is_distributed:
        console.print("meshrun bench measures collectives between processes: run it as `meshrun launch "
                      f"--nproc-per-node 2 bench {args.op}` (or under torchrun)", markup=False)
        return 2
    from meshrun.config import DistConfig
    from meshrun.dist.process_group import init_distributed, shutdown

    ctx = init_distributed(env, DistConfig(backend=args.backend, device="cuda" if args.backend == "nccl" else "auto"))
    try:
        result = run_bench(args, env=env, device=ctx.device, backend=ctx.backend or "gloo")
    finally:
        shutdown()
    if env.is_rank_zero:
        console.print(render_table(result))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
            console.print(f"wrote {args.json}", markup=False)
    return 0


def run_bench(args: argparse.Namespace, *, env: ClusterEnv, device: torch.device, backend: str) -> dict:
    """Measure every (op, size); every rank must call this with the same arguments (all are collectives)."""
    gpu = device.type == "cuda"
    sizes = [parse_size(s) for s in (args.sizes or ("1M,16M,256M,1G" if gpu else "64K,1M,8M")).split(",")]
    dtype = DTYPES[args.dtype or ("bf16" if gpu else "fp32")]
    iters = args.iters or (20 if gpu else 5)
    ops = OPS if args.op == "all" else (args.op,)
    rows = [measure(op, size, dtype=dtype, device=device, iters=iters, warmup=args.warmup, world_size=env.world_size)
            for op in ops for size in sizes]
    name = torch.cuda.get_device_name(device) if gpu else f"cpu ({platform.machine()})"
    return {"device": name, "backend": backend, "world_size": env.world_size, "num_nodes": env.num_nodes,
            "dtype": str(dtype).removeprefix("torch."), "iters": iters, "warmup": args.warmup,
            "torch": torch.__version__, "rows": [asdict(row) for row in rows]}


def measure(op: str, size_bytes: int, *, dtype: torch.dtype, device: torch.device, iters: int, warmup: int,
            world_size: int) -> BenchRow:
    """Time one collective on a buffer of ``size_bytes``. Collectives every rank must reach."""
    n = world_size
    count = max(n, size_bytes // dtype.itemsize // n * n)  # divisible by n for the gather/scatter chunks
    run = _collective(op, count, n, dtype=dtype, device=device)
    for _ in range(warmup):
        run()
    dist.barrier()  # note: collective; all ranks start the timed loop together
    seconds = _timed(run, iters, device) / iters
    slowest = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # note: collective; the slowest rank's time counts
    seconds = float(slowest.item())
    nbytes = count * dtype.itemsize
    algbw = nbytes / seconds / 1e9
    return BenchRow(op=op, size_bytes=nbytes, count=count, time_us=seconds * 1e6, algbw_gbps=algbw,
                    busbw_gbps=algbw * bus_factor(op, n))


def _collective(op: str, count: int, n: int, *, dtype: torch.dtype, device: torch.device) -> Callable[[], None]:
    if op == "allreduce":
        buf = torch.ones(count, dtype=dtype, device=device)  # (count,)
        return lambda: dist.all_reduce(buf)
    whole = torch.ones(count, dtype=dtype, device=device)  # (count,): gathered output / scattered input
    chunk = torch.ones(count // n, dtype=dtype, device=device)  # (count / n,)
    if op == "allgather":
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed after 2.8
        return lambda: gather(whole, chunk)
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return lambda: scatter(chunk, whole)


def _timed(run: Callable[[], None], iters: int, device: torch.device) -> float:
    """Seconds for ``iters`` runs: CUDA events on GPU (device time), wall clock on CPU."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            run()
        end.record()
        end.synchronize()  # note: CPU-GPU sync point
        return start.elapsed_time(end) / 1e3
    begin = time.perf_counter()
    for _ in range(iters):
        run()
    return time.perf_counter() - begin


def render_table(result: dict) -> Table:
    table = Table(title=f"{result['world_size']} ranks on {result['num_nodes']} node(s), {result['device']}, "
                        f"{result['backend']}, {result['dtype']}, mean of {result['iters']} runs (slowest rank)")
    for column in ("op", "size", "time", "algbw GB/s", "busbw GB/s"):
        table.add_column(column, justify="right")
    for row in result["rows"]:
        table.add_row(row["op"], _human(row["size_bytes"]), _duration(row["time_us"]),
                      f"{row['algbw_gbps']:.3g}", f"{row['busbw_gbps']:.3g}")
    return table


def _duration(us: float) -> str:
    return f"{us / 1e3:.2f} ms" if us >= 1e3 else f"{us:.1f} us"


def _human(nbytes: int) -> str:
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return f"{nbytes}B"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
