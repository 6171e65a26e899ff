"""Peer: the baseline's GPT trained with Hugging Face Accelerate (1.x), written the way its docs recommend.

`Accelerator(mixed_precision="bf16")` with a `TorchDynamoPlugin` (Accelerate's own way to torch.compile: `prepare`
wraps the model in DDP and then compiles it), `accelerator.prepare(model, optimizer)`, `accelerator.backward(loss)`,
fused AdamW, and `accelerator.clip_grad_norm_` when --grad-clip is set. Same model, tokens, arguments and JSON line
as benchmarks/baseline_ddp_gpt.py. Launch with torchrun or meshrun launch (Accelerate reads their environment):

    meshrun launch --standalone --nproc-per-node 2 benchmarks/peer_accelerate.py --size 124m

On a machine without a GPU it runs on CPU with gloo and fp32, as the baseline does.
"""

from __future__ import annotations

import torch
from accelerate import Accelerator
from accelerate.utils import TorchDynamoPlugin

from baseline_ddp_gpt import adamw, bench_args, build_model, random_batch, report, time_steps


def main() -> None:
    args = bench_args(__doc__)
    on_gpu = torch.cuda.is_available()
    accelerator = Accelerator(
        cpu=not on_gpu,  # without it Accelerate would not pick gloo on a CPU-only machine
        mixed_precision="bf16" if on_gpu else "no",  # fp32 on CPU, as the baseline (uses_bf16)
        dynamo_plugin=TorchDynamoPlugin(backend="inductor" if args.compile else "no"),
    )
    torch.backends.cuda.matmul.allow_tf32 = True
    model = build_model(args)
    n_params = sum(p.numel() for p in model.parameters())
    # Accelerate's docs place the model before creating the optimizer; prepare() then leaves it where it is
    model = model.to(accelerator.device)
    opt = adamw(model, accelerator.device)
    model, opt = accelerator.prepare(model, opt)  # DDP, then torch.compile of the DDP module (dynamo_plugin)
    inputs, targets = random_batch(args, accelerator.process_index, accelerator.device)

    def step() -> torch.Tensor:
        loss = model(inputs, targets)  # prepare() runs forward under bf16 autocast
        accelerator.backward(loss)
        if args.grad_clip:
            accelerator.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    elapsed, loss = time_steps(step, args, accelerator.device)
    if accelerator.is_main_process:
        report("accelerate-ddp", args, world=accelerator.num_processes, n_params=n_params, elapsed=elapsed,
               loss=loss, device=accelerator.device)
    accelerator.end_training()  # destroys the process group


if __name__ == "__main__":
    main()
