"""meshrun's Session on a user's own model: the baseline's GPT through `Session.prepare_model`, as docs/api.md shows.

`meshrun.Session()`, `session.prepare_model(model, layout=..., compile=True)` (each block compiled in place before
FSDP2 wraps it; on GPUs FSDP2 computes in bf16 and reduces gradients in fp32 by default), fused AdamW, the user's
own bf16 autocast and `clip_grad_norm_` when --grad-clip is set. `--cuda-graphs` adds `cuda_graphs=True` (the
compiled model recorded as CUDA graphs; with FSDP the whole model one unit, compiled as one graph), `--compile-mode max-autotune` adds
`compile_mode="max-autotune"`, `--residual-dtype bf16` adds `residual_dtype="bf16"` (each block's input cast to
bf16 under the loop's autocast, as meshrun train's default for DDP). Same model, tokens, arguments and JSON line as
benchmarks/baseline_ddp_gpt.py; --layout picks ddp or fsdp. Launch with torchrun or meshrun launch:

    meshrun launch --standalone --nproc-per-node 2 benchmarks/session_gpt.py --size 1b --layout fsdp

On a machine without a GPU it runs on CPU with gloo and fp32, as the baseline does.
"""

from __future__ import annotations

import torch

import meshrun
from baseline_ddp_gpt import SEED, adamw, bench_args, build_model, random_batch, report, time_steps, uses_bf16


def main() -> None:
    def extra(p):
        p.add_argument("--layout", default="ddp", choices=("ddp", "fsdp"))
        p.add_argument("--cuda-graphs", action="store_true", help="prepare_model(cuda_graphs=True), compiled")
        p.add_argument("--compile-mode", default="default", choices=("default", "max-autotune"),
                       help="prepare_model(compile_mode=...), with compile")
        p.add_argument("--residual-dtype", default="fp32", choices=("fp32", "bf16"),
                       help="prepare_model(residual_dtype=...): the hidden state between blocks under autocast")

    args = bench_args(__doc__, extra=extra)
    session = meshrun.Session(seed=SEED)
    torch.backends.cuda.matmul.allow_tf32 = True
    model = build_model(args)
    n_params = sum(p.numel() for p in model.parameters())
    model = session.prepare_model(model, layout=args.layout, compile=args.compile, cuda_graphs=args.cuda_graphs,
                                  compile_mode=args.compile_mode if args.compile else "default",
                                  residual_dtype=args.residual_dtype)
    opt = adamw(model, session.device)
    inputs, targets = random_batch(args, session.rank, session.device)

    def step() -> torch.Tensor:
        with torch.autocast(session.device.type, dtype=torch.bfloat16, enabled=uses_bf16(session.device)):
            loss = model(inputs, targets)
        loss.backward()
        if args.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    elapsed, loss = time_steps(step, args, session.device)
    if session.rank == 0:
        impl = (f"session-{args.layout}" + ("-graphs" if args.cuda_graphs else "")
                + ("-autotune" if args.compile_mode == "max-autotune" else "")
                + ("-bf16-stream" if args.residual_dtype == "bf16" else ""))
        report(impl, args, world=session.world_size,
               n_params=n_params, elapsed=elapsed, loss=loss, device=session.device)
    session.close()


if __name__ == "__main__":
    main()
