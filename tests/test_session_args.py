"""Session's arguments are checked in one process as at scale, and its errors name the arguments a Session user
passed (``micro_batch=``), not the CLI's options (``--train.micro_batch``). Session.step_batches before
Session.prepare_model counts every rank as a data-parallel one (a script that wraps its model itself), and a later
layout that splits the batch otherwise (TP on 2 gloo ranks, where the TP group must read the same samples) is
refused instead of training on the wrong ones.
"""

from __future__ import annotations

import re

import pytest
import torch

from dist_utils import run_distributed
from meshrun import Session
from meshrun.config import ConfigError

ORDER_ERROR = (r"^Session\.prepare_model\(layout='tp'\): Session\.step_batches already split each batch over 2 "
               r"data-parallel rank\(s\) \({}\), but layout='tp' splits it over 1; call prepare_model first")


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


def test_step_batches_before_prepare_model_in_one_process_keeps_every_layout():
    session = Session(seed=0)
    data = [(torch.randn(4), torch.tensor(0)) for _ in range(16)]
    assert session.step_batches(data, micro_batch=4, global_batch=16).grad_accum == 4  # one data-parallel rank
    session.prepare_model(torch.nn.Linear(4, 2))  # one process runs any layout as one: nothing to refuse
    session.close()


class Numbered(torch.utils.data.Dataset):
    """Sample i is (i, i): which samples a rank reads is visible in its batches."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor([i]), torch.tensor([i])


def tp_batch_order(rank: int, world_size: int) -> dict:
    """The reported script's two orders under layout='tp' on 2 ranks, then a TP layout after DDP's batches."""
    from mlp_lm import MLPLM

    out = {}
    session = Session(seed=0)
    session.step_batches(Numbered(), micro_batch=4, global_batch=32)  # every rank its own half, accumulation 4
    try:  # the wrong order: the 2 TP ranks would read different halves of each batch
        session.prepare_model(MLPLM(), layout="tp", tp_plan=MLPLM.tp_plan)
    except ConfigError as exc:
        out["wrong_order"] = str(exc)
    session = Session(seed=0)  # the group is up already: a new Session, the right order
    session.prepare_model(MLPLM(), layout="tp", tp_plan=MLPLM.tp_plan)
    batches = session.step_batches(Numbered(), micro_batch=4, global_batch=32)
    out["grad_accum"] = batches.grad_accum
    out["samples"] = [[x.flatten().tolist() for x, _ in batches.next_step()] for _ in range(2)]
    session = Session(seed=0)  # the group is up already: a new Session, a new layout
    session.prepare_model(torch.nn.Linear(4, 2), layout="ddp")
    session.step_batches(Numbered(), micro_batch=4, global_batch=32)
    try:  # DDP's batches give each rank its own half; TP needs both ranks to read the same samples
        session.prepare_model(MLPLM(), layout="tp", tp_plan=MLPLM.tp_plan)
    except ConfigError as exc:
        out["relayout"] = str(exc)
    session.close()
    return out


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_tp_ranks_read_the_same_samples_and_a_layout_after_step_batches_that_splits_otherwise_is_refused():
    rank0, rank1 = run_distributed(tp_batch_order, 2, init_pg=False)
    for result in (rank0, rank1):
        assert "\n" not in result.get("wrong_order", "not refused\n")
        assert re.match(ORDER_ERROR.format("no layout yet: every rank a data-parallel one"), result["wrong_order"])
        # the right order: one data-parallel rank, so 32 = 4 x 1 x 8, and both TP ranks read every sample
        assert result["grad_accum"] == 8
        assert re.match(ORDER_ERROR.format("DDP"), result["relayout"]), result["relayout"]
    assert rank0["samples"] == rank1["samples"]
    assert all(len({i for micro in step for i in micro}) == 32 for step in rank0["samples"])
