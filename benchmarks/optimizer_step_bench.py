"""Host and device time of one AdamW step over FSDP2-sharded parameters: torch's AdamW (its update dispatched through
DTensor) against meshrun's LocalShardAdamW (the same update on the local shards).

Run it on every rank of a job, for example

    meshrun launch --nproc-per-node 2 benchmarks/optimizer_step_bench.py --size 1b     # GPUs: fused AdamW
    meshrun launch --nproc-per-node 2 benchmarks/optimizer_step_bench.py --size tiny --n-layers 18  # CPU, gloo

It builds meshrun's GPT of that size, shards it with FSDP2 (one unit per block, as the trainer does for large
models), gives every parameter a gradient, and times ``--steps`` optimizer steps of each implementation, alternating
them ``--repeat`` times. Per row it prints the host time of ``step()`` (its Python and dispatch work, measured
without waiting for the device) and the wall time of a step with the device synchronised after it, as the median and
min-max over the repeats, and the ``DTensorSpec`` objects each step leaves alive (pytorch/pytorch#188174: torch's fused
AdamW over DTensors leaves one per parameter per step on torch 2.10 and 2.11). Rank 0 prints one JSON line per
implementation.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch
import torch.distributed as dist


def timed(optimizer, steps: int, device: torch.device) -> tuple[float, float]:
    """(host ms per step, synchronised wall ms per step) over ``steps`` steps."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    host = 0.0
    start = time.perf_counter()
    for _ in range(steps):
        before = time.perf_counter()
        optimizer.step()
        host += time.perf_counter() - before
    sync()
    return host / steps * 1e3, (time.perf_counter() - start) / steps * 1e3


def specs_left_per_step(optimizer, steps: int) -> float:
    """DTensorSpec objects alive after ``steps`` more steps, per step (0 when a step frees what it made)."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    def alive() -> int:
        gc.collect()
        return sum(1 for o in gc.get_objects() if isinstance(o, DTensorSpec))

    before = alive()
    for _ in range(steps):
        optimizer.step()
    return (alive() - before) / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="small", help="meshrun's GPT size (tiny, small, 124m, 350m, 1b)")
    p.add_argument("--n-layers", type=int, default=0, help="blocks instead of the size's own (0: the size's); "
                   "--size tiny --n-layers 18 has the 1b model's 164 parameter tensors at a size where the host's "
                   "work is all there is to time on a CPU")
    p.add_argument("--kernel", choices=("auto", "fused", "foreach"), default="auto",
                   help="AdamW's kernels (auto: fused on GPUs, for-each on CPU, as the trainer)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from meshrun.models.gpt import GPT, gpt_config
    from meshrun.parallel.local_adamw import LocalShardAdamW

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    rows = {}
    models = {}
    impls = [("torch-adamw", torch.optim.AdamW, {}), ("meshrun-local-shard-adamw", LocalShardAdamW, {})]
    if cuda and args.kernel in ("auto", "fused"):  # the trainer's default on GPUs: the Triton kernel on the shards
        impls.append(("meshrun-triton-adamw", LocalShardAdamW, {"triton": True}))
    for name, cls, extra in impls:
        torch.manual_seed(0)
        with torch.device(device):
            model = GPT(gpt_config(args.size, n_layers=args.n_layers))
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        params = [q for q in model.parameters() if q.requires_grad]
        for q in params:
            q.grad = torch.randn_like(q) * 1e-3
        kernel = args.kernel if args.kernel != "auto" else "fused" if cuda else "foreach"
        kind = {kernel: True}
        optimizer = cls([{"params": [q for q in params if q.ndim >= 2], "weight_decay": 0.1},
                         {"params": [q for q in params if q.ndim < 2], "weight_decay": 0.0}], lr=1e-4, **kind,
                        **extra)
        timed(optimizer, 3, device)  # state built, kernels warm
        models[name] = (model, optimizer)
        rows[name] = {"host": [], "wall": [], "tensors": len(params), "kernel": kernel}
    for _ in range(args.repeat):  # alternating, so that a slow stretch of the machine hits both
        for name, (_, optimizer) in models.items():
            host, wall = timed(optimizer, args.steps, device)
            rows[name]["host"].append(host)
            rows[name]["wall"].append(wall)
    for name, (_, optimizer) in models.items():
        rows[name]["specs"] = specs_left_per_step(optimizer, args.steps)
    if rank == 0:
        device_name = torch.cuda.get_device_name(device) if cuda else "cpu"
        for name, row in rows.items():
            out = {"impl": name, "size": args.size, "n_layers": args.n_layers or None, "ranks": dist.get_world_size(), "device": device_name,
                   "kernel": row["kernel"], "param_tensors": row["tensors"], "torch": torch.__version__,
                   "dtensor_specs_left_per_step": row["specs"]}
            if name == "meshrun-triton-adamw":  # 0: the kernel could not take the shards; torch's fused one ran
                out["triton_group_steps"] = models[name][1].triton_steps
            for key in ("host", "wall"):
                out[f"{key}_ms"] = round(statistics.median(row[key]), 3)
                out[f"{key}_ms_min_max"] = [round(min(row[key]), 3), round(max(row[key]), 3)]
            print(json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
