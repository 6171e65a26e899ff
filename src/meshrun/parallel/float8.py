"""float8 training on Hopper and newer GPUs through torchao (optional extra: ``pip install -e ".[float8]"``).

The blocks' linear layers become torchao ``Float8Linear``: their matmuls run in float8 (e4m3 inputs and weights,
e5m2-free "tensorwise" recipe: one dynamic scale per tensor, the fastest) while parameters, gradients and the
optimizer stay in high precision. The output head and the embedding stay in bf16 (the head's gradient is the
most sensitive to precision, as in torchtitan). With FSDP2 the weights are all-gathered in float8, halving that
traffic. Applied before compile, so inductor fuses the scaling and casting into the neighbouring kernels.
"""

from __future__ import annotations

import torch
from torch import nn

from meshrun.config import ConfigError
from meshrun.parallel.kernels import cuda_capability


def check_float8(device: torch.device, *, tp: int) -> None:
    """Refuse train.float8 where it cannot run, naming the reason."""
    # the target's GPU not asked here (the planner checks a GPU layout on a laptop or a login node): allowed
    capability = cuda_capability(device)
    if device.type != "cuda" or (capability is not None and capability < (8, 9)):
        raise ConfigError("train.float8=true needs an NVIDIA GPU with float8 matmuls (Ada, Hopper or newer); "
                          f"this run is on {device}. Drop --train.float8")
    if tp > 1:
        raise ConfigError("train.float8=true is not supported with tensor parallelism yet (parallel.tp="
                          f"{tp}); use FSDP or DDP, or drop --train.float8")
    try:
        import torchao.float8  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"train.float8=true needs torchao ({exc}); install it with pip install -e \".[float8]\"")\
            from None


def convert_blocks_to_float8(model: nn.Module, *, fsdp: bool, blocks_attr: str) -> int:
    """Swap the linear layers inside the blocks (``model.<blocks_attr>``) for Float8Linear in place; returns how
    many were swapped."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp)
    swapped = []

    def wanted(module: nn.Module, fqn: str) -> bool:
        ok = (fqn.startswith(blocks_attr + ".") and isinstance(module, nn.Linear)
              and module.in_features % 16 == 0 and module.out_features % 16 == 0)
        if ok:
            swapped.append(fqn)
        return ok

    convert_to_float8_training(model, module_filter_fn=wanted, config=config)
    return len(swapped)
