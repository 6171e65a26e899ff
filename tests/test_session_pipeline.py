"""Session.prepare_model(layout="pp") pipelines a user's model (tests/mlp_lm.py, not the built-in GPT) exactly
like one process trains it (CPU, gloo, fp32), and its checkpoints resume at the same layout and in one process.

MLPLM (3 MLP blocks in an nn.ModuleList: stage 0 holds embeddings and blocks 0-1, stage 1 block 2, norm and head)
trains for 6 AdamW steps (lr 1e-2) on batches of 8 random sequences of 16 tokens, 1F1B over 4 micro-batches, from
the weights one process builds with the same seed. The reference is plain PyTorch in this process. Tolerances are
those of the GPT pipeline layout tests (tests/test_parallel_layouts.py): loss per step atol 1e-5, every final
parameter atol 1e-4 (one AdamW step moves a parameter by up to 1e-2, so a lost gradient, a wrong micro-batch scale
or a stage trained on the wrong activations is far outside). AdamW's eps is 1e-6, not 1e-8: with 1e-8 one hidden
unit whose gradients are near zero turned the rounding of micro-batch sums into a 3e-4 difference (m / sqrt(v)
amplifies it); with 1e-6 the largest difference seen is 1e-5. The same spawn saves at step 3 and resumes into a
fresh pipelined model, which must continue bit for bit; last, a model whose forward does not skip the modules a
stage lacks gets an error saying so.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dist_utils import run_distributed
from mlp_lm import MLPLM
from meshrun.config import ConfigError

STEPS, SAVE_AT, BATCH, SEQ, VOCAB = 6, 3, 8, 16, 64
LOSS_ATOL, PARAM_ATOL = 1e-5, 1e-4
EPS = 1e-6  # AdamW eps: see the module docstring
pytestmark = pytest.mark.timeout(300)


def step_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(700 + step % 2))
    return tokens[:, :-1], tokens[:, 1:]


def reference() -> tuple[list[float], dict[str, torch.Tensor], float]:
    """Plain PyTorch, one process: the model Session(seed=0) would build, trained on the whole batch."""
    torch.manual_seed(0)
    model = MLPLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=EPS)
    losses = []
    for step in range(STEPS):
        inputs, targets = step_batch(step)
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():
        val = F.cross_entropy(model(step_batch(99)[0]).flatten(0, 1), step_batch(99)[1].flatten()).item()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, val


def train(pipe, optimizer, steps: range) -> list[float | None]:
    losses = []
    for step in steps:
        loss = pipe.step(*step_batch(step))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(None if loss is None else loss.item())
    return losses


def params(pipe) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for part in pipe.parts for n, p in part.named_parameters()}


def pipelined(rank: int, world_size: int, ckpt: str) -> dict:
    from meshrun import PipelineOptions, Session

    session = Session(seed=0, checkpoint=ckpt)
    pipe = session.prepare_model(MLPLM(), layout="pp", pipeline=PipelineOptions(microbatches=4))
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2, eps=EPS, foreach=True)
    losses = train(pipe, optimizer, range(SAVE_AT))
    session.save(SAVE_AT, model=pipe, optimizer=optimizer)
    saved = params(pipe)
    losses += train(pipe, optimizer, range(SAVE_AT, STEPS))
    val = pipe.evaluate(*step_batch(99))
    out = {"losses": losses, "params": params(pipe), "saved": saved, "val": None if val is None else val.item(),
           "blocks": sorted({n.split(".")[1] for n in saved if n.startswith("blocks.")})}
    fresh = session.prepare_model(MLPLM(), layout="pp", pipeline=PipelineOptions(microbatches=4))
    optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2, eps=EPS, foreach=True)
    out["resumed_step"] = session.resume(model=fresh, optimizer=optimizer)
    out["resumed_losses"] = train(fresh, optimizer, range(SAVE_AT, STEPS))
    out["resumed_params"] = params(fresh)
    out["unaware"] = step_error(session)  # last: it breaks the pipeline's connections
    session.close()
    return out


class Unaware(MLPLM):
    """A forward that does not skip what a stage lacks (the first stage has no head)."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def step_error(session) -> str:
    pipe = session.prepare_model(Unaware(), layout="pp")
    try:
        pipe.step(*step_batch(0))
    except Exception as exc:  # noqa: BLE001 - the test reads its first line
        return f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    return "no error"


@pytest.fixture(scope="module")
def ref():
    return reference()


@pytest.fixture(scope="module")
def two_stages(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("pp_ckpt"))
    return run_distributed(pipelined, 2, ckpt, init_pg=False), ckpt


@pytest.mark.slow
def test_pp2_matches_one_process(two_stages, ref):
    (first, last), _ = two_stages
    ref_losses, ref_params, ref_val = ref
    assert first["losses"] == [None] * STEPS and first["val"] is None  # the loss lives on the last stage
    assert last["losses"] == pytest.approx(ref_losses, abs=LOSS_ATOL)
    assert ref_losses[-1] < ref_losses[0] - 0.05  # it trained
    assert last["val"] == pytest.approx(ref_val, abs=LOSS_ATOL)
    assert (first["blocks"], last["blocks"]) == (["0", "1"], ["2"])
    assert not set(first["params"]) & set(last["params"])  # each parameter on one stage only
    assert set(first["params"]) | set(last["params"]) == set(ref_params)
    for name, value in ref_params.items():
        got = first["params"].get(name, last["params"].get(name))
        torch.testing.assert_close(got, value, atol=PARAM_ATOL, rtol=0, msg=name)


@pytest.mark.slow
def test_pp2_checkpoint_resumes_bitwise_at_the_same_layout(two_stages):
    for rank in two_stages[0]:
        assert rank["resumed_step"] == SAVE_AT
        assert rank["resumed_losses"] == rank["losses"][SAVE_AT:]
        for name, value in rank["params"].items():
            assert torch.equal(rank["resumed_params"][name], value), name


@pytest.mark.slow
def test_a_forward_that_calls_a_missing_module_is_explained(two_stages):
    first = two_stages[0][0]["unaware"]
    assert first.startswith("ConfigError: layout='pp': Unaware.forward called a module") and "skip None" in first


@pytest.mark.slow
def test_pp2_checkpoint_resumes_in_one_process(two_stages):
    from meshrun import Session

    (first, last), ckpt = two_stages
    session = Session(seed=5, checkpoint=ckpt)
    pipe = session.prepare_model(MLPLM(), layout="pp")  # one process: step() runs the whole model
    assert session.resume(model=pipe) == SAVE_AT
    session.close()
    for name, value in params(pipe).items():
        assert torch.equal(value, first["saved"].get(name, last["saved"].get(name))), name


# ---- errors that name the option (no process group) ----------------------------------------------------------------

class NoBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)


class LooseParameter(MLPLM):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))


class Tied(MLPLM):
    def __init__(self):
        super().__init__(dim=32)
        self.head = nn.Linear(32, 64, bias=False)
        self.head.weight = self.embed.weight


@pytest.mark.parametrize("model,kwargs,names", [
    (NoBlocks(), {}, "blocks="),
    (MLPLM(layers=3), {"pp": 4, "world_size": 4}, "pp=4"),
    (MLPLM(), {"blocks": "head"}, "blocks='head'"),
    (LooseParameter(), {}, "LooseParameter.scale"),
    (Tied(), {}, "head.weight"),
    (MLPLM(), {"microbatches": 1}, "PipelineOptions.microbatches=1"),
    (MLPLM(), {"schedule": "zigzag"}, "PipelineOptions.schedule"),
])
def test_a_model_or_option_that_cannot_be_pipelined_is_named(model, kwargs, names):
    from meshrun.parallel.module import find_blocks
    from meshrun.parallel.module_pipeline import PipelineOptions, pipeline_dims, stage_spec

    options = PipelineOptions(**{k: kwargs.pop(k) for k in ("microbatches", "schedule") if k in kwargs})
    with pytest.raises(ConfigError) as err:
        dims = pipeline_dims("pp", options, world_size=kwargs.pop("world_size", 2), nodes=1, pp=kwargs.pop("pp", 0))
        stage_spec(model, kwargs.get("blocks", find_blocks(model)), options, dims=dims)
    assert names in str(err.value).splitlines()[0]


def test_pipeline_layout_words_mean_these_degrees():
    from meshrun.parallel.module import layout_dims

    def degrees(layout, **kw):
        d = layout_dims(layout, world_size=4, **kw)
        return d.pp, d.dp_replicate, d.dp_shard, d.tp

    assert degrees("pp") == (4, 1, 1, 1)
    assert degrees("pp", pp=2) == (2, 2, 1, 1)  # the ranks left over replicate each stage
    assert degrees("pp+fsdp") == (2, 1, 2, 1)  # ... or shard it
    with pytest.raises(ConfigError, match="pp=2 needs layout='pp' or 'pp\\+fsdp', not 'fsdp'"):
        layout_dims("fsdp", world_size=4, pp=2)
    with pytest.raises(ConfigError, match="pp=3 does not divide the world size 4"):
        layout_dims("pp", world_size=4, pp=3)
