"""What `meshrun train` compiles traces without a graph break, in every layout (2 gloo ranks on CPU).

A graph break splits a compiled block into pieces that run eagerly in between: on a GPU each piece is launched
(or, under train.cuda_graphs, recorded) on its own, and the host work between them lands on the step. Each layout
builds its engine as the trainer does with ``train.compile=true``, while ``torch.compile`` is swapped for a counting
eager backend with ``fullgraph=True``: any break in a block, the whole one-process/DDP step or a loss raises, naming
its cause. The backend is eager, so this checks tracing, not inductor's code (the GPU tests run that).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.testing import CompileCounterWithBackend

from dist_utils import each_run, recorded_compile_modes, results_of, run_distributed
from test_parallel_layouts import build, model_config, train

pytestmark = pytest.mark.slow

LAYOUTS = {
    "ddp2": {"dp_replicate": 2},
    "fsdp2": {"dp_replicate": 1, "dp_shard": 2},
    "tp2": {"dp_replicate": 1, "tp": 2},
    "tp2_sp": {"dp_replicate": 1, "tp": 2, "sequence_parallel": "true"},
    "pp2": {"dp_replicate": 1, "pp": 2, "pp_microbatches": 2},
}


def _worker(rank: int, world_size: int, name: str, bf16_stream: bool = False) -> dict:
    counter = CompileCounterWithBackend("eager")
    compile_ = torch.compile

    def one_graph(fn=None, **kwargs):
        """torch.compile as the trainer calls it (a module's .compile() calls it too), traced whole or not at all."""
        kwargs = {k: v for k, v in kwargs.items() if k not in ("mode", "backend", "fullgraph")}
        return compile_(fn, backend=counter, fullgraph=True, **kwargs)

    torch.compile = one_graph
    try:
        torch._dynamo.reset()
        grad_accum = 2 if name == "pp2" else 1
        # bf16_stream: bf16 autocast with train.residual_dtype=bf16, whose cast of each block's input is traced too
        extra = {"dtype": "bf16", "residual_dtype": "bf16"} if bf16_stream else {}
        _, engine = build(model_config(tied=False), LAYOUTS[name], grad_accum=grad_accum,
                          train={"compile": "true", **extra}, compute_dtype=torch.bfloat16 if bf16_stream else None)
        losses = train(engine, grad_accum=grad_accum)["losses"]
    finally:
        torch.compile = compile_
        dist.barrier()
    return {"graphs": counter.frame_count, "losses": losses}


CASES = {"whole": list(LAYOUTS), "bf16_stream": ["ddp2", "tp2", "pp2"], "max_autotune": ["ddp2", "fsdp2"]}
"""The layouts each test below checks, by kind of run."""


def _every_case(rank: int, world_size: int) -> dict:
    """Every run of this file, one after another on the same 2 ranks: starting 2 ranks took longer than most runs.
    Each starts from ``torch._dynamo.reset()`` and builds its own mesh; one that raises (both ranks meet in the
    workers' closing barrier) fails its own test."""
    runs = {}
    for kind, names in CASES.items():
        for name in names:
            runs[kind, name] = (functools.partial(_mode_worker, rank, world_size, name) if kind == "max_autotune"
                                else functools.partial(_worker, rank, world_size, name, kind == "bf16_stream"))
    return each_run(runs)


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_distributed(_every_case, 2, timeout=600, threads=1)


@pytest.mark.parametrize("name", CASES["whole"])
def test_compiled_blocks_and_losses_trace_as_whole_graphs(name, runs):
    for rank, result in enumerate(results_of(runs, ("whole", name))):
        # at least one graph per rank: something was compiled (fullgraph=True would have raised on a break)
        assert result["graphs"] >= 1, (name, rank, result)
        assert all(torch.isfinite(torch.tensor(result["losses"]))), (name, rank, result)


@pytest.mark.parametrize("name", CASES["bf16_stream"])
def test_the_bf16_residual_streams_cast_traces_into_the_same_whole_graphs(name, runs):
    for rank, result in enumerate(results_of(runs, ("bf16_stream", name))):
        assert result["graphs"] >= 1, (name, rank, result)
        assert all(torch.isfinite(torch.tensor(result["losses"]))), (name, rank, result)


def _mode_worker(rank: int, world_size: int, name: str) -> dict:
    try:
        with recorded_compile_modes() as modes:
            torch._dynamo.reset()
            _, engine = build(model_config(tied=False), LAYOUTS[name], grad_accum=1,
                              train={"compile": "true", "compile_mode": "max-autotune"})
            losses = train(engine, grad_accum=1)["losses"]
    finally:
        dist.barrier()
    return {"modes": modes, "losses": losses}


@pytest.mark.parametrize("name, autotuned", [("ddp2", 1), ("fsdp2", 2)])
def test_compile_mode_max_autotune_reaches_every_compile_of_the_step_or_blocks(name, autotuned, runs):
    """train.compile_mode=max-autotune: the whole DDP step (one compile) or each of FSDP2's 2 blocks is compiled in
    torch's max-autotune mode (without CUDA graphs on CPU); only the separately compiled loss keeps the default."""
    for rank, result in enumerate(results_of(runs, ("max_autotune", name))):
        modes = result["modes"]
        assert modes.count("max-autotune-no-cudagraphs") == autotuned, (name, rank, modes)
        assert set(modes) <= {"max-autotune-no-cudagraphs", None}, (name, rank, modes)
        assert all(torch.isfinite(torch.tensor(result["losses"]))), (name, rank, result)
