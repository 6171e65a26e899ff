"""Session's arguments are checked in one process as at scale, and its errors name the arguments a Session user
passed (``micro_batch=``), not the CLI's options (``--train.micro_batch``)."""

from __future__ import annotations

import pytest
import torch

from meshrun import Session
from meshrun.config import ConfigError


def test_a_misspelt_layout_is_refused_in_one_process_too():
    # one process runs every layout as one, so before this a typo surfaced only when the job went to many ranks
    session = Session(seed=0)
    with pytest.raises(ConfigError, match=r"^layout='zero3' is not one of none, ddp, fsdp, .*pp\+fsdp$"):
        session.prepare_model(torch.nn.Linear(4, 2), layout="zero3")
    session.close()


def test_step_batches_names_its_own_arguments():
    session = Session(seed=0)
    session.prepare_model(torch.nn.Linear(4, 2))
    data = [(torch.randn(4), torch.tensor(0)) for _ in range(16)]
    with pytest.raises(ConfigError, match=r"^global_batch=16 is not divisible by micro_batch=3 x 1 data-parallel "
                                          r"ranks = 3; .* or change micro_batch$"):
        session.step_batches(data, micro_batch=3, global_batch=16)
    with pytest.raises(ConfigError, match=r"^grad_accum=3 contradicts global_batch=16"):
        session.step_batches(data, micro_batch=4, global_batch=16, grad_accum=3)
    with pytest.raises(ConfigError, match=r"^micro_batch=0 must be an integer >= 1$"):
        session.step_batches(data, micro_batch=0, global_batch=16)
    with pytest.raises(ConfigError, match=r"^global_batch=-4 must be an integer >= 0 \(0: derived"):
        session.step_batches(data, micro_batch=4, global_batch=-4)
    with pytest.raises(ConfigError, match=r"^the dataset has 16 samples, fewer than one global batch of 32 "
                                          r"\(micro_batch=32 x 1 data-parallel ranks x 1 accumulation\)"):
        session.step_batches(data, micro_batch=32)
    assert session.step_batches(data, micro_batch=4, global_batch=16).grad_accum == 4
    session.close()


def test_residual_dtype_casts_each_blocks_input_under_the_loops_autocast_and_refuses_other_values():
    from mlp_lm import MLPLM

    seen = {}
    for residual in ("fp32", "bf16"):
        session = Session(seed=0)
        model = session.prepare_model(MLPLM(), residual_dtype=residual)
        dtypes = seen[residual] = []
        for block in model.blocks:
            block.register_forward_hook(lambda m, args, out: dtypes.append((args[0].dtype, out.dtype)))
        with torch.autocast("cpu", torch.bfloat16):  # the user's loop autocasts
            model(torch.randint(0, 64, (2, 16))).float().mean().backward()
        assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
        session.close()
    assert seen["fp32"] == [(torch.float32, torch.float32)] * 3  # autocast alone leaves the stream in fp32
    assert seen["bf16"] == [(torch.bfloat16, torch.bfloat16)] * 3
    session = Session(seed=0)
    with pytest.raises(ConfigError, match=r"^residual_dtype='fp16': choose one of fp32, bf16"):
        session.prepare_model(MLPLM(), residual_dtype="fp16")
    session.close()
