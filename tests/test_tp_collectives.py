"""The GPT's tensor-parallel plan issues the collectives Megatron-style TP needs and no more (2 gloo ranks, torch's
CommDebugMode around one forward and backward with the loss on vocabulary-sharded logits).

Per block, without sequence parallelism: 2 all-reduces forward (after the attention's and the MLP's row-parallel
projections) and 2 backward (the gradient of each sub-layer's input, summed over the projections that read it:
q, k and v; gate and up). With sequence parallelism: 2 all-gathers and 2 reduce-scatters each way. Counting a
1-block and a 2-block model, the difference is one block's collectives, whatever the embedding, head and loss add.
Before the plan prepared each sub-layer's input once, every column-parallel projection all-reduced its own input
gradient: 5 all-reduces per block backward instead of 2.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from torch.utils._python_dispatch import TorchDispatchMode

from dist_utils import each_run, results_of, run_distributed


def _tp_steps(world_size: int, sequence_parallel: bool, make_mode, read, bf16: bool = False) -> dict:
    """One forward and backward of a 1-block and a 2-block GPT under TP, each inside a fresh ``make_mode()``; returns
    ``{blocks: read(mode)}``."""
    import contextlib

    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from meshrun.models.gpt import GPT, SIZES
    from meshrun.models.gpt_spec import gpt_tp_plan
    from meshrun.parallel.tp import apply_tp

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    out = {}
    for blocks in (1, 2):
        torch.manual_seed(0)
        cfg = replace(SIZES["tiny"], n_layers=blocks, tie_embeddings=False)
        model = GPT(cfg)
        apply_tp(model, gpt_tp_plan, mesh, sequence_parallel=sequence_parallel, loss_parallel=True)
        tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
        mode = make_mode()
        with mode, loss_parallel():
            with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
                logits = model(tokens)
            F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten()).backward()
        out[blocks] = read(mode)
    return out


def _count_worker(rank: int, world_size: int, sequence_parallel: bool) -> dict[int, dict[str, int]]:
    from torch.distributed.tensor.debug import CommDebugMode

    return _tp_steps(world_size, sequence_parallel, CommDebugMode,
                     lambda mode: {str(op).rsplit(".", 1)[-1]: n for op, n in mode.get_comm_counts().items()})


@pytest.mark.parametrize("sequence_parallel, per_block", [
    (False, {"all_reduce": 4}),
    (True, {"all_gather_into_tensor": 4, "reduce_scatter_tensor": 4}),
], ids=["tp", "tp_sequence_parallel"])
def test_one_block_adds_exactly_megatrons_collectives(sequence_parallel, per_block, spawned):
    counts = results_of(spawned, "sequence_parallel" if sequence_parallel else "tp")[0]
    one, two = counts[1], counts[2]
    added = {op: two.get(op, 0) - one.get(op, 0) for op in {*one, *two}}
    assert {op: n for op, n in added.items() if n} == per_block, counts


class _AllReduceDtypes(TorchDispatchMode):
    """Records the dtype of every all-reduce's input."""

    def __init__(self):
        super().__init__()
        self.dtypes: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "all_reduce" in str(func):
            self.dtypes.append(str(args[0].dtype).removeprefix("torch."))
        return func(*args, **(kwargs or {}))


def _dtype_worker(rank: int, world_size: int) -> dict[int, list[str]]:
    return _tp_steps(world_size, False, _AllReduceDtypes, lambda mode: mode.dtypes, bf16=True)


def test_under_bf16_autocast_a_blocks_all_reduces_move_bf16_both_ways(spawned):
    """RMSNorm returns its output in the autocast dtype, so the gradient of each sub-layer's input, which TP
    all-reduces over the column-parallel projections that read it, is bf16 like the forward's all-reduces: half the
    bytes of the fp32 it was (the norm computes in fp32 under autocast, and the projections cast its output anyway)."""
    dtypes = results_of(spawned, "bf16")[0]
    one, two = dtypes[1], dtypes[2]
    added = list(two)
    for d in one:  # what the second block adds: the 2-block run's all-reduces less the 1-block run's
        added.remove(d)
    assert sorted(added) == ["bfloat16"] * 4, dtypes


def _hf_count_worker(rank: int, world_size: int) -> dict[int, dict[str, int]]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from meshrun.parallel.tp import apply_tp_plan

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    counts = {}
    for blocks in (1, 2):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=blocks, num_attention_heads=4, num_key_value_heads=2,
                                             attn_implementation="sdpa"))
        apply_tp_plan(model, {f"model.{k}": v for k, v in model.config.base_model_tp_plan.items()}, mesh)
        tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
        mode = CommDebugMode()
        with mode:
            model(input_ids=tokens, labels=tokens).loss.backward()
        counts[blocks] = {str(op).rsplit(".", 1)[-1]: n for op, n in mode.get_comm_counts().items()}
    return counts


def _every_worker(rank: int, world_size: int) -> dict:
    """The runs of every test in this file, one after another on the same 2 ranks (starting the ranks took longer
    than the counting; each run builds its own models on the one TP mesh). Hugging Face's only where transformers is
    installed."""
    import importlib.util

    runs = {"tp": lambda: _count_worker(rank, world_size, False),
            "sequence_parallel": lambda: _count_worker(rank, world_size, True),
            "bf16": lambda: _dtype_worker(rank, world_size)}
    if importlib.util.find_spec("transformers") is not None:
        runs["hugging_face"] = lambda: _hf_count_worker(rank, world_size)
    return each_run(runs)


@pytest.fixture(scope="module")
def spawned() -> list[dict]:
    return run_distributed(_every_worker, 2, timeout=300, threads=1)


def test_a_hugging_face_plan_all_reduces_each_sub_layers_input_gradient_once(spawned):
    """Qwen2's own ``base_model_tp_plan`` (q/k/v and gate/up "colwise", o and down "rowwise"): the column-parallel
    siblings share one DTensor of their input (parallel/tp.share_column_inputs), so a decoder layer costs 2
    all-reduces forward and 2 backward, not 2 + 5."""
    pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")
    counts = results_of(spawned, "hugging_face")[0]
    one, two = counts[1], counts[2]
    added = {op: two.get(op, 0) - one.get(op, 0) for op in {*one, *two}}
    assert {op: n for op, n in added.items() if n} == {"all_reduce": 4}, counts
