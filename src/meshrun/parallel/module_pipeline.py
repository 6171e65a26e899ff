"""Pipeline parallelism for a user's own ``nn.Module``: ``Session.prepare_model(model, layout="pp")``.

The model is cut by the trainer's own stage splitting (:func:`meshrun.parallel.pipeline.split_stage`: each stage
is a copy of the model without the blocks, embedding and head it does not own, under the original parameter
names) and run by the trainer's :class:`~meshrun.parallel.pipeline.PipelineEngine` (torch.distributed.pipelining
schedules). Each stage goes through the same fixed order as the other layouts (activation checkpointing, then
FSDP2 over its blocks with 'pp+fsdp', or replication over the ranks left over with 'pp').

What the model must satisfy (docs/api.md shows one):

* its repeated blocks are an nn.ModuleList or an nn.ModuleDict keyed "0", "1", ... (found as
  :func:`~meshrun.parallel.module.find_blocks` does, or named with ``blocks=``), at least one per stage;
* modules with parameters registered before the blocks (beside them, and beside each module on the way down to
  them) run before the blocks and stay on the first stage; those registered after them stay on the last stage
  (or name them: ``PipelineOptions.first_stage`` / ``last_stage``). Modules without parameters stay everywhere;
* ``forward`` takes one tensor, passes one tensor from block to block, skips a module that is None (the
  embedding on later stages, the head on earlier ones) and a block that is None (ModuleList) or absent
  (ModuleDict), and returns what it has: the last stage's output goes to the loss, the others' to the next stage;
* no parameter sits directly on the model (or a module on the way to the blocks), and no two stages share a
  parameter (untie tied embeddings; meshrun.parallel.tied refuses it naming both names).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from meshrun.ckpt.session import model_fingerprint
from meshrun.comm.mesh import ParallelDims
from meshrun.config import (MULTI_STAGE_SCHEDULES, MULTIPLE_OF_PP_SCHEDULES, PIPELINE_SCHEDULES, ConfigError,
                            PipelineSchedule)
from meshrun.models.spec import ModelStructure
from meshrun.parallel.kernels import inductor_mode
from meshrun.parallel.module import (ModuleLayout, check_compile_mode, find_blocks, layout_dims,
                                     resolve_compute_dtype, session_options, session_residual)
from meshrun.parallel.pipeline import layer_ranges
from meshrun.parallel.step_weights import StepWeights, grad_adder
from meshrun.parallel.tied import find_shared

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class PipelineOptions:
    """How layout='pp' / 'pp+fsdp' runs a user's model (``Session.prepare_model(..., pipeline=...)``)."""

    schedule: PipelineSchedule = "1f1b"
    """gpipe, 1f1b, interleaved1f1b, interleavedzb or loopedbfs (torch.distributed.pipelining schedules)."""
    microbatches: int = 0
    """Pipeline micro-batches each step() batch is split into (it must divide the batch); 0: two per stage."""
    virtual_stages: int = 2
    """Stages per rank with interleaved1f1b, interleavedzb and loopedbfs (gpipe and 1f1b run one)."""
    loss_fn: LossFn | None = None
    """(last stage's output, targets) -> the mean loss of a micro-batch; None: cross-entropy over the last dim."""
    cast_once: bool | None = None
    """With bf16 autocast (layout='pp', compute_dtype bf16): each stage's nn.Linear layers hold bf16 copies of their
    weights, made once per step() call, instead of casting the fp32 weights for every micro-batch, and each
    micro-batch's weight gradient is added straight into the fp32 ``.grad`` (autocast's arithmetic, bitwise; the
    trainer's parallel.pp_cast_once, meshrun.parallel.step_weights). None: on where it can serve on a CUDA GPU
    (bf16 autocast, a schedule other than interleavedzb), as the trainer's default; True refuses the others."""
    first_stage: tuple[str, ...] | None = None
    """Dotted names of the modules before the blocks (None: those registered before them)."""
    last_stage: tuple[str, ...] | None = None
    """Dotted names of the modules after the blocks (None: those registered after them)."""


def mean_cross_entropy(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of (..., C) scores against (...) class indices, averaged over every target."""
    return F.cross_entropy(output.flatten(0, -2).float(), targets.flatten())


class PipelinedModule:
    """This rank's pipeline stage(s) of a user's model. Not called like a module: ``step`` runs the schedule's
    forward and backward passes; ``parameters()`` (or ``module``) feed the optimizer, ``parts`` the checkpoints."""

    def __init__(self, parts: list[nn.Module], engine, *, loss_fn: LossFn, fingerprint: str):
        self.parts = parts
        self.engine = engine
        """The trainer's PipelineEngine; None in a single process (step runs the whole model)."""
        self.loss_fn = loss_fn
        self.fingerprint = fingerprint
        """Parameter names and shapes of the whole model (the checkpoint manifest's model fingerprint)."""
        self.module = parts[0] if len(parts) == 1 else nn.ModuleList(parts)

    @property
    def is_last(self) -> bool:
        """True where ``step`` returns the loss: the rank holding the last stage (every rank in one process)."""
        return self.engine is None or self.engine.is_last

    def parameters(self) -> Iterator[nn.Parameter]:
        for part in self.parts:
            yield from part.parameters()

    def train(self, mode: bool = True) -> PipelinedModule:
        for part in self.parts:
            part.train(mode)
        return self

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Forward and backward passes of one batch; gradients accumulate as after ``loss.backward()``. Returns
        the mean loss over the batch on the last stage, None elsewhere. Collective: every rank of the pipeline
        calls it with a batch of the same size (the first stage uses ``inputs``, the last ``targets``)."""
        if self.engine is None:
            loss = self.loss_fn(self.parts[0](inputs), targets)
            loss.backward()
            return loss.detach()
        self._check_batch(inputs)
        device = self.engine.device
        try:
            loss_sum, count = self.engine.forward_backward([(inputs.to(device), targets.to(device))])
        except Exception as exc:
            explained = _explained(exc, self.parts[0])
            if explained is None:
                raise
            raise explained from exc
        return loss_sum / count if self.is_last else None

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Mean loss of one batch, forward only; on the last stage, None elsewhere. Collective like ``step``."""
        if self.engine is None:
            return self.loss_fn(self.parts[0](inputs), targets)
        device = self.engine.device
        loss_sum, count = self.engine.eval_loss(inputs.to(device), targets.to(device))
        return loss_sum / count if self.is_last else None

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip by the norm of every stage's gradients together (collective over the pipeline); returns it."""
        if self.engine is None:
            return nn.utils.clip_grad_norm_(list(self.parameters()), max_norm)
        return self.engine.clip_grad_norm(max_norm)

    def _check_batch(self, inputs: torch.Tensor) -> None:
        m = self.engine.microbatches
        if inputs.shape[0] % m:
            raise ConfigError(f"PipelineOptions.microbatches={m} does not divide the batch of {inputs.shape[0]} "
                              f"samples given to step(); pass a batch that is a multiple of {m} or change "
                              "microbatches")


def _explained(exc: Exception, part: nn.Module) -> ConfigError | None:
    """A forward that called a module this stage does not hold (None) gets an error saying what to change."""
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, TypeError) and "'NoneType' object is not callable" in str(cause):
            return ConfigError(f"layout='pp': {type(part).__name__}.forward called a module or block that this "
                               "pipeline stage does not hold (None); make forward skip None modules and blocks "
                               "(docs/api.md, 'Pipeline parallelism for your own model')")
        cause = cause.__cause__ or cause.__context__
    return None


def pipeline_dims(layout: str, options: PipelineOptions, *, world_size: int, nodes: int, pp: int) -> ParallelDims:
    """The degrees and schedule settings of a pipeline layout (pure arithmetic; raises ConfigError)."""
    dims = layout_dims(layout, world_size=world_size, nodes=nodes, pp=pp)
    if dims.pp < 2:
        raise ConfigError(f"layout={layout!r} with pp={dims.pp} has no pipeline; pass pp=2 or more, or use "
                          "layout='ddp' / 'fsdp'")
    if options.schedule not in PIPELINE_SCHEDULES or options.schedule == "auto":
        raise ConfigError(f"PipelineOptions.schedule={options.schedule!r} is not one of "
                          f"{', '.join(s for s in PIPELINE_SCHEDULES if s != 'auto')}")
    interleaved = options.schedule in MULTI_STAGE_SCHEDULES
    if interleaved and options.virtual_stages < 2:
        raise ConfigError(f"PipelineOptions.virtual_stages={options.virtual_stages}: {options.schedule} runs 2 or "
                          "more stages per rank; pass virtual_stages=2 or use schedule='1f1b'")
    p, m = dims.pp, options.microbatches or 2 * dims.pp
    if m < p:
        raise ConfigError(f"PipelineOptions.microbatches={m} is fewer than the pp={p} stages, so the schedule never "
                          f"fills the pipeline; use microbatches={2 * p} or more")
    if options.schedule in MULTIPLE_OF_PP_SCHEDULES and m % p:
        raise ConfigError(f"PipelineOptions.microbatches={m} must be a multiple of pp={p} for {options.schedule}; "
                          f"use {p * -(-m // p)}")
    return replace(dims, pp_schedule=options.schedule, pp_microbatches=m,
                   pp_virtual_stages=options.virtual_stages if interleaved else 1)


def edge_modules(model: nn.Module, blocks: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(modules with parameters registered before the blocks, those registered after), at each level of the
    blocks' dotted path; modules without parameters belong to every stage."""
    first: list[str] = []
    last: list[str] = []
    parent, prefix = model, ""
    for attr in blocks.split("."):
        after = False
        for name, child in parent.named_children():
            if name == attr:
                after = True
            elif any(True for _ in child.parameters()):
                (last if after else first).append(prefix + name)
        parent, prefix = parent.get_submodule(attr), f"{prefix}{attr}."
    return tuple(first), tuple(last)


def stage_spec(model: nn.Module, blocks: str, options: PipelineOptions, *, dims: ParallelDims,
               layout: str = "pp") -> ModelStructure:
    """The ModelStructure split_stage cuts ``model`` by, after checking the model can be cut (raises ConfigError)."""
    name = type(model).__name__
    if not blocks:
        raise ConfigError(f"layout='pp': {name} has no repeated blocks to cut into stages (an nn.ModuleList or "
                          "nn.ModuleDict of two or more modules of one class); pass blocks='path.to.blocks'")
    try:
        container = model.get_submodule(blocks)
    except AttributeError:
        raise ConfigError(f"blocks={blocks!r}: {name} has no such submodule; give the dotted path of its "
                          "repeated blocks") from None
    if not isinstance(container, (nn.ModuleList, nn.ModuleDict)):
        raise ConfigError(f"blocks={blocks!r} is a {type(container).__name__}; layout='pp' cuts an nn.ModuleList "
                          "or nn.ModuleDict of blocks: put the blocks in one")
    if isinstance(container, nn.ModuleDict) and list(container.keys()) != [str(i) for i in range(len(container))]:
        raise ConfigError(f"blocks={blocks!r} is an nn.ModuleDict keyed {list(container.keys())[:4]}...; key it "
                          "'0', '1', ... in forward order, or use an nn.ModuleList")
    if dims.stages > len(container):
        raise ConfigError(f"pp={dims.pp}" + (f" x virtual_stages={dims.pp_virtual_stages}" if dims.pp_virtual_stages
                                             > 1 else "") + f" = {dims.stages} stages, but {name}.{blocks} holds "
                          f"{len(container)} blocks; every stage needs one. Lower pp")
    found = edge_modules(model, blocks)
    first = found[0] if options.first_stage is None else tuple(options.first_stage)
    last = found[1] if options.last_stage is None else tuple(options.last_stage)
    check_splittable(model, blocks, first, last)
    spec = ModelStructure(blocks=blocks, first_stage=first, last_stage=last)
    check_stage_ties(model, spec, stages=dims.stages, layout=layout)
    return spec


def check_splittable(model: nn.Module, blocks: str, first: tuple[str, ...], last: tuple[str, ...]) -> None:
    """No parameter outside a module on the way to the blocks; the first/last-stage modules exist."""
    path = blocks.split(".")
    for depth in range(len(path)):
        owner = model.get_submodule(".".join(path[:depth]))
        for pname, param in owner.named_parameters(recurse=False):
            where = ".".join([*path[:depth], pname])
            raise ConfigError(f"{type(model).__name__}.{where} is a parameter outside any module, so layout='pp' "
                              "cannot give it to one stage; hold it in a module (e.g. nn.Embedding, or a small "
                              "nn.Module) that runs before or after the blocks")
    for option, names in (("first_stage", first), ("last_stage", last)):
        for mod in names:
            try:
                model.get_submodule(mod)
            except AttributeError:
                raise ConfigError(f"PipelineOptions.{option}: {type(model).__name__} has no module {mod!r}; "
                                  "give dotted module names") from None


def check_stage_ties(model: nn.Module, spec: ModelStructure, *, stages: int, layout: str) -> None:
    """Refuse a tied parameter whose names would sit on two pipeline stages (each stage would train its own
    copy). A name outside the blocks and the first/last-stage modules stays on every stage."""
    blocks = f"{spec.blocks}."
    block_stage = {str(i): stage for stage, ids in enumerate(layer_ranges(len(model.get_submodule(spec.blocks)),
                                                                         stages)) for i in ids}

    def stage_of(name: str) -> str:
        if name.startswith(blocks):
            return str(block_stage[name[len(blocks):].split(".")[0]])
        if any(name.startswith(f"{mod}.") for mod in spec.first_stage):
            return "0"
        if any(name.startswith(f"{mod}.") for mod in spec.last_stage):
            return str(stages - 1)
        return "(every stage)"

    find_shared(model).split_by(stage_of, layout=f"layout={layout!r}", what="pipeline stages",
                                fix="untie them (e.g. tie_word_embeddings=False) or use layout='fsdp'")


@torch.no_grad()
def copy_from_rank0(whole: nn.Module, parts: list[nn.Module], device: torch.device) -> None:
    """Every stage starts from rank 0's weights: each tensor of the whole model is broadcast from rank 0, one at
    a time (a rank holds its stages plus one tensor on the device), and copied where a stage owns it.
    Collective: every rank, the same tensors in the same order."""
    owned = {n: t for part in parts for n, t in [*part.named_parameters(), *part.named_buffers()]}
    for name, tensor in [*whole.named_parameters(), *whole.named_buffers()]:
        buffer = tensor.detach().to(device, copy=True)
        dist.broadcast(buffer, src=0)
        if name in owned:
            owned[name].copy_(buffer)


def prepare_pipeline(model: nn.Module, layout: str, *, device: torch.device, world_size: int, nodes: int = 1,
                     pp: int = 0, blocks: str | None = None, options: PipelineOptions | None = None,
                     activation_checkpoint: str = "none", compute_dtype: torch.dtype | str | None = None,
                     compile: bool = False, compile_mode: str = "default",
                     grad_reduce_dtype: str = "fp32",
                     residual_dtype: str = "fp32") -> tuple[PipelinedModule, ModuleLayout]:
    """Cut ``model`` into pipeline stages and build this rank's (see the module docstring). In one process the
    whole model runs in ``step``. ``compute_dtype``, ``compile``, ``compile_mode``, ``grad_reduce_dtype`` and
    ``residual_dtype`` as for meshrun.parallel.module.prepare_module.
    Collective: every rank must call it (mesh, weight broadcast)."""
    from meshrun.parallel.apply import cast_block_inputs, layout_name, parallelize, uses_fsdp
    from meshrun.parallel.pipeline import PipelineEngine, split_stage, stage_ids

    check_compile_mode(compile_mode, compile=compile)
    cast_inputs = session_residual(residual_dtype)  # refused before any collective
    options = options or PipelineOptions()
    loss_fn = options.loss_fn or mean_cross_entropy
    cast_once = options.cast_once
    blocks = find_blocks(model) if blocks is None else blocks
    fingerprint = model_fingerprint(model)
    if world_size == 1:
        model = model.to(device)
        dims = layout_dims("none", world_size=1)
        if cast_inputs and blocks:
            cast_block_inputs(ModelStructure(blocks=blocks).block_modules(model))
        compiled = compile_blocks(model, blocks, compile_mode) if compile else 0
        return (PipelinedModule([model], None, loss_fn=loss_fn, fingerprint=fingerprint),
                ModuleLayout(dims=dims, name=layout_name(dims), blocks=blocks, module=model, compiled=compiled,
                             compile_mode=compile_mode, residual_dtype=residual_dtype))
    dims = pipeline_dims(layout, options, world_size=world_size, nodes=nodes, pp=pp)
    compute_dtype = resolve_compute_dtype(compute_dtype, dims, device)
    spec = stage_spec(model, blocks, options, dims=dims, layout=layout)
    dims.build_mesh(device.type)  # collective: every rank
    rank = dist.get_rank()
    ids = stage_ids(dims.coords(rank).pp, pp=dims.pp, virtual_stages=dims.pp_virtual_stages)
    shared = find_shared(model)  # ties within one stage (across stages were refused above)
    parts = [split_stage(model, i, dims.stages, spec=spec).to(device) for i in ids]
    for part in parts:
        shared.restore(part, layout=f"layout={layout!r}", after="cutting the stages")
    copy_from_rank0(model, parts, device)
    options = session_options(layout, compute_dtype=compute_dtype, device=device, compiled=compile,
                              compile_mode=compile_mode, activation_checkpoint=activation_checkpoint,
                              grad_reduce_dtype=grad_reduce_dtype, split_backward=dims.pp_schedule == "interleavedzb",
                              residual_dtype=residual_dtype)
    for part in parts:
        parallelize(part, spec, dims, options)
    fp32 = compute_dtype is None or compute_dtype == torch.float32

    def summed_loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return loss_fn(output, targets) * targets.numel()  # the engine divides by the step's target count

    autocast_dtype = None if fp32 or uses_fsdp(dims) else compute_dtype
    cast_once = session_cast_once(cast_once, layout, dims, device, autocast_dtype)
    engine = PipelineEngine(parts, ids, n_stages=dims.stages, schedule=dims.pp_schedule,
                            microbatches=dims.pp_microbatches, device=device, pp_group=dims.get_mesh("pp").get_group(),
                            dp_rank=dims.dp_rank(rank), dp_size=dims.dp_size, tp_rank=0,
                            autocast_dtype=autocast_dtype, loss_fn=summed_loss,
                            step_weights=StepWeights(parts, autocast_dtype,
                                                     add=grad_adder(compiled=compile, device=device))
                            if cast_once else None)
    compiled = sum(len(spec.block_modules(part)) for part in parts) if compile else 0
    return (PipelinedModule(parts, engine, loss_fn=loss_fn, fingerprint=fingerprint),
            ModuleLayout(dims=dims, name=layout_name(dims), blocks=blocks, module=parts[0], compute_dtype=compute_dtype,
                         grad_reduce_dtype=grad_reduce_dtype, compiled=compiled, compile_mode=compile_mode,
                         residual_dtype=residual_dtype))


def session_cast_once(choice: bool | None, layout: str, dims: ParallelDims, device: torch.device,
                      autocast_dtype: torch.dtype | None) -> bool:
    """PipelineOptions.cast_once resolved: True (refused where it cannot serve), False, or None: on where it can
    serve on a CUDA GPU, as the trainer's parallel.pp_cast_once=auto (measured there)."""
    if choice:
        check_session_cast_once(layout, dims, autocast_dtype)
        return True
    if choice is None:
        return device.type == "cuda" and autocast_dtype is not None and dims.pp_schedule != "interleavedzb"
    return False


def check_session_cast_once(layout: str, dims: ParallelDims, autocast_dtype: torch.dtype | None) -> None:
    """Refuse PipelineOptions(cast_once=True) where the copies would not be used or their gradients not summed."""
    if autocast_dtype is None:
        why = ("FSDP2 already gives the stages bf16 parameters (its mixed-precision policy)" if layout == "pp+fsdp"
               else "this model computes in fp32")
        raise ConfigError(f"PipelineOptions(cast_once=True) copies weights for bf16 autocast, and {why}: pass "
                          "compute_dtype=torch.bfloat16 with layout='pp', or drop cast_once")
    if dims.pp_schedule == "interleavedzb":
        raise ConfigError("PipelineOptions(cast_once=True): schedule='interleavedzb' writes weight gradients outside "
                          "autograd's accumulation, which the copies' gradients go through; use "
                          "schedule='interleaved1f1b', or drop cast_once")


def compile_blocks(model: nn.Module, blocks: str, compile_mode: str = "default") -> int:
    """Compile each block under ``blocks`` in place (names keep no ``_orig_mod.``) in inductor's ``compile_mode``;
    returns how many."""
    found = [block for block in (model.get_submodule(blocks).children() if blocks else ()) if block is not None]
    for block in found:
        block.compile(mode=inductor_mode(compile_mode, False))
    return len(found)
