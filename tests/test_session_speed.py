"""Session.prepare_model's speed settings: compute_dtype="auto" (bf16 FSDP2 parameters on GPUs) and compile=True.

CPU: how the arguments resolve, and that compile=True compiles the blocks in place (names unchanged). GPU (run on
the GPU machine: ``pytest -m gpu tests/test_session_speed.py``): the defaults on 2 GPUs with FSDP2 give bf16
compute and train within bf16 tolerance of fp32, with and without compile.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dist_utils import recorded_compile_modes, run_distributed
from mlp_lm import MLPLM

from meshrun.config import ConfigError
from meshrun.parallel.module import layout_dims, resolve_compute_dtype

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


@pytest.mark.parametrize("layout, device, expected", [
    ("fsdp", CUDA, torch.bfloat16), ("hsdp", CUDA, torch.bfloat16), ("tp+fsdp", CUDA, torch.bfloat16),
    ("ddp", CUDA, None), ("tp", CUDA, None), ("fsdp", CPU, None)])
def test_auto_compute_dtype_is_bf16_where_fsdp_shards_on_a_gpu(layout, device, expected):
    dims = layout_dims(layout, world_size=4)
    assert resolve_compute_dtype("auto", dims, device) is expected


def test_explicit_compute_dtype_wins_and_a_wrong_one_is_named():
    dims = layout_dims("fsdp", world_size=2)
    assert resolve_compute_dtype(torch.float32, dims, CUDA) is torch.float32
    assert resolve_compute_dtype(None, dims, CUDA) is None
    assert resolve_compute_dtype(torch.bfloat16, dims, CPU) is torch.bfloat16
    with pytest.raises(ConfigError, match=r"compute_dtype='bf16' is not 'auto'.*torch.bfloat16"):
        resolve_compute_dtype("bf16", dims, CUDA)


def test_compile_compiles_the_whole_model_in_place_without_sharding_and_says_so(capsys):
    """One process (and DDP): one graph for the whole model, as meshrun train compiles it (a loss inside the model
    then never writes fp32 logits); FSDP2 and TP compile each block (tests/test_session_layouts.py)."""
    from meshrun import Session

    session = Session(seed=0)
    model = session.prepare_model(MLPLM(), layout="none", compile=True)
    assert model._compiled_call_impl is not None, "the whole model is the compiled unit"
    assert all(block._compiled_call_impl is None for block in model.blocks)
    assert all("_orig_mod" not in name for name, _ in model.named_parameters())
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "1 module(s) compiled" in line and "compute fp32 (compute_dtype='auto')" in line, line
    plain = session.prepare_model(MLPLM(), layout="none")
    assert all(block._compiled_call_impl is None for block in plain.blocks)
    assert "not compiled (compile=True compiles)" in capsys.readouterr().out


def test_compile_covers_a_model_without_repeated_blocks():
    from meshrun import Session

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    prepared = Session(seed=0).prepare_model(model, layout="none", compile=True)
    assert prepared._compiled_call_impl is not None


def test_cuda_graphs_are_refused_where_they_cannot_record_naming_the_fix():
    from meshrun import Session
    from meshrun.parallel.module import prepare_module

    with pytest.raises(ConfigError, match=r"^cuda_graphs=True records what compile=True compiles; add compile=True"):
        Session(seed=0).prepare_model(MLPLM(), layout="none", cuda_graphs=True)
    with pytest.raises(ConfigError, match=r"^cuda_graphs=True records CUDA graphs and this process runs on cpu"):
        Session(seed=0).prepare_model(MLPLM(), layout="none", compile=True, cuda_graphs=True)
    # TP on 2 ranks: refused before the mesh (a collective) is built, so one process can ask
    with pytest.raises(ConfigError, match=r"^cuda_graphs=True records the whole compiled model, for layout='ddp', "
                                          r"'fsdp', 'hsdp' or one process, not layout='tp'"):
        prepare_module(MLPLM(), "tp", device=CUDA, world_size=2, compile=True, cuda_graphs=True)
    with pytest.raises(ConfigError, match=r"^cuda_graphs=True records the whole compiled model.*not layout='pp'"):
        Session(seed=0).prepare_model(MLPLM(), layout="pp", compile=True, cuda_graphs=True)


@pytest.mark.parametrize("layout, compiled", [("none", 1), ("pp", 3)])
def test_compile_mode_max_autotune_reaches_every_compiled_module_and_the_start_up_line(capsys, layout, compiled):
    """One process: the whole model (layout none), or each of the 3 blocks (pp in one process), compiled in
    inductor's max-autotune mode (without CUDA graphs); the default mode asks for none."""
    from meshrun import Session

    session = Session(seed=0)
    with recorded_compile_modes() as modes:
        model = session.prepare_model(MLPLM(), layout=layout, compile=True, compile_mode="max-autotune")
        assert modes == ["max-autotune-no-cudagraphs"] * compiled, modes
        assert f"{compiled} module(s) compiled (max-autotune)" in capsys.readouterr().out
        if layout == "none":
            logits = model(torch.randint(0, 64, (2, 16)))
            assert logits.shape == (2, 16, 64) and torch.isfinite(logits).all()
        modes.clear()
        session.prepare_model(MLPLM(), layout=layout, compile=True)
        assert modes == [None] * compiled, modes
    assert "(max-autotune)" not in capsys.readouterr().out


def _fsdp_autotune(rank: int, world_size: int) -> dict:
    from meshrun import Session

    with recorded_compile_modes() as modes:
        session = Session(seed=0)
        model = session.prepare_model(MLPLM(), layout="fsdp", compile=True, compile_mode="max-autotune")
        losses, _ = _train(session, model, steps=3)
    return {"modes": modes, "losses": losses}


def test_compile_mode_max_autotune_compiles_each_fsdp_block_on_two_ranks():
    """FSDP2 on 2 gloo ranks: each of the 3 blocks is compiled in max-autotune mode before FSDP2 wraps it, and the
    model trains (finite losses)."""
    results = run_distributed(_fsdp_autotune, 2)
    for rank, result in enumerate(results):
        assert result["modes"] == ["max-autotune-no-cudagraphs"] * 3, (rank, result["modes"])
        assert torch.isfinite(torch.tensor(result["losses"])).all(), (rank, result)


def test_compile_mode_is_refused_without_compile_or_when_unknown_naming_the_fix():
    from meshrun import Session

    with pytest.raises(ConfigError, match=r"^compile_mode='max-autotune' sets how compile=True compiles; add "
                                          r"compile=True or drop compile_mode"):
        Session(seed=0).prepare_model(MLPLM(), layout="none", compile_mode="max-autotune")
    with pytest.raises(ConfigError, match=r"^compile_mode='fast': choose one of default, max-autotune"):
        Session(seed=0).prepare_model(MLPLM(), layout="pp", compile=True, compile_mode="fast")


def test_each_optimizer_step_starts_a_new_replay_generation(monkeypatch):
    """Marked once when the model is prepared, then after every optimizer.step() of any optimizer, and no longer
    once the session removes the hook."""
    from meshrun.session import replay_generation_per_optimizer_step

    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    params = [torch.nn.Parameter(torch.ones(2))]
    optimizers = torch.optim.SGD(params, lr=0.1), torch.optim.AdamW(params)
    handle = replay_generation_per_optimizer_step()
    assert len(marks) == 1
    for optimizer in optimizers:
        params[0].grad = torch.ones(2)
        optimizer.step()
    assert len(marks) == 3
    handle.remove()
    optimizers[0].step()
    assert len(marks) == 3


# ---- GPU ------------------------------------------------------------------------------------------------------------

def on_two_gpus(test):
    """A test for the GPU machine (pytest -m gpu), on 2 CUDA GPUs."""
    for mark in (pytest.mark.gpu, pytest.mark.slow,
                 pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")):
        test = mark(test)
    return test


def _train(session, model, steps: int = 6) -> tuple[list[float], torch.dtype]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(7)
    losses, dtype = [], None
    for _ in range(steps):
        tokens = torch.randint(0, 64, (8, 17), generator=gen).to(session.device)
        share = 8 // session.dp_size
        tokens = tokens[session.dp_rank * share:(session.dp_rank + 1) * share]
        logits = model(tokens[:, :-1])
        dtype = logits.dtype
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(session.sum_metrics(loss=loss.detach())["loss"] / session.dp_size)
    return losses, dtype


def _gpu_defaults(rank: int, world_size: int) -> dict:
    from meshrun import Session

    torch.cuda.set_device(rank)
    session = Session(seed=0)
    out = {}
    for name, kwargs in (("fp32", {"compute_dtype": torch.float32}), ("auto", {}), ("auto_compiled", {"compile": True})):
        model = session.prepare_model(MLPLM(), layout="fsdp", **kwargs)
        out[name] = (*_train(session, model), session.layout.compute_dtype)
    session.close()
    return out


@on_two_gpus
def test_fsdp_defaults_on_gpus_are_bf16_and_track_fp32():
    results = run_distributed(_gpu_defaults, 2, init_pg=False, timeout=600)
    fp32_losses, fp32_dtype, fp32_policy = results[0]["fp32"]
    assert fp32_dtype == torch.float32 and fp32_policy is torch.float32
    for name in ("auto", "auto_compiled"):
        losses, dtype, policy = results[0][name]
        assert policy is torch.bfloat16 and dtype == torch.bfloat16, name
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(fp32_losses), rtol=0, atol=0.05,
                                   msg=lambda m: f"{name}: bf16 losses left fp32's: {m}")


def test_fsdp_as_cuda_graphs_makes_the_whole_model_one_unit_compiled_as_one_graph():
    """prepare_model(layout='fsdp' or 'hsdp', compile=True, cuda_graphs=True): the whole model one FSDP2 unit, its
    forward one compiled graph recorded as CUDA graphs (FSDP2's hooks between blocks would split them)."""
    from meshrun.parallel.data_parallel import WHOLE_MODEL
    from meshrun.parallel.module import session_options

    whole = session_options("fsdp", compute_dtype=torch.bfloat16, device=CUDA, compiled=False,
                            activation_checkpoint="none", fsdp_whole_graphs=True)
    assert (whole.fsdp_unit_blocks, whole.compiled, whole.cuda_graphs) == (WHOLE_MODEL, True, True)
    blocks = session_options("fsdp", compute_dtype=torch.bfloat16, device=CUDA, compiled=True,
                             activation_checkpoint="none")
    assert (blocks.fsdp_unit_blocks, blocks.compiled, blocks.cuda_graphs) == (0, True, False)


def _graphs_with_accumulation(rank: int, world_size: int, layout: str) -> dict:
    """``layout`` on 2 GPUs, fp32, 2 micro-batches per optimizer step through session.sync_gradients and an
    evaluation every 5 steps, compiled with and without CUDA graphs: the losses, gradient norms and evaluation
    losses."""
    from meshrun import Session

    torch.cuda.set_device(rank)
    session = Session(seed=0)
    out = {}
    for graphs in (False, True):
        torch.manual_seed(0)
        model = session.prepare_model(MLPLM(), layout=layout, compile=True, cuda_graphs=graphs,
                                      compute_dtype=torch.float32)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        gen = torch.Generator().manual_seed(7)
        losses, norms, evals = [], [], []
        for step in range(1, 31):
            for i in range(2):
                tokens = torch.randint(0, 64, (8, 17), generator=gen)[rank * 4:(rank + 1) * 4].to(session.device)
                with session.sync_gradients(model, last=i == 1):
                    logits = model(tokens[:, :-1])
                    loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()) / 2
                    loss.backward()
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).item())
            optimizer.step()
            optimizer.zero_grad()
            losses.append(2 * loss.item())
            if step % 5 == 0:
                with torch.no_grad():
                    held_out = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(99)).cuda()
                    logits = model(held_out[:, :-1])
                    evals.append(F.cross_entropy(logits.float().flatten(0, 1), held_out[:, 1:].flatten()).item())
        out[graphs] = {"losses": losses, "norms": norms, "evals": evals, "line": session.layout.cuda_graphs,
                       "whole_unit": session.layout.fsdp_whole}
    session.close()
    return out


@on_two_gpus
@pytest.mark.parametrize("layout", ["ddp", "fsdp"])
def test_cuda_graphs_accumulate_gradients_like_launched_kernels(layout):
    """A replay of the first micro-batch's graph by the second would overwrite the gradients the first one left
    (pytorch#169545): norms and losses would leave the launched kernels' within a few steps. FSDP2 as CUDA graphs
    holds the whole model as one unit, gathered before each forward and resharded after each backward: a replay
    that read stale gathered weights would show too. fp32, so within 1e-3 relative (FSDP2: the whole model as one
    graph against block by block, other fusions)."""
    results = run_distributed(_graphs_with_accumulation, 2, layout, init_pg=False, timeout=600)
    launched, graphed = results[0][False], results[0][True]
    assert graphed["line"] and not launched["line"]
    assert graphed["whole_unit"] == (layout == "fsdp") and not launched["whole_unit"]
    for key in ("losses", "norms", "evals"):
        torch.testing.assert_close(torch.tensor(graphed[key]), torch.tensor(launched[key]), rtol=1e-3, atol=1e-4,
                                   msg=lambda m: f"{key} with CUDA graphs against launched kernels: {m}")
    # it trained: uniform random tokens over 64 ids leave ln 64 = 4.16 as the floor; on 2 H100s 4.42 -> 4.23
    assert graphed["losses"][-1] < graphed["losses"][0] - 0.1


def test_fsdp_as_cuda_graphs_of_a_large_model_says_to_drop_them():
    """The whole model one unit gathers all of it on every GPU: above the size meshrun train does that for, the
    start-up note names the fix; below it, and block by block, nothing is said."""
    from meshrun.parallel.data_parallel import FSDP_ONE_UNIT_PARAMS
    from meshrun.parallel.module import layout_note

    dims = layout_dims("fsdp", world_size=8)
    note = layout_note("fsdp", dims, nodes=1, whole_params=1_000_000_000)
    assert note.startswith("cuda_graphs=True with layout='fsdp' gathers the whole model (1,000M parameters)")
    assert note.endswith("for a model this size drop cuda_graphs (FSDP2 then gathers one block at a time, beside the "
                         "previous block's compute)")
    assert layout_note("fsdp", dims, nodes=1, whole_params=FSDP_ONE_UNIT_PARAMS - 1) == ""
    assert layout_note("fsdp", dims, nodes=1) == ""
    both = layout_note("hsdp", layout_dims("hsdp", world_size=8, nodes=1), nodes=1, whole_params=10**9)
    assert both.startswith("layout='hsdp' on one node runs plain FSDP") and "drop cuda_graphs" in both
