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

from dist_utils import run_distributed


def _count_worker(rank: int, world_size: int, sequence_parallel: bool) -> dict[int, dict[str, int]]:
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import loss_parallel

    from meshrun.models.gpt import GPT, SIZES
    from meshrun.models.gpt_spec import gpt_tp_plan
    from meshrun.parallel.tp import apply_tp

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    counts = {}
    for blocks in (1, 2):
        torch.manual_seed(0)
        cfg = replace(SIZES["tiny"], n_layers=blocks, tie_embeddings=False)
        model = GPT(cfg)
        apply_tp(model, gpt_tp_plan, mesh, sequence_parallel=sequence_parallel, loss_parallel=True)
        tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
        mode = CommDebugMode()
        with mode, loss_parallel():
            logits = model(tokens)
            F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
        counts[blocks] = {str(op).rsplit(".", 1)[-1]: n for op, n in mode.get_comm_counts().items()}
    return counts


@pytest.mark.parametrize("sequence_parallel, per_block", [
    (False, {"all_reduce": 4}),
    (True, {"all_gather_into_tensor": 4, "reduce_scatter_tensor": 4}),
], ids=["tp", "tp_sequence_parallel"])
def test_one_block_adds_exactly_megatrons_collectives(sequence_parallel, per_block):
    counts = run_distributed(_count_worker, 2, sequence_parallel, timeout=180)[0]
    one, two = counts[1], counts[2]
    added = {op: two.get(op, 0) - one.get(op, 0) for op in {*one, *two}}
    assert {op: n for op, n in added.items() if n} == per_block, counts


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


def test_a_hugging_face_plan_all_reduces_each_sub_layers_input_gradient_once():
    """Qwen2's own ``base_model_tp_plan`` (q/k/v and gate/up "colwise", o and down "rowwise"): the column-parallel
    siblings share one DTensor of their input (parallel/tp.share_column_inputs), so a decoder layer costs 2
    all-reduces forward and 2 backward, not 2 + 5."""
    pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")
    counts = run_distributed(_hf_count_worker, 2, timeout=180)[0]
    one, two = counts[1], counts[2]
    added = {op: two.get(op, 0) - one.get(op, 0) for op in {*one, *two}}
    assert {op: n for op, n in added.items() if n} == {"all_reduce": 4}, counts
