"""The NCCL flight recorder: environment defaults that make NCCL keep a ring buffer of recent collectives and dump it
on a timeout, so that a hang leaves a trace per rank in the run folder.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import MutableMapping

import torch


def torch_at_least(major: int, minor: int) -> bool:
    """Whether the installed torch release is at least major.minor (local suffixes such as +cu130 ignored)."""
    parts = torch.__version__.split("+")[0].split(".")
    return (int(parts[0]), int(parts[1])) >= (major, minor)


def enable_flight_recorder(environ: MutableMapping[str, str], *, run_dir: str | Path,
                           buffer_size: int = 2000, new_names: bool | None = None) -> dict[str, str]:
    """Set flight-recorder defaults in ``environ`` unless the user set them; return what was set.

    Must happen before the NCCL process group is created (the launcher sets it for workers, or the trainer
    sets ``os.environ`` before ``init_process_group``). On a collective timeout each rank then writes its last
    ``buffer_size`` collectives to ``<run_dir>/nccl_trace/rank_<N>``; read them with ``torchfrtrace``.
    torch 2.9 and newer read the TORCH_FR_* names and warn about the older TORCH_NCCL_* ones, which torch 2.8
    reads; only the names this torch reads are set (``new_names`` overrides the version check).
    """
    if new_names is None:
        new_names = torch_at_least(2, 9)
    trace_prefix = str(Path(run_dir) / "nccl_trace" / "rank_")
    wanted = [(("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"), str(buffer_size)),
              (("TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_DUMP_ON_TIMEOUT"), "1"),
              (("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"), trace_prefix)]
    applied: dict[str, str] = {}
    for names, value in wanted:
        if any(name in environ for name in names):
            continue  # the user chose (in either spelling); leave it alone
        name = names[0] if new_names else names[1]
        environ[name] = applied[name] = value
    if any(name in applied for name in ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")):
        os.makedirs(Path(trace_prefix).parent, exist_ok=True)
    return applied
