"""train.weight_copies: the linear layers hold bf16 copies of their weights, which meshrun's Triton AdamW writes as it
updates the fp32 weights, and with one micro-batch a step their gradients stay bf16; under DDP the copies are DDP's
parameters, their gradients all-reduced in bf16.

The arithmetic is autocast's (the same bf16 weights in the matmuls, the gradients' same values), so runs are compared
bitwise with the same run without copies:

* through the trainer on CPU (bf16 autocast, torch's single-tensor AdamW, which changes the weights itself, so each step
  casts the copies again), with one micro-batch a step and with two;
* the Triton kernel, run by Triton's interpreter on CPU, writing the copies as it steps and reading bf16 gradients,
  against the same kernel without copies (bitwise copies; the gradient norm sums bf16 values in another order, so
  the weights are a unit in the last place apart); a weight changed outside the optimizer (a checkpoint loaded) is
  cast again before the next step uses it;
* under DDP on 2 gloo ranks: rank 0's fp32 weights reach every rank, the gradients handed to the fp32 weights are the
  ranks' mean within one bf16 rounding, and the trainer's DDP with and without copies tracks one process;
* and the refusals, ``auto``'s choice and the start-up line.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from dist_utils import run_distributed
from meshrun.comm.mesh import ParallelDims
from meshrun.config import ConfigError, load_config
from meshrun.models.gpt import gpt_config
from meshrun.models.spec import get_model_spec
from meshrun.parallel import kernels
from meshrun.parallel.checks import check_layout, use_weight_copies, weight_copies_refusal
from meshrun.parallel.kernels import describe_speed

ROOT = Path(__file__).resolve().parents[1]
BF16 = ("--model.name=tiny", "--train.dtype=bf16", "--train.micro_batch=4", "--train.eval_every=3",
        "--train.eval_samples=8", "--checkpoint.final=false", "--health.check_versions=false")


def _run(run_dir: Path, *extra: str):
    from test_resume import job
    from meshrun.train.trainer import Trainer

    trainer = Trainer(job(run_dir, steps=6, extra=(*BF16, *extra)))
    try:
        copies = trainer.engine.step_weights
        result = trainer.fit()
        weights = {name: tensor.clone() for name, tensor in trainer.engine.model.state_dict().items()}
    finally:
        trainer.close()
    return result.losses, result.val_loss, weights, copies


@pytest.mark.parametrize("extra", [
    ("--train.grad_accum=1",), ("--train.grad_accum=2",),
    # an output head of its own (copied too), its loss chunk by chunk, the blocks recomputed in backward
    ("--model.tie_embeddings=false", "--train.loss=chunked", "--parallel.activation_checkpoint=full")])
def test_the_trainer_trains_bitwise_like_autocasts_casts(tmp_path, extra):
    plain = _run(tmp_path / "plain", *extra, "--train.weight_copies=false")
    copied = _run(tmp_path / "copied", *extra, "--train.weight_copies=true")
    assert plain[3] is None and copied[3] is not None
    # the 7 matrices in each of 2 blocks; an output head that shares the embedding's weight gets no copy
    copies = 14 if "--model.tie_embeddings=false" not in extra else 15
    assert len(copied[3].pairs) == copies
    assert copied[3].casts == 6 * copies, "torch's AdamW changes every weight: each step casts each copy once"
    assert len(copied[0]) == 6 and copied[0] == plain[0], (plain[0], copied[0])
    assert copied[1] is not None and copied[1] == plain[1], "evaluation"
    for name, tensor in plain[2].items():
        assert copied[2][name].dtype == torch.float32 and torch.equal(copied[2][name], tensor), name


CASE = textwrap.dedent("""
    import torch
    from meshrun.models.gpt import GPT, gpt_config
    from meshrun.parallel.engine import LocalEngine, LossStep
    from meshrun.parallel.grad_norm import clip_divisor
    from meshrun.parallel.local_adamw import LocalShardAdamW
    from meshrun.parallel.step_weights import StepWeights

    def build(copied):
        torch.manual_seed(0)
        model = GPT(gpt_config("tiny"))
        copies = StepWeights([model], torch.bfloat16, grads_in_dtype=True) if copied else None
        engine = LocalEngine(model, step=LossStep(model, torch.bfloat16), autocast_dtype=torch.bfloat16,
                             step_weights=copies)
        decay = [p for p in model.parameters() if p.ndim >= 2]
        optimizer = LocalShardAdamW([{"params": decay, "weight_decay": 0.1},
                                     {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}],
                                    lr=3e-3, betas=(0.9, 0.95), fused=True, triton=True, copies=copies)
        return model, engine, optimizer, copies

    def batches(step, n):
        g = torch.Generator().manual_seed(step)
        return [(torch.randint(0, 256, (2, 32), generator=g), torch.randint(0, 256, (2, 32), generator=g))
                for _ in range(n)]

    runs = [build(False), build(True)]
    model, engine, optimizer, copies = runs[1]
    losses = [[], []]
    for step in range(6):
        n = 2 if step == 4 else 1  # one step of two micro-batches: fp32 gradients
        for i, (m, e, o, _) in enumerate(runs):
            loss, tokens = e.forward_backward(batches(step, n))
            if i == 1:
                grad_dtypes = {p.grad.dtype for p, _ in copies.pairs}
                # torch 2.10 and newer let an fp32 weight hold a bf16 gradient
                bf16 = n == 1 and hasattr(torch.Tensor, "grad_dtype")
                assert grad_dtypes == {torch.bfloat16 if bf16 else torch.float32}, (step, grad_dtypes)
                assert all(c.grad is None for _, c in copies.pairs), "each copy hands its gradient on"
            norm = e.clip_grad_norm(float("inf"))
            o.grad_scale = clip_divisor(norm, 1.0)
            o.step()
            o.zero_grad(set_to_none=True)
            losses[i].append(float(loss) / float(tokens))
        assert abs(losses[1][-1] / losses[0][-1] - 1) < 1e-5, (step, losses)
        for (p, c) in copies.pairs:
            assert torch.equal(c, p.to(torch.bfloat16)), "the kernel wrote each copy as it updated its weight"
    assert copies.casts == len(copies.pairs), "cast once, before the first step; then the optimizer wrote them"
    assert optimizer.triton_steps == 2 * 6
    for a, b in zip(runs[0][0].parameters(), model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)
    # weights changed outside the optimizer are cast again before the next step uses them: one changed in place,
    # then all of them, as loading a checkpoint copies into every weight
    before = copies.casts
    with torch.no_grad():
        model.layers["0"].attention.wq.weight.zero_()
    engine.forward_backward(batches(9, 1))
    assert copies.casts == before + 1
    assert not copies.copy_of(model.layers["0"].attention.wq.weight).any()
    model.zero_grad(set_to_none=True)
    model.load_state_dict(runs[0][0].state_dict())
    engine.forward_backward(batches(9, 1))
    assert copies.casts == before + 1 + len(copies.pairs)
    for (p, c) in copies.pairs:
        assert torch.equal(c, p.to(torch.bfloat16))
""")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton is not installed (torch's CPU builds do not depend on it; the test extra adds it on "
                           "Linux x86-64)")
def test_the_kernel_writes_the_copies_and_reads_bf16_gradients_bitwise_like_autocast():
    """Triton's interpreter on CPU (in a subprocess: TRITON_INTERPRET is read when the kernels are defined): six
    steps of the tiny model, one of them of two micro-batches, with clipping, against the kernel without copies.
    Each copy equals its weight rounded to bf16, bitwise. The gradients have the same values in bf16, but the norm
    that clipping divides by sums them in another order (last bits apart): the losses stay within 1e-5 and the
    weights within 1e-6 (1 to 2 units in the last place after six steps)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{ROOT / 'src'}:{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-c", CASE + "\nprint('ok')"], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


@pytest.mark.skipif(not hasattr(torch.Tensor, "grad_dtype"),
                    reason=f"torch {torch.__version__} lets no fp32 parameter hold a bf16 gradient (2.10 and newer)")
def test_torchs_adamw_steps_bf16_gradients_like_their_fp32_values():
    """A group the Triton kernel does not take (here: no kernel on CPU) goes to torch's AdamW, whose kernels take a
    gradient in its parameter's dtype only: LocalShardAdamW casts the copies' bf16 gradients for it."""
    from meshrun.parallel.local_adamw import LocalShardAdamW

    torch.manual_seed(0)
    start, grad = torch.randn(5, 3), torch.randn(5, 3).bfloat16()
    runs = []
    for dtype in (torch.float32, torch.bfloat16):
        param = torch.nn.Parameter(start.clone())
        param.grad_dtype = None
        optimizer = LocalShardAdamW([param], lr=1e-2, triton=True)
        for _ in range(2):
            param.grad = grad.to(dtype)
            optimizer.step()
        runs.append(param)
    assert torch.equal(runs[0], runs[1])


def _dims(*overrides: str, world_size: int = 1, gpus_per_node: int = 0) -> ParallelDims:
    job = load_config(None, ["--model.name=tiny", *overrides])
    return ParallelDims.from_config(job.parallel, world_size=world_size, gpus_per_node=gpus_per_node,
                                    model=gpt_config("tiny", n_layers=4), spec=get_model_spec("gpt"))


@pytest.mark.parametrize("overrides,world_size,fp32,message", [
    (("--parallel.tp=2", "--parallel.dp_replicate=1"), 2, False,
     r"^train.weight_copies=true runs in one process or under DDP, not for TP over 2 ranks .*FSDP2's sharding"),
    (("--parallel.pp=2", "--parallel.dp_replicate=1"), 2, False,
     r"^train.weight_copies=true runs in one process or under DDP, not for PP .*parallel.pp_cast_once gives"),
    (("--parallel.dp_shard=2", "--parallel.dp_replicate=1"), 2, False,
     r"^train.weight_copies=true runs in one process or under DDP, not for FSDP"),
    ((), 1, True, r"^train.weight_copies=true copies weights for bf16 compute.*set --train.dtype=bf16"),
    (("--train.float8=true",), 1, False, r"^train.weight_copies=true: train.float8 layers"),
    (("--replicas.groups=2", "--replicas.lighthouse=localhost:29510"), 1, False,
     r"^train.weight_copies=true: replica groups"),
    (("--parallel.grad_reduce_dtype=fp32",), 2, False,
     r"^train.weight_copies=true under DDP puts the linear layers' bf16 gradients in DDP's buckets.*fp32"),
])
def test_it_is_refused_where_it_cannot_serve(overrides, world_size, fp32, message):
    job = load_config(None, ["--model.name=tiny", "--train.weight_copies=true", *overrides])
    assert re.match(message, weight_copies_refusal(job, _dims(*overrides, world_size=world_size), fp32=fp32))


def test_it_serves_one_process_and_ddp_with_or_without_accumulation():
    job = load_config(None, ["--model.name=tiny", "--train.weight_copies=true"])
    assert weight_copies_refusal(job, _dims(), fp32=False) is None
    assert weight_copies_refusal(job, _dims(world_size=2), fp32=False) is None
    spec, shape, cpu = get_model_spec("gpt"), gpt_config("tiny", n_layers=4), torch.device("cpu")
    check_layout(job, spec, shape, _dims(world_size=2), device=cpu, compute_dtype=torch.bfloat16)
    accumulating = load_config(None, ["--model.name=tiny", "--train.weight_copies=true", "--train.micro_batch=4",
                                      "--train.global_batch=16"])  # 2 ranks of 4 samples: 2 micro-batches each
    check_layout(accumulating, spec, shape, _dims(world_size=2), device=cpu, compute_dtype=torch.bfloat16)


def test_auto_is_on_for_one_process_and_ddp_within_a_node_on_gpus_with_the_triton_adamw(monkeypatch):
    job = load_config(None, ["--model.name=tiny"])
    one, ddp, nodes = _dims(), _dims(world_size=2, gpus_per_node=2), _dims(world_size=2, gpus_per_node=1)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(kernels, "resolve_adamw_kernel", lambda job, device: "triton")
    assert use_weight_copies(job, one, cuda, torch.bfloat16)
    # DDP on the GPUs of one node takes the copies' bf16 gradients where an fp32 weight can hold them (torch 2.10)
    assert use_weight_copies(job, ddp, cuda, torch.bfloat16) == hasattr(torch.Tensor, "grad_dtype")
    assert not use_weight_copies(job, nodes, cuda, torch.bfloat16)  # two nodes: bf16 sums not measured there
    assert not use_weight_copies(job, _dims(world_size=2), cuda, torch.bfloat16)  # processes per node not known
    assert not use_weight_copies(job, ddp, cuda, torch.bfloat16, grad_accum=2)
    fp32_reduce = load_config(None, ["--model.name=tiny", "--parallel.grad_reduce_dtype=fp32"])
    assert not use_weight_copies(fp32_reduce, _dims("--parallel.grad_reduce_dtype=fp32", world_size=2,
                                                    gpus_per_node=2), cuda, torch.bfloat16)
    tp = _dims("--parallel.tp=2", "--parallel.dp_replicate=1", world_size=2, gpus_per_node=2)
    assert not use_weight_copies(job, tp, cuda, torch.bfloat16)
    assert not use_weight_copies(job, one, cuda, None)  # fp32 compute
    assert not use_weight_copies(job, one, cpu, torch.bfloat16)
    monkeypatch.setattr(kernels, "resolve_adamw_kernel", lambda job, device: "torch")
    assert not use_weight_copies(job, one, cuda, torch.bfloat16)
    assert use_weight_copies(load_config(None, ["--train.weight_copies=true"]), one, cpu, torch.bfloat16)
    with pytest.raises(ConfigError, match="train.weight_copies"):
        load_config(None, ["--train.weight_copies=maybe"])


def _ddp_worker(rank: int, world_size: int, keep: bool) -> dict:
    """One step of a small model under DDP with copies, each rank its own input: what DDP's start and the step's
    end leave in the fp32 weights and their gradients."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    from meshrun.parallel.data_parallel import apply_ddp
    from meshrun.parallel.step_weights import StepWeights

    torch.manual_seed(rank)  # each rank starts from other weights: DDP's start must give them all rank 0's
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 8))
    copies = StepWeights([model], torch.bfloat16, grads_in_dtype=keep, reduced_by_ddp=True)
    ddp = apply_ddp(model, init_device_mesh("cpu", (world_size,)), torch.device("cpu"), copies=copies)
    registered = sorted({str(p.dtype) for p in ddp._module_parameters})
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(100 + rank))
    with copies.held(micro_batches=1), torch.autocast("cpu", torch.bfloat16):
        ddp(x).float().square().sum().backward()
    return {"weights": weights, "x": x, "registered": registered,
            "grads": {name: p.grad.clone() for name, p in model.named_parameters()},
            "copy_grads": [c.grad for _, c in copies.pairs]}


@pytest.mark.parametrize("keep", [True, False])
def test_ddp_sums_the_copies_gradients_in_bf16_and_hands_them_to_the_fp32_weights(keep):
    """DDP on 2 gloo ranks holding the copies: rank 0's fp32 weights reach every rank; the linear layers'
    gradients are the mean of the ranks' autocast gradients within one bf16 rounding of the sum (rtol 8e-3), left
    in bf16 where the step keeps them (``keep``: torch 2.10's ``Tensor.grad_dtype``) and cast otherwise; the norm's
    fp32 gradients are the fp32 mean (rtol 1e-5); every rank ends with the same gradients."""
    if keep and not hasattr(torch.Tensor, "grad_dtype"):
        pytest.skip(f"torch {torch.__version__} lets no fp32 parameter hold a bf16 gradient (2.10 and newer)")
    from torch import nn

    results = run_distributed(_ddp_worker, 2, keep, timeout=120)
    assert results[0]["registered"] == ["torch.bfloat16", "torch.float32"]  # the copies and the norm
    reference = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 8))
    reference.load_state_dict(results[0]["weights"])
    means = {}
    for result in results:
        assert all(torch.equal(result["weights"][n], t) for n, t in results[0]["weights"].items())
        assert result["copy_grads"] == [None] * 4, "each copy (2 weights, 2 biases) hands its gradient on"
        reference.zero_grad()
        with torch.autocast("cpu", torch.bfloat16):
            reference(result["x"]).float().square().sum().backward()
        for name, p in reference.named_parameters():
            means[name] = means.get(name, 0) + p.grad / len(results)
    for name, grad in results[0]["grads"].items():
        linear = not name.startswith("1.")
        assert grad.dtype == (torch.bfloat16 if linear and keep else torch.float32), name
        torch.testing.assert_close(grad.float(), means[name], rtol=8e-3 if linear else 1e-5, atol=1e-6)
        assert torch.equal(results[1]["grads"][name], grad), name


def _trainer_worker(rank: int, world_size: int, initial: dict) -> dict:
    from test_parallel_layouts import build, load_full, model_config, train

    out = {}
    for copies, accum in (("false", 1), ("true", 1), ("true", 2)):
        _, engine = build(model_config(tied=False), {"dp_replicate": 2}, grad_accum=accum,
                          train={"dtype": "bf16", "weight_copies": copies}, compute_dtype=torch.bfloat16)
        load_full(engine, initial)
        skipped = []  # the micro-batches whose all-reduce DDP's no_sync skips
        no_sync = engine.step.no_sync
        engine.step.no_sync = lambda: skipped.append(1) or no_sync()
        out[(copies, accum)] = train(engine, grad_accum=accum) | {
            "by_ddp": engine.step_weights is not None and engine.step_weights.reduced_by_ddp, "skipped": len(skipped)}
    return out


@pytest.mark.slow
def test_ddp_with_copies_trains_like_one_process():
    """The trainer's DDP on 2 gloo ranks (bf16 autocast, an output head of its own) with and without copies, from the
    same weights, against one process with autocast's casts: losses within 2e-3 (near 5.5), gradient norms and the
    validation loss likewise (rtol 1e-2, 2e-3), as test_residual_dtype allows DDP's bf16 runs. With copies also 2
    micro-batches a step (as a resume that keeps the checkpoint's global batch on fewer ranks re-derives): each
    micro-batch all-reduced and added in fp32, not added in bf16 under DDP's no_sync."""
    from test_parallel_layouts import model_config
    from test_residual_dtype import LOSS_ATOL, NORM_RTOL, _reference
    from meshrun.models.gpt import GPT

    torch.manual_seed(0)
    model = GPT(model_config(tied=False))
    model.init_weights()
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ref = _reference(False, "bf16", initial)
    results = run_distributed(_trainer_worker, 2, initial, timeout=300)
    for result in results:
        assert not result[("false", 1)]["by_ddp"] and result[("true", 1)]["by_ddp"] and result[("true", 2)]["by_ddp"]
        assert result[("true", 2)]["skipped"] == 0, "with copies DDP all-reduces every micro-batch"
        for case, got in result.items():
            assert got["losses"] == pytest.approx(ref["losses"], abs=LOSS_ATOL), case
            assert got["norms"] == pytest.approx(ref["norms"], rel=NORM_RTOL), case
            assert got["val"] == pytest.approx(ref["val"], abs=LOSS_ATOL), case


def test_the_speed_line_says_how_the_copies_are_made():
    job = load_config(None, ["--model.name=tiny", "--train.dtype=bf16"])
    line = describe_speed(job, torch.device("cpu"), torch.bfloat16,
                          weight_copies="bf16 weight copies written by the AdamW kernel and bf16 weight gradients")
    assert "bf16 autocast, bf16 weight copies written by the AdamW kernel and bf16 weight gradients" in line


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_defaults_hold_copies_that_the_kernel_writes(tmp_path):
    """The defaults on one GPU: the copies are cast once, before the first step, then the Triton AdamW writes them
    (each equal to its weight rounded to bf16), and the gradients reach the optimizer in bf16."""
    from meshrun.train.trainer import Trainer

    job = load_config(None, ["--model.name=small", "--data.max_bytes=2000000", "--train.eval_every=0",
                             "--checkpoint.final=false", "--train.steps=5", f"--run.dir={tmp_path}",
                             "--health.check_versions=false"])
    trainer = Trainer(job)
    try:
        copies = trainer.engine.step_weights
        assert copies is not None and len(copies.pairs) == 4 * 7
        seen = []
        trainer.optimizer.register_step_pre_hook(
            lambda optimizer, args, kwargs: seen.append({p.grad.dtype for p, _ in copies.pairs}))
        for _ in range(3):
            trainer.train_step()
        assert copies.casts == len(copies.pairs) and trainer.optimizer.triton_steps == 2 * 3
        grad = torch.bfloat16 if hasattr(torch.Tensor, "grad_dtype") else torch.float32
        assert seen == [{grad}] * 3, seen
        for param, copy in copies.pairs:
            assert torch.equal(copy, param.to(torch.bfloat16))
    finally:
        trainer.close()
