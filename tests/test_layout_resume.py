"""A checkpoint written under one parallel layout resumes under another through the trainer (DCP reshards model
and optimizer): FSDP 4 -> TP 2 x DP 2, and FSDP 4 -> DDP 2, with the losses of the uninterrupted FSDP run
(rtol 1e-4: the layouts differ only in the order of floating-point reductions)."""

import pytest
import torch

from dist_utils import run_distributed
from test_resume import _worker

COMMON = ("--data.max_bytes=200000", "--train.global_batch=8", "--checkpoint.interval_steps=3",
          "--checkpoint.keep_last=5", "--health.check_versions=false")
FSDP4 = ("--parallel.dp_shard=4", "--parallel.dp_replicate=1", "--train.micro_batch=2")
TP2_DP2 = ("--parallel.tp=2", "--parallel.dp_replicate=2", "--parallel.dp_shard=1", "--train.micro_batch=4")
DDP2 = ("--parallel.dp_replicate=2", "--parallel.dp_shard=1", "--train.micro_batch=4")


@pytest.mark.slow
def test_fsdp_checkpoint_resumes_under_tp_dp_and_ddp(tmp_path):
    full = run_distributed(_worker, 4, tmp_path / "fsdp", 12, (*COMMON, *FSDP4), threads=1)[0][0]
    step6 = tmp_path / "fsdp" / "checkpoints" / "step_0000006"
    step9 = tmp_path / "fsdp" / "checkpoints" / "step_0000009"
    tp = run_distributed(_worker, 4, tmp_path / "tp", 12, (*COMMON, *TP2_DP2, f"--checkpoint.resume={step6}"),
                         threads=1)
    torch.testing.assert_close(torch.tensor(tp[0][0]), torch.tensor(full[6:]), rtol=1e-4, atol=0)
    ddp = run_distributed(_worker, 2, tmp_path / "ddp", 12, (*COMMON, *DDP2, f"--checkpoint.resume={step9}"),
                          threads=1)
    torch.testing.assert_close(torch.tensor(ddp[0][0]), torch.tensor(full[9:]), rtol=1e-4, atol=0)
