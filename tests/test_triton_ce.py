"""meshrun's cross-entropy kernels (parallel/triton_ce.py, train.cross_entropy) compute F.cross_entropy's sum.

* The operators' torch path (CPU), eager and compiled: loss and gradient equal F.cross_entropy's, ignored targets
  included.
* The Triton kernel itself on CPU, through Triton's interpreter (TRITON_INTERPRET=1, in a subprocess: the
  variable is read when the kernels are defined), with a vocabulary that is not a multiple of the block.
* The operator on a GPU (``-m gpu``), against fp32 F.cross_entropy, in bf16, fp16 and fp32, with strided rows,
  under torch.compile and as CUDA graphs.
* ``auto`` picks the kernels on CUDA GPUs only; ``triton`` where they cannot run is a clear error.
* Without Triton (a CPU-only install), importing meshrun and running ``meshrun plan`` log nothing of torch's
  "Triton not available", and the operator still computes F.cross_entropy's sum.
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
import torch.nn.functional as F

from meshrun.config import ConfigError, load_config
from meshrun.parallel import triton_ce
from meshrun.parallel.engine import token_loss_sum
from meshrun.parallel.kernels import describe_speed, resolve_cross_entropy, select_cross_entropy

ROOT = Path(__file__).resolve().parents[1]


def _case(n: int, v: int, *, dtype=torch.bfloat16, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, v, generator=g) * 3).to(device=device, dtype=dtype)
    targets = torch.randint(0, v, (n,), generator=g).to(device)
    targets[::7] = triton_ce.IGNORE_INDEX
    return logits, targets


def _ours(fn, logits, targets, grad=0.7):
    """``fn``'s loss of the logits, and their gradient when the loss's incoming gradient is ``grad``."""
    x = logits.detach().requires_grad_()
    loss = fn(x, targets)
    loss.backward(torch.tensor(grad, device=x.device))
    return loss.detach(), x.grad


def _reference(logits, targets, grad=0.7):
    """The same for fp32 F.cross_entropy."""
    return _ours(lambda x, y: F.cross_entropy(x.flatten(0, -2).float(), y.flatten(), reduction="sum"), logits, targets,
                 grad)


@pytest.mark.parametrize("compiled", [False, True])
def test_torch_path_equals_f_cross_entropy(compiled):
    logits, targets = _case(2 * 19, 301)
    logits, targets = logits.view(2, 19, 301), targets.view(2, 19)  # (B, T, V): flattened as the engine's loss does
    fn = torch.compile(triton_ce.cross_entropy_sum, fullgraph=True) if compiled else triton_ce.cross_entropy_sum
    loss, grad = _ours(fn, logits, targets)
    ref_loss, ref_grad = _reference(logits, targets)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(grad.float(), ref_grad.float(), rtol=0, atol=0)
    assert grad.dtype == torch.bfloat16 and grad.view(-1, 301)[::7].abs().max() == 0  # ignored rows: no gradient


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton is not installed (torch's CPU builds do not depend on it; the test extra adds it on "
                           "Linux x86-64)")
def test_triton_kernel_in_the_interpreter_equals_f_cross_entropy():
    """The forward kernel, run by Triton's interpreter on CPU tensors with 256-wide blocks over a 1000-word
    vocabulary (the last block masked), against torch's log-sum-exp and cross-entropy in fp32."""
    script = textwrap.dedent("""
        import torch, torch.nn.functional as F
        from meshrun.parallel import triton_ce as tc
        g = torch.Generator().manual_seed(0)
        n, v = 37, 1000
        x = (torch.randn(n, v, generator=g) * 3).bfloat16()
        y = torch.randint(0, v, (n,), generator=g); y[::7] = -100
        loss, lse = torch.empty(n), torch.empty(n)
        tc._forward_kernel[(n,)](x, x.stride(0), y, loss, lse, v, -100, BLOCK=256)
        ref_loss, ref_lse = tc._rows_reference(x, y, -100)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
        print("ok")
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{ROOT / 'src'}:{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    if "only 0-dimensional arrays can be converted" in proc.stderr:  # seen with Triton 3.5 and NumPy 2.4
        pytest.skip(f"Triton {importlib.metadata.version('triton')}'s interpreter cannot pass scalar kernel "
                    "arguments under this NumPy (Triton 3.9 can)")
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_without_triton_meshrun_logs_no_triton_warning():
    """In a subprocess where importing triton fails (as on torch's CPU builds, which do not depend on it, whether or
    not this machine has it): ``import meshrun.cli``, ``meshrun plan`` (which imports the loss kernels' module) and
    the operator's torch path leave no "Triton not available" (torch's triton_op logs it when it is defined) on
    stderr."""
    script = textwrap.dedent("""
        import sys

        class NoTriton:
            def find_spec(self, name, path=None, target=None):
                if name == "triton" or name.startswith("triton."):
                    raise ImportError(f"No module named {name!r}")
                return None

        sys.meta_path.insert(0, NoTriton())
        import meshrun.cli
        assert meshrun.cli.main(["plan", "--nodes", "1", "--gpus-per-node", "2", "--model", "small"]) in (0, None)
        import torch, torch.nn.functional as F
        from meshrun.parallel import triton_ce as tc
        assert not tc.available()
        x = torch.randn(6, 11)
        y = torch.randint(0, 11, (6,)); y[0] = -100
        torch.testing.assert_close(tc.cross_entropy_sum(x, y), F.cross_entropy(x, y, reduction="sum"))
        print("ok")
    """)
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
    assert "Triton not available" not in proc.stderr, proc.stderr[-3000:]


def test_auto_picks_triton_on_cuda_only_and_triton_elsewhere_is_refused():
    cpu = torch.device("cpu")
    assert resolve_cross_entropy("auto", cpu, compiled=True) == "torch"
    assert resolve_cross_entropy("torch", cpu, compiled=False) == "torch"
    with pytest.raises(ConfigError, match=r"^train.cross_entropy=triton needs a compiled step on a CUDA GPU .*this "
                                          r"run is on cpu\. Use --train.cross_entropy=auto"):
        resolve_cross_entropy("triton", cpu, compiled=True)
    with pytest.raises(ConfigError, match="train.cross_entropy"):
        load_config(None, ["--train.cross_entropy=liger"])
    job = load_config(None, [])
    assert job.train.cross_entropy == "auto"
    assert "| cross-entropy torch |" in describe_speed(job, cpu, None)
    assert "| cross-entropy on vocabulary shards (TP) |" in describe_speed(job, cpu, None, vocab_sharded=True)
    chunked = load_config(None, ["--train.loss=chunked"])
    assert "| cross-entropy chunked with the head |" in describe_speed(chunked, cpu, None)


def test_the_engine_loss_takes_the_kernels_only_for_cuda_tensors_in_a_compiled_step():
    """Selected, the training loss still runs torch's cross-entropy on CPU tensors, on DTensors and run eagerly."""
    logits, targets = _case(16, 64)
    logits, targets = logits.view(2, 8, 64), targets.view(2, 8)  # (B, T, V)
    try:
        select_cross_entropy("auto", torch.device("cpu"), compiled=True)
        assert not triton_ce._IN_USE[0]
        triton_ce.use(True)
        assert not triton_ce.in_use(logits)
        torch.testing.assert_close(token_loss_sum(logits, targets), _reference(logits, targets)[0])
    finally:
        triton_ce.use(False)


needs_gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("v", [50304, 50257, 1000])
@pytest.mark.parametrize("mode", ["eager", "compiled", "cuda-graphs"])
@pytest.mark.parametrize("_", [pytest.param(None, marks=needs_gpu)])
def test_kernels_on_a_gpu_equal_f_cross_entropy(dtype, v, mode, _):
    """Loss within 1e-5 relative of fp32 F.cross_entropy's, gradient within one step of ``dtype`` of it, over
    strided rows (a slice of wider logits); ignored targets get no gradient."""
    wide, targets = _case(512, v + 64, dtype=dtype, device="cuda")
    logits = wide[:, :v]  # rows 64 elements apart: the kernels take the row stride
    targets = targets.clamp(max=v - 1)  # ignored targets (-100) stay
    fn = triton_ce.cross_entropy_sum
    if mode != "eager":
        torch._dynamo.reset()  # 18 compilations of one function here: past dynamo's recompile limit otherwise
        fn = torch.compile(fn, fullgraph=True, mode="reduce-overhead" if mode == "cuda-graphs" else None)
    for _ in range(3 if mode == "cuda-graphs" else 1):  # graphs are recorded on a later call and replayed after
        loss, grad = _ours(fn, logits, targets)
    ref_loss, ref_grad = _reference(logits, targets)
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
    step = {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11, torch.float32: 2 ** -20}[dtype]  # at 0.5 to 1
    assert grad.dtype == dtype
    torch.testing.assert_close(grad.float(), ref_grad.float(), rtol=0, atol=2 * step)
    assert grad[::7].abs().max() == 0


@pytest.mark.parametrize("_", [pytest.param(None, marks=needs_gpu)])
def test_the_engine_loss_takes_the_kernel_in_a_compiled_step_on_a_gpu(_):
    """Selected, a compiled step's loss traces meshrun's operator (dynamo's graph holds it); run eagerly it does not."""
    logits, targets = _case(64, 1000, device="cuda")
    logits, targets = logits.view(2, 32, 1000), targets.view(2, 32)
    graphs = []

    def record(gm, _inputs):
        graphs.append(str(gm.graph))
        return gm.forward

    try:
        select_cross_entropy("auto", torch.device("cuda"), compiled=True)
        assert triton_ce._IN_USE[0] and not triton_ce.in_use(logits)  # eager: torch's
        torch._dynamo.reset()
        loss = torch.compile(token_loss_sum, backend=record, fullgraph=True)(logits, targets)
        assert "meshrun.cross_entropy_rows" in graphs[0], graphs[0]
        torch.testing.assert_close(loss, _reference(logits, targets)[0], rtol=1e-5, atol=1e-3)
    finally:
        triton_ce.use(False)
