"""train.residual_dtype: with bf16 under bf16 autocast the hidden state between blocks stays bf16 (CPU, bf16
autocast); auto, the default, chooses bf16 for one process and DDP computing in bf16.

A forward pre-hook casts each block's input to the autocast dtype, so the first block's input (the embedding's fp32
output) becomes bf16 and every block after it reads and returns bf16. Checked on one model (the dtypes each block
sees and returns; all gradients reach the fp32 parameters; nothing changes without autocast), on the layout check
(refused with fp32 compute) and on 2 gloo ranks (DDP, TP, a 1F1B pipeline), whose losses, gradient norms and
validation loss track one process with the same setting: atol 2e-3 on losses near 5.5 (seen up to 6.5e-4, bf16
matmuls summing in another order; the fp32 stream's runs differ as much), rtol 1e-2 on norms (seen up to 2.1e-3).
Over 10 steps the bf16 stream's losses differ from the fp32 stream's by less than 0.02 (seen up to 8e-4), and not
by nothing: the setting takes effect and trains alike.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from dist_utils import run_distributed
from meshrun.comm.mesh import ParallelDims
from meshrun.config import ConfigError, load_config
from meshrun.models.gpt import GPT, SIZES
from meshrun.models.gpt_spec import GPT_SPEC
from meshrun.parallel.apply import cast_block_inputs
from meshrun.parallel.checks import bf16_stream, check_layout
from meshrun.parallel.engine import LocalEngine
from meshrun.parallel.kernels import describe_speed
from test_parallel_layouts import build, load_full, model_config, train

LOSS_ATOL, NORM_RTOL, SETTINGS_APART = 2e-3, 1e-2, 0.02


def _record_dtypes(model: GPT) -> list[tuple[torch.dtype, torch.dtype]]:
    """(input, output) dtype of each block's forward, in call order (the input after any pre-hook)."""
    seen: list[tuple[torch.dtype, torch.dtype]] = []
    for block in model.layers.values():
        block.register_forward_hook(lambda module, args, out: seen.append((args[0].dtype, out.dtype)))
    return seen


def _model(*, cast: bool) -> tuple[GPT, list]:
    torch.manual_seed(0)
    model = GPT(replace(SIZES["tiny"], n_layers=3))
    model.init_weights()
    if cast:
        cast_block_inputs(list(model.layers.values()))
    return model, _record_dtypes(model)


def test_every_block_reads_and_returns_bf16_and_the_gradients_reach_fp32_parameters():
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    runs = {}
    for cast in (False, True):
        model, seen = _model(cast=cast)
        with torch.autocast("cpu", torch.bfloat16):
            logits = model(tokens)
        logits.float().square().mean().backward()
        runs[cast] = (logits.detach().float(), seen, model)
    assert runs[False][1] == [(torch.float32, torch.float32)] * 3  # autocast alone: an fp32 stream
    assert runs[True][1] == [(torch.bfloat16, torch.bfloat16)] * 3
    model = runs[True][2]
    assert all(p.grad is not None and p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all()
               for p in model.parameters())
    # the same model computed with fewer bits between blocks: close, and not the same
    difference = (runs[True][0] - runs[False][0]).abs().max()
    assert 0 < difference < 0.05, difference


def test_without_autocast_the_hook_changes_nothing():
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
    plain, _ = _model(cast=False)
    hooked, seen = _model(cast=True)
    assert torch.equal(plain(tokens), hooked(tokens))
    assert seen == [(torch.float32, torch.float32)] * 3


def test_it_needs_bf16_compute_and_the_speed_line_says_so():
    job = load_config(None, ["--model.name=tiny", "--train.residual_dtype=bf16"])
    dims = ParallelDims.from_config(job.parallel, world_size=1)
    with pytest.raises(ConfigError, match="set --train.dtype=bf16, or drop --train.residual_dtype") as error:
        check_layout(job, GPT_SPEC, SIZES["tiny"], dims, device=torch.device("cpu"), compute_dtype=None)
    assert str(error.value).startswith("train.residual_dtype=bf16")
    check_layout(job, GPT_SPEC, SIZES["tiny"], dims, device=torch.device("cpu"), compute_dtype=torch.bfloat16)
    on = bf16_stream(job, dims, torch.bfloat16)
    assert "bf16 autocast, residual stream in bf16" in describe_speed(job, torch.device("cpu"), torch.bfloat16,
                                                                      residual_bf16=on)
    assert "residual stream" not in describe_speed(job, torch.device("cpu"), torch.bfloat16)
    with pytest.raises(ConfigError, match="train.residual_dtype"):
        load_config(None, ["--train.residual_dtype=fp16"])


@pytest.mark.parametrize("degrees, extra, expected", [
    ({}, [], True),  # one process in bf16: auto casts
    ({"dp_replicate": 2}, [], True),  # DDP
    ({"dp_replicate": 1, "tp": 2}, [], True),  # TP: 1.03x on 2 H200s (1b)
    ({"dp_replicate": 1, "pp": 2}, [], True),  # a pipeline: 1.02x
    ({"dp_replicate": 1, "dp_shard": 2}, [], False),  # FSDP2's bf16 parameters keep the stream bf16 anyway
    ({"dp_replicate": 1, "dp_shard": 1, "cp": 2}, [], False),  # context parallelism: not measured
    ({}, ["--train.float8=true"], False),  # float8 with the bf16 stream: not measured
    ({"dp_replicate": 1, "dp_shard": 2}, ["--train.residual_dtype=bf16"], True),  # asked for: on
    ({"dp_replicate": 1, "tp": 2}, ["--train.residual_dtype=fp32"], False),  # asked for: off
])
def test_auto_casts_without_fsdp_or_context_parallelism_in_bf16_only(degrees, extra, expected):
    job = load_config(None, ["--model.name=tiny", "--train.dtype=bf16", *extra,
                             *(f"--parallel.{k}={v}" for k, v in degrees.items())])
    if not any(e.startswith("--train.residual_dtype") for e in extra):
        assert job.train.residual_dtype == "auto"  # the default
    dims = ParallelDims.from_config(job.parallel, world_size=math.prod(degrees.values()))
    assert bf16_stream(job, dims, torch.bfloat16) is expected
    assert bf16_stream(job, dims, None) is (expected and job.train.residual_dtype == "bf16")  # fp32: auto is off


LAYOUTS = {
    "ddp2": (True, {"dp_replicate": 2}),
    "tp2": (True, {"dp_replicate": 1, "tp": 2}),
    "pp2_1f1b": (False, {"dp_replicate": 1, "pp": 2, "pp_microbatches": 4, "pp_schedule": "1f1b"}),
}


def _reference(tied: bool, residual: str, initial: dict) -> dict:
    model = GPT(model_config(tied=tied))
    model.load_state_dict(initial)
    if residual == "bf16":
        cast_block_inputs(list(model.layers.values()))
    return train(LocalEngine(model, autocast_dtype=torch.bfloat16), grad_accum=1)


def _worker(rank: int, world_size: int, initials: dict) -> dict:
    out = {}
    for name, (tied, parallel) in LAYOUTS.items():
        for residual in ("fp32", "bf16"):
            cfg = model_config(tied=tied)
            _, engine = build(cfg, parallel, grad_accum=1, train={"dtype": "bf16", "residual_dtype": residual},
                              compute_dtype=torch.bfloat16)
            recorded = []
            for part in engine.model_parts:
                for block in part.layers.values():
                    block.register_forward_hook(lambda m, args, o: recorded.append((args[0].dtype, o.dtype)))
            load_full(engine, initials[tied])
            out[(name, residual)] = train(engine, grad_accum=1) | {"dtypes": sorted(set(recorded), key=str)}
    return out


@pytest.mark.slow
def test_ddp_tp_and_a_pipeline_track_one_process_with_a_bf16_stream():
    initials = {}
    for tied in (True, False):
        torch.manual_seed(0)
        model = GPT(model_config(tied=tied))
        model.init_weights()
        initials[tied] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    refs = {(tied, residual): _reference(tied, residual, initials[tied])
            for tied in (True, False) for residual in ("fp32", "bf16")}
    results = run_distributed(_worker, 2, initials, timeout=600, threads=1)
    for name, (tied, _) in LAYOUTS.items():
        for residual in ("fp32", "bf16"):
            ref = refs[(tied, residual)]
            for rank, result in enumerate(results):
                got = result[(name, residual)]
                stream = torch.bfloat16 if residual == "bf16" else torch.float32
                assert got["dtypes"] == [(stream, stream)], (name, residual, rank, got["dtypes"])
                assert got["losses"] == pytest.approx(ref["losses"], abs=LOSS_ATOL), (name, residual)
                assert got["norms"] == pytest.approx(ref["norms"], rel=NORM_RTOL), (name, residual)
                assert got["val"] == pytest.approx(ref["val"], abs=LOSS_ATOL), (name, residual)
        apart = [abs(a - b) for a, b in zip(results[0][(name, "bf16")]["losses"], results[0][(name, "fp32")]["losses"])]
        assert 0 < max(apart) < SETTINGS_APART, (name, apart)


def test_a_bf16_run_casts_between_blocks_by_default_and_its_start_up_line_says_so(tmp_path, capsys):
    """End to end through the trainer (one CPU process, train.dtype=bf16, residual_dtype left at auto): every block
    reads and returns bf16 in a training step, and the header's speed line names the bf16 stream."""
    from meshrun.train.trainer import Trainer

    job = load_config(None, ["--model.name=tiny", "--train.dtype=bf16", "--train.steps=1", f"--run.dir={tmp_path}",
                             "--health.check_versions=false"])
    trainer = Trainer(job)
    try:
        seen = []
        for part in trainer.engine.model_parts:
            for block in part.layers.values():
                block.register_forward_hook(lambda module, args, out: seen.append((args[0].dtype, out.dtype)))
        trainer.train_step()
    finally:
        trainer.close()
    assert seen and set(seen) == {(torch.bfloat16, torch.bfloat16)}, seen
    assert "bf16 autocast, residual stream in bf16" in capsys.readouterr().out
