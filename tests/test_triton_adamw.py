"""meshrun's AdamW kernel (parallel/triton_adamw.py, train.adamw_kernel) steps like torch's fused AdamW.

* On CPU through Triton's interpreter (TRITON_INTERPRET=1, in a subprocess: the variable is read when the kernels
  are defined): ``LocalShardAdamW(triton=True)`` against torch's fused AdamW over five steps, with weight decay in one
  group and none in the other, tensors that are not a multiple of the kernel's block, a clipping divisor
  (``grad_scale``) and a skipped step (``found_inf``); bf16 gradients against their fp32 values.
* On a GPU (``-m gpu``), the same against torch's fused CUDA kernel, at a size of many blocks.
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
    if hasattr(torch.Tensor, "grad_dtype"):
        namespace["compare"]("cuda", shapes, grad_dtype=torch.bfloat16)


def test_auto_picks_the_kernel_on_cuda_only_and_triton_elsewhere_is_refused():
    job = load_config(None, [])
    assert resolve_adamw_kernel(job, torch.device("cpu")) == "foreach"
    assert "AdamW (for-each)" in describe_speed(job, torch.device("cpu"), None)
    job = load_config(None, ["--train.adamw_kernel=triton"])
    refused = r"^train.adamw_kernel=triton .*this run is on cpu.*--train.adamw_kernel=auto"
    with pytest.raises(ConfigError, match=refused):
        resolve_adamw_kernel(job, torch.device("cpu"))
    job = load_config(None, ["--train.adamw_kernel=triton", "--train.fused_optimizer=false"])
    with pytest.raises(ConfigError, match="train.fused_optimizer is false"):
        resolve_adamw_kernel(job, torch.device("cpu"))
    with pytest.raises(ConfigError, match="train.adamw_kernel"):
        load_config(None, ["--train.adamw_kernel=apex"])
