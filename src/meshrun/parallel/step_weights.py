"""Linear layers' weights cast to the compute dtype once per optimizer step (``parallel.pp_cast_once``).

Under bf16 autocast every linear layer casts its fp32 weight to bf16 each time it runs, and autograd casts the
weight's gradient back to fp32 and adds it into ``.grad``. A pipeline stage runs each of its blocks once per
micro-batch, so with 8 micro-batches a step casts every weight 8 times (compiled blocks cast inside the graph,
where autocast's cast cache does not apply) and adds 8 fp32 gradients. Profiles of the 1b model on 2 H100s put that
memory traffic at about 37 ms of a 285 ms step on the first stage (docs/performance.md).

With :class:`StepWeights`, each linear layer of a stage gets a copy of its weight (and bias) in the compute dtype,
refreshed from the fp32 parameter once per step. For the length of a step the layer holds the copy, so autocast
finds it in bf16 and casts nothing, and a hook adds each micro-batch's bf16 gradient straight into the fp32
parameter's ``.grad`` (``grad.to(fp32)`` for the first, ``add_`` for the others), then drops it. The arithmetic is
autocast's: the same bf16 values in the matmuls and the same fp32 sums of the gradients in the same order, so losses
and gradients are bitwise those without it (tests/test_step_weights.py). Outside a step the layers hold their fp32
parameters again: the optimizer, gradient clipping, checkpoints and state dicts never see the copies.

The copies are persistent tensors updated in place, so CUDA graphs, which take parameters as fixed inputs, keep
replaying the same addresses. Other parameters (norms, embeddings) are left alone: autocast runs those ops in fp32.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial
from typing import Iterator, Sequence

import torch
from torch import nn

COPIED_MODULES: tuple[type[nn.Module], ...] = (nn.Linear,)
"""The modules whose parameters get copies: those autocast casts to bf16 on every call."""


def _add_into(master: torch.Tensor, copy: torch.Tensor) -> None:
    """The copy's post-accumulate hook: its gradient (this micro-batch's) into the fp32 parameter's, then dropped."""
    grad, copy.grad = copy.grad, None
    if master.grad is None:
        master.grad = grad.to(master.dtype)
    else:
        master.grad.add_(grad)


class StepWeights:
    """The compute-dtype copies of ``parts``' linear layers' parameters, and the swap that puts them in place."""

    def __init__(self, parts: Sequence[nn.Module], dtype: torch.dtype):
        self.dtype = dtype
        self.slots: list[tuple[nn.Module, str, nn.Parameter, nn.Parameter]] = []
        """(module, name, fp32 parameter, copy) for each place a copied parameter is held."""
        self.pairs: list[tuple[nn.Parameter, nn.Parameter]] = []
        """(fp32 parameter, copy), once each."""
        copies: dict[int, nn.Parameter] = {}  # a weight two layers share gets one copy, which both hold
        for part in parts:
            for module in part.modules():
                if not isinstance(module, COPIED_MODULES):
                    continue
                for name, param in module.named_parameters(recurse=False):
                    if not param.is_floating_point() or param.dtype == dtype:
                        continue
                    if id(param) not in copies:
                        copy = nn.Parameter(param.detach().to(dtype), requires_grad=param.requires_grad)
                        if param.requires_grad:
                            copy.register_post_accumulate_grad_hook(partial(_add_into, param))
                        copies[id(param)] = copy
                        self.pairs.append((param, copy))
                    self.slots.append((module, name, param, copies[id(param)]))

    def __len__(self) -> int:
        return len(self.slots)

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the fp32 parameters (as the optimizer or a checkpoint left them) into the copies, in place."""
        for param, copy in self.pairs:
            copy.copy_(param)

    @contextmanager
    def held(self) -> Iterator[None]:
        """Refresh the copies and let the layers hold them until the block ends (one optimizer step's forwards and
        backwards, or an evaluation)."""
        self.refresh()
        for module, name, _, copy in self.slots:
            module._parameters[name] = copy
        try:
            yield
        finally:
            for module, name, param, _ in self.slots:
                module._parameters[name] = param
