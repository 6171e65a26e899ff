"""Tied weights through the layouts, without a process group: what is recorded, re-shared and refused up front.

The layouts' parity with one process on a tied model is in tests/test_session_layouts.py (DDP, FSDP, HSDP, TP and
TP x FSDP on 2 and 4 gloo ranks). Here: a tie is found, survives to_empty, and is refused with one line naming both
parameters where it cannot hold (two FSDP2 units, two pipeline stages); a tensor-parallel plan naming a module TP
cannot split is refused before any process group is needed.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from meshrun.config import ConfigError
from meshrun.models.spec import ModelStructure
from meshrun.parallel.module import layout_dims, layout_note, prepare_module
from meshrun.parallel.module_pipeline import check_stage_ties, prepare_pipeline
from meshrun.parallel.tied import find_shared
from mlp_lm import MLPLM

CPU = torch.device("cpu")


def test_find_shared_groups_the_names_of_one_tensor():
    assert find_shared(MLPLM(tied=True)).groups == (("embed.weight", "head.weight"),)
    assert not find_shared(MLPLM())


def test_restore_reties_what_to_empty_untied():
    with torch.device("meta"):
        model = MLPLM(tied=True)
    shared = find_shared(model)
    model.to_empty(device=CPU)
    shared.restore(model, layout="layout='fsdp'", after="to_empty")
    assert model.head.weight is model.embed.weight
    assert find_shared(model) == shared


def test_restore_refuses_two_halves_it_cannot_share():
    model = MLPLM(tied=True)
    shared = find_shared(model)
    model.head.weight = nn.Parameter(torch.zeros(64, 16))  # placed differently: another shape
    with pytest.raises(ConfigError) as info:
        shared.restore(model, layout="layout='tp'", after="tensor parallelism")
    message = str(info.value)
    assert message.startswith("layout='tp': embed.weight and head.weight are one tied parameter, but after tensor "
                              "parallelism they are two (embed.weight: tensor (64, 32) on cpu; head.weight: tensor "
                              "(64, 16) on cpu)")
    assert "\n" not in message


def shared_blocks(a: int, b: int, layers: int = 4) -> MLPLM:
    """An MLPLM whose blocks ``a`` and ``b`` share their up projection."""
    model = MLPLM(layers=layers)
    model.blocks[b].up.weight = model.blocks[a].up.weight
    return model


def test_a_tie_across_fsdp_units_is_refused_before_sharding():
    model = shared_blocks(0, 2)
    units = [[block] for block in model.blocks]
    with pytest.raises(ConfigError, match=r"^layout='fsdp': blocks\.0\.up\.weight and blocks\.2\.up\.weight are one "
                       r"tied parameter, but FSDP2 unit 0 \(blocks\.0\) and unit 2 \(blocks\.2\) would each hold its "
                       r"own copy .*pass blocks=''"):
        find_shared(model).check_units(model, units, layout="layout='fsdp'")
    find_shared(model).check_units(model, [list(model.blocks)], layout="layout='fsdp'")  # one unit: fine
    tied = MLPLM(tied=True)  # the embedding and the head are both in the root unit
    find_shared(tied).check_units(tied, [[block] for block in tied.blocks], layout="layout='fsdp'")


@pytest.mark.parametrize("layout", ["pp", "pp+fsdp"])
def test_pipelines_refuse_a_tie_across_stages_before_any_collective(layout):
    with pytest.raises(ConfigError, match=rf"^layout='{re.escape(layout)}': embed\.weight and head\.weight are one "
                       r"tied parameter, but pipeline stages 0 and 1 would each hold its own copy .*untie them"):
        prepare_pipeline(MLPLM(tied=True), layout, device=CPU, world_size=2, pp=2)


def test_a_tie_within_one_pipeline_stage_is_kept():
    spec = ModelStructure(blocks="blocks", first_stage=("embed", "pos"), last_stage=("norm", "head"))
    check_stage_ties(shared_blocks(0, 1), spec, stages=2, layout="pp")  # blocks 0-1 on stage 0, 2-3 on stage 1
    with pytest.raises(ConfigError, match=r"blocks\.0\.up\.weight and blocks\.3\.up\.weight .* stages 0 and 1"):
        check_stage_ties(shared_blocks(0, 3), spec, stages=2, layout="pp")


class Conv1D(nn.Module):
    """transformers.pytorch_utils.Conv1D (GPT-2's projections): a linear layer with its weight stored (in, out)."""

    def __init__(self, nf: int, nx: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02)
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], -1)


def test_a_tp_plan_naming_a_module_tp_cannot_split_is_refused_up_front():
    model = MLPLM()
    for block in model.blocks:
        block.up = Conv1D(64, 32)
    # world_size=2 with no process group: the plan is checked before the mesh is built
    with pytest.raises(ConfigError) as info:
        prepare_module(model, "tp", device=CPU, world_size=2)
    message = str(info.value)
    assert message.startswith("tensor-parallel plan entry 'blocks.*.up': blocks.0.up is a "
                              "test_tied_weights.Conv1D, which ColwiseParallel cannot split; colwise and rowwise "
                              "plans split nn.Linear and nn.Embedding modules only. Convert blocks.0.up to nn.Linear")
    assert message.endswith("or leave it out of the plan") and "weight = conv.weight.T" in message


def test_hsdp_note_says_what_the_layout_ran_as():
    one_node = layout_dims("hsdp", world_size=8, nodes=1)
    assert layout_note("hsdp", one_node, nodes=1).startswith("layout='hsdp' on one node runs plain FSDP over 8 ranks")
    no_shards = layout_dims("hsdp", world_size=2, nodes=1, dp_replicate=2)
    assert "runs DDP" in layout_note("hsdp", no_shards, nodes=1)
    assert layout_note("hsdp", layout_dims("hsdp", world_size=8, nodes=2), nodes=2) == ""
    assert layout_note("fsdp", layout_dims("fsdp", world_size=8), nodes=1) == ""


# ---- Hugging Face models (where transformers is installed: pip install -e ".[hf]") ----------------------------------

def tied_qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                         attn_implementation="sdpa")
    return Qwen2ForCausalLM(config)


def qwen2_plan(model, *, embedding: bool) -> dict[str, str]:
    """The model's own plan under ``model.``, the head split by vocabulary rows and, with ``embedding``, the
    embedding too (both Shard(0): one DTensor)."""
    plan = {f"model.{k}": v for k, v in model.config.base_model_tp_plan.items()} | {"lm_head": "colwise_rep"}
    return plan | ({"model.embed_tokens": "embedding_rowwise"} if embedding else {})


def train_qwen2(rank: int, world_size: int) -> dict:
    """4 AdamW steps of a tied Qwen2 on one batch; TP over every rank, or one process (world_size 1)."""
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor

    from meshrun import Session

    session = Session(seed=0)
    model = tied_qwen2()
    out: dict = {}
    if world_size > 1:
        try:
            session.prepare_model(tied_qwen2(), layout="tp", tp_plan=qwen2_plan(model, embedding=False))
        except ConfigError as exc:
            out["refused"] = str(exc)
        model = session.prepare_model(model, layout="tp", tp_plan=qwen2_plan(model, embedding=True))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(4):
        logits = model(tokens[:, :-1]).logits  # (B, T, V)
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    out["tied"] = model.lm_head.weight is model.model.embed_tokens.weight
    out["losses"] = losses
    out["params"] = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                     for n, p in model.named_parameters(remove_duplicate=False)}
    return out


@pytest.mark.slow
def test_a_tied_qwen2_under_tp_trains_like_one_process():
    pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")
    from dist_utils import run_distributed

    ref = train_qwen2(0, 1)
    got = run_distributed(train_qwen2, 2, init_pg=False)[0]
    assert got["refused"].startswith("layout='tp': model.embed_tokens.weight and lm_head.weight are one tied "
                                     "parameter, but after tensor parallelism they are two")
    assert got["tied"] and ref["tied"]
    assert got["losses"] == pytest.approx(ref["losses"], abs=1e-5)
    assert ref["losses"][-1] < ref["losses"][0] - 0.05
    assert {"lm_head.weight", "model.embed_tokens.weight"} <= set(got["params"])
    for name, value in ref["params"].items():
        torch.testing.assert_close(got["params"][name], value, atol=1e-4, rtol=0, msg=name)


def test_gpt2_conv1d_in_a_tp_plan_is_refused_up_front():
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    with pytest.raises(ConfigError, match=r"^tensor-parallel plan entry 'transformer\.h\.\*\.mlp\.c_fc': "
                       r"transformer\.h\.0\.mlp\.c_fc is a transformers\.pytorch_utils\.Conv1D, which ColwiseParallel "
                       r"cannot split; .*Convert transformer\.h\.0\.mlp\.c_fc to nn\.Linear"):
        prepare_module(model, "tp", device=CPU, world_size=2, tp_plan={"transformer.h.*.mlp.c_fc": "colwise"})
