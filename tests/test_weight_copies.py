"""train.weight_copies: one process's linear layers hold bf16 copies of their weights, which meshrun's Triton AdamW
writes as it updates the fp32 weights, and with one micro-batch a step their gradients stay bf16.

The arithmetic is autocast's (the same bf16 weights in the matmuls, the gradients' same values), so runs are compared
bitwise with the same run without copies:

* through the trainer on CPU (bf16 autocast, torch's single-tensor AdamW, which changes the weights itself, so each step
  casts the copies again), with one micro-batch a step and with two;
* the Triton kernel, run by Triton's interpreter on CPU, writing the copies as it steps and reading bf16 gradients,
  against the same kernel without copies (bitwise copies; the gradient norm sums bf16 values in another order, so
  the weights are a unit in the last place apart); a weight changed outside the optimizer (a checkpoint loaded) is
  cast again before the next step uses it;
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


def _dims(*overrides: str, world_size: int = 1) -> ParallelDims:
    job = load_config(None, ["--model.name=tiny", *overrides])
    return ParallelDims.from_config(job.parallel, world_size=world_size, model=gpt_config("tiny", n_layers=4),
                                    spec=get_model_spec("gpt"))


@pytest.mark.parametrize("overrides,world_size,fp32,message", [
    ((), 2, False,
     r"^train.weight_copies=true runs in one process, not for DDP over 2 ranks .*drop --train.weight_copies"),
    (("--parallel.pp=2", "--parallel.dp_replicate=1"), 2, False, r"^train.weight_copies=true runs in one process, not for PP .*parallel.pp_cast_once gives a pipeline's"),
    ((), 1, True, r"^train.weight_copies=true copies weights for bf16 compute.*set --train.dtype=bf16"),
    (("--train.float8=true",), 1, False, r"^train.weight_copies=true: train.float8 layers"),
    (("--replicas.groups=2", "--replicas.lighthouse=localhost:29510"), 1, False,
     r"^train.weight_copies=true: replica groups"),
])
def test_it_is_refused_where_it_cannot_serve(overrides, world_size, fp32, message):
    job = load_config(None, ["--model.name=tiny", "--train.weight_copies=true", *overrides])
    assert re.match(message, weight_copies_refusal(job, _dims(*overrides, world_size=world_size), fp32=fp32))


def test_the_layout_check_refuses_it_for_ddp():
    job = load_config(None, ["--model.name=tiny", "--train.weight_copies=true"])
    with pytest.raises(ConfigError, match=r"^train.weight_copies=true runs in one process, not for DDP"):
        check_layout(job, get_model_spec("gpt"), gpt_config("tiny", n_layers=4), _dims(world_size=2),
                     device=torch.device("cpu"), compute_dtype=torch.bfloat16)


def test_auto_is_on_for_one_process_on_gpus_with_the_triton_adamw(monkeypatch):
    job = load_config(None, ["--model.name=tiny"])
    one, two = _dims(), _dims(world_size=2)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(kernels, "resolve_adamw_kernel", lambda job, device: "triton")
    assert use_weight_copies(job, one, cuda, torch.bfloat16)
    assert not use_weight_copies(job, two, cuda, torch.bfloat16)  # DDP
    assert not use_weight_copies(job, one, cuda, None)  # fp32 compute
    assert not use_weight_copies(job, one, cpu, torch.bfloat16)
    monkeypatch.setattr(kernels, "resolve_adamw_kernel", lambda job, device: "torch")
    assert not use_weight_copies(job, one, cuda, torch.bfloat16)
    assert use_weight_copies(load_config(None, ["--train.weight_copies=true"]), one, cpu, torch.bfloat16)
    with pytest.raises(ConfigError, match="train.weight_copies"):
        load_config(None, ["--train.weight_copies=maybe"])


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
