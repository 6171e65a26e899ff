"""torch's AdamW stepping each DTensor parameter on its local shard.

FSDP2 and TP hold their parameters, gradients and AdamW moments as DTensors. torch's AdamW then runs its update
through DTensor's dispatch: for each call over the parameter list it unwraps every DTensor, propagates shardings and
wraps the results again, host work that grows with the number of parameters while the kernel itself only ever reads
local shards (the update is element-wise). With ``fused=True`` that dispatch also leaks on some torch releases: one
``DTensorSpec`` per parameter per step, from the scalar step and learning-rate tensors
(pytorch/pytorch#188174, reported on torch 2.10 and 2.11; host memory grew by tens of GB over 100k steps; on one
H200 with torch 2.11 the 1b model's 164 parameters left 164 a step, ``benchmarks/optimizer_step_bench.py``).

``LocalShardAdamW`` is torch.optim.AdamW: the same state (built by AdamW's own ``_init_group``, so state dicts,
checkpoints and schedulers see no difference) and the same functional ``adam`` call, given the local shards. Where a
gradient's placements differ from its parameter's (a Partial gradient that DTensor would reduce first), or they sit
on different meshes, and for ``differentiable=True``, the step is torch's own through DTensor. The result is bitwise torch's
(tests/test_local_adamw.py).

``triton=True`` (the trainer's default on CUDA GPUs, train.adamw_kernel) runs a fused group's update through
meshrun's Triton kernel instead of torch's (parallel/triton_adamw.py): the same arithmetic in one launch over all
local tensors, which reads a clipped gradient divided by ``grad_scale`` without writing it back (torch's fused kernel
stores the divided gradient). Groups the kernel cannot take (amsgrad, a tensor learning rate, ``capturable=True``
for a step recorded as a CUDA graph, other dtypes or devices) keep torch's kernel. Given ``copies`` (the linear
layers' bf16 copies, parallel/step_weights.py) the kernel writes each copy as it updates its parameter, and bf16
gradients (which one process's copies leave) are read as they are; torch's kernel gets them cast to fp32.
"""

from __future__ import annotations

import torch
from torch.autograd.graph import increment_version
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam

from meshrun.parallel import triton_adamw
from meshrun.parallel.grad_norm import local_tensor
from meshrun.parallel.step_weights import StepWeights


def _same_layout(param: torch.Tensor) -> bool:
    """The gradient is laid out like its parameter (and so like the moments built with zeros_like)."""
    grad = param.grad
    if not isinstance(param, DTensor) and not isinstance(grad, DTensor):
        return True
    if not (isinstance(param, DTensor) and isinstance(grad, DTensor)):
        return False
    return param._spec.mesh == grad._spec.mesh and param._spec.placements == grad._spec.placements


def _torch_step(optimizer: torch.optim.AdamW) -> None:
    """AdamW's own step without its hooks: torch wraps ``step`` of each optimizer class it builds to run the step
    hooks, so AdamW's may already be wrapped, and this step's own wrapper has run them once."""
    step = torch.optim.AdamW.step
    while getattr(step, "hooked", False) and hasattr(step, "__wrapped__"):
        step = step.__wrapped__
    step(optimizer)


class LocalShardAdamW(torch.optim.AdamW):
    """torch.optim.AdamW whose update runs on the local shards of DTensor parameters (module docstring).

    ``triton``: fused groups step through meshrun's Triton kernel where it can take their tensors."""

    def __init__(self, params, *args, triton: bool = False, copies: StepWeights | None = None, **kwargs):
        super().__init__(params, *args, **kwargs)
        self.triton = triton
        self.triton_steps = 0
        """Group steps the Triton kernel ran (tests and the start-up check read it)."""
        self.copies = copies
        """The linear layers' compute-dtype copies of their weights (parallel/step_weights.py): the Triton kernel
        writes each one as it updates its parameter, so the next step need not cast the weights again."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:  # first: the closure makes the gradients whose layout decides the path
            with torch.enable_grad():
                loss = closure()
        if any(group["differentiable"] or not all(_same_layout(p) for p in group["params"] if p.grad is not None)
               for group in self.param_groups):
            _torch_step(self)  # torch's own step, through DTensor (and with autograd for differentiable=True)
            return loss
        for group in self.param_groups:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            exp_avgs: list[torch.Tensor] = []
            exp_avg_sqs: list[torch.Tensor] = []
            max_exp_avg_sqs: list[torch.Tensor] = []
            state_steps: list[torch.Tensor] = []
            beta1, beta2 = group["betas"]
            has_complex = self._init_group(group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps)
            if self._triton_step(group, params, grads, exp_avgs, exp_avg_sqs, state_steps, has_complex):
                continue
            # torch's kernels take a gradient in its parameter's dtype only (a weight copy's may be bf16)
            grads = [g.to(p.dtype) if g.dtype != p.dtype else g for p, g in zip(params, grads)]
            adam(*([local_tensor(t) for t in tensors] for tensors in (params, grads, exp_avgs, exp_avg_sqs,
                                                                        max_exp_avg_sqs)), state_steps,
                 amsgrad=group["amsgrad"], has_complex=has_complex, beta1=beta1, beta2=beta2, lr=group["lr"],
                 weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
                 foreach=group["foreach"], capturable=group["capturable"], differentiable=group["differentiable"],
                 fused=group["fused"], grad_scale=getattr(self, "grad_scale", None),
                 found_inf=getattr(self, "found_inf", None), decoupled_weight_decay=group["decoupled_weight_decay"])
        return loss

    def _triton_step(self, group, params, grads, exp_avgs, exp_avg_sqs, state_steps, has_complex: bool) -> bool:
        """This group's update through the Triton kernel, where it can take it; False: run torch's."""
        if not (self.triton and group["fused"] and not group["amsgrad"] and not has_complex
                and not group["differentiable"] and not group["capturable"]  # graphs would keep stale addresses
                and not isinstance(group["lr"], torch.Tensor)
                and group.get("decoupled_weight_decay", True)):
            return False
        local = [[local_tensor(t) for t in tensors] for tensors in (params, grads, exp_avgs, exp_avg_sqs)]
        copies = [self.copies.copy_of(p) for p in params] if self.copies is not None else None
        # one launch per gradient dtype (the weight copies' gradients may be bf16 beside fp32 ones)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, grad in enumerate(local[1]):
            by_dtype.setdefault(grad.dtype, []).append(i)
        launches = [([[tensors[i] for i in index] for tensors in local], [state_steps[i] for i in index],
                     [copies[i] for i in index] if copies is not None else None) for index in by_dtype.values()]
        if not all(triton_adamw.supports(*tensors, steps, these) for tensors, steps, these in launches):
            return False
        beta1, beta2 = group["betas"]
        for tensors, steps, these in launches:
            triton_adamw.adamw_(*tensors, steps, lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                                weight_decay=group["weight_decay"], maximize=group["maximize"],
                                grad_scale=getattr(self, "grad_scale", None),
                                found_inf=getattr(self, "found_inf", None), copies=these)
        increment_version(params)  # the kernel wrote them in place, where autograd does not see it
        if self.copies is not None:
            self.copies.written(params)
        self.triton_steps += 1
        return True
