"""Layouts for a user's own ``nn.Module`` (``Session.prepare_model``), through the trainer's own code.

``layout`` is one word: ``ddp``, ``fsdp``, ``hsdp``, ``tp`` or ``tp+fsdp`` (``none`` for a single process). It
resolves to a :class:`~meshrun.comm.mesh.ParallelDims` (the same DeviceMesh builder as the trainer) and the model,
described by a :class:`~meshrun.models.spec.ModelStructure` (its blocks and TP plan), is parallelised by
:func:`meshrun.parallel.apply.parallelize`, the trainer's own front door and fixed order: TP (the model's plan)
-> activation checkpointing -> FSDP2 / HSDP over each repeated block, then the root. DDP wraps the whole module.

The repeated blocks are ``blocks`` when given (a dotted module path, e.g. ``"model.layers"``), else found: the
ModuleList or ModuleDict with the most children that all share one class (at least two). A model without such a
container is sharded as one FSDP unit (still correct, less overlap). The tensor-parallel plan is ``tp_plan`` when
given, else the model's ``tp_plan`` attribute (a dict, see meshrun.parallel.tp).

Unlike the trainer (which builds on the meta device), the user's model already exists: rank 0's weights are
broadcast first, so every layout starts from the weights one process would have.

Speed, as the trainer has it: ``compute_dtype="auto"`` (the default) gives FSDP2 bf16 parameters with fp32
gradient reduction on a CUDA device (fp32 elsewhere, and under DDP, where the user's own autocast decides), and
``compile=True`` compiles each repeated block in place before FSDP2 wraps it (the whole model when it has no
repeated blocks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import nn

from meshrun.config import COMPILE_MODES, REDUCE_DTYPES, RESIDUAL_DTYPES, ConfigError
from meshrun.comm.mesh import ParallelDims
from meshrun.models.spec import ModelStructure, count_unique_params
from meshrun.parallel.data_parallel import FSDP_ONE_UNIT_PARAMS, WHOLE_MODEL
from meshrun.parallel.kernels import bf16_by_default, inductor_mode
from meshrun.parallel.options import ParallelOptions, reduce_dtype
from meshrun.parallel.tied import find_shared
from meshrun.parallel.tp import resolve_plan

LAYOUTS = ("none", "ddp", "fsdp", "hsdp", "tp", "tp+fsdp", "pp", "pp+fsdp")


@dataclass(frozen=True)
class ModuleLayout:
    """What prepare_model did: the degrees, the blocks it sharded and the module to checkpoint."""

    dims: ParallelDims
    name: str
    blocks: str
    """Dotted path of the repeated blocks ('' when none were found)."""
    module: nn.Module
    """The model itself (never a DDP wrapper), with its original parameter names."""
    compute_dtype: torch.dtype | None = None
    """FSDP2's parameter dtype in forward and backward (None: the parameters' own)."""
    grad_reduce_dtype: str = "fp32"
    """The dtype data parallelism sums gradients in ('fp32' or 'bf16')."""
    compiled: int = 0
    """Modules compiled in place (the blocks, or 1 for a model without repeated blocks)."""
    compile_mode: str = "default"
    """Inductor's mode for them: default or max-autotune (prepare_model(compile_mode=...))."""
    cuda_graphs: bool = False
    """The compiled model is recorded as CUDA graphs (prepare_model(cuda_graphs=True))."""
    residual_dtype: str = "fp32"
    """'bf16': each block's input is cast to the autocast dtype under autocast (prepare_model(residual_dtype=...))."""
    note: str = ""
    """A start-up note when the layout ran as something else than its name says (hsdp on one node is FSDP)."""
    fsdp_whole: bool = False
    """FSDP2 holds the whole model as one unit, compiled as one graph (FSDP2 or HSDP with cuda_graphs=True)."""

    def describe(self, device: torch.device, choice: Any) -> str:
        """One start-up line: layout, device, compute dtype (and where it came from), compilation."""
        dtype = "fp32" if self.compute_dtype in (None, torch.float32) else str(self.compute_dtype).split(".")[-1]
        how = ("; pass compute_dtype=torch.float32 for fp32" if choice == "auto" and dtype != "fp32" else "")
        compiled = f"{self.compiled} module(s) compiled" if self.compiled else "not compiled (compile=True compiles)"
        compiled += f" ({self.compile_mode})" if self.compiled and self.compile_mode != "default" else ""
        compiled += ", recorded as CUDA graphs" if self.cuda_graphs else ""
        compiled += ", the whole model one FSDP2 unit" if self.fsdp_whole else ""
        notes = "; gradients summed in bf16" if self.grad_reduce_dtype == "bf16" and self.dims.dp_size > 1 else ""
        if self.residual_dtype == "bf16":
            notes += "; each block's input cast to the autocast dtype under autocast (residual_dtype='bf16')"
        return (f"meshrun: prepare_model: {self.name} over {self.dims.world_size} rank(s) on {device.type}; "
                f"compute {dtype} (compute_dtype={choice!r}{how}){notes}; {compiled}")


COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def resolve_compute_dtype(choice: Any, dims: ParallelDims, device: torch.device) -> torch.dtype | None:
    """``compute_dtype``: 'auto' = bf16 where FSDP2 holds the parameters on a CUDA device (FSDP then gathers and
    computes in bf16 and reduces gradients in fp32, as the trainer does), else None (fp32 parameters: under DDP
    and in one process the user's own autocast decides); a dtype or None is taken as given."""
    from meshrun.parallel.apply import uses_fsdp

    if isinstance(choice, str) and choice == "auto":
        return torch.bfloat16 if bf16_by_default(device) and uses_fsdp(dims) else None
    if choice is None or choice in COMPUTE_DTYPES:
        return choice
    raise ConfigError(f"compute_dtype={choice!r} is not 'auto', None or one of "
                      f"{', '.join(str(d) for d in COMPUTE_DTYPES)}; give e.g. compute_dtype=torch.bfloat16")


def check_layout_word(layout: str) -> None:
    """A layout word is one of LAYOUTS (raises ConfigError naming them)."""
    if layout not in LAYOUTS:
        raise ConfigError(f"layout={layout!r} is not one of {', '.join(LAYOUTS)}")


def layout_dims(layout: str, *, world_size: int, nodes: int = 1, tp: int = 0, dp_replicate: int = 0,
                pp: int = 0) -> ParallelDims:
    """The degrees a layout word means at ``world_size`` ranks (pure arithmetic; raises ConfigError).

    Like ``tp`` for 'tp', ``pp`` defaults to every rank for 'pp' and to 2 for 'pp+fsdp'; ranks left over replicate
    ('pp') or shard ('pp+fsdp') each stage."""
    check_layout_word(layout)
    if layout == "none" and world_size > 1:
        raise ConfigError(f"layout='none' runs one process, but the world size is {world_size}; use layout='ddp'")
    tp = tp or (world_size if layout == "tp" else 2 if layout == "tp+fsdp" else 1)
    if tp > 1 and layout not in ("tp", "tp+fsdp"):
        raise ConfigError(f"tp={tp} needs layout='tp' or 'tp+fsdp', not {layout!r}")
    pp = pp or (world_size if layout == "pp" else 2 if layout == "pp+fsdp" else 1)
    if pp > 1 and layout not in ("pp", "pp+fsdp"):
        raise ConfigError(f"pp={pp} needs layout='pp' or 'pp+fsdp', not {layout!r}")
    if world_size % (tp * pp):
        what = f"tp={tp}" if pp == 1 else f"pp={pp}"
        raise ConfigError(f"{what} does not divide the world size {world_size}; choose a {what[:2]} that divides it")
    dp = world_size // (tp * pp)
    if layout == "hsdp":
        dp_replicate = dp_replicate or (nodes if nodes > 1 else 1)
        if dp % dp_replicate:
            raise ConfigError(f"layout='hsdp': dp_replicate={dp_replicate} does not divide {dp} data-parallel "
                              "ranks; pass dp_replicate= a divisor (replicas, usually the number of nodes)")
        return ParallelDims(dp_replicate=dp_replicate, dp_shard=dp // dp_replicate, tp=tp, pp=1,
                            world_size=world_size)
    shard = layout in ("fsdp", "tp+fsdp", "pp+fsdp")
    return ParallelDims(dp_replicate=1 if shard else dp, dp_shard=dp if shard else 1, tp=tp, pp=pp,
                        world_size=world_size)


def find_blocks(model: nn.Module) -> str:
    """Dotted path of the largest ModuleList/ModuleDict whose children (two or more) share one class; '' if none."""
    best, size = "", 1
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            continue
        children = list(module.children())
        if len(children) > size and len({type(c) for c in children}) == 1:
            best, size = name, len(children)
    return best


def prepare_module(model: nn.Module, layout: str, *, device: torch.device, world_size: int, nodes: int = 1,
                   tp: int = 0, dp_replicate: int = 0, blocks: str | None = None,
                   tp_plan: Mapping[str, Any] | None = None, activation_checkpoint: str = "none",
                   compute_dtype: torch.dtype | str | None = None,
                   compile: bool = False, compile_mode: str = "default", grad_reduce_dtype: str = "fp32",
                   cuda_graphs: bool = False, residual_dtype: str = "fp32") -> tuple[nn.Module, ModuleLayout]:
    """Apply ``layout`` to ``model`` (in place where possible); returns (the module to train, what was done).
    ``compute_dtype``: see :func:`resolve_compute_dtype`; ``compile``: compile the blocks before FSDP2 or TP wraps
    them, or, for DDP and one process, the whole model, in inductor's ``compile_mode`` (see
    :func:`check_compile_mode`); ``grad_reduce_dtype``: 'fp32' or 'bf16', the dtype DDP,
    FSDP2 and HSDP sum gradients in across ranks (meshrun train's parallel.grad_reduce_dtype); ``cuda_graphs``:
    record that whole compiled model as CUDA graphs (inductor's reduce-overhead), DDP split at 100 MiB gradient
    buckets as meshrun train's defaults do (see :func:`check_session_graphs`; the caller marks a new replay
    generation per optimizer step); ``residual_dtype``: 'bf16' casts each block's input to the autocast dtype
    when the caller's loop autocasts (meshrun train's train.residual_dtype; see :func:`session_residual`).

    Collective: every rank must call it (it builds the mesh and broadcasts rank 0's weights)."""
    from meshrun.parallel.apply import ddp_bucket_mb, layout_name, parallelize, uses_fsdp
    from meshrun.parallel.checks import reorders_by_default
    from meshrun.parallel.comm_overlap import enable_comm_reorder
    from meshrun.parallel.data_parallel import apply_ddp

    check_compile_mode(compile_mode, compile=compile)
    dims = layout_dims(layout, world_size=world_size, nodes=nodes, tp=tp, dp_replicate=dp_replicate)
    compute_dtype = resolve_compute_dtype(compute_dtype, dims, device)
    # DDP or one process keep the model whole: compiled as one graph (with a loss inside it, the logits never exist
    # in fp32), as meshrun train compiles them; per-block graphs where FSDP2 or TP hooks run between the blocks
    alone = dims.tp == 1 and dims.pp == 1
    keeps_whole = alone and not uses_fsdp(dims)
    # FSDP2 or HSDP alone as CUDA graphs: the whole model one unit, its forward one graph (as meshrun train's
    # parallel.fsdp_unit_blocks=auto does for small models), FSDP2's hooks and collectives outside it
    fsdp_whole = alone and cuda_graphs and uses_fsdp(dims)
    if cuda_graphs:
        check_session_graphs(layout, whole_graph=keeps_whole or fsdp_whole, compile=compile, device=device)
    if dims.pp > 1:
        raise ConfigError(f"layout={layout!r} cuts the model into stages: use meshrun.parallel.module_pipeline."
                          "prepare_pipeline (Session.prepare_model does)")
    blocks = find_blocks(model) if blocks is None else blocks
    plan = tp_plan if tp_plan is not None else getattr(model, "tp_plan", None)
    if dims.tp > 1 and not plan:
        raise ConfigError(f"layout={layout!r}: {type(model).__name__} has no tensor-parallel plan; pass "
                          "tp_plan={'module.glob': 'colwise' | 'rowwise', ...} or use layout='fsdp'")
    if dims.tp > 1 and isinstance(plan, Mapping):
        resolve_plan(model, plan)  # a module TP cannot split is named before anything is built
    shared = find_shared(model)
    whole_params = count_unique_params([model]) if fsdp_whole else 0  # before FSDP2 shards it
    model = model.to(device)
    shared.restore(model, layout=f"layout={layout!r}", after=f"moving the model to {device}")
    if world_size > 1:
        dims.build_mesh(device.type)  # collective: every rank
    _broadcast_from_rank0(model)
    structure = ModelStructure(blocks=blocks, tp_plan=plan)
    whole_graph = compile and keeps_whole
    options = session_options(layout, compute_dtype=compute_dtype, device=device, compiled=compile and not whole_graph,
                              compile_mode=compile_mode, activation_checkpoint=activation_checkpoint,
                              grad_reduce_dtype=grad_reduce_dtype, residual_dtype=residual_dtype,
                              fsdp_whole_graphs=fsdp_whole)
    parallelize(model, structure, dims, options)
    if whole_graph:
        # in place: parameter names keep no "_orig_mod."; with cuda_graphs, inductor's reduce-overhead
        model.compile(mode=inductor_mode(compile_mode, cuda_graphs))
        if dims.dp_replicate > 1:  # one node: one graph each way, unless recorded (see parallel.ddp_graph)
            torch._dynamo.config.optimize_ddp = nodes > 1 or cuda_graphs
    if reorders_by_default(dims, device, compiled=compile):
        enable_comm_reorder()  # as meshrun train's parallel.comm_reorder=auto: TP's all-reduces beside compute
    compiled = 1 if whole_graph or fsdp_whole else compile_unblocked(model, structure, compile_mode) if compile else 0
    trained = model
    if dims.dp_replicate > 1 and not uses_fsdp(dims):
        trained = apply_ddp(model, dims.get_mesh("dp_replicate"), device, sync_buffers=True,
                            reduce_dtype=options.reduce_dtype, bucket_mb=ddp_bucket_mb(0, cuda_graphs=cuda_graphs))
        shared.restore(model, layout=f"layout={layout!r}", after="DDP", reshare=False)
    return trained, ModuleLayout(dims=dims, name=layout_name(dims), blocks=blocks, module=model,
                                 compute_dtype=compute_dtype, grad_reduce_dtype=grad_reduce_dtype, compiled=compiled,
                                 compile_mode=compile_mode, cuda_graphs=cuda_graphs, residual_dtype=residual_dtype,
                                 note=layout_note(layout, dims, nodes=nodes, whole_params=whole_params),
                                 fsdp_whole=fsdp_whole)


def check_session_graphs(layout: str, *, whole_graph: bool, compile: bool, device: torch.device) -> None:
    """``cuda_graphs=True`` records the whole model that ``compile=True`` compiles for DDP, FSDP2, HSDP and one
    process (``whole_graph``: the layout can compile the model as one graph), on a CUDA GPU; anything else is
    refused before any collective, naming the fix."""
    if not whole_graph:
        raise ConfigError(f"cuda_graphs=True records the whole compiled model, for layout='ddp', 'fsdp', 'hsdp' or one "
                          f"process, not layout={layout!r}, whose TP collectives or pipeline stages run between the "
                          "compiled blocks; drop cuda_graphs")
    if not compile:
        raise ConfigError("cuda_graphs=True records what compile=True compiles; add compile=True")
    if device.type != "cuda":
        raise ConfigError(f"cuda_graphs=True records CUDA graphs and this process runs on {device}; drop cuda_graphs")


def check_compile_mode(compile_mode: str, *, compile: bool) -> None:
    """``compile_mode`` of ``Session.prepare_model``: 'default' or 'max-autotune' (as meshrun train's
    train.compile_mode), and only with ``compile=True``; refused before any collective, naming the fix."""
    if compile_mode not in COMPILE_MODES:
        raise ConfigError(f"compile_mode={compile_mode!r}: choose one of {', '.join(COMPILE_MODES)} (inductor's "
                          "mode for what compile=True compiles)")
    if compile_mode != "default" and not compile:
        raise ConfigError(f"compile_mode={compile_mode!r} sets how compile=True compiles; add compile=True or drop "
                          "compile_mode")


def session_options(layout: str, *, compute_dtype: torch.dtype | None, device: torch.device, compiled: bool,
                    activation_checkpoint: str, grad_reduce_dtype: str = "fp32",
                    compile_mode: str = "default", split_backward: bool = False,
                    residual_dtype: str = "fp32", fsdp_whole_graphs: bool = False) -> ParallelOptions:
    """parallelize's options for ``Session.prepare_model``: its arguments; the rest as ``meshrun train``'s defaults
    (no sequence parallelism or float8, FSDP2 units as parallel.fsdp_unit_blocks=auto makes them, 'auto'
    resharding). ``split_backward``: a zero-bubble pipeline schedule runs. ``fsdp_whole_graphs``: FSDP2 holds the
    whole model as one unit, its forward compiled as one graph and recorded as CUDA graphs."""
    return ParallelOptions(compute_dtype=compute_dtype, compiled=compiled or fsdp_whole_graphs,
                           cuda_graphs=fsdp_whole_graphs, compile_mode=compile_mode,
                           fsdp_unit_blocks=WHOLE_MODEL if fsdp_whole_graphs else 0,
                           activation_checkpoint=activation_checkpoint, device=device, layout=f"layout={layout!r}",
                           reduce_dtype=session_reduce_dtype(grad_reduce_dtype), split_backward=split_backward,
                           residual_in_compute_dtype=session_residual(residual_dtype))


# Session takes the dtype itself: your loop, not meshrun, decides where autocast runs ('auto' is meshrun train's)
SESSION_RESIDUAL_DTYPES = tuple(d for d in RESIDUAL_DTYPES if d != "auto")


def session_residual(choice: str) -> bool:
    """``residual_dtype`` of ``Session.prepare_model``: 'fp32' (the default: autocast leaves the hidden state between
    blocks in the parameters' dtype) or 'bf16' (each block's first input is cast to the autocast dtype while the
    loop autocasts, so the stream between blocks stays bf16; without autocast nothing changes). Refuses the rest."""
    if choice not in SESSION_RESIDUAL_DTYPES:
        raise ConfigError(f"residual_dtype={choice!r}: choose one of {', '.join(SESSION_RESIDUAL_DTYPES)} (the dtype "
                          "of the hidden state between blocks under autocast)")
    return choice == "bf16"


# Session takes the dtype itself: meshrun train's 'auto' depends on micro-batches per step, which your loop decides
SESSION_REDUCE_DTYPES = tuple(d for d in REDUCE_DTYPES if d != "auto")


def session_reduce_dtype(choice: str) -> torch.dtype:
    """``grad_reduce_dtype`` of ``Session.prepare_model`` ('fp32' or 'bf16') as a torch dtype; refuses the rest."""
    if choice not in SESSION_REDUCE_DTYPES:
        raise ConfigError(f"grad_reduce_dtype={choice!r}: choose one of {', '.join(SESSION_REDUCE_DTYPES)} (the dtype "
                          "data parallelism sums gradients in)")
    return reduce_dtype(choice)


def compile_unblocked(model: nn.Module, spec: ModelStructure, compile_mode: str = "default") -> int:
    """After ``parallelize(..., compiled=True)`` compiled the blocks: the whole model, in place, when it has none
    (parameter names keep no ``_orig_mod.``). Returns how many modules are compiled."""
    blocks = spec.block_modules(model)
    if not blocks:
        model.compile(mode=inductor_mode(compile_mode, False))
    return len(blocks) or 1


def layout_note(layout: str, dims: ParallelDims, *, nodes: int, whole_params: int = 0) -> str:
    """What a user should know at start-up about how their layout word ran ('' when it ran as named).
    ``whole_params``: FSDP2 holds the whole model of this many parameters as one unit (cuda_graphs=True)."""
    notes = []
    if layout == "hsdp" and dims.dp_replicate == 1:
        where = "one node" if nodes <= 1 else f"dp_replicate=1 ({nodes} nodes)"
        notes.append(f"layout='hsdp' on {where} runs plain FSDP over {dims.dp_shard} ranks (HSDP replicates across "
                     "nodes: dp_replicate defaults to the number of nodes); pass dp_replicate=2 or more for replicas "
                     "within a node")
    elif layout == "hsdp" and dims.dp_shard == 1:
        notes.append(f"layout='hsdp' with dp_replicate={dims.dp_replicate} of {dims.dp_size} ranks shards nothing: "
                     "it runs DDP; pass a dp_replicate that leaves 2 or more ranks per replica to shard")
    if whole_params >= FSDP_ONE_UNIT_PARAMS:
        notes.append(f"cuda_graphs=True with layout={layout!r} gathers the whole model ({whole_params / 1e6:,.0f}M "
                     "parameters) on every GPU for each forward and backward, where meshrun train does so only "
                     f"below {FSDP_ONE_UNIT_PARAMS / 1e6:,.0f}M parameters; for a model this size drop cuda_graphs "
                     "(FSDP2 then gathers one block at a time, beside the previous block's compute)")
    return "; ".join(notes)


@torch.no_grad()
def _broadcast_from_rank0(model: nn.Module) -> None:
    """Every rank starts from rank 0's weights and buffers (one broadcast per tensor; every rank must reach it)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    for tensor in [*model.parameters(), *model.buffers()]:
        dist.broadcast(tensor.data, src=0)
