"""parallel.pp_cast_once: a pipeline stage's linear layers hold bf16 copies of their weights, made once per step,
and each micro-batch's gradient goes straight into the fp32 one. The arithmetic is autocast's, so everything is
compared bitwise with the same run without it (CPU, bf16 autocast): gradients of a block over several
micro-batches, eager and compiled, and the losses, evaluation losses and weights of 2-rank pipeline runs through the
trainer and through Session. Last, the first step of a bf16 pipeline gives every weight a gradient (torch 2.8's
autocast cache took it from the linear layers)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dist_utils import run_distributed
from meshrun.comm.mesh import ParallelDims
from meshrun.config import ConfigError, load_config
from meshrun.models.gpt import Block, gpt_config, rope_cache
from meshrun.models.spec import get_model_spec
from meshrun.parallel.checks import check_cast_once, check_layout, use_cast_once
from meshrun.parallel.kernels import describe_speed
from meshrun.parallel.step_weights import StepWeights, add_all, compiled_adder, grad_adder


def _micro_batches(block: nn.Module, weights: StepWeights | None, inputs: list[torch.Tensor], rope) -> None:
    """One step's forwards and backwards under bf16 autocast, the weights held as in PipelineEngine.forward_backward."""
    held = weights.held() if weights is not None else torch.enable_grad()
    with torch.autocast("cpu", torch.bfloat16), held:
        for x in inputs:
            block(x, rope).float().square().mean().backward()


@pytest.mark.parametrize("compiled,adder", [
    (False, "each"), (False, "batched"), pytest.param(True, "each", marks=pytest.mark.slow),
    pytest.param(True, "compiled", marks=pytest.mark.slow)])
def test_a_blocks_gradients_over_micro_batches_are_bitwise_autocasts(compiled, adder):
    """adder: each gradient added as its hook fires (CPU, eager); all of a backward pass's added when it ends, eagerly
    or compiled (what a compiled model on a GPU does)."""
    torch.manual_seed(0)
    cfg = gpt_config("tiny")
    block = Block(cfg)
    reference = copy.deepcopy(block)
    rope = rope_cache(cfg.seq_len, cfg.head_dim, cfg.rope_theta)
    if compiled:
        block.compile()
        reference.compile()
    add = {"each": None, "batched": add_all, "compiled": compiled_adder()}[adder]
    weights = StepWeights([block], torch.bfloat16, add=add)
    assert len(weights) == 7, "wq, wk, wv, wo, w1, w2, w3: the norms' weights stay fp32 (autocast runs them in fp32)"
    for step in range(3):
        inputs = [torch.randn(2, 16, cfg.dim) for _ in range(4)]
        _micro_batches(block, weights, inputs, rope)
        _micro_batches(reference, None, inputs, rope)
        for (name, param), ref in zip(block.named_parameters(), reference.parameters()):
            assert param.dtype == torch.float32 and param.grad.dtype == torch.float32, name
            assert torch.equal(param.grad, ref.grad), f"step {step}: {name}"
        assert all(copy.grad is None for *_, copy in weights.slots), "each micro-batch's gradient was handed on"
        assert not weights.pending, "every backward pass added its gradients before it returned"
        with torch.no_grad():  # an optimizer step on the fp32 parameters: the next step's copies must follow it
            for param, ref in zip(block.parameters(), reference.parameters()):
                param -= 0.5 * param.grad
                ref -= 0.5 * ref.grad
                param.grad = ref.grad = None
    assert block.attention.wq.weight.dtype == torch.float32, "outside a step the layers hold their fp32 weights"


def test_the_copies_are_the_same_tensors_every_step():
    """CUDA graphs take parameters as fixed inputs: the copies are refreshed in place, never replaced."""
    block = Block(gpt_config("tiny"))
    weights = StepWeights([block], torch.bfloat16)
    with weights.held():
        first = block.attention.wq.weight
        assert first.dtype == torch.bfloat16
    with torch.no_grad():
        block.attention.wq.weight.add_(1.0)
    with weights.held():
        assert block.attention.wq.weight is first
        assert torch.equal(first, (block.attention.wq._parameters["weight"]).detach())
    assert torch.equal(first.float(), block.attention.wq.weight.to(torch.bfloat16).float())


# ---- where it is refused -----------------------------------------------------------------------------------------

def _dims(*overrides: str, world_size: int = 2) -> ParallelDims:
    job = load_config(None, ["--model.name=tiny", "--parallel.dp_replicate=1", *overrides])
    return ParallelDims.from_config(job.parallel, world_size=world_size, model=gpt_config("tiny", n_layers=4),
                                    spec=get_model_spec("gpt"))


@pytest.mark.parametrize("overrides, fp32, float8, message", [
    (("--parallel.tp=2",), False, False, r"applies to pipeline layouts \(parallel.pp > 1\)"),
    (("--parallel.pp=2",), True, False, "set --train.dtype=bf16"),
    (("--parallel.pp=2", "--parallel.dp_shard=2"), False, False, "FSDP2 already gives"),
    (("--parallel.pp=2", "--parallel.pp_schedule=interleavedzb"), False, False, "set --parallel.pp_schedule"),
    (("--parallel.pp=2",), False, True, "drop one of --train.float8 and --parallel.pp_cast_once"),
])
def test_it_is_refused_where_the_copies_would_not_be_used(overrides, fp32, float8, message):
    world = 4 if "--parallel.dp_shard=2" in overrides else 2
    with pytest.raises(ConfigError, match=message) as error:
        check_cast_once(_dims(*overrides, world_size=world), fp32=fp32, float8=float8)
    assert str(error.value).startswith("parallel.pp_cast_once=true")


def test_the_layout_check_applies_it_and_the_speed_line_says_so():
    job = load_config(None, ["--model.name=tiny", "--parallel.pp=2", "--parallel.dp_replicate=1",
                             "--parallel.pp_cast_once=true"])
    spec, shape = get_model_spec("gpt"), gpt_config("tiny")
    with pytest.raises(ConfigError, match="set --train.dtype=bf16"):
        check_layout(job, spec, shape, _dims("--parallel.pp=2"), device=torch.device("cpu"), compute_dtype=None)
    check_layout(job, spec, shape, _dims("--parallel.pp=2"), device=torch.device("cpu"), compute_dtype=torch.bfloat16)
    line = describe_speed(job, torch.device("cpu"), torch.bfloat16, cast_once=True)
    assert "bf16 autocast, weights cast once per step" in line, line


@pytest.mark.parametrize(("choice", "overrides", "device", "fp32", "expected"), [
    ("auto", ("--parallel.pp=2",), "cuda", False, True),  # the default: a pipeline in bf16 on GPUs
    ("auto", ("--parallel.pp=2",), "cpu", False, False),  # measured on GPUs only
    ("auto", ("--parallel.pp=2",), "cuda", True, False),  # fp32: nothing to cast
    ("auto", ("--parallel.pp=2", "--parallel.dp_shard=2"), "cuda", False, False),  # FSDP2 casts itself
    ("auto", ("--parallel.pp=2", "--parallel.pp_schedule=interleavedzb"), "cuda", False, False),
    ("auto", ("--parallel.tp=2",), "cuda", False, False),  # no pipeline
    ("false", ("--parallel.pp=2",), "cuda", False, False),
    ("true", ("--parallel.pp=2",), "cpu", False, True),
])
def test_auto_casts_once_where_it_can_serve_on_gpus(choice, overrides, device, fp32, expected):
    """parallel.pp_cast_once=auto (the default) is on for the pipeline layouts it serves on CUDA GPUs, where it was
    measured faster, and off wherever true would be refused or nothing was measured."""
    world = 4 if "--parallel.dp_shard=2" in overrides else 2
    job = load_config(None, ["--model.name=tiny", "--parallel.dp_replicate=1", *overrides,
                             f"--parallel.pp_cast_once={choice}"])
    dims = _dims(*overrides, world_size=world)
    assert use_cast_once(job, dims, torch.device(device), None if fp32 else torch.bfloat16) is expected


# ---- through the trainer: 2 pipeline stages on 2 gloo ranks --------------------------------------------------------

COMMON = ("--data.max_bytes=100000", "--train.global_batch=8", "--train.micro_batch=2", "--train.grad_accum=4",
          "--model.n_layers=4", "--parallel.pp=2", "--parallel.dp_replicate=1", "--parallel.pp_microbatches=4",
          "--train.dtype=bf16", "--train.eval_every=3", "--train.eval_samples=8", "--checkpoint.final=false",
          "--health.check_versions=false")


def _pipeline_worker(rank, world_size, run_dir, extra, batched=False):
    from test_resume import job
    from meshrun.train.trainer import Trainer

    trainer = Trainer(job(run_dir, steps=6, extra=(*COMMON, *extra)))
    held, backwards, batches = trainer.engine.step_weights, [], []
    if held is not None:  # count the micro-batches whose gradients reached one copy
        held.slots[0][3].register_post_accumulate_grad_hook(lambda copy: backwards.append(1))
    if batched:  # as a compiled model on a GPU adds them (grad_adder), eagerly: each backward pass's in one call
        held.add = lambda accumulators, grads: (batches.append(len(grads)), add_all(accumulators, grads))
    try:
        result = trainer.fit()
        weights = {name: tensor.clone() for name, tensor in trainer.engine.model_parts[0].state_dict().items()}
    finally:
        trainer.close()
    return result.losses, result.val_loss, weights, len(backwards) if held is not None else None, batches, \
        len(held) if held is not None else 0


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved1f1b"])
def test_pipeline_runs_train_bitwise_like_per_micro_batch_casts(tmp_path, schedule):
    extra = (f"--parallel.pp_schedule={schedule}",)
    plain = run_distributed(_pipeline_worker, 2, tmp_path / "plain", extra)
    once = run_distributed(_pipeline_worker, 2, tmp_path / "once", (*extra, "--parallel.pp_cast_once=true"))
    last = 1  # the last stage's rank reports the losses
    assert plain[last][3] is None and once[0][3] == once[last][3] == 6 * 4, "each stage's copies in every backward"
    assert len(once[last][0]) == 6 and once[last][0] == plain[last][0], (plain[last][0], once[last][0])
    assert once[last][1] is not None and once[last][1] == plain[last][1], "evaluation runs with the copies held too"
    for rank in range(2):
        for name, tensor in plain[rank][2].items():
            assert once[rank][2][name].dtype == torch.float32, name
            assert torch.equal(once[rank][2][name], tensor), f"rank {rank}: {name}"


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved1f1b"])
def test_gradients_added_once_per_backward_pass_train_bitwise_alike(tmp_path, schedule):
    """Each micro-batch's gradients kept until the stage's backward pass ends, then added in one call (what
    grad_adder does for compiled models on GPUs), inside torch.distributed.pipelining's schedules."""
    extra = (f"--parallel.pp_schedule={schedule}", "--parallel.pp_cast_once=true")
    each = run_distributed(_pipeline_worker, 2, tmp_path / "each", extra)
    batched = run_distributed(_pipeline_worker, 2, tmp_path / "batched", extra, True)
    stages = 2 if schedule == "interleaved1f1b" else 1  # stages per rank, each with a backward pass of its own
    for rank in range(2):
        assert each[rank][4] == [], "without an adder each gradient is added as it arrives"
        copies = batched[rank][5]
        # 6 steps x 3 micro-batches after the first (whose gradients are cast, not added) x the rank's stages
        assert len(batched[rank][4]) == 6 * 3 * stages and sum(batched[rank][4]) == 6 * 3 * copies, batched[rank][4]
        for name, tensor in each[rank][2].items():
            assert torch.equal(batched[rank][2][name], tensor), f"rank {rank}: {name}"
    assert batched[1][0] == each[1][0] and batched[1][1] == each[1][1]


# ---- through Session: a user's model (tests/mlp_lm.py) pipelined over 2 gloo ranks ----------------------------------

def _session_worker(rank, world_size):
    from mlp_lm import MLPLM
    from test_session_pipeline import params, step_batch, train
    from meshrun import PipelineOptions, Session

    session = Session(seed=0)
    runs = {}
    for cast_once in (False, True):
        pipe = session.prepare_model(MLPLM(), layout="pp", compute_dtype=torch.bfloat16,
                                     pipeline=PipelineOptions(microbatches=4, cast_once=cast_once))
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2, foreach=True)
        losses = train(pipe, optimizer, range(4))
        val = pipe.evaluate(*step_batch(99))
        runs[cast_once] = (losses, params(pipe), None if val is None else val.item(),
                           pipe.engine.step_weights is not None)
    session.close()
    return runs


@pytest.mark.slow
def test_session_pipeline_option_trains_bitwise_like_per_micro_batch_casts():
    for rank, runs in enumerate(run_distributed(_session_worker, 2, init_pg=False)):
        (losses, weights, val, held), (once_losses, once_weights, once_val, once_held) = runs[False], runs[True]
        assert not held and once_held
        assert once_losses == losses and once_val == val, (rank, losses, once_losses)
        for name, value in weights.items():
            assert once_weights[name].dtype == torch.float32 and torch.equal(once_weights[name], value), name


def test_session_refuses_the_option_without_bf16_autocast():
    from meshrun.parallel.module_pipeline import PipelineOptions, check_session_cast_once, pipeline_dims

    dims = pipeline_dims("pp", PipelineOptions(), world_size=2, nodes=1, pp=0)
    with pytest.raises(ConfigError, match=r"this model computes in fp32: pass compute_dtype=torch.bfloat16"):
        check_session_cast_once("pp", dims, None)
    with pytest.raises(ConfigError, match="FSDP2 already gives the stages bf16 parameters"):
        check_session_cast_once("pp+fsdp", dims, None)
    zero_bubble = pipeline_dims("pp", PipelineOptions(schedule="interleavedzb", microbatches=4), world_size=2, nodes=1,
                                pp=0)
    with pytest.raises(ConfigError, match="schedule='interleaved1f1b'"):
        check_session_cast_once("pp", zero_bubble, torch.bfloat16)
    check_session_cast_once("pp", dims, torch.bfloat16)


def test_session_casts_once_by_default_where_it_can_serve_on_gpus():
    """PipelineOptions(cast_once=None), the default, is on as the trainer's auto is: bf16 autocast on a CUDA GPU, any
    schedule but interleavedzb; True is refused where it cannot serve, False stays off."""
    from meshrun.parallel.module_pipeline import PipelineOptions, pipeline_dims, session_cast_once

    dims = pipeline_dims("pp", PipelineOptions(), world_size=2, nodes=1, pp=0)
    zero_bubble = pipeline_dims("pp", PipelineOptions(schedule="interleavedzb", microbatches=4), world_size=2, nodes=1,
                                pp=0)
    gpu, cpu, bf16 = torch.device("cuda"), torch.device("cpu"), torch.bfloat16
    assert session_cast_once(None, "pp", dims, gpu, bf16)
    assert not session_cast_once(None, "pp", dims, cpu, bf16)  # measured on GPUs only
    assert not session_cast_once(None, "pp", dims, gpu, None)  # fp32, or FSDP2's own bf16 parameters
    assert not session_cast_once(None, "pp", zero_bubble, gpu, bf16)
    assert not session_cast_once(False, "pp", dims, gpu, bf16)
    assert session_cast_once(True, "pp", dims, cpu, bf16)
    with pytest.raises(ConfigError, match="this model computes in fp32"):
        session_cast_once(True, "pp", dims, gpu, None)


# ---- the first step of a bf16 pipeline -----------------------------------------------------------------------------

def _first_step_grads(rank, world_size, run_dir, extra):
    from test_resume import job
    from meshrun.train.trainer import Trainer

    trainer = Trainer(job(run_dir, steps=1, extra=(*COMMON, *extra)))
    try:
        trainer.engine.forward_backward(trainer.data.next_step())
        return sorted(name for part in trainer.engine.model_parts for name, param in part.named_parameters()
                      if param.grad is None or not param.grad.any())
    finally:
        trainer.close()


@pytest.mark.slow
def test_the_first_bf16_pipeline_step_gives_every_weight_a_gradient(tmp_path):
    """The stages infer their shapes with a forward under no_grad in the first step, inside the step's autocast; torch
    2.8's autocast cache kept those casts, made without autograd, for the real forwards, and every linear layer
    (uncompiled) went without a gradient in that step (the run with pp_cast_once, which casts no weights, did
    not)."""
    for extra in ((), ("--parallel.pp_cast_once=true",)):
        missing = run_distributed(_first_step_grads, 2, tmp_path / str(len(extra)), extra)
        assert missing == [[], []], (extra, missing)


def test_a_weight_two_layers_share_gets_one_copy_and_both_gradients():
    torch.manual_seed(0)
    first, second = nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)
    second.weight = first.weight
    model = nn.Sequential(first, nn.ReLU(), second)
    reference = copy.deepcopy(model)  # deepcopy keeps the tie
    weights = StepWeights([model], torch.bfloat16)
    assert len({id(c) for *_, c in weights.slots}) == 1 and len(weights) == 2
    x = torch.randn(4, 8)
    with torch.autocast("cpu", torch.bfloat16), weights.held():
        assert first.weight is second.weight and first.weight.dtype == torch.bfloat16
        model(x).float().sum().backward()
    with torch.autocast("cpu", torch.bfloat16):
        reference(x).float().sum().backward()
    assert torch.equal(first.weight.grad, reference[0].weight.grad)


def test_compiled_models_on_gpus_add_a_backward_passs_gradients_in_one_compiled_call():
    """grad_adder: on a GPU with the model compiled, the mixed-dtype additions run as compiled kernels after each
    backward pass (eager torch adds fp32 += bf16 in an unvectorised kernel there); elsewhere each is added eagerly as
    it arrives."""
    assert callable(grad_adder(compiled=True, device=torch.device("cuda")))
    assert grad_adder(compiled=False, device=torch.device("cuda")) is None
    assert grad_adder(compiled=True, device=torch.device("cpu")) is None
    cfg, calls = gpt_config("tiny"), []
    block = Block(cfg)
    weights = StepWeights([block], torch.bfloat16, add=lambda a, g: (calls.append(len(g)), add_all(a, g)))
    rope = rope_cache(cfg.seq_len, cfg.head_dim, cfg.rope_theta)
    _micro_batches(block, weights, [torch.randn(2, 16, cfg.dim) for _ in range(3)], rope)
    assert calls == [7, 7], "the first micro-batch's gradients are cast; each later one's added in one call"
