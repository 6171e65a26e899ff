"""parallel.data_parallel: how the default pure data-parallel layout runs (DDP or FSDP2), decided from the model's
size and the device before the mesh is built; and parallel.fsdp_unit_blocks=0: how many blocks each FSDP2 unit
holds, from the sizes of the model and its blocks (no torch needed: the planner uses it too)."""

from __future__ import annotations

import dataclasses
import math

from meshrun.config import ParallelConfig

FSDP_AUTO_PARAMS = 1_000_000_000
"""parallel.data_parallel=auto shards models of at least this many parameters on GPUs. Measured on 2 H100s:
the 124M model trains 1.5x faster with DDP than with FSDP2 (per-block hooks and collectives cost more than the
small model's compute hides), the 1.2B model 1.13x faster with FSDP2 (each GPU updates half the optimizer state,
and the reduce-scatter overlaps backward), with half the memory."""


def choose_data_parallel(parallel: ParallelConfig, *, params: int, on_gpu: bool,
                         world_size: int | None = None) -> tuple[ParallelConfig, str]:
    """Apply ``parallel.data_parallel`` to the default pure data-parallel layout (dp_replicate=-1, dp_shard=1).

    Returns the config with the degrees to use, and a note for the start-up header ('' when the layout was given
    explicitly or stays DDP). The result is what runs, so it is also what config.toml records. With ``world_size``
    1 (one process) nothing is sharded: the note says so where data_parallel=fsdp was asked for.
    """
    plain = parallel.dp_replicate == -1 and parallel.dp_shard == 1
    mode = parallel.data_parallel
    if mode == "auto":
        big = on_gpu and params >= FSDP_AUTO_PARAMS and parallel.tp == 1 and parallel.pp == 1
        mode = "fsdp" if big else "ddp"
        why = f"{params / 1e9:.2f}B parameters >= {FSDP_AUTO_PARAMS / 1e9:g}B on GPUs"
    else:
        why = f"parallel.data_parallel={mode}"
    if mode != "fsdp" or not plain:
        return parallel, ""
    if world_size == 1:
        note = ("data parallelism: one process holds the whole model, nothing to shard (parallel.data_parallel=fsdp "
                "shards from 2 processes)") if parallel.data_parallel == "fsdp" else ""
        return dataclasses.replace(parallel, dp_replicate=1, dp_shard=-1), note
    note = (f"data parallelism: FSDP2 over every data-parallel rank ({why}); --parallel.data_parallel=ddp keeps "
            "whole replicas")
    return dataclasses.replace(parallel, dp_replicate=1, dp_shard=-1), note


FSDP_ONE_UNIT_PARAMS = 350_000_000
"""Below this many parameters (of this rank's part of the model), ``parallel.fsdp_unit_blocks=0`` on GPUs makes the
whole model one FSDP2 unit where the step runs as CUDA graphs (checks.whole_model_unit), else all blocks one unit.
On 2x H100 (124m, 16 x 1024 tokens, clip 1.0) all blocks in one unit ran 376.8k tokens/s per GPU and one unit per
block 226.4k: each unit's hooks, copies and collectives cost about the same whatever its size, and a small model's
blocks are too quick to hide them. Larger models get units of :data:`FSDP_UNIT_PARAMS`, whose all-gathers overlap
the previous unit's compute."""

FSDP_UNIT_PARAMS = 150_000_000
"""``parallel.fsdp_unit_blocks=0`` on GPUs, for models of :data:`FSDP_ONE_UNIT_PARAMS` or more: as many
consecutive blocks per FSDP2 unit as make at least this many parameters (one block per unit where a block is this
big). The host spends about 2 ms in each unit's forward (FSDP2's hooks, copies and collective calls, the compiled
block's guards) whatever the unit's size, and the GPU waits when the host falls behind. On 2 H200s, the 1b model
(51M parameters a block, 4 x 2048 tokens per GPU, 35 ms of forward on the GPU) took the host 36-55 ms to issue the
forward of one-block units, 33-41 ms with two blocks a unit and 31-34 ms with three (this size); the runs of one-block
units whose host took longest were up to 10% slower (docs/benchmarks.md, round 26)."""


def auto_unit_blocks(params: int, block_params: int, blocks: int) -> int:
    """``parallel.fsdp_unit_blocks=0`` on GPUs for a model (or pipeline stage) of ``params`` parameters whose
    largest block has ``block_params``: all ``blocks`` in one unit under :data:`FSDP_ONE_UNIT_PARAMS`, else as many
    per unit as make :data:`FSDP_UNIT_PARAMS` parameters (at least one, at most all)."""
    if blocks <= 0:
        return 1
    if params < FSDP_ONE_UNIT_PARAMS:
        return blocks
    return min(max(math.ceil(FSDP_UNIT_PARAMS / max(block_params, 1)), 1), blocks)


def reduces_in_bf16(*, fsdp: bool, replicate: int, bf16: bool, on_gpu: bool, one_node: bool,
                    accumulates: bool) -> bool:
    """``parallel.grad_reduce_dtype=auto``: does data parallelism sum gradients in bf16? Yes for FSDP2 without
    replicas (``replicate`` 1), computing in bf16 on GPUs, all of its ranks on one node, one micro-batch per optimizer
    step (not ``accumulates``: no gradient accumulation, no pipeline); fp32 otherwise.

    Under FSDP2's bf16 parameters each rank's gradients come out of the matmuls in bf16. With fp32 reduction FSDP2
    casts them to fp32 before the reduce-scatter; in bf16 it reduce-scatters them as they are: half the bytes, no
    casts, and each sum rounded to bf16 once per rank it passes (once on 2 ranks, at most 7 times on a node of 8),
    into fp32 shards that the optimizer steps as before. On 2 H200s (1b, round 28, 2026-11-30, 2 repeats each in
    three calls) it ran 1.021x, 1.027x and 1.018x fp32 reduction (52.3-53.0% MFU); earlier, with one block per FSDP2
    unit, the difference was inside the runs' spread. GPU test: ``tests/test_speed_gpu.py -k bf16_gradient`` (losses
    within 0.1% of fp32 reduction over 100 steps). Where a step accumulates several micro-batches (train.grad_accum,
    and every pipeline step) FSDP2 skips the reduce-scatter until the last and, with a bf16 reduce dtype, adds their
    unsharded gradients in bf16 instead of fp32, which is precision lost per micro-batch: fp32 there. DDP keeps fp32:
    torch's bf16 compression hook costs more casts than the all-reduce saves within a node (124m: 449.9k against
    456.7k tokens/s per GPU); so do replicas and several nodes, where more ranks' sums are rounded and nothing here
    measured them. (DDP's linear layers still sum in bf16 on one node: train.weight_copies makes their bf16 copies
    DDP's parameters, with no casts; meshrun.parallel.checks.use_weight_copies.)"""
    return fsdp and replicate == 1 and bf16 and on_gpu and one_node and not accumulates
