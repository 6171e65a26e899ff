"""The baseline meshrun is measured against: a plain, hand-written DDP GPT script.

GPT-2 architecture (LayerNorm, GELU MLP, learned positions, tied embeddings), bf16 autocast, SDPA flash attention,
fused AdamW, torch.compile on the whole model, DDP. Random tokens: throughput does not depend on the data.
Launch with torchrun (or meshrun launch); rank 0 prints one JSON line:

    torchrun --nproc-per-node 2 benchmarks/baseline_ddp_gpt.py --size 124m --micro-batch 16 --seq 1024

Without a GPU it runs on CPU with gloo, fp32 and the plain AdamW (a smoke test, not a measurement). The peer scripts
(peer_accelerate.py, peer_fabric.py) import the model and the helpers below, so that every implementation trains
the same model on the same tokens and reports in the same format; only the training loop is each library's own.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

# (dim, layers, heads, vocab): GPT-2's vocabulary padded to 50304; tiny and small use 256 rows like meshrun's
# sizes of those names, which keeps CPU smoke runs short (the output layer dominates a small model).
SIZES = {"124m": (768, 12, 12, 50304), "1b": (2048, 18, 16, 50304), "tiny": (64, 2, 4, 256),
         "small": (256, 4, 8, 256)}
PEAK_BF16_FLOPS = 989e12  # H100 SXM dense bf16 (the H200 has the same compute)
SEED = 1234


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, dim, layers, heads, vocab, seq):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.wte.weight
        for module in self.modules():  # GPT-2 init: N(0, 0.02) weights, zero biases
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


# ---- shared by the baseline and the peer scripts: arguments, model, data, optimizer, timing, report ----


def bench_args(description: str, extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    """The arguments every implementation takes, so that the harness can call them all alike (``extra`` adds a
    script's own)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    if extra is not None:
        extra(p)
    p.add_argument("--size", default="124m", choices=SIZES)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=20, help="untimed first steps (compilation, allocator growth)")
    p.add_argument("--grad-clip", type=float, default=0.0, help="clip the global grad norm to this (0 = off)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True, help="torch.compile the model")
    p.add_argument("--ddp-graph", choices=("split", "whole"), default="whole",
                   help="whole: one compiled graph, all-reduce after backward (on 2 H100s 425k tokens/s per GPU on "
                   "124m against 411k split); split: dynamo cuts the graph at DDP's buckets (torch's default)")
    p.add_argument("--bucket-mb", type=int, default=25, help="DDP's gradient bucket size in MiB (25: torch's default)")
    p.add_argument("--trace", metavar="DIR", help="after the timed steps, record two more with the torch profiler "
                   "into DIR/rank_<N>.json (to compare kernel timelines with meshrun's run.profile_steps)")
    args = p.parse_args()
    if not 0 <= args.warmup < args.steps:
        p.error(f"--warmup {args.warmup} must be at least 0 and below --steps {args.steps}")
    return args


def build_model(args: argparse.Namespace) -> GPT:
    """The GPT of args.size on the CPU, with the same initial weights in every process and implementation."""
    torch.manual_seed(SEED)
    dim, layers, heads, vocab = SIZES[args.size]
    return GPT(dim, layers, heads, vocab, args.seq)


def random_batch(args: argparse.Namespace, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """One fixed batch of random tokens per rank, reused every step: throughput does not depend on the data."""
    gen = torch.Generator().manual_seed(SEED + rank)
    x = torch.randint(0, SIZES[args.size][3], (args.micro_batch, args.seq + 1), generator=gen).to(device)  # (B, T+1)
    return x[:, :-1], x[:, 1:]  # inputs (B, T), next-token targets (B, T)


def adamw(model: nn.Module, device: torch.device) -> torch.optim.AdamW:
    """AdamW as all implementations use it: the fused kernel on GPUs, the plain one on CPU."""
    return torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=device.type == "cuda")


def time_steps(step: Callable[[], torch.Tensor], args: argparse.Namespace,
               device: torch.device) -> tuple[float, float]:
    """Runs args.steps training steps; returns the seconds of those after args.warmup and the last loss."""
    for i in range(args.steps):
        if i == args.warmup:
            synchronize(device)  # note: a CPU-GPU sync point, so the clock starts after the warm-up's kernels
            start = time.perf_counter()
        loss = step()
    synchronize(device)
    elapsed = time.perf_counter() - start
    if args.trace:
        record_trace(step, Path(args.trace) / f"rank_{os.environ.get('RANK', 0)}.json")
    return elapsed, loss.item()


def record_trace(step: Callable[[], torch.Tensor], path: Path) -> None:
    """Two steps under the torch profiler (CPU and CUDA activity), written as a Chrome trace to ``path``."""
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for i in range(2):
            with record_function(f"ProfilerStep#{i}"):  # the step marks meshrun's run.profile_steps traces carry
                step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))


def uses_bf16(device: torch.device) -> bool:
    """bf16 mixed precision on GPUs, fp32 on CPU: meshrun's train.dtype=auto does the same, and bf16 matmuls are
    several times slower than fp32 on CPUs without bf16 units."""
    return device.type == "cuda"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def report(impl: str, args: argparse.Namespace, *, world: int, n_params: int, elapsed: float, loss: float,
           device: torch.device) -> None:
    """Prints the one JSON line the harness reads (call it on rank 0 only)."""
    tokens_per_gpu = (args.steps - args.warmup) * args.micro_batch * args.seq / elapsed
    dim, layers, _, _ = SIZES[args.size]
    # nanoGPT's estimate: 6 N + 12 L d T FLOPs per token (N without position embeddings), bf16 dense peak
    flops = 6 * (n_params - args.seq * dim) + 12 * layers * dim * args.seq
    on_gpu = device.type == "cuda"
    print(json.dumps({"impl": impl, "size": args.size, "gpus": world, "micro_batch": args.micro_batch,
                      "seq": args.seq, "grad_clip": args.grad_clip, "tokens_per_s_per_gpu": tokens_per_gpu,
                      "mfu": flops * tokens_per_gpu / PEAK_BF16_FLOPS if on_gpu else None, "loss": loss,
                      "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if on_gpu else None,
                      "device": torch.cuda.get_device_name(device) if on_gpu else "cpu"}), flush=True)


# ---- the baseline itself: plain DDP ----


def init_distributed() -> tuple[int, int, torch.device]:
    """Rank, world size and device; joins the process group (nccl on GPUs, gloo on CPU) when launched."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if "RANK" not in os.environ:
        return 0, 1, device
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size(), device


def main():
    args = bench_args(__doc__)
    rank, world, device = init_distributed()
    torch.backends.cuda.matmul.allow_tf32 = True
    model = build_model(args).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    opt = adamw(model, device)
    if args.compile:
        torch._dynamo.config.optimize_ddp = args.ddp_graph == "split"
        model = torch.compile(model)  # the whole model and its loss as one graph, then DDP around it
    if dist.is_initialized():
        # gradients live in DDP's buckets: no copy into them before each all-reduce (torch's advice for speed)
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True,
                    bucket_cap_mb=args.bucket_mb)
    inputs, targets = random_batch(args, rank, device)

    def step() -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=uses_bf16(device)):
            loss = model(inputs, targets)
        loss.backward()  # DDP all-reduces the gradients in buckets during backward
        if args.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    elapsed, loss = time_steps(step, args, device)
    if rank == 0:
        report("baseline-ddp", args, world=world, n_params=n_params, elapsed=elapsed, loss=loss, device=device)
    if dist.is_initialized():
        # a gloo group still owned by the DDP reducer when the interpreter shuts down aborts the process
        # ("terminate called without an active exception", seen once on a loaded 2-core CI machine): let the
        # group's worker threads finish the last collective (the sleep releases the GIL), free the model while the
        # interpreter is alive, then destroy the group
        time.sleep(0.2)
        del model, step
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
