"""Communication beside compute: inductor's reordering of the collectives inside compiled graphs
(``parallel.comm_reorder``) and NCCL's channels for a pipeline's sends and receives (``parallel.pp_p2p_channels``).

Neither changes what is computed. The reordering moves work that does not need a collective's result (in TP's
backward, the weight gradients) between the collective's launch and its wait, so NCCL's kernel runs beside it. The
channel count caps how many of the GPU's SMs the pipeline's point-to-point kernels hold while matmuls run beside
them. Which runs turn them on is decided in :mod:`meshrun.parallel.checks` (``use_comm_reorder``,
``p2p_channels``).
"""

from __future__ import annotations

from typing import MutableMapping

REORDER_PASSES = ("reorder_compute_for_overlap", "sink_waits", "raise_comms")
"""inductor's built-in scheduler passes, in order: schedule independent compute between each collective and its wait,
move the waits as late as their users allow, and the collectives as early as their inputs allow (torch 2.8 to
2.13 know all three by these names)."""

P2P_VAR = "NCCL_MAX_P2P_NCHANNELS"
CTA_VAR = "NCCL_CTA_POLICY"
ZERO_CTA = "2"
"""NCCL's zero-CTA policy: collectives on symmetric buffers within a node run on the copy engines (NCCL 2.28+)."""


def enable_comm_reorder() -> None:
    """Turn on inductor's compute/communication reordering for graphs compiled after this call in this process."""
    import torch._inductor.config as inductor_config

    inductor_config.reorder_for_compute_comm_overlap = True
    inductor_config.reorder_for_compute_comm_overlap_passes = list(REORDER_PASSES)


def set_zero_cta(environ: MutableMapping[str, str]) -> str:
    """parallel.fsdp_symm_mem: NCCL's zero-CTA policy in ``environ`` (before NCCL creates a communicator), unless a
    policy is already set there, which wins (1, the efficiency policy, or 0 keep FSDP2's symmetric all-gathers on
    NCCL's symmetric kernels instead of the copy engines); returns the policy in force."""
    environ.setdefault(CTA_VAR, ZERO_CTA)
    return environ[CTA_VAR]


def set_p2p_channels(environ: MutableMapping[str, str], channels: int, *, explicit: bool) -> str:
    """Set NCCL's channel cap for point-to-point operations in ``environ`` (before NCCL creates a communicator: it
    reads the variable then); returns the value now in force, or "" where NCCL chooses. ``explicit``: the user gave
    parallel.pp_p2p_channels, which wins over the environment; under auto a value already there is kept."""
    if channels and (explicit or P2P_VAR not in environ):
        environ[P2P_VAR] = str(channels)
    return environ.get(P2P_VAR, "")
