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
