"""The layouts on 2 GPUs with NCCL: fp32 parity with a 1-GPU reference, and bf16 mixed precision with compile and
activation checkpointing (run on the GPU machine: ``pytest -m gpu tests/test_parallel_gpu.py``). Context
parallelism (cp2) is here because torch's ring attention runs on CUDA only; its CPU tests are in
test_context_parallel.py.

Tolerances: fp32 as in test_parallel_layouts.py but 10x looser (different GPU kernels are chosen for the
different local shapes of TP shards, so sums are ordered differently). bf16: losses within 0.05 of the fp32
reference over 10 steps (bf16 rounding of activations; a broken layout is off by > 0.3 after a few steps).
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from meshrun.comm.process_group import release_cuda_graphs
from test_parallel_layouts import (LOSS_ATOL, NORM_RTOL, PARAM_ATOL, Layout, reference_run, run_layout)

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]

FP32 = {
    "fsdp2": Layout(tied=True, grad_accum=2, parallel={"dp_replicate": 1, "dp_shard": 2}),
    "tp2": Layout(tied=True, grad_accum=1, parallel={"dp_replicate": 1, "tp": 2, "sequence_parallel": "true"}),
    "pp2_1f1b": Layout(tied=False, grad_accum=2, parallel={"dp_replicate": 1, "pp": 2, "pp_microbatches": 4}),
    "ddp2": Layout(tied=True, grad_accum=2, parallel={"dp_replicate": 2}),
}
# Context parallelism runs in bf16 only: fp32 SDPA takes the efficient-attention kernel, whose ring merge fails inside
# torch 2.11 (a shape mismatch merging a partial block; seen on 2 H100s), so meshrun refuses it with the fix named.
FOUR_GPUS = {  # context parallelism composed with TP, FSDP and HSDP in bf16 (run on a 4-GPU machine)
    "cp2_tp2_sp": Layout(tied=True, grad_accum=1, parallel={"dp_replicate": 1, "cp": 2, "tp": 2,
                                                            "sequence_parallel": "true"}),
    "fsdp2_cp2": Layout(tied=True, grad_accum=2, parallel={"dp_replicate": 1, "dp_shard": 2, "cp": 2}),
    "hsdp2_cp2": Layout(tied=True, grad_accum=1, parallel={"dp_replicate": 2, "cp": 2}),
}
BF16 = {
    # compiled FSDP2 of a small model: by default the whole model one unit, recorded as CUDA graphs
    # (checks.whole_model_unit), with selective recomputation here; the next two layouts run other settings
    "fsdp2_compile_selective": Layout(tied=True, grad_accum=2, parallel={"dp_replicate": 1, "dp_shard": 2,
                                                                         "activation_checkpoint": "selective"},
                                      train={"compile": "true"}),
    # inductor's max-autotune mode (train.compile_mode): other kernels for the same math
    "fsdp2_compile_autotune": Layout(tied=True, grad_accum=2, parallel={"dp_replicate": 1, "dp_shard": 2},
                                     train={"compile": "true", "compile_mode": "max-autotune"}),
    # the whole model one FSDP2 unit, its forward compiled as one graph, launched kernels
    "fsdp2_whole_compile": Layout(tied=True, grad_accum=2, parallel={"dp_replicate": 1, "dp_shard": 2,
                                                                     "fsdp_unit_blocks": -1},
                                  train={"compile": "true", "cuda_graphs": "false"}),
    # FSDP2 block by block, each block compiled: what larger models run
    "fsdp2_blocks_compile": Layout(tied=True, grad_accum=2, parallel={"dp_replicate": 1, "dp_shard": 2,
                                                                      "fsdp_unit_blocks": 1},
                                   train={"compile": "true"}),
    "tp2_full_ac": Layout(tied=True, grad_accum=1, parallel={"dp_replicate": 1, "tp": 2,
                                                             "activation_checkpoint": "full"}),
    # TP's compiled cross-entropy on each rank's vocabulary shard (meshrun.parallel.vocab_loss), blocks as graphs
    "tp2_compile": Layout(tied=True, grad_accum=2, parallel={"dp_replicate": 1, "tp": 2},
                          train={"compile": "true"}),
    "pp2_gpipe": Layout(tied=False, grad_accum=1, parallel={"dp_replicate": 1, "pp": 2, "pp_schedule": "gpipe",
                                                            "pp_microbatches": 4}),
    # the pipeline defaults with 1F1B (what the trainer runs where interleaved 1F1B does not fit): micro-batches
    # from the batch (2 here: no micro-batch reaches 4096 tokens, so pp of them), stages cut by cost, compiled blocks
    "pp2_defaults_compile": Layout(tied=False, grad_accum=2, parallel={"dp_replicate": 1, "pp": 2},
                                   train={"compile": "true"}),
    # interleaved 1F1B (2 stages per rank, 4 layers), compiled, weights cast once per step: the trainer's pipeline
    # default on GPUs since it passed here (1.024x 1F1B on 2 H200s, docs/benchmarks.md round 15)
    "pp2_interleaved_compile": Layout(tied=False, grad_accum=2, n_layers=4,
                                      parallel={"dp_replicate": 1, "pp": 2, "pp_schedule": "interleaved1f1b",
                                                "pp_microbatches": 4},
                                      train={"compile": "true"}),
    "cp2_compile_selective": Layout(tied=True, grad_accum=2, parallel={"dp_replicate": 1, "cp": 2,
                                                                       "activation_checkpoint": "selective"},
                                    train={"compile": "true"}),
    # gradients summed in bf16: DDP through torch's bf16 compression hook on NCCL, FSDP2 through its reduce dtype
    "ddp2_bf16_reduce_compile": Layout(tied=True, grad_accum=2, parallel={"dp_replicate": 2,
                                                                          "grad_reduce_dtype": "bf16"},
                                       train={"compile": "true"}),
    "fsdp2_bf16_reduce": Layout(tied=True, grad_accum=2, parallel={"dp_replicate": 1, "dp_shard": 2,
                                                                   "grad_reduce_dtype": "bf16"}),
    # the hidden state between blocks in bf16 (train.residual_dtype), compiled, with each layout's CUDA graphs
    "ddp2_bf16_stream_compile": Layout(tied=True, grad_accum=2, parallel={"dp_replicate": 2},
                                       train={"compile": "true", "residual_dtype": "bf16"}),
    "tp2_bf16_stream_compile": Layout(tied=True, grad_accum=1, parallel={"dp_replicate": 1, "tp": 2},
                                      train={"compile": "true", "residual_dtype": "bf16"}),
    "pp2_interleaved_bf16_stream_compile": Layout(tied=False, grad_accum=2, n_layers=4,
                                                  parallel={"dp_replicate": 1, "pp": 2,
                                                            "pp_schedule": "interleaved1f1b", "pp_microbatches": 4},
                                                  train={"compile": "true", "residual_dtype": "bf16"}),
}


def _nccl_worker(rank: int, world_size: int, layouts: dict, initials: dict, dtype_name: str) -> dict:
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size, device_id=device,
                            timeout=timedelta(seconds=120))
    try:
        dtype = None if dtype_name == "fp32" else torch.bfloat16
        return {name: run_layout(layout, initials[layout.model], device=device, compute_dtype=dtype)
                for name, layout in layouts.items()}
    finally:
        release_cuda_graphs()  # a TP block recorded as a CUDA graph holds its all-reduce: destroy would wait on it
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def references():
    # the 2-layer models (tied or not), and the untied 4-layer one for the schedules with 2 stages per rank
    return {(tied, layers): reference_run(tied, layers, torch.device("cuda", 0))
            for tied, layers in ((True, 2), (False, 2), (False, 4))}


def _spawn(layouts, references, dtype_name, world: int = 2):
    initials = {model: ref["initial"] for model, ref in references.items()}
    per_rank = run_distributed(_nccl_worker, world, layouts, initials, dtype_name, init_pg=False, timeout=900)
    return {name: [per_rank[r][name] for r in range(world)] for name in layouts}


def assert_fp32_parity(results: dict, layouts: dict, references) -> None:
    for name, ranks in results.items():
        ref = references[layouts[name].model]
        for result in ranks:
            torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref["losses"]), rtol=0,
                                       atol=10 * LOSS_ATOL, msg=lambda m: f"{name}: {m}")
            torch.testing.assert_close(torch.tensor(result["norms"]), torch.tensor(ref["norms"]),
                                       rtol=10 * NORM_RTOL, atol=0, msg=lambda m: f"{name}: {m}")
        state = {}
        for result in ranks:
            if result["state"] is not None and result["coords"].dp_replicate == 0:
                state.update(result["state"])
        for key, expected in ref["state"].items():
            torch.testing.assert_close(state[key], expected, rtol=0, atol=10 * PARAM_ATOL,
                                       msg=lambda m: f"{name} {key}: {m}")


def test_fp32_layouts_on_two_gpus_equal_one_gpu(references):
    results = _spawn(FP32, references, "fp32")
    assert_fp32_parity(results, FP32, references)
    for name in ("fsdp2", "tp2"):  # DTensor's CUDA RNG tracker: each shard draws its own values
        wq = results[name][0]["own_init"]["layers.0.attention.wq.weight"]
        assert not torch.equal(wq[:32], wq[32:]) and 0.015 < wq.std().item() < 0.025, name


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 CUDA GPUs")
def test_bf16_context_parallel_with_tp_fsdp_and_hsdp_on_four_gpus_tracks_fp32(references):
    assert_bf16_tracks_fp32(_spawn(FOUR_GPUS, references, "bf16", world=4), FOUR_GPUS, references)


def test_bf16_layouts_with_compile_and_checkpointing_track_fp32(references):
    assert_bf16_tracks_fp32(_spawn(BF16, references, "bf16"), BF16, references)


def assert_bf16_tracks_fp32(results: dict, layouts: dict, references) -> None:
    for name, ranks in results.items():
        ref = references[layouts[name].model]
        losses = torch.tensor(ranks[0]["losses"])
        assert torch.isfinite(losses).all(), name
        torch.testing.assert_close(losses, torch.tensor(ref["losses"]), rtol=0, atol=0.05,
                                   msg=lambda m: f"{name}: {m}")
