"""parallel.ddp_batched_copy: DDP copies each full bucket's gradients into it with one ``_foreach_copy_`` and one
division, not one kernel per parameter as each gradient arrives (torch's ``batched_grad_copy``).

On 2 gloo ranks the trainer's DDP engine trains 10 steps of the tiny model with and without it, from the same
weights and batches, in fp32 and in bf16 with the linear layers' bf16 copies as DDP's parameters (the GPU default):
dividing by a world size of 2 is exact whether each gradient is scaled as it is copied or the bucket is divided once,
so the losses, gradient norms and final weights are bitwise equal. ``auto`` leaves it off (not measured on GPUs
yet), and ``true`` is refused, naming the option, where torch's DDP lacks it.
"""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed
from meshrun.comm.mesh import ParallelDims
from meshrun.config import ConfigError, load_config
from meshrun.models.gpt import gpt_config
from meshrun.models.spec import get_model_spec
from meshrun.parallel import checks
from meshrun.parallel.checks import check_layout, ddp_batches_copies

MISSING = "this torch's DistributedDataParallel has no batched_grad_copy"


def _worker(rank: int, world_size: int, initial: dict) -> dict:
    from test_parallel_layouts import build, full_state, load_full, model_config, train

    out = {}
    for dtype in ("fp32", "bf16"):
        extra = {"dtype": "bf16", "weight_copies": "true"} if dtype == "bf16" else {"dtype": "fp32"}
        for batched in ("false", "true", "auto"):
            _, engine = build(model_config(tied=True), {"dp_replicate": 2, "ddp_batched_copy": batched}, grad_accum=1,
                              train=extra, compute_dtype=torch.bfloat16 if dtype == "bf16" else None)
            load_full(engine, initial)
            result = train(engine, grad_accum=1)
            out[(dtype, batched)] = result | {"batched": engine.step.batched_grad_copy, "state": full_state(engine)}
    return out


@pytest.mark.slow
@pytest.mark.skipif(not ddp_batches_copies(), reason=MISSING)
def test_batched_copies_train_bitwise_like_per_parameter_copies():
    from test_parallel_layouts import model_config
    from meshrun.models.gpt import GPT

    torch.manual_seed(0)
    model = GPT(model_config(tied=True))
    model.init_weights()
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for result in run_distributed(_worker, 2, initial, timeout=300):
        for dtype in ("fp32", "bf16"):
            plain, batched, auto = (result[(dtype, b)] for b in ("false", "true", "auto"))
            assert batched["batched"] and not plain["batched"] and not auto["batched"], "auto: off until measured"
            moved = max(float((plain["state"][k] - v).abs().max()) for k, v in initial.items() if k in plain["state"])
            assert moved > 1e-2, "the weights moved"
            assert batched["losses"] == plain["losses"] and batched["norms"] == plain["norms"], dtype
            assert batched["val"] == plain["val"], dtype
            for name, tensor in plain["state"].items():
                assert torch.equal(batched["state"][name], tensor), (dtype, name)


def test_true_is_refused_where_torch_lacks_it(monkeypatch):
    job = load_config(None, ["--model.name=tiny", "--parallel.ddp_batched_copy=true"])
    spec, shape = get_model_spec("gpt"), gpt_config("tiny")
    dims = ParallelDims.from_config(job.parallel, world_size=2)
    monkeypatch.setattr(checks, "ddp_batches_copies", lambda: False)
    with pytest.raises(ConfigError) as refused:
        check_layout(job, spec, shape, dims, device=torch.device("cpu"), compute_dtype=None)
    assert str(refused.value).startswith("parallel.ddp_batched_copy=true needs the batched_grad_copy")
    assert "drop --parallel.ddp_batched_copy" in str(refused.value)
    monkeypatch.setattr(checks, "ddp_batches_copies", lambda: True)
    check_layout(job, spec, shape, dims, device=torch.device("cpu"), compute_dtype=None)
    with pytest.raises(ConfigError, match="parallel.ddp_batched_copy"):
        load_config(None, ["--parallel.ddp_batched_copy=sometimes"])
