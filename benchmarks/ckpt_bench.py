"""Checkpoint save and load speed against the raw write bandwidth of the same disk, measured in the same run.

For one model (GPT + AdamW state; DDP across the ranks, so each rank writes about 1/N of the state):

* raw: every rank writes and fsyncs a file as large as its shard, at the same time (the disk's ceiling);
* sync save: ``Checkpointer.save`` end to end (DCP write + fsync, SHA-256 of the shards, manifest, rename);
* async save: the training stall (``save`` returning after staging to CPU) and the time until it is published;
* load: ``Checkpointer.load`` with resume=auto, with and without the SHA-256 verification.

Reads come from the page cache (the file was just written; dropping caches would need root and disturb other
users), so load numbers are an upper bound for a cold start. Prints a table and one JSON line (``--json`` also
writes it to a file).

``--dir`` may be an ``s3://`` or ``gs://`` URL (credentials and endpoint from the environment, as for training):
then "raw" is one upload per rank of its shard's size, streamed in parts as a save streams its shards, and the
save and load go through the object store.

    python3 benchmarks/ckpt_bench.py --model small --nproc 2             # CPU, gloo, 2 ranks
    torchrun --nproc-per-node 8 benchmarks/ckpt_bench.py --model 1b --device cuda
    python3 benchmarks/ckpt_bench.py --model 1b --device cuda --nproc 1  # one GPU
    AWS_ENDPOINT_URL=http://127.0.0.1:9000 python3 benchmarks/ckpt_bench.py --model 1b --device cuda --nproc 1 \
        --dir s3://bench/ckpt                                            # an S3 server
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from meshrun.ckpt.checkpointer import Checkpointer
from meshrun.ckpt.manifest import data_location, read_manifest
from meshrun.ckpt.storage import Store, is_url, store_for
from meshrun.ckpt.state import ModelOptimState, RNGState, TrainProgress
from meshrun.config import CheckpointConfig
from meshrun.env import ProcessPlacement
from meshrun.models.gpt import GPT, gpt_config


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small", help="named size: tiny, small, 124m, 350m, 1b")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--nproc", type=int, default=2, help="ranks to spawn when not started by torchrun")
    parser.add_argument("--repeat", type=int, default=3, help="timed repetitions of each measurement")
    parser.add_argument("--dir", default="", help="folder on the disk to measure, or an s3:// or gs:// URL (default: "
                                                  "a temp dir in runs/)")
    parser.add_argument("--no-async", action="store_true",
                        help="skip the async save, whose staging copy doubles the state in host memory (a 1b state "
                             "of 12.7 GB on a 24 GB machine)")
    parser.add_argument("--json", default="", help="also write the JSON result to this file")
    return parser.parse_args(argv)


def build_state(args: argparse.Namespace, env: ProcessPlacement, device: torch.device) -> tuple[dict, int]:
    """GPT + AdamW with its state (one step on zero gradients): a DDP replica, the same on every rank (seeded)."""
    torch.manual_seed(0)
    model = GPT(gpt_config(args.model)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)  # a checkpoint holds no gradients: the 1b state is 12.7 GB, not 17
    state = {"model_optim": ModelOptimState([model], [optimizer]), "trainer": TrainProgress(), "rng": RNGState(env)}
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    return state, params


def raw_write(store: Store, folder: str, size: int, rank: int) -> float:
    """Seconds to write and fsync (local) or upload (object store) ``size`` incompressible bytes on this rank."""
    block = np.random.default_rng(rank).bytes(min(size, 64 << 20))
    path = store.join(folder, f"raw-{rank}.bin")
    start = time.perf_counter()
    with store.open_write(path) as handle:  # an object store uploads it in parts, as a save streams its shards
        left = size
        while left > 0:
            left -= handle.write(block[:left])
        if not is_url(folder):
            handle.flush()
            os.fsync(handle.fileno())
    elapsed = time.perf_counter() - start
    store.delete(path)
    return elapsed


def timed(fn, *, sync: bool = True) -> float:
    """Wall seconds of ``fn`` as the slowest rank saw it (barrier before; max over ranks after)."""
    if sync and dist.is_initialized():
        dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def measure(args: argparse.Namespace, env: ProcessPlacement, folder: str) -> dict:
    device = torch.device("cuda", env.local_rank) if args.device == "cuda" else torch.device("cpu")
    state, params = build_state(args, env, device)
    store = store_for(folder)

    def checkpointer(name: str, *, verify: bool = True, **overrides) -> Checkpointer:
        # keep_last=1: at most two checkpoints per folder on disk at a time (1b: 13 GB each)
        return Checkpointer(CheckpointConfig(keep_last=1, **overrides), folder=store.join(folder, name), env=env,
                            layout={"dp_replicate": env.world_size}, config_fingerprint="bench",
                            verify_checksums=verify)

    steps = range(1, args.repeat + 1)
    sync_ckpt = checkpointer("sync")
    first_sync = timed(lambda: sync_ckpt.save(0, state))  # also checks the folder is shared; not steady state
    sync_s = [timed(lambda s=s: sync_ckpt.save(s, state)) for s in steps]
    manifest = read_manifest(data_location(store.join(folder, "sync", f"step_{args.repeat:07d}")))
    total = sum(info["size"] for info in manifest["files"].values())
    mine = sum(info["size"] for name, info in manifest["files"].items() if name.startswith(f"__{env.rank}_"))
    raw_s = [timed(lambda: raw_write(store, folder, mine, env.rank)) for _ in steps]
    first_stall, stall_s, async_total_s = None, [], []
    if not args.no_async:
        async_ckpt = checkpointer("async", async_save=True)
        first_stall = timed(lambda: async_ckpt.save(0, state))  # allocates the staging buffers
        async_ckpt.wait()
        for step in steps:
            stall_s.append(timed(lambda s=step: async_ckpt.save(s, state)))
            async_total_s.append(stall_s[-1] + timed(async_ckpt.wait, sync=False))
        async_ckpt.close()
        if env.rank == 0:
            store.delete(store.join(folder, "async"), recursive=True)
    load_s = [timed(lambda: sync_ckpt.load(state, resume="auto")) for _ in steps]
    fast = checkpointer("sync", verify=False)
    load_nohash_s = [timed(lambda: fast.load(state, resume="auto")) for _ in steps]
    med = statistics.median
    result = {"model": args.model, "params": params, "device": args.device, "ranks": env.world_size,
              "storage": "object store" if is_url(folder) else "local folder",
              "checkpoint_bytes": total, "rank0_shard_bytes": mine, "torch": torch.__version__,
              "first_sync_save_s": first_sync, "first_async_stall_s": first_stall,
              "save_breakdown_rank0_s": manifest["timings"]}
    for key, times in (("raw_write", raw_s), ("sync_save", sync_s), ("async_stall", stall_s),
                       ("async_total", async_total_s), ("load", load_s), ("load_nohash", load_nohash_s)):
        result[f"{key}_s"] = med(times) if times else None  # None: not measured (--no-async)
        result[f"{key}_GBps"] = total / med(times) / 1e9 if times else None
    return result


ROWS = (("raw write + fsync (same bytes)", "raw_write_s"), ("sync save", "sync_save_s"),
        ("async save: training stall", "async_stall_s"), ("async save: until published", "async_total_s"),
        ("load (auto, sha256 verified)", "load_s"), ("load (no checksums)", "load_nohash_s"))


def report(result: dict, json_path: str) -> None:
    title = (f"checkpoint speed: {result['model']} ({result['params'] / 1e6:.1f}M params), {result['ranks']} rank(s) "
             f"on {result['device']}, {result['checkpoint_bytes'] / 1e6:.1f} MB, {result['storage']}")
    raw = "raw upload, in parts (same bytes)" if result["storage"] == "object store" else ROWS[0][0]
    labels = {key: raw if key == "raw_write_s" else label for label, key in ROWS}
    rows = [(labels[key], f"{result[key]:.3f}", f"{result['checkpoint_bytes'] / result[key] / 1e9:.2f}",
             f"{result[key] / result['raw_write_s']:.2f}x") if result[key] is not None else (label, "-", "-", "-")
            for label, key in ROWS]
    header = ("what", "seconds", "GB/s", "time vs raw write")
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # plain text where rich is not installed
        print(title)
        for row in (header, *rows):
            print(f"{row[0]:<32}{row[1]:>10}{row[2]:>8}{row[3]:>20}")
    else:
        table = Table(title=title)
        for column in header:
            table.add_column(column, justify="left" if column == "what" else "right")
        for row in rows:
            table.add_row(*row)
        Console(width=100).print(table)
    print(json.dumps(result))
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=1))


def run(args: argparse.Namespace) -> dict | None:
    """One rank's run (the process group is up, or this is the only rank)."""
    env = ProcessPlacement.detect()
    base = args.dir.rstrip("/") or "runs"
    store = store_for(base)
    folder = store.join(base, f"ckpt-bench-{secrets.token_hex(4)}")
    if dist.is_initialized():
        box = [folder]
        dist.broadcast_object_list(box, src=0)
        folder = box[0]
    store.makedirs(folder)
    try:
        result = measure(args, env, folder)
    finally:
        if dist.is_initialized():
            dist.barrier()
        if env.rank == 0:
            store.delete(folder, recursive=True)
    return result if env.rank == 0 else None


def _spawned(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world)})
    _main_rank(args)


def _main_rank(args: argparse.Namespace) -> None:
    env = ProcessPlacement.detect()
    # Ranks sharing a CPU: one intra-op pool each of its share, as torchrun sets OMP_NUM_THREADS (oversubscribed
    # pools turn every tensor copy into a scheduler wait).
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // env.local_world_size))
    if env.world_size > 1:
        if args.device == "cuda":
            torch.cuda.set_device(env.local_rank)
        backend = "cpu:gloo,cuda:nccl" if args.device == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=600))
    try:
        result = run(args)
        if result is not None:
            report(result, args.json)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if "RANK" in os.environ or args.nproc <= 1:
        _main_rank(args)
        return 0
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.start_processes(_spawned, args=(args.nproc, port, args), nprocs=args.nproc, start_method="spawn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
