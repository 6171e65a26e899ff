"""``parallel.async_tp``: overlap tensor parallelism's communication with its matmuls (asynchronous TP).

With sequence parallelism every TP region starts with an all-gather of the sequence-sharded activations and ends
with a reduce-scatter. Inductor's micro-pipelining pass rewrites each all-gather -> matmul and matmul ->
reduce-scatter pair of a compiled block into fused ops that split the matmul into chunks and move each chunk over
symmetric memory while the next one computes (as in torchtitan's async TP). It needs CUDA, compiled blocks,
``parallel.sequence_parallel`` and a TP group of GPUs that share NVLink; the checks live in
:meth:`meshrun.config.JobConfig.validate`.
"""

from __future__ import annotations

import warnings

import torch
from torch.distributed.device_mesh import DeviceMesh

from meshrun.config import ConfigError
from meshrun.parallel.kernels import require_compiled_cuda


def check_async_tp(device: torch.device, *, tp: int, compiled: bool) -> None:
    """Refuse parallel.async_tp where it cannot run, naming what to change."""
    if tp < 2:
        raise ConfigError(f"parallel.async_tp=true needs tensor parallelism (parallel.tp >= 2, got {tp}); "
                          "drop --parallel.async_tp or set --parallel.tp")
    require_compiled_cuda("parallel.async_tp", cuda_why="symmetric memory",
                          compile_why="is a compiler pass over the compiled blocks", device=device, compiled=compiled)


def enable_async_tp(tp_mesh: DeviceMesh) -> None:
    """Turn on inductor's micro-pipelined TP for blocks compiled after this call, over ``tp_mesh``'s group."""
    # private: async TP is switched on only through these (as torchtitan does); no public API in 2.8 to 2.13
    import torch._inductor.config as inductor_config
    from torch.distributed import _symmetric_memory

    inductor_config._micro_pipeline_tp = True
    with warnings.catch_warnings():  # newer torch enables symmetric memory by itself and deprecates the call
        warnings.simplefilter("ignore", FutureWarning)
        _symmetric_memory.enable_symm_mem_for_group(tp_mesh.get_group().group_name)
