"""The baseline meshrun is measured against: a plain DDP GPT script in the seeds' pattern.

GPT-2 architecture (LayerNorm, GELU MLP, learned positions, tied embeddings), bf16 autocast, SDPA flash attention,
fused AdamW, torch.compile on the whole model, DDP. Random tokens: throughput does not depend on the data.
Launch with torchrun (or meshrun launch); rank 0 prints one JSON line:

    torchrun --nproc-per-node 2 benchmarks/baseline_ddp_gpt.py --size 124m --micro-batch 16 --seq 1024
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

SIZES = {"124m": (768, 12, 12), "1b": (2048, 18, 16), "tiny": (64, 2, 4)}  # (dim, layers, heads)


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


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--size", default="124m", choices=SIZES)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=20)
    args = p.parse_args()
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("nccl")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    torch.backends.cuda.matmul.allow_tf32 = True
    dim, layers, heads = SIZES[args.size]
    model = GPT(dim, layers, heads, 50304, args.seq).cuda()
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
    model = torch.compile(model)
    if distributed:
        model = DDP(model, device_ids=[local])
    x = torch.randint(0, 50304, (args.micro_batch, args.seq + 1), device="cuda")
    inputs, targets = x[:, :-1], x[:, 1:]
    for step in range(args.steps):
        if step == args.warmup:
            torch.cuda.synchronize()
            start = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(inputs, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    tokens_per_gpu = (args.steps - args.warmup) * args.micro_batch * args.seq / elapsed
    # nanoGPT's estimate: 6 N + 12 L d T FLOPs per token (N without position embeddings), H100 bf16 peak 989 TF
    flops = 6 * (n_params - args.seq * dim) + 12 * layers * dim * args.seq
    if rank == 0:
        print(json.dumps({"impl": "baseline-ddp", "size": args.size, "gpus": world, "micro_batch": args.micro_batch,
                          "seq": args.seq, "tokens_per_s_per_gpu": tokens_per_gpu,
                          "mfu": flops * tokens_per_gpu / 989e12, "loss": loss.item(),
                          "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
                          "device": torch.cuda.get_device_name()}), flush=True)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
