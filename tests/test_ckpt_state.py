"""The Stateful helpers: bitwise round trips, RNG continuity, pipeline-style model parts. One process."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch
from test_ckpt_support import Job, assert_same, checkpointer, rng_draws

from meshrun.ckpt.state import ModelOptimState, RNGState, from_json_blob, json_blob
from meshrun.env import ProcessPlacement
from meshrun.models.gpt import GPT, SIZES

ENV = ProcessPlacement.detect({})


def test_json_blob_round_trip():
    value = {"lr": 1e-3, "betas": [0.9, 0.95], "name": "cosine é", "none": None, "inf": float("inf")}
    blob = json_blob(value, what="x")
    assert blob.dtype == torch.uint8 and blob.dim() == 1
    assert from_json_blob(blob) == value
    with pytest.raises(TypeError, match="scheduler: cannot be stored"):
        json_blob({"f": object()}, what="scheduler")


def test_round_trip_is_bitwise(tmp_path):
    job = Job(ENV, seed=0)
    job.train(3, data_seed=1)
    ckpt = checkpointer(tmp_path, ENV)
    ckpt.save(3, job.state, meta={"epoch": 0})
    saved, lr, draws = job.snapshot(), job.sched.get_last_lr(), rng_draws()
    counters, metrics = dataclasses.replace(job.counters), dict(job.metrics)

    job.train(2, data_seed=2)
    assert ckpt.load(job.state)["step"] == 3
    assert_same(job.snapshot(), saved)
    assert rng_draws() == draws
    assert job.counters == counters and job.metrics == metrics and job.sched.get_last_lr() == lr
    assert isinstance(job.opt.param_groups[0]["betas"], tuple), "hyperparameters come back with their types"
    # and training goes on exactly as it would have: same state, same next step
    other = Job(ENV, seed=0)
    other.train(3, data_seed=1)
    job.train(1, data_seed=9)
    other.train(1, data_seed=9)
    assert_same(job.snapshot(), other.snapshot())


def test_dropout_stream_continues_after_restore(tmp_path):
    """RNG continuity: the masks drawn after a restore are the ones the uninterrupted run drew."""
    job = Job(ENV, seed=0, dropout=0.5)
    job.train(1, data_seed=1)
    ckpt = checkpointer(tmp_path, ENV)
    ckpt.save(1, job.state)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    job.model.train()
    with torch.no_grad():
        uninterrupted = [job.model(tokens) for _ in range(3)]
    torch.manual_seed(999)
    random.seed(999)
    np.random.seed(999)
    ckpt.load(job.state)
    with torch.no_grad():
        resumed = [job.model(tokens) for _ in range(3)]
    assert not torch.equal(uninterrupted[0], uninterrupted[1]), "dropout is active"
    for a, b in zip(uninterrupted, resumed):
        assert torch.equal(a, b)


def test_missing_rng_stream_reseeds_deterministically():
    rng = RNGState(ProcessPlacement(rank=3, local_rank=3, world_size=4, local_world_size=4, node_rank=0, num_nodes=1,
                              master_addr="127.0.0.1", master_port=1, source="torchrun"), seed=7)
    rng.load_state_dict({})
    first = rng_draws()
    rng.load_state_dict({})
    assert rng.reseeded and rng_draws() == first
    torch.manual_seed(7 + 3)
    assert torch.rand(4).tolist() != first[0], "not the stream a fresh run's seed + rank gives"


def _untied() -> GPT:
    torch.manual_seed(0)
    return GPT(dataclasses.replace(SIZES["tiny"], tie_embeddings=False))


def _stages(whole: GPT) -> list[GPT]:
    """Two pipeline-stage copies of ``whole`` keeping the original parameter names (layers 0 | layer 1 + head)."""
    first, second = _untied(), _untied()
    first.load_state_dict(whole.state_dict())
    second.load_state_dict(whole.state_dict())
    del first.layers["1"]
    first.norm = first.output = None
    del second.layers["0"]
    second.tok_embeddings = None
    return [first, second]


def _step(parts: list[GPT], optimizers: list[torch.optim.Optimizer]) -> None:
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))
    hidden = tokens
    for part in parts:
        hidden = part(hidden)
    hidden.float().square().mean().backward()
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad()


def test_pipeline_parts_reshard_to_one_part_and_back(tmp_path):
    whole = _untied()
    parts = _stages(whole)
    optimizers = [torch.optim.AdamW(p.parameters(), lr=1e-2) for p in parts]
    _step(parts, optimizers)
    checkpointer(tmp_path, ENV).save(1, {"model_optim": ModelOptimState(parts, optimizers)})

    merged = ModelOptimState([whole], [torch.optim.AdamW(whole.parameters(), lr=1e-2)])
    checkpointer(tmp_path, ENV).load({"model_optim": merged})
    expected = {**parts[0].state_dict(), **parts[1].state_dict()}
    assert_same(dict(whole.state_dict()), expected)
    # one optimizer step later, the whole model matches the two stages stepping on their own
    _step(parts, optimizers)
    _step([whole], merged.optimizers)
    assert_same(dict(whole.state_dict()), {**parts[0].state_dict(), **parts[1].state_dict()})

    checkpointer(tmp_path / "back", ENV).save(2, {"model_optim": merged})
    again = _stages(_untied())
    again_opts = [torch.optim.AdamW(p.parameters(), lr=1e-2) for p in again]
    checkpointer(tmp_path / "back", ENV).load({"model_optim": ModelOptimState(again, again_opts)})
    for restored, original in zip(again, parts):
        assert_same(dict(restored.state_dict()), dict(original.state_dict()))


def test_one_optimizer_over_several_parts(tmp_path):
    """The trainer's shape: one optimizer over all local stages; FQNs stay the model's own."""
    whole = _untied()
    parts = _stages(whole)
    optimizer = torch.optim.AdamW([p for part in parts for p in part.parameters()], lr=1e-2)
    _step(parts, [optimizer])
    state = ModelOptimState(parts, [optimizer])
    keys = set(state.state_dict()["model"])
    assert keys == set(whole.state_dict()), "original names, e.g. layers.1.* from the second stage"
    checkpointer(tmp_path, ENV).save(1, {"model_optim": state})
    merged = ModelOptimState([whole], [torch.optim.AdamW(whole.parameters(), lr=1e-2)])
    checkpointer(tmp_path, ENV).load({"model_optim": merged})
    _step(parts, [optimizer])
    _step([whole], merged.optimizers)
    assert_same(dict(whole.state_dict()), {**parts[0].state_dict(), **parts[1].state_dict()})


def test_optimizer_count_must_match_parts():
    linears = [torch.nn.Linear(2, 2) for _ in range(3)]
    with pytest.raises(ValueError, match="3 model parts and 2 optimizers"):
        ModelOptimState(linears, [torch.optim.SGD(linears[0].parameters(), lr=1),
                                  torch.optim.SGD(linears[1].parameters(), lr=1)])
