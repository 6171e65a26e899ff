"""The loss hooks of the model contract, and the generic layers (parallel/, comm/) with a model that is not the GPT.

A model with an auxiliary loss term (an MoE router's load-balancing loss stands behind ``ModelSpec.aux_loss``) gets
it added to its gradients, by the one-process engine and by the sharded engine, while the logged loss stays the
cross-entropy; ``train.loss=chunked`` finds the head through ``hidden_states`` / ``head_weight``. Compared with a
reference computed by hand on a copy of the same weights, in one process.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import meshrun
from meshrun.comm.mesh import ParallelDims
from meshrun.config import ConfigError, load_config
from meshrun.models.shape import ModelShape
from meshrun.models.spec import ModelSpec, ModelStructure, register_model
from meshrun.parallel.apply import build_engine, check_chunked_loss
from meshrun.parallel.pipeline import split_stage
from meshrun.parallel.sharded import ShardedEngine
from mlp_lm import MLPLM, build_from_shape

CPU = torch.device("cpu")
AUX_WEIGHT = 0.05
TINY = ModelShape(dim=32, n_layers=3, n_heads=1, vocab_size=64, seq_len=16, ffn_dim=64)


class RoutedMLPLM(MLPLM):
    """MLPLM with a head without bias and a stand-in for a router's load-balancing loss: each forward records
    ``AUX_WEIGHT x`` the mean square of the blocks' outputs, a term that depends on every block's weights."""

    def __init__(self, shape: ModelShape):
        super().__init__(vocab=shape.vocab_size, dim=shape.dim, hidden=shape.hidden_dim, layers=shape.n_layers,
                         seq=shape.seq_len)
        self.head = nn.Linear(shape.dim, shape.vocab_size, bias=False)
        self.router_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, head: bool = True) -> torch.Tensor:
        h = self.embed(x) + self.pos(torch.arange(x.shape[1], device=x.device))  # (B, T, C)
        aux = h.new_zeros(())
        for block in self.blocks:
            h = block(h)
            aux = aux + h.pow(2).mean()
        self.router_loss = AUX_WEIGHT * aux / len(self.blocks)
        h = self.norm(h)
        return self.head(h) if head else h  # (B, T, V) or (B, T, C)


SPEC = register_model(ModelSpec(
    arch="routed_mlp_lm", build=RoutedMLPLM, sizes={"tiny": TINY}, blocks="blocks",
    first_stage=("embed", "pos"), last_stage=("norm", "head"), tp_plan=MLPLM.tp_plan,
    hidden_states=lambda model, tokens: model(tokens, head=False), head_weight=lambda model: model.head.weight,
    aux_loss=lambda model: model.router_loss, tp_checks=lambda m: [("model.ffn_dim (MLP width)", m.hidden_dim)]),
    replace=True)


def batches(n: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    tokens = torch.randint(0, TINY.vocab_size, (n, 4, TINY.seq_len + 1), generator=torch.Generator().manual_seed(3))
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def reference(model: nn.Module, steps: list[tuple[torch.Tensor, torch.Tensor]], *, aux: bool):
    """Gradients of the mean over micro-batches of (mean token cross-entropy + the router term), and the summed
    cross-entropy."""
    model = copy.deepcopy(model)
    model.zero_grad(set_to_none=True)
    logged = 0.0
    for inputs, targets in steps:
        logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        logged += float(loss.detach()) * targets.numel()
        ((loss + (model.router_loss if aux else 0.0)) / len(steps)).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, logged


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("loss", ["full", "chunked"])
def test_the_one_process_engine_adds_the_auxiliary_term_to_the_gradients(loss):
    job = load_config(None, ["--model.arch=routed_mlp_lm", "--model.name=tiny", "--train.micro_batch=4",
                             "--train.grad_accum=2", "--train.seed=5", f"--train.loss={loss}",
                             "--train.compile=false"])
    dims = ParallelDims(dp_replicate=1, dp_shard=1, tp=1, pp=1, world_size=1)
    engine = build_engine(job=job, model_cfg=TINY, dims=dims, mesh=None, device=CPU, compute_dtype=None)
    model = engine.model_parts[0]
    assert isinstance(model, RoutedMLPLM)
    steps = batches()
    want, logged = reference(model, steps, aux=True)
    without, _ = reference(model, steps, aux=False)
    loss_sum, tokens = engine.forward_backward(steps)
    assert_close(grads(model), want)
    assert not torch.allclose(want["blocks.0.up.weight"], without["blocks.0.up.weight"], rtol=1e-3)  # the term counts
    assert float(loss_sum) == pytest.approx(logged, rel=1e-5) and int(tokens) == 2 * 4 * TINY.seq_len  # cross-entropy


def test_the_sharded_engine_adds_the_auxiliary_term_to_the_gradients():
    torch.manual_seed(0)
    model = RoutedMLPLM(TINY)
    steps = batches()
    want, logged = reference(model, steps, aux=True)
    engine = ShardedEngine(model, dp_rank=0, dp_size=1, reports_loss=True, fsdp=False, loss_parallel=False,
                           autocast_dtype=None, aux_loss=SPEC.aux_loss)
    loss_sum, _ = engine.forward_backward(steps)
    assert_close(grads(model), want)
    assert float(loss_sum) == pytest.approx(logged, rel=1e-5)


def test_layouts_refuse_what_the_model_does_not_give():
    dims = ParallelDims(dp_replicate=1, dp_shard=1, tp=1, pp=2, world_size=2)
    with pytest.raises(ConfigError, match=r"^parallel.pp=2: model.arch='routed_mlp_lm' has an auxiliary loss term"):
        dims.validate_model(TINY, SPEC)
    plain = ModelSpec(arch="no_hooks", build=build_from_shape, sizes={"tiny": TINY}, blocks="blocks")
    with pytest.raises(ConfigError, match=r"^parallel.tp=2: model.arch='no_hooks' has no tensor-parallel plan"):
        ParallelDims(dp_replicate=1, dp_shard=1, tp=2, pp=1, world_size=2).validate_model(TINY, plain)
    local = ParallelDims(dp_replicate=1, dp_shard=1, tp=1, pp=1, world_size=1)
    with pytest.raises(ConfigError, match=r"^train.loss=chunked: model.arch='no_hooks' does not give its output "
                       r"head's input and weight \(ModelSpec.hidden_states, head_weight\)"):
        check_chunked_loss("chunked", plain, dims=local, local=True)
    check_chunked_loss("chunked", SPEC, dims=local, local=True)
    with pytest.raises(ValueError, match=r"model= needs spec="):
        ParallelDims.from_config(load_config(None, []).parallel, world_size=1, model=TINY)


def test_stage_splitting_follows_the_structure_of_a_model_that_is_not_the_gpt():
    with torch.device("meta"):
        whole = RoutedMLPLM(TINY)  # blocks in an nn.ModuleList: other stages' slots become None
    first, last = (split_stage(whole, s, 2, spec=SPEC) for s in range(2))
    assert [b is not None for b in first.blocks] == [True, True, False]
    assert [b is not None for b in last.blocks] == [False, False, True]
    assert first.head is None and first.norm is None and first.embed is not None
    assert last.embed is None and last.pos is None and last.head is not None
    structure = ModelStructure(blocks="blocks")  # Session's description of a built model: no first/last stage
    middle = split_stage(whole, 1, 3, spec=structure)
    assert middle.embed is not None and [b is not None for b in middle.blocks] == [False, True, False]


def test_nothing_in_parallel_or_comm_names_a_model():
    src = Path(meshrun.__file__).parent
    files = [path for folder in ("parallel", "comm") for path in sorted((src / folder).glob("*.py"))]
    named = [f"{path.relative_to(src)}:{i}" for path in files
             for i, line in enumerate(path.read_text().splitlines(), 1) if re.search(r"gpt", line, re.IGNORECASE)]
    assert named == []


def test_the_auxiliary_term_joins_a_vocabulary_parallel_loss():
    """Under TP's loss_parallel the token-loss sum is a replicated DTensor: the plain auxiliary term is lifted onto
    its mesh (one process, a 1-rank gloo group; the placement logic is the same at any size)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    from meshrun.parallel.engine import with_aux_loss

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        logit = torch.tensor(2.0, requires_grad=True)
        weight = torch.tensor(3.0, requires_grad=True)
        summed = DTensor.from_local(logit * 5.0, mesh, [Replicate()])
        out = with_aux_loss(summed, weight * 0.5, tokens=4)
        assert isinstance(out, DTensor) and float(out.full_tensor().detach()) == 10.0  # the value stays the loss sum
        out.full_tensor().backward()
        assert float(logit.grad) == 5.0 and float(weight.grad) == 0.5 * 4  # d/d(aux) = tokens
    finally:
        dist.destroy_process_group()
