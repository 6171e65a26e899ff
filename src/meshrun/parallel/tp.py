"""Tensor parallelism applied from outside, through the model's plan (ModelSpec.tp_plan or a user's dict).

A plan is either a function ``(part, tp_mesh, *, sequence_parallel, loss_parallel)`` that shards the part in
place (a Megatron-style plan of the model's spec, in its ``models/<name>_spec.py``), or a dict from module names -- with
``*`` matching one name component, as in ``"layers.*.attention.wq"`` -- to a torch ``ParallelStyle`` or one of
a word from :data:`STYLES` (``colwise``, ``rowwise``, ``colwise_rep``, ...: the spelling Hugging Face models use
in ``tp_plan``). A module
sharded by a dict plan must reshape with ``-1`` heads (``view(B, T, -1, head_dim)``): it sees n_heads / tp heads.
Parameters of leaf modules the plan leaves alone become Replicate DTensors (see :func:`replicate_params`) so the
optimizer's foreach kernels and the gradient norm see one kind of tensor; a parameter held directly by a module
with children stays a plain tensor (then build the optimizer with foreach=False).
"""

from __future__ import annotations

import fnmatch
import weakref
from typing import Any, Callable, Mapping

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from meshrun.config import ConfigError

STYLES: dict[str, Callable[[], Any]] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),  # e.g. an output head: gathered logits
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),  # vocabulary rows of an embedding
}
"""Plan words (Hugging Face's ``base_model_tp_plan`` / ``tp_plan`` spelling) and the torch styles they stand for."""


def apply_tp(model: nn.Module, plan: Callable[..., None] | Mapping[str, Any], tp_mesh: DeviceMesh, *,
             sequence_parallel: bool = False, loss_parallel: bool = False) -> None:
    """Shard ``model`` (a whole model or a pipeline stage) over ``tp_mesh`` in place, following ``plan``."""
    if callable(plan):
        plan(model, tp_mesh, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
        return
    if sequence_parallel:
        raise ValueError("parallel.sequence_parallel needs a plan function that places the norms; a dict plan "
                         "shards linears only. Drop --parallel.sequence_parallel")
    apply_tp_plan(model, plan, tp_mesh)


def apply_tp_plan(model: nn.Module, plan: Mapping[str, Any], tp_mesh: DeviceMesh) -> list[str]:
    """Shard the modules a dict plan names; replicate every other parameter. Returns the sharded module names."""
    resolved = resolve_plan(model, plan)
    parallelize_module(model, tp_mesh, resolved)
    share_column_inputs(model, resolved, tp_mesh)
    for name, module in model.named_modules():
        leaf = next(module.children(), None) is None  # a parent's hooks would turn its children's inputs to DTensors
        if leaf and name not in resolved and any(not isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            replicate_params(module, tp_mesh)
    return sorted(resolved)


def share_column_inputs(model: nn.Module, resolved: Mapping[str, Any], tp_mesh: DeviceMesh) -> list[list[str]]:
    """Let sibling column-parallel linears that read the same tensor (q/k/v, gate/up) share one replicated DTensor
    of it, so that backward all-reduces that input's gradient once instead of once per linear. Returns the
    groups of siblings that share.

    torch's ColwiseParallel turns a plain input into a DTensor in each linear's own pre-hook; the gradients of the
    three copies are then all-reduced one by one. A pre-hook put in front of theirs hands every sibling the DTensor
    the first one made from the same tensor object (a memo of one tensor per parent, cleared when the parent's
    forward returns; a different input makes a new one). A plan function can get the same with PrepareModuleInput
    on the parent, as the built-in model's does; a dict plan (Hugging Face's ``tp_plan`` words) names only
    linears, whose parents take their inputs by keyword or by position, so the memo works at the linears instead."""
    modules = dict(model.named_modules())
    siblings: dict[str, list[str]] = {}
    for name, style in resolved.items():
        if type(style) is ColwiseParallel and tuple(getattr(style, "input_layouts", ())) == (Replicate(),):
            siblings.setdefault(name.rpartition(".")[0], []).append(name)
    groups = [names for names in siblings.values() if len(names) > 1]
    for names in groups:
        memo: dict[str, Any] = {}

        def shared_input(_module: nn.Module, inputs: tuple, memo: dict[str, Any] = memo) -> tuple | None:
            if not inputs or type(inputs[0]) is not torch.Tensor:
                return None
            x = inputs[0]
            known = memo.get("input")
            if known is None or known() is not x:
                memo["input"] = weakref.ref(x)
                memo["dtensor"] = DTensor.from_local(x, tp_mesh, [Replicate()], run_check=False)
            return (memo["dtensor"], *inputs[1:])

        for name in names:
            modules[name].register_forward_pre_hook(shared_input, prepend=True)
        # dropped when the parent's forward returns: autograd keeps what backward needs, the memo keeps nothing
        modules[name.rpartition(".")[0]].register_forward_hook(lambda *_, memo=memo: memo.clear())
    return groups


def resolve_plan(model: nn.Module, plan: Mapping[str, Any]) -> dict[str, Any]:
    """The module names a dict plan matches in ``model``, each with its torch ParallelStyle; raises a ConfigError
    for an unknown word, a plan that matches nothing, or a module colwise/rowwise cannot split."""
    modules = {name: module for name, module in model.named_modules() if name}
    resolved: dict[str, Any] = {}
    for pattern, style in plan.items():
        if isinstance(style, str):
            if style not in STYLES:
                raise ConfigError(f"tensor-parallel plan entry {pattern!r}: {style!r} is not one of "
                                  f"{', '.join(STYLES)} (or a torch ParallelStyle)")
            style = STYLES[style]()
        matches = [n for n in modules if fnmatch.fnmatchcase(n, pattern) and n.count(".") == pattern.count(".")]
        for name in matches:
            check_module_type(name, modules[name], style, pattern=pattern)
        resolved.update({n: style for n in matches})
    if not resolved:
        raise ConfigError(f"tensor-parallel plan names no module of {type(model).__name__} (patterns: "
                          f"{', '.join(plan)}); give module names as in model.named_modules()")
    return resolved


def check_module_type(name: str, module: nn.Module, style: Any, *, pattern: str) -> None:
    """Colwise and rowwise styles split an nn.Linear or an nn.Embedding (torch raises NotImplementedError deep
    inside parallelize_module for anything else); other styles (SequenceParallel, PrepareModuleInput, a user's
    own ParallelStyle) take any module."""
    if not isinstance(style, (ColwiseParallel, RowwiseParallel)) or isinstance(module, (nn.Linear, nn.Embedding)):
        return
    kind = type(module)
    hint = (" (a transformers Conv1D holds its weight transposed: nn.Linear(in, out) takes weight = conv.weight.T;"
            " a fused q/k/v layer must be split into three layers first)" if kind.__name__ == "Conv1D" else "")
    raise ConfigError(f"tensor-parallel plan entry {pattern!r}: {name} is a {kind.__module__}.{kind.__qualname__}, "
                      f"which {type(style).__name__} cannot split; colwise and rowwise plans split nn.Linear and "
                      f"nn.Embedding modules only. Convert {name} to nn.Linear{hint}, or leave it out of the plan")


def replicate_params(module: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Make ``module``'s parameters Replicate DTensors while its inputs and outputs stay plain tensors.

    Used for the norms when sequence parallelism is off: every parameter of a TP model is then a DTensor, which
    the optimizers' foreach and fused kernels need (they refuse a mix of DTensors and plain tensors), and the
    gradient-norm computation sees one kind of tensor per mesh.
    """
    def to_dtensor(_module, inputs, mesh):
        return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                     if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in inputs)

    def to_local(_module, outputs, _mesh):
        return outputs.to_local() if isinstance(outputs, DTensor) else outputs

    distribute_module(module, tp_mesh, input_fn=to_dtensor, output_fn=to_local)


class _Settled(torch.autograd.Function):
    """An AsyncCollectiveTensor waited on, as a plain tensor that keeps its autograd edge (identity backward)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        done = x.trigger_wait()
        return done.view_as(done)  # a fresh tensor: autograd's metadata must not land on the collective's buffer

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _settle_output(_module: nn.Module, _inputs: tuple, output: Any) -> Any:
    return _Settled.apply(output) if isinstance(output, AsyncCollectiveTensor) else None


def settle_async_outputs(model: nn.Module, *, compiled: list[nn.Module]) -> None:
    """Wait, in eager mode, for the async collectives that TP styles' output hooks leave (``to_local()`` of an
    ``async_op=True`` redistribute is an AsyncCollectiveTensor), on every hooked module outside ``compiled``, so a
    compiled block never takes one as input. torch 2.12-2.14 unwrap such an input with ``trigger_wait()``, dropping its
    requires_grad (pytorch#179849, fixed by #191113): the block returned no input gradient and the embedding's
    Redistribute backward failed (``'Tensor' object has no attribute '_local_tensor'``)."""
    inside = {id(m) for block in compiled for m in block.modules()}
    for name, module in model.named_modules():
        if name and id(module) not in inside and module._forward_hooks:
            module.register_forward_hook(_settle_output)  # after the style's hook: sees its output
