"""``meshrun bench``: collective bandwidth between the workers of a launch, per group and per link.

    meshrun launch --nproc-per-node 8 bench allreduce --sizes 1M,16M,256M,1G --json bench.json
    meshrun launch --nnodes 2 --nproc-per-node 8 ... bench all --groups world,intra,inter --pairs 256M

Bandwidths follow the nccl-tests convention (GB = 1e9 bytes): ``algbw = size / time``; ``busbw = algbw x factor``
makes the figure comparable with the link speed whatever the rank count (the sizes and factors of each operation
are in :mod:`meshrun.diag.bench_ops`). The time per operation is the slowest rank's mean over ``--iters`` timed
runs after ``--warmup`` untimed ones. ``--groups intra`` measures within each node (all nodes at once),
``inter`` across nodes between ranks of the same local index (all local indices at once, as data-parallel
traffic does); ``--pairs SIZE`` adds the send/recv matrix of every rank pair (:mod:`meshrun.diag.links`).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from meshrun.config import BACKENDS
from meshrun.diag import links
from meshrun.diag.bench_ops import OPS, bus_factor, element_count, operation
from meshrun.diag.timing import timed
from meshrun.env import ProcessPlacement
from meshrun.help_format import PlainHelpFormatter

GROUPS = ("world", "intra", "inter")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30}


@dataclass(frozen=True)
class BenchRow:
    op: str
    group: str
    """world, intra (within each node) or inter (across nodes, one local index)."""
    ranks: int
    """Ranks in each group measured."""
    size_bytes: int
    count: int
    """Elements in the whole buffer (the gathered output / the scattered input)."""
    time_us: float
    algbw_gbps: float
    busbw_gbps: float


def parse_size(text: str, option: str = "--sizes") -> int:
    """'1M' -> 1048576 bytes; '64K', '1G', '4096' work too (binary units, as nccl-tests). ValueError naming
    ``option`` for anything else, 0 included."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)B?\s*", text.upper())
    if not match:
        raise ValueError(f"{option}: {text!r} is not a size; use e.g. 64K, 16M, 1G")
    size = int(match.group(1)) * _UNITS[match.group(2)]
    if size == 0:
        raise ValueError(f"{option}: {text!r} is 0 bytes; give a size above 0, e.g. 64K")
    return size


def usage_error(args: argparse.Namespace, *, cuda: bool) -> str | None:
    """The first problem of a bench command line, in one line that names the option and the fix; None when it can
    run. Pure: `meshrun launch` asks before it starts workers, and every worker asks again before its process
    group exists (so all ranks refuse alike, and rank 0 alone says why)."""
    try:
        for text in (args.sizes or "1M").split(","):
            parse_size(text)
        if args.pairs is not None:
            parse_size(args.pairs, "--pairs")
    except ValueError as exc:
        return str(exc)
    if args.iters is not None and args.iters < 1:
        return f"--iters {args.iters}: give 1 or more timed runs per size (default 20 on GPU, 5 on CPU)"
    if args.warmup < 0:
        return f"--warmup {args.warmup}: give 0 or more untimed runs per size (default 3)"
    groups = [g.strip() for g in args.groups.split(",") if g.strip()]
    if not groups or set(groups) - set(GROUPS):
        return f"--groups {args.groups}: choose from {', '.join(GROUPS)} (comma-separated)"
    if args.backend == "nccl" and not cuda:
        return "--backend nccl needs CUDA GPUs and none is available here; use --backend gloo (or auto, the default)"
    return None


def launch_usage_error(argv: list[str]) -> str | None:
    """usage_error for the arguments `meshrun launch ... bench ARGV` hands to every worker, asked once before they
    start. argparse's own errors and --help exit here, once, as a plain `meshrun bench` would."""
    return usage_error(build_parser().parse_args(argv), cuda=torch.cuda.is_available())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshrun bench", description=__doc__.splitlines()[0],
                                     formatter_class=PlainHelpFormatter)
    parser.add_argument("op", choices=(*OPS, "all"), help="operation to measure (all: each in turn)")
    parser.add_argument("--sizes", help="comma-separated buffer sizes (default 1M,16M,256M,1G on GPU, "
                                        "64K,1M,8M on CPU)")
    parser.add_argument("--iters", type=int, help="timed runs per size (default 20 on GPU, 5 on CPU)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs per size first (default 3)")
    parser.add_argument("--dtype", choices=DTYPES, help="element type (default bf16 on GPU, fp32 on CPU)")
    parser.add_argument("--backend", choices=BACKENDS, default="auto",
                        help="auto: nccl with CUDA, else gloo")
    parser.add_argument("--groups", default="world", metavar="LIST",
                        help="comma-separated: world (all ranks), intra (the ranks of each node), inter (one local "
                             "index across nodes); default world")
    parser.add_argument("--pairs", metavar="SIZE", help="also measure send/recv between every pair of ranks with a "
                                                        "buffer of SIZE, and name the slowest link")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON (rank 0)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    env = ProcessPlacement.detect()
    console = Console(highlight=False, soft_wrap=True)
    if not env.is_distributed:
        console.print("meshrun bench measures collectives between processes: run it as `meshrun launch "
                      f"--nproc-per-node 2 bench {args.op}` (or under torchrun)", markup=False)
        return 2
    problem = usage_error(args, cuda=torch.cuda.is_available())
    if problem:
        if env.is_rank_zero:  # every rank refuses alike, before any process group: one says why
            print(f"meshrun bench: error: {problem}", file=sys.stderr)
        return 2
    groups = [g.strip() for g in args.groups.split(",") if g.strip()]
    from meshrun.config import DistConfig
    from meshrun.comm.process_group import init_distributed, shutdown

    ctx = init_distributed(env, DistConfig(backend=args.backend, device="cuda" if args.backend == "nccl" else "auto"))
    try:
        result = run_bench(args, env=env, device=ctx.device, backend=ctx.backend or "gloo", groups=groups)
    finally:
        shutdown()
    if env.is_rank_zero:
        render(result, console)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
            console.print(f"wrote {args.json}", markup=False)
    return 0


def run_bench(args: argparse.Namespace, *, env: ProcessPlacement, device: torch.device, backend: str,
              groups: list[str] | tuple[str, ...] = ("world",)) -> dict:
    """Measure every (group, op, size), then the pairs; every rank must call this with the same arguments."""
    gpu = device.type == "cuda"
    sizes = [parse_size(s) for s in (args.sizes or ("1M,16M,256M,1G" if gpu else "64K,1M,8M")).split(",")]
    dtype = DTYPES[args.dtype or ("bf16" if gpu else "fp32")]
    iters = args.iters if args.iters is not None else (20 if gpu else 5)
    ops = OPS if args.op == "all" else (args.op,)
    measured, skipped = bench_groups(groups, env=env, device=device)
    rows = [measure(op, size, dtype=dtype, device=device, iters=iters, warmup=args.warmup, group=group, name=name)
            for name, group in measured for op in ops for size in sizes]
    name = torch.cuda.get_device_name(device) if gpu else f"cpu ({platform.machine()})"
    result = {"device": name, "backend": backend, "world_size": env.world_size, "num_nodes": env.num_nodes,
              "dtype": str(dtype).removeprefix("torch."), "iters": iters, "warmup": args.warmup,
              "torch": torch.__version__, "rows": [asdict(row) for row in rows], "skipped_groups": skipped}
    if args.pairs:
        matrix = links.measure_pairs(size_bytes=parse_size(args.pairs, "--pairs"), dtype=dtype, device=device,
                                     iters=iters, warmup=args.warmup)
        result["pairs"] = {"size_bytes": matrix.size_bytes, "gbps": matrix.gbps, "slowest": matrix.slowest(),
                           "nodes": [r // env.local_world_size for r in range(env.world_size)]}
    return result


def bench_groups(names: list[str] | tuple[str, ...], *, env: ProcessPlacement,
                 device: torch.device) -> tuple[list[tuple[str, object]], dict[str, str]]:
    """([(name, group)], {skipped name: why}). Builds the node x local mesh when intra/inter are asked for (a
    collective: every rank must call this with the same names)."""
    wanted, skipped = [], {}
    uniform = env.world_size == env.num_nodes * env.local_world_size
    if ("intra" in names or "inter" in names) and not uniform:
        skipped = {n: "nodes run different numbers of ranks" for n in ("intra", "inter") if n in names}
    mesh = None
    if uniform and {"intra", "inter"} & set(names) and env.world_size > 1:
        from meshrun.comm.mesh import node_mesh

        mesh = node_mesh(num_nodes=env.num_nodes, local_world_size=env.local_world_size, device_type=device.type)
    for name in names:
        size = {"world": env.world_size, "intra": env.local_world_size, "inter": env.num_nodes}[name]
        if name in skipped:
            continue
        if size < 2:
            skipped[name] = f"1 rank per group ({env.num_nodes} node(s) x {env.local_world_size} rank(s))"
            continue
        wanted.append((name, None if name == "world" else mesh.get_group("local" if name == "intra" else "node")))
    return wanted, skipped


def measure(op: str, size_bytes: int, *, dtype: torch.dtype, device: torch.device, iters: int, warmup: int,
            group=None, name: str = "world") -> BenchRow:
    """Time one operation on a buffer of ``size_bytes`` in ``group``; the slowest rank of the whole job counts.
    Collectives every rank must reach."""
    n = dist.get_world_size(group)
    count = element_count(size_bytes, n, dtype.itemsize)
    run = operation(op, count, group=group, dtype=dtype, device=device)
    for _ in range(warmup):
        run()
    dist.barrier()  # note: collective; all ranks start the timed loop together
    seconds = timed(run, iters, device) / iters
    slowest = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # note: collective on the default group
    seconds = float(slowest.item())
    nbytes = count * dtype.itemsize
    algbw = nbytes / seconds / 1e9
    return BenchRow(op=op, group=name, ranks=n, size_bytes=nbytes, count=count, time_us=seconds * 1e6,
                    algbw_gbps=algbw, busbw_gbps=algbw * bus_factor(op, n))


def render(result: dict, console: Console) -> None:
    console.print(render_table(result))
    for name, why in result.get("skipped_groups", {}).items():
        console.print(f"group {name} not measured: {why}", markup=False)
    if "pairs" in result:
        console.print(pairs_table(result["pairs"]))
        a, b, gbps = result["pairs"]["slowest"]
        nodes = result["pairs"]["nodes"]
        console.print(f"slowest link: rank {a} (node {nodes[a]}) <-> rank {b} (node {nodes[b]}): {gbps:.3g} GB/s "
                      "each way", markup=False)


def render_table(result: dict) -> Table:
    table = Table(title=f"{result['world_size']} ranks on {result['num_nodes']} node(s), {result['device']}, "
                        f"{result['backend']}, {result['dtype']}, mean of {result['iters']} runs (slowest rank)")
    for column in ("op", "group", "size", "time", "algbw GB/s", "busbw GB/s"):
        table.add_column(column, justify="right")
    for row in result["rows"]:
        table.add_row(row["op"], f"{row['group']} ({row['ranks']})", _human(row["size_bytes"]),
                      _duration(row["time_us"]), f"{row['algbw_gbps']:.3g}", f"{row['busbw_gbps']:.3g}")
    return table


def pairs_table(pairs: dict) -> Table:
    table = Table(title=f"send/recv GB/s each way between rank pairs, {_human(pairs['size_bytes'])} buffers")
    table.add_column("rank")
    n = len(pairs["gbps"])
    for b in range(n):
        table.add_column(str(b), justify="right")
    for a, row in enumerate(pairs["gbps"]):
        table.add_row(str(a), *("-" if v is None else f"{v:.3g}" for v in row))
    return table


def _duration(us: float) -> str:
    return f"{us / 1e3:.2f} ms" if us >= 1e3 else f"{us:.1f} us"


def _human(nbytes: int) -> str:
    """The message-size label in --sizes syntax (64K, 1G: exact, parse_size reads it back), not a rounded size."""
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return f"{nbytes}B"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
