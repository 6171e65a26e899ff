"""Data parallelism: FSDP2 (``fully_shard``) over the dp mesh, HSDP over (replicate, shard), or classic DDP.

FSDP2 wraps each repeated block (the ModelSpec's blocks, or those Session found), then the root (embedding, final
norm and output head stay in the root's group, which keeps tied embeddings in one group). Parameter names do not change: FSDP2 swaps parameters for DTensors in place.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

# the sizes and rule of parallel.fsdp_unit_blocks=0, re-exported from where the planner reads them without torch
from meshrun.comm.dp_choice import FSDP_ONE_UNIT_PARAMS, FSDP_UNIT_PARAMS, auto_unit_blocks  # noqa: F401
from meshrun.parallel.step_weights import StepWeights

try:  # the symmetric-memory pool that parallel.fsdp_symm_mem gathers into (symm_mem_supported)
    from torch.distributed import _symmetric_memory as symm_mem
except ImportError:
    symm_mem = None


def mixed_precision(compute_dtype: torch.dtype | None,
                    reduce_dtype: torch.dtype = torch.float32) -> MixedPrecisionPolicy:
    """bf16 (or fp16) parameters for compute, gradients reduced in ``reduce_dtype`` (fp32 unless
    parallel.grad_reduce_dtype says bf16); plain fp32 when compute_dtype is None and the reduction is fp32."""
    fp32 = compute_dtype is None or compute_dtype == torch.float32
    if fp32 and reduce_dtype == torch.float32:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=None if fp32 else compute_dtype, reduce_dtype=reduce_dtype)


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, *, compute_dtype: torch.dtype | None,
               reshard_after_forward: bool, blocks: list[nn.Module], unit_blocks: int = 1,
               reduce_dtype: torch.dtype = torch.float32, prefetch: int = 0, symm_mem: bool = False) -> None:
    """Shard ``model`` over ``dp_mesh``: 1-D mesh = FSDP, 2-D (replicate, shard) mesh = HSDP.

    ``reshard_after_forward=False`` keeps gathered parameters until backward (used with pipeline parallelism,
    where each stage runs many micro-batches per step and re-gathering each time would multiply the traffic).
    ``unit_blocks`` consecutive blocks form one FSDP2 unit (one all-gather and one reduce-scatter for all of them);
    -1: no unit of blocks, the whole model is the root unit. ``prefetch``: units each unit gathers ahead
    (:func:`set_prefetch`; 0: FSDP2's own order). ``symm_mem``: all-gathers through symmetric memory
    (:func:`use_symm_mem`).
    """
    mp_policy = mixed_precision(compute_dtype, reduce_dtype)
    units = fsdp_units(blocks, unit_blocks)
    for i, unit in enumerate(units):
        # the last unit's parameters are needed again first thing in backward: keep them gathered
        reshard = reshard_after_forward and i < len(units) - 1
        fully_shard(unit if len(unit) > 1 else unit[0], mesh=dp_mesh, mp_policy=mp_policy,
                    reshard_after_forward=reshard)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    if prefetch and units:
        set_prefetch(model, [unit[0] for unit in units], prefetch)
    if symm_mem:
        use_symm_mem(model, dp_mesh)
    if dp_mesh.device_type == "cpu":
        # gloo: FSDP2 reduces fp32 gradients with ReduceOp.AVG, which torch 2.8's gloo sums instead (gradients
        # N times too large); a SUM followed by FSDP's own division is right on every version.
        for module in [*blocks, model]:
            if hasattr(module, "set_force_sum_reduction_for_comms"):
                module.set_force_sum_reduction_for_comms(True)


def set_prefetch(root: nn.Module, units: list[nn.Module], depth: int) -> None:
    """parallel.fsdp_prefetch: each FSDP2 unit (and the root, for the first units) gathers the next ``depth`` units'
    parameters right after its own all-gather, and in backward the ``depth`` units before it.

    FSDP2 alone issues a unit's all-gather from the unit's pre-forward hook, when the host gets there. In a GPU-bound
    step the host is only a little ahead: on 2 H200s (1b, 2 ranks, one unit per block, profiled) one rank issued each
    block's copy-in and all-gather about 0.1 ms before the GPU reached it, so it idled about 0.5 ms per block waiting
    for them, while the other rank's all-gather kernels, started early, waited for it about 2 ms each, holding SMs
    beside the matmuls (which ran 1.3x as long there). Gathered ahead, each all-gather is queued a whole unit earlier
    (under the profiler those waits fell to 0.3 ms; unprofiled, the step ran level, docs/benchmarks.md round 25).
    Prefetching changes when parameters are gathered, not what is computed. With resharding after forward off
    (FSDP2 keeps the gathered parameters for backward) the backward prefetches find them gathered and do nothing."""
    for i, module in enumerate([root, *units]):
        ahead = units[i:i + depth]  # units[i] is the module after this one
        if ahead:
            module.set_modules_to_forward_prefetch(ahead)
    for i, unit in enumerate(units):
        behind = units[max(i - depth, 0):i][::-1]
        if behind:
            unit.set_modules_to_backward_prefetch(behind)


def use_symm_mem(model: nn.Module, dp_mesh: DeviceMesh) -> None:
    """parallel.fsdp_symm_mem: every FSDP2 unit of ``model`` all-gathers into buffers from NCCL's symmetric memory,
    once per unit (a unit of several blocks is one FSDP2 state shared by its modules). With NCCL's zero-CTA policy
    (comm_overlap.set_zero_cta, before the process group is made) NCCL does those all-gathers with the copy engines
    within a node: no SMs held beside the matmuls. Reduce-scatters stay as they were.

    torch 2.13 and newer do it themselves (``FSDPModule.set_symm_mem_for_comm``); on older ones (the GPU machine's
    2.11) each unit gets :class:`SymmMemAllGather` through FSDP2's ``set_custom_all_gather``, the same allocation
    and the same NCCL all-gather. check_layout has refused the runs that can do neither (no FSDP2, not CUDA, a torch
    without both, NCCL before 2.28)."""
    own = hasattr(FSDPModule, "set_symm_mem_for_comm")
    if not own:
        symm_mem.set_backend("NCCL")
        # NCCL's communicator must exist before the first buffer is registered with it (torch does the same)
        dist.barrier(group=dp_mesh.get_group(dp_mesh.ndim - 1))
    seen: set[int] = set()
    for module in model.modules():
        if isinstance(module, FSDPModule) and id(module._get_fsdp_state()) not in seen:
            seen.add(id(module._get_fsdp_state()))
            if own:
                module.set_symm_mem_for_comm()  # its backend defaults to NCCL, the only one
            else:
                module.set_custom_all_gather(SymmMemAllGather())


def describe_units(parts: list[nn.Module]) -> str:
    """The start-up line's account of FSDP2's units in ``parts`` (each a root FSDP2 module, or not FSDP2 at all):
    how many blocks each unit of blocks holds, and how many such units besides the roots; '' without FSDP2."""
    per_state: dict[int, int] = {}
    roots = {id(part._get_fsdp_state()) for part in parts if isinstance(part, FSDPModule)}
    for part in parts:
        for module in part.modules():
            # a unit of several blocks is one state shared by them
            key = id(module._get_fsdp_state()) if isinstance(module, FSDPModule) else None
            if key is not None and key not in roots:
                per_state[key] = per_state.get(key, 0) + 1
    if not roots:
        return ""
    root = "the root" if len(roots) == 1 else f"{len(roots)} stage roots"
    if not per_state:
        return "FSDP2: the whole model one unit" if len(roots) == 1 else f"FSDP2: {root}, no units of blocks"
    low, high = min(per_state.values()), max(per_state.values())
    each = f"{high} block{'s' if high > 1 else ''}" if low == high else f"{low}-{high} blocks"
    return f"FSDP2: {root} and {len(per_state)} unit{'s' if len(per_state) > 1 else ''} of {each}"


def symm_mem_supported() -> bool:
    """This torch can gather FSDP2's parameters into symmetric memory: by itself, or through a custom all-gather."""
    if hasattr(FSDPModule, "set_symm_mem_for_comm"):
        return True
    return (symm_mem is not None and hasattr(FSDPModule, "set_custom_all_gather") and hasattr(symm_mem, "get_mem_pool")
            and hasattr(symm_mem, "set_backend") and hasattr(torch.cuda, "use_mem_pool"))


def _all_gather_base() -> type:
    try:  # torch 2.9 and newer
        from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather
    except ImportError:
        return object
    return AllGather


class SymmMemAllGather(_all_gather_base()):
    """FSDP2's all-gather on a torch without ``set_symm_mem_for_comm``: its output buffer comes from the device's
    symmetric-memory pool (the pool hands the same buffer back each step, so it is registered with NCCL once) and is
    registered for the group, and NCCL's ordinary all-gather then runs on it, on the copy engines under the zero-CTA
    policy. What torch 2.13's own symmetric all-gather does, through FSDP2's custom all-gather hook."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        with torch.cuda.use_mem_pool(symm_mem.get_mem_pool(device)):
            return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, async_op: bool = False):
        symm_mem.rendezvous(output_tensor, group=group.group_name)
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


WHOLE_MODEL = -1
"""parallel.fsdp_unit_blocks=-1: no FSDP2 unit of blocks, the whole model is the root unit (apply.compile_forward)."""


def fsdp_units(blocks: list[nn.Module], unit_blocks: int) -> list[list[nn.Module]]:
    """The blocks each FSDP2 unit shards together (``unit_blocks`` consecutive blocks; the root unit is the rest).
    :data:`WHOLE_MODEL`: none, the root unit holds the whole model."""
    if unit_blocks == WHOLE_MODEL:
        return []
    return [blocks[i:i + unit_blocks] for i in range(0, len(blocks), unit_blocks)]


def gather_in_pool(model: nn.Module) -> torch.utils.hooks.RemovableHandle | None:
    """Before each forward of ``model`` (an FSDP2 module, on a CUDA GPU), gather its parameters (``model.unshard()``)
    with every allocation of the gather, the all-gather's buffer and the unsharded parameters, in a CUDA memory pool
    of its own. For the whole model as one FSDP2 unit replayed as CUDA graphs (apply.compile_forward, Session's
    ``cuda_graphs=True``); returns the hook's handle.

    FSDP2 frees the unsharded parameters after each backward and allocates them again before the next forward. From
    the device's shared cache they can come back at other addresses, and inductor's CUDA graphs, which take
    parameters as fixed addresses, then record the graph again (pytorch#183451: FSDP2 under ``reduce-overhead`` slow
    for its first steps). In a pool that holds only this gather's memory, each step allocates the same sizes in the
    same order on the same stream into blocks all freed since, and gets the same blocks back. The hook runs before
    FSDP2's own pre-forward hook, which then finds the parameters gathered; outside a forward FSDP2 gathers on the
    current stream, after the optimizer's update of the shards. A torch without ``torch.cuda.use_mem_pool`` gets no
    hook (None): the graphs stay correct, and may be recorded again in the first steps."""
    if not hasattr(torch.cuda, "use_mem_pool"):
        return None
    pool = torch.cuda.MemPool()

    def gather(module: nn.Module, args: tuple) -> None:
        with torch.cuda.use_mem_pool(pool):
            module.unshard()

    return model.register_forward_pre_hook(gather, prepend=True)


DDP_BROADCAST_BYTES = 250 * 1024 * 1024
"""DDP's own bucket size for broadcasting rank 0's parameters at its start (its ``broadcast_bucket_size``)."""


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, device: torch.device, *, bucket_mb: int = 25,
              sync_buffers: bool = False, reduce_dtype: torch.dtype = torch.float32,
              copies: StepWeights | None = None, batched_copy: bool = False) -> nn.Module:
    """Wrap in DistributedDataParallel over ``dp_mesh``'s group; returns the wrapper (the model keeps its names).

    ``sync_buffers`` broadcasts rank 0's buffers before every forward (models with running statistics, such as
    BatchNorm, need it; the trainer's models compute their buffers identically everywhere and skip it).
    ``reduce_dtype=torch.bfloat16`` all-reduces each gradient bucket in bf16 (torch's ``bf16_compress_hook``:
    cast to bf16, divide by the world size, all-reduce, copy back into the fp32 bucket). ``copies``: the linear
    layers' bf16 copies of their weights (train.weight_copies, built with ``reduced_by_ddp``), which DDP takes as
    its parameters in their place: their gradients are all-reduced in bf16 buckets. ``batched_copy``: DDP copies a
    bucket's gradients into it with one ``_foreach_copy_`` and one division once the bucket is full, not one kernel
    per parameter as each arrives (torch's ``batched_grad_copy``; parallel.ddp_batched_copy, checked by
    meshrun.parallel.checks.check_layout).

    Collective: every rank of the dp group must call this (DDP broadcasts rank 0's parameters).
    """
    from torch.distributed.utils import _sync_module_states
    from torch.nn.parallel import DistributedDataParallel

    held = contextlib.nullcontext()
    if copies is not None:
        # DDP would broadcast only the copies it holds: rank 0's fp32 weights first, with the broadcast DDP's own
        # start uses (torch's _sync_module_states); the copies are cast from them at each step's start
        _sync_module_states(model, dp_mesh.get_group(), DDP_BROADCAST_BYTES, 0, set())
        held = copies.registered_by()

    # The trainer's models compute their buffers (e.g. a RoPE table) identically everywhere: syncing them before
    # every forward would be a wasted collective per step. Newer torch renames the switch (the old name warns).
    no_buffer_sync = ({"forward_sync_buffers": sync_buffers}
                      if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
                      else {"broadcast_buffers": sync_buffers})
    batched = {"batched_grad_copy": True} if batched_copy else {}
    with held:
        ddp = DistributedDataParallel(model, process_group=dp_mesh.get_group(),
                                      device_ids=[device.index] if device.type == "cuda" else None,
                                      gradient_as_bucket_view=True, bucket_cap_mb=bucket_mb, **no_buffer_sync,
                                      **batched)
    if reduce_dtype == torch.bfloat16:
        ddp.register_comm_hook(dp_mesh.get_group(), bf16_all_reduce)
    elif reduce_dtype != torch.float32:
        raise ValueError(f"apply_ddp: reduce_dtype={reduce_dtype} is not fp32 or bf16")
    return ddp


def bf16_all_reduce(process_group, bucket):
    """torch's ``bf16_compress_hook`` under another name: DDP refuses that name unless NCCL is available
    (``register_comm_hook`` checks it by name), while gloo sums bf16 tensors too, so CPU runs can reduce in bf16."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

    return bf16_compress_hook(process_group, bucket)
