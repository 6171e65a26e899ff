"""Peer: the baseline's GPT trained with Lightning Fabric (2.x), written the way its docs recommend.

`Fabric(strategy="ddp", precision="bf16-mixed")`, torch.compile before `fabric.setup(model, optimizer)` (setup takes
the compile wrapper off, wraps the model in DDP and compiles again around it), `fabric.backward(loss)`, fused AdamW,
and `fabric.clip_gradients` when --grad-clip is set. Same model, tokens, arguments and JSON line as
benchmarks/baseline_ddp_gpt.py. Launch with torchrun or meshrun launch:

    meshrun launch --standalone --nproc-per-node 2 benchmarks/peer_fabric.py --size 124m

On a machine without a GPU it runs on CPU with gloo and fp32, as the baseline does.
"""

from __future__ import annotations

import os

import torch
from lightning.fabric import Fabric

from baseline_ddp_gpt import adamw, bench_args, build_model, random_batch, report, time_steps


def start_fabric(on_gpu: bool) -> Fabric:
    """A Fabric for the processes torchrun (or meshrun launch) started.

    Fabric checks that devices x num_nodes equals the launcher's WORLD_SIZE, so both come from the launcher's
    environment. `launch()` is still needed: under torchrun it starts no processes (Fabric's TorchElastic
    environment says they are created externally) but joins the process group, and `setup()` refuses a DDP
    strategy that was not launched.
    """
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    fabric = Fabric(accelerator="cuda" if on_gpu else "cpu", devices=local_world,
                    num_nodes=int(os.environ.get("WORLD_SIZE", 1)) // local_world, strategy="ddp",
                    precision="bf16-mixed" if on_gpu else "32-true")  # fp32 on CPU, as the baseline (uses_bf16)
    fabric.launch()
    return fabric


def main() -> None:
    args = bench_args(__doc__)
    fabric = start_fabric(torch.cuda.is_available())
    torch.backends.cuda.matmul.allow_tf32 = True
    model = build_model(args)
    n_params = sum(p.numel() for p in model.parameters())
    if args.compile:
        model = torch.compile(model)  # before setup(), as Fabric's docs ask; setup re-applies it around DDP
    opt = adamw(model, fabric.device)
    model, opt = fabric.setup(model, opt)  # moves to the device, wraps in DDP
    inputs, targets = random_batch(args, fabric.global_rank, fabric.device)

    def step() -> torch.Tensor:
        loss = model(inputs, targets)  # the Fabric module runs forward under the precision's autocast
        fabric.backward(loss)
        if args.grad_clip:
            fabric.clip_gradients(model, opt, max_norm=args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    elapsed, loss = time_steps(step, args, fabric.device)
    if fabric.is_global_zero:
        report("fabric-ddp", args, world=fabric.world_size, n_params=n_params, elapsed=elapsed, loss=loss,
               device=fabric.device)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # Fabric ends only an NCCL group, and only at exit


if __name__ == "__main__":
    main()
