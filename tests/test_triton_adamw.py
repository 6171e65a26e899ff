"""meshrun's AdamW kernel (parallel/triton_adamw.py, train.adamw_kernel) steps like torch's fused AdamW.

* On CPU through Triton's interpreter (TRITON_INTERPRET=1, in a subprocess: the variable is read when the kernels
  are defined): ``LocalShardAdamW(triton=True)`` against torch's fused AdamW over five steps, with weight decay in one
  group and none in the other, tensors that are not a multiple of the kernel's block, a clipping divisor
  (``grad_scale``) and a skipped step (``found_inf``); bf16 gradients against their fp32 values.
* On a GPU (``-m gpu``), the same against torch's fused CUDA kernel, at a size of many blocks.
* Tensors that start off 16-byte alignment step exactly like aligned copies (CPU and GPU).
* The local shards of FSDP2's and TP's parameters (2 gloo processes, interpreted): the kernel takes them (they are
  contiguous and aligned, padded shards and uneven rows included) and steps them like torch's fused kernel.
* ``auto`` picks the kernel on CUDA GPUs only; ``triton`` where it cannot run is a clear error.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from meshrun.config import ConfigError, load_config
from meshrun.parallel.kernels import describe_speed, resolve_adamw_kernel

ROOT = Path(__file__).resolve().parents[1]

CASE = textwrap.dedent("""
    import torch
    from meshrun.parallel.local_adamw import LocalShardAdamW

    def compare(device, shapes, steps=5, grad_dtype=torch.float32):
        g = torch.Generator().manual_seed(0)
        start = [torch.randn(s, generator=g) for s in shapes]
        grads = [[torch.randn(s, generator=g).to(grad_dtype) for s in shapes] for _ in range(steps)]
        def build(triton):
            params = [torch.nn.Parameter(t.clone().to(device)) for t in start]
            if triton and grad_dtype != torch.float32:
                for p in params:
                    p.grad_dtype = None  # torch 2.10 and newer: an fp32 parameter may hold a bf16 gradient
            groups = [{"params": params[::2], "weight_decay": 0.1}, {"params": params[1::2], "weight_decay": 0.0}]
            return params, LocalShardAdamW(groups, lr=1e-2, betas=(0.9, 0.95), fused=True, triton=triton)
        (ref, ref_opt), (ours, opt) = build(False), build(True)
        for step in range(steps):
            scale = torch.tensor(2.0 if step == 1 else 1.0, device=device)  # a clipped step
            skip = torch.tensor(1.0 if step == 3 else 0.0, device=device)  # a non-finite one
            for optimizer, params in ((ref_opt, ref), (opt, ours)):
                for p, grad in zip(params, grads[step]):
                    # torch's kernel reads the gradient's fp32 value (and writes it back divided by grad_scale: a
                    # copy each); ours reads the bf16 one itself
                    p.grad = grad.to(device).float().clone() if optimizer is ref_opt else grad.to(device).clone()
                optimizer.grad_scale, optimizer.found_inf = scale, skip
                optimizer.step()
        assert opt.triton_steps == 2 * steps, opt.triton_steps  # both groups, every step
        assert ref_opt.triton_steps == 0
        for a, b in zip(ref, ours):
            torch.testing.assert_close(b, a, rtol=2e-6, atol=2e-7)
        for a, b in zip(ref, ours):
            sa, sb = ref_opt.state[a], opt.state[b]
            assert float(sa["step"]) == float(sb["step"]) == steps - 1  # the skipped step does not count
            torch.testing.assert_close(sb["exp_avg"], sa["exp_avg"], rtol=2e-6, atol=1e-7)
            torch.testing.assert_close(sb["exp_avg_sq"], sa["exp_avg_sq"], rtol=2e-6, atol=1e-8)
        assert ref_opt.state_dict()["param_groups"] == opt.state_dict()["param_groups"]

    def unaligned_equals_aligned(device):
        # tensors that start 4 bytes into their buffer (as FSDP2's packed gradient shards can) take the kernel's
        # path without alignment hints: the same arithmetic, so the same values as aligned copies
        from meshrun.parallel import triton_adamw
        g = torch.Generator().manual_seed(1)
        runs = []
        for offset in (0, 1):
            tensors = []
            for _ in range(4):  # parameter, gradient, exp_avg, exp_avg_sq
                buffer = torch.empty(offset + 3000, device=device)
                buffer[offset:] = torch.rand(3000, generator=g).to(device)
                tensors.append(buffer[offset:])
            tensors[2].zero_()
            tensors[3].zero_()
            steps = [torch.zeros((), device=device)]
            for _ in range(2):
                triton_adamw.adamw_(*[[t] for t in tensors], steps, lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8,
                                    weight_decay=0.1)
            runs.append(tensors)
            g = torch.Generator().manual_seed(1)
        assert runs[1][0].data_ptr() % 16 and not runs[0][0].data_ptr() % 16
        for a, b in zip(*runs):
            assert torch.equal(a, b)
""")


def _run_interpreted(script: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{ROOT / 'src'}:{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-c", CASE + textwrap.dedent(script) + "\nprint('ok')"], env=env,
                          capture_output=True, text=True, timeout=300)
    if "only 0-dimensional arrays can be converted" in proc.stderr:  # seen with Triton 3.5 and NumPy 2.4
        pytest.skip(f"Triton {importlib.metadata.version('triton')}'s interpreter cannot pass scalar kernel "
                    "arguments under this NumPy (Triton 3.9 can)")
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton is not installed (torch's CPU builds do not depend on it; the test extra adds it on "
                           "Linux x86-64)")
def test_kernel_in_the_interpreter_steps_like_torchs_fused_adamw():
    """Shapes of 1 to 2,500 elements (the last block of most of them masked), fp32 gradients, and bf16 ones where
    torch lets an fp32 parameter hold them (2.10 and newer)."""
    _run_interpreted("""
        shapes = [(33, 7), (2500,), (3, 1025), (1024,), (1,)]
        compare("cpu", shapes)
        unaligned_equals_aligned("cpu")
        if hasattr(torch.Tensor, "grad_dtype"):
            compare("cpu", shapes, grad_dtype=torch.bfloat16)
    """)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernel_on_a_gpu_steps_like_torchs_fused_adamw():
    """A few million elements over tensors of many blocks, against torch's fused CUDA kernel."""
    namespace: dict = {}
    exec(CASE, namespace)
    shapes = [(768, 2304), (50304, 64), (768,), (3072, 768), (5, 7)]
    namespace["compare"]("cuda", shapes)
    namespace["unaligned_equals_aligned"]("cuda")
    if hasattr(torch.Tensor, "grad_dtype"):
        namespace["compare"]("cuda", shapes, grad_dtype=torch.bfloat16)


def _sharded_worker(rank: int, world_size: int) -> dict:
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from meshrun.parallel.local_adamw import LocalShardAdamW

    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    for layout in ("fsdp", "tp"):
        models = []
        for _ in range(2):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(15, 34), nn.ReLU(), nn.Linear(34, 7), nn.LayerNorm(7))  # 7 rows: padded
            if layout == "fsdp":
                fully_shard(model, mesh=mesh)
            else:
                parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
            models.append(model)
        optimizers = [LocalShardAdamW([{"params": [p for p in m.parameters() if p.ndim == 2], "weight_decay": 0.1},
                                       {"params": [p for p in m.parameters() if p.ndim < 2], "weight_decay": 0.0}],
                                      lr=1e-2, betas=(0.9, 0.95), fused=True, triton=triton)
                      for m, triton in zip(models, (False, True))]
        local = lambda t: t._local_tensor if isinstance(t, DTensor) else t  # noqa: E731
        diff = lambda: max((local(a) - local(b)).abs().max().item()  # noqa: E731
                           for a, b in zip(models[0].parameters(), models[1].parameters()))
        ran: dict = {"sharded": sum(isinstance(p, DTensor) for p in models[1].parameters())}
        torch.manual_seed(1 + rank)
        for step in range(4):
            x = torch.randn(4, 15)
            before = [local(p).clone() for p in models[1].parameters()]
            for model, optimizer in zip(models, optimizers):
                model(x).square().mean().backward()
                optimizer.grad_scale, optimizer.found_inf = torch.tensor(1.25), torch.tensor(float(step == 2))
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if step == 0:
                ran["first"] = diff()  # the same weights and gradients: only rounding apart
            if step == 2:
                ran["skipped_moved"] = any(not torch.equal(a, local(b))
                                           for a, b in zip(before, models[1].parameters()))
        ran["last"], ran["triton_steps"] = diff(), optimizers[1].triton_steps
        out[layout] = ran
    return out


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_fsdp2_and_tp_local_shards_step_through_the_kernel(monkeypatch):
    """Two gloo processes, the kernel run by Triton's interpreter (the spawned processes read TRITON_INTERPRET as
    they import meshrun): FSDP2's and TP's shards reach the kernel in every group step, FSDP2's unaligned gradient
    shards included (7-row layers: packed shards of odd length), against torch's fused AdamW with clipping: after
    the first step within 1e-6, a skipped (non-finite) step leaves the weights as they were, and after 4 steps within
    1e-4 (each model computes its own gradients from its own weights, so rounding can move a ReLU's boundary)."""
    from dist_utils import run_distributed

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for result in run_distributed(_sharded_worker, 2):
        for layout, ran in result.items():
            assert ran["sharded"] >= 2, (layout, ran)  # the layers' parameters are DTensors
            assert ran["triton_steps"] == 2 * 4, (layout, ran)  # both groups, every step
            assert ran["first"] < 1e-6 and ran["last"] < 1e-4 and not ran["skipped_moved"], (layout, ran)


def test_auto_picks_the_kernel_on_cuda_only_and_triton_elsewhere_is_refused():
    job = load_config(None, [])
    assert resolve_adamw_kernel(job, torch.device("cpu")) == "foreach"
    assert "AdamW (single-tensor)" in describe_speed(job, torch.device("cpu"), None)
    job = load_config(None, ["--train.adamw_kernel=triton"])
    refused = r"^train.adamw_kernel=triton .*this run is on cpu.*--train.adamw_kernel=auto"
    with pytest.raises(ConfigError, match=refused):
        resolve_adamw_kernel(job, torch.device("cpu"))
    job = load_config(None, ["--train.adamw_kernel=triton", "--train.fused_optimizer=false"])
    with pytest.raises(ConfigError, match="train.fused_optimizer is false"):
        resolve_adamw_kernel(job, torch.device("cpu"))
    with pytest.raises(ConfigError, match="train.adamw_kernel"):
        load_config(None, ["--train.adamw_kernel=apex"])
