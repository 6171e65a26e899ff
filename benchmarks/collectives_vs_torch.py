"""``meshrun bench`` and ``meshrun doctor``'s per-GPU figures against plain torch loops, in the same run.

For every operation of ``meshrun bench`` (all-reduce, all-gather, reduce-scatter, broadcast, all-to-all, send/recv)
and every size, this times the operation twice: with ``meshrun.diag.bench.measure`` (CUDA events, the figure
``meshrun bench`` prints) and with a hand-written loop (wall clock around ``torch.cuda.synchronize``), whose
nccl-tests bus-bandwidth factors are written out below instead of imported, so that an error in either shows as a
ratio away from 1. Each is measured twice, alternating, and the better of the two counts. Then each rank's GPU:
``meshrun.diag.gpu_health``'s bf16 GEMM and copy bandwidth against plain loops.

    PYTHONPATH=src python -m meshrun launch --nproc-per-node 4 benchmarks/collectives_vs_torch.py --json out.json
    PYTHONPATH=src python -m meshrun launch --nproc-per-node 2 benchmarks/collectives_vs_torch.py --sizes 64K,1M  # CPU

Rank 0 prints a table with the ratio meshrun / plain for each row, and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.distributed as dist

from meshrun.config import DistConfig
from meshrun.diag import bench, gpu_health
from meshrun.comm.process_group import init_distributed, shutdown
from meshrun.env import ProcessPlacement

# nccl-tests' bus-bandwidth factors, written out independently of meshrun.diag.bench_ops
FACTOR = {"allreduce": lambda n: 2 * (n - 1) / n, "allgather": lambda n: (n - 1) / n,
          "reducescatter": lambda n: (n - 1) / n, "alltoall": lambda n: (n - 1) / n,
          "broadcast": lambda n: 1.0, "sendrecv": lambda n: 1.0}


def plain_op(op: str, count: int, n: int, rank: int, device: torch.device, dtype: torch.dtype):
    """The operation as one would write it by hand with torch.distributed."""
    x = torch.ones(count, dtype=dtype, device=device)
    part = torch.ones(count // n, dtype=dtype, device=device)
    out = torch.empty_like(x)
    if op == "allreduce":
        return lambda: dist.all_reduce(x)
    if op == "allgather":
        return lambda: dist.all_gather_into_tensor(x, part)
    if op == "reducescatter":
        return lambda: dist.reduce_scatter_tensor(part, x)
    if op == "broadcast":
        return lambda: dist.broadcast(x, src=0)
    if op == "alltoall":
        return lambda: dist.all_to_all_single(out, x)

    def sendrecv():
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, (rank + 1) % n),
                                       dist.P2POp(dist.irecv, out, (rank - 1) % n)])
        for req in reqs:
            req.wait()
    return sendrecv


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plain_seconds(run, *, iters: int, warmup: int, device: torch.device) -> float:
    for _ in range(warmup):
        run()
    sync(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        run()
    sync(device)
    mine = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64, device=device)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return float(mine.item())


def compare_collective(op: str, size: int, *, env: ProcessPlacement, device, dtype, iters: int, warmup: int) -> dict:
    n = env.world_size
    count = max(n, size // dtype.itemsize // n * n)
    ours, plain = 0.0, 0.0
    for _ in range(2):  # alternate, keep the better of each
        row = bench.measure(op, size, dtype=dtype, device=device, iters=iters, warmup=warmup)
        ours = max(ours, row.busbw_gbps)
        seconds = plain_seconds(plain_op(op, count, n, env.rank, device, dtype), iters=iters, warmup=warmup,
                                device=device)
        plain = max(plain, count * dtype.itemsize / seconds / 1e9 * FACTOR[op](n))
    return {"op": op, "size_bytes": count * dtype.itemsize, "meshrun_busbw_gbps": ours, "plain_busbw_gbps": plain,
            "ratio": ours / plain if plain else None}


def plain_gemm_tflops(device, n: int, iters: int) -> float:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    for _ in range(3):
        a @ b
    sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        a @ b
    sync(device)
    return 2 * n**3 * iters / (time.perf_counter() - start) / 1e12


def plain_copy_gbps(device, nbytes: int, iters: int) -> float:
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    sync(device)
    return 2 * nbytes * iters / (time.perf_counter() - start) / 1e9


def compare_device(env: ProcessPlacement, device) -> dict:
    gpu = device.type == "cuda"
    n, nbytes, iters = (8192, 2**30, 20) if gpu else (128, 2**22, 3)
    ours = {"gemm": gpu_health.gemm_tflops(device), "mem": gpu_health.memory_gbps(device)}
    plain = {"gemm": plain_gemm_tflops(device, n, iters), "mem": plain_copy_gbps(device, nbytes, iters)}
    name = torch.cuda.get_device_name(device) if gpu else "cpu"
    mine = {"rank": env.rank, "device": f"{device} {name}", "gemm_tflops": ours["gemm"],
            "plain_gemm_tflops": plain["gemm"], "mem_gbps": ours["mem"], "plain_mem_gbps": plain["mem"],
            "nvml": gpu_health.nvml_state(device.index) if gpu else {}}
    gathered = [None] * env.world_size
    dist.all_gather_object(gathered, mine)
    return gathered


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", help="default 1M,16M,256M,1G on GPU, 64K,1M on CPU")
    parser.add_argument("--iters", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    env = ProcessPlacement.detect()
    ctx = init_distributed(env, DistConfig())
    device, gpu = ctx.device, ctx.device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    sizes = [bench.parse_size(s) for s in (args.sizes or ("1M,16M,256M,1G" if gpu else "64K,1M")).split(",")]
    iters = args.iters or (20 if gpu else 5)
    try:
        rows = [compare_collective(op, size, env=env, device=device, dtype=dtype, iters=iters, warmup=args.warmup)
                for op in bench.OPS for size in sizes]
        devices = compare_device(env, device)
    finally:
        shutdown()
    if env.is_rank_zero:
        report(rows, devices, env=env, device=device, dtype=dtype, args=args)
    return 0


def report(rows, devices, *, env, device, dtype, args) -> None:
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{env.world_size} ranks, {card}, {dtype}, torch {torch.__version__}")
    print(f"{'op':>14} {'size':>10} {'meshrun busbw':>14} {'plain busbw':>12} {'ratio':>6}")
    for r in rows:
        print(f"{r['op']:>14} {r['size_bytes']:>10} {r['meshrun_busbw_gbps']:>14.4g} {r['plain_busbw_gbps']:>12.4g} "
              f"{r['ratio']:>6.3f}")
    print(f"{'rank':>4} {'device':<28} {'GEMM TFLOP/s':>12} {'plain':>8} {'memory GB/s':>12} {'plain':>8}  NVML")
    for d in devices:
        print(f"{d['rank']:>4} {d['device']:<28} {d['gemm_tflops']:>12.4g} {d['plain_gemm_tflops']:>8.4g} "
              f"{d['mem_gbps']:>12.5g} {d['plain_mem_gbps']:>8.5g}  {gpu_health.describe_nvml(d['nvml']) or '-'}")
    record = {"device": card, "world_size": env.world_size, "dtype": str(dtype), "torch": torch.__version__,
              "collectives": rows, "devices": devices}
    print(json.dumps(record))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
