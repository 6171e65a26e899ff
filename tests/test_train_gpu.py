"""`meshrun train` end to end on GPUs (run on the GPU machine: ``pytest -m gpu tests/test_train_gpu.py``).

2 GPUs through `meshrun launch` (NCCL, bf16 autocast, the model compiled with its loss) against 1 GPU with twice
the accumulation (same global batch): losses within 0.05 over 20 steps (bf16 rounding; a missing gradient sync or a
wrong shard is off by > 0.3 within a few steps), median gradient norms within 10%, and the MFU and peak memory
fields are filled in.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--model.name=small", "--train.steps=20", "--train.log_every=1", "--train.eval_every=10",
        "--train.compile=true", "--train.global_batch=16", "--data.max_bytes=2000000", "--run.progress=lines",
        "--train.lr=1e-3"]  # at the default 3e-3 this small model's loss spikes, and bf16 rounding differences
                            # between the two runs grow chaotically after a spike (0.067 at step 19 on 2x H100)


def train(run_dir: Path, gpus: int, *extra: str) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{os.environ.get('PYTHONPATH', '')}",
           "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    cmd = [sys.executable, "-m", "meshrun", "launch", f"--nproc-per-node={gpus}", "train", *ARGS,
           f"--run.dir={run_dir}", *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in proc.stderr, "deprecated flight-recorder variable set"
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def one_gpu(tmp_path_factory) -> list[dict]:
    return [r for r in train(tmp_path_factory.mktemp("one"), 1) if r["kind"] == "train"]


@pytest.mark.parametrize("extra", [[], ["--parallel.ddp_overlap=true"]], ids=["ddp", "ddp_overlap"])
def test_two_gpu_ddp_matches_one_gpu_with_accumulation(tmp_path, one_gpu, extra):
    one = one_gpu
    two = [r for r in train(tmp_path / "two", 2, *extra) if r["kind"] == "train"]
    assert len(one) == len(two) == 20
    torch.testing.assert_close(torch.tensor([r["loss"] for r in two]), torch.tensor([r["loss"] for r in one]),
                               rtol=0, atol=0.05)
    assert two[-1]["loss"] < two[0]["loss"] - 0.5
    # the gradient norm sees what AdamW's losses hide: an accumulation that kept one micro-batch's gradients (a CUDA
    # graph replayed over the first one's) would leave the 1-GPU run about half the norm
    norms = [statistics.median(r["grad_norm"] for r in run) for run in (one, two)]
    assert abs(norms[1] / norms[0] - 1) < 0.1, f"median gradient norm (1 GPU, 2 GPUs): {norms}"
    assert all(r["peak_mem_gib"] > 0 for r in two)
    if any(r["mfu"] is None for r in two):
        pytest.fail(f"MFU missing: {torch.cuda.get_device_name()} is not in metrics.PEAK_BF16_FLOPS")


def test_context_parallel_trains_like_one_gpu_and_resumes_with_another_cp(tmp_path):
    """cp 2 (ring attention, FSDP over the cp ranks) against 1 GPU from the same weights: a 1-GPU run saves step 1,
    cp 2 resumes it, and steps 2-20 stay within 0.05 of the 1-GPU run's (both uncompiled bf16, the same samples: cp
    ranks read the same data, so the data-parallel degree is 1 in both). Then cp 2's step-10 checkpoint resumed as
    FSDP 2 (cp 1): steps 11-20 within 0.05 of the uninterrupted cp 2 run (DCP reshards the parameters and optimizer
    state from the dp_shard_cp mesh to the dp_shard one).

    Why from a checkpoint: each run started from its own initialisation is a different experiment. One GPU draws
    whole tensors from torch's generator; a sharded layout draws each shard from DTensor's RNG tracker, so its
    starting weights differ (equally distributed, not equal). Compared that way, a 20-step cp 2 run and the 1-GPU
    run once differed by up to 0.15."""
    one = [r for r in train(tmp_path / "one", 1, "--train.compile=false", "--checkpoint.interval_steps=1",
                            "--checkpoint.keep_every=1") if r["kind"] == "train"]  # keeps every step's checkpoint
    step1 = tmp_path / "one" / "checkpoints" / "step_0000001"
    assert (step1 / "COMPLETE").exists(), sorted(p.name for p in step1.parent.iterdir())
    cp_args = ["--parallel.cp=2", "--parallel.dp_replicate=1", "--train.compile=false",
               "--checkpoint.interval_steps=10", "--checkpoint.keep_every=10"]
    cp = [r for r in train(tmp_path / "cp2", 2, *cp_args, f"--checkpoint.resume={step1}") if r["kind"] == "train"]
    assert [r["step"] for r in cp] == list(range(2, 21))
    torch.testing.assert_close(torch.tensor([r["loss"] for r in cp]), torch.tensor([r["loss"] for r in one[1:]]),
                               rtol=0, atol=0.05)
    assert cp[-1]["loss"] < cp[0]["loss"] - 0.3, "cp 2 did not train"
    step10 = tmp_path / "cp2" / "checkpoints" / "step_0000010"
    assert (step10 / "COMPLETE").exists(), sorted(p.name for p in step10.parent.iterdir())
    resumed = [r for r in train(tmp_path / "fsdp2", 2, "--parallel.dp_shard=2", "--parallel.dp_replicate=1",
                                "--train.compile=false", f"--checkpoint.resume={step10}")
               if r["kind"] == "train"]
    assert [r["step"] for r in resumed] == list(range(11, 21))
    torch.testing.assert_close(torch.tensor([r["loss"] for r in resumed]), torch.tensor([r["loss"] for r in cp[9:]]),
                               rtol=0, atol=0.05)
