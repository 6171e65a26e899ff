"""LocalShardAdamW (meshrun.parallel.local_adamw): torch's AdamW stepping DTensor parameters on their local shards,
bitwise equal to torch's own step through DTensor, without dispatching the update through DTensor."""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch
import torch.distributed as dist
from torch import nn

from meshrun.parallel.local_adamw import LocalShardAdamW


def _pair(params_a, params_b, **kwargs):
    groups = lambda ps: [{"params": ps[:-1], "weight_decay": 0.1}, {"params": ps[-1:], "weight_decay": 0.0}]  # noqa: E731
    return (torch.optim.AdamW(groups(params_a), lr=1e-2, betas=(0.9, 0.95), **kwargs),
            LocalShardAdamW(groups(params_b), lr=1e-2, betas=(0.9, 0.95), **kwargs))


def _twin_params():
    params_a = [nn.Parameter(torch.randn(8, 4)), nn.Parameter(torch.randn(4))]
    return params_a, [nn.Parameter(p.detach().clone()) for p in params_a]


def _local(t):
    from torch.distributed.tensor import DTensor
    return t._local_tensor if isinstance(t, DTensor) else t


def _assert_same(opt_a, opt_b, params_a, params_b):
    for a, b in zip(params_a, params_b):
        assert torch.equal(_local(a), _local(b))
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(_local(opt_a.state[a][key]), _local(opt_b.state[b][key])), key


def live_specs(spec_type) -> int:
    gc.collect()
    return sum(isinstance(o, spec_type) for o in gc.get_objects())


@contextlib.contextmanager
def dtensor_ops():
    """The aten ops called on DTensor arguments while the block runs (DTensor's dispatch runs each of them)."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    seen: list[str] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(isinstance(x, DTensor) for x in tree_leaves((args, kwargs or {}))):
                seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Record():
        yield seen


@pytest.mark.parametrize("fused", [True, False])
def test_plain_tensors_step_like_torchs_adamw_and_share_its_state_dict(fused):
    torch.manual_seed(0)
    params_a, params_b = _twin_params()
    opt_a, opt_b = _pair(params_a, params_b, fused=fused)
    for step in range(3):
        for a, b in zip(params_a, params_b):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        if fused:  # the trainer's clipping and non-finite guard: no update where found_inf is 1 (step 1)
            for opt in (opt_a, opt_b):
                opt.grad_scale, opt.found_inf = torch.tensor(1.5), torch.tensor(float(step == 1))
        opt_a.step()
        opt_b.step()
    _assert_same(opt_a, opt_b, params_a, params_b)
    reloaded = torch.optim.AdamW([{"params": params_a[:-1]}, {"params": params_a[-1:]}], fused=fused)
    reloaded.load_state_dict(opt_b.state_dict())  # the same state layout as torch's AdamW
    assert reloaded.state_dict()["state"].keys() == opt_a.state_dict()["state"].keys()


def test_a_closure_makes_the_gradients_before_the_step_as_in_torch():
    torch.manual_seed(0)
    params_a, params_b = _twin_params()
    opt_a, opt_b = _pair(params_a, params_b)
    for _ in range(3):
        losses = []
        for opt, params in ((opt_a, params_a), (opt_b, params_b)):
            def closure(opt=opt, params=params):
                opt.zero_grad(set_to_none=True)  # no gradient until the closure runs
                loss = sum((q ** 2).sum() for q in params)
                loss.backward()
                return loss
            losses.append(opt.step(closure))
        assert torch.equal(losses[0], losses[1])
    _assert_same(opt_a, opt_b, params_a, params_b)


def _fsdp_worker(rank: int, world_size: int, device_type: str = "cpu") -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    if device_type == "cuda":
        from datetime import timedelta
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world_size, timeout=timedelta(seconds=120),
                                device_id=torch.device("cuda", rank))
    torch.set_default_device(device_type if device_type == "cpu" else f"cuda:{rank}")
    mesh = init_device_mesh(device_type, (world_size,))
    out = {}
    for kind in ("fused", "foreach", "for-loop"):  # the update's three kernels in torch (for-loop: CPU's default)
        fused = kind == "fused"
        models = []
        for _ in range(2):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 8))
            fully_shard(model, mesh=mesh)
            models.append(model)
        params_a, params_b = list(models[0].parameters()), list(models[1].parameters())
        opt_a, opt_b = _pair(params_a, params_b, **({"for-loop": {"foreach": False}}.get(kind, {kind: True})))
        torch.manual_seed(1 + rank)
        specs = []
        for step in range(4):
            x = torch.randn(4, 16)
            for model in models:
                model(x).square().mean().backward()
            if fused:
                for opt in (opt_a, opt_b):
                    opt.grad_scale, opt.found_inf = torch.tensor(1.25), torch.tensor(float(step == 2))
            with dtensor_ops() as torch_ops:
                opt_a.step()
            before = live_specs(DTensorSpec)
            with dtensor_ops() as local_ops:
                opt_b.step()
            specs.append(live_specs(DTensorSpec) - before)  # what this step left alive
            for opt in (opt_a, opt_b):
                opt.zero_grad(set_to_none=True)
        _assert_same(opt_a, opt_b, params_a, params_b)
        assert all(isinstance(p, DTensor) for p in params_b)
        out[kind] = {"torch_ops": torch_ops, "local_ops": local_ops, "specs": specs}

    # a Partial gradient on a replicated parameter: DTensor reduces it first, so the step stays torch's
    def replicated():
        torch.manual_seed(2)
        return [nn.Parameter(distribute_tensor(torch.randn(6, 3), mesh, [Replicate()])),
                nn.Parameter(distribute_tensor(torch.ones(3), mesh, [Replicate()]))]

    params_a, params_b = replicated(), replicated()
    opt_a, opt_b = _pair(params_a, params_b, fused=True)
    for a, b in zip(params_a, params_b):
        local = torch.full(a.shape, float(rank + 1))
        a.grad = DTensor.from_local(local, mesh, [Partial()], run_check=False)
        b.grad = DTensor.from_local(local.clone(), mesh, [Partial()], run_check=False)
    hook_calls = []
    opt_b.register_step_post_hook(lambda *_: hook_calls.append(1))
    opt_a.step()  # torch has wrapped AdamW's step with its hook runner by now (opt_a is one)
    with dtensor_ops() as partial_ops:
        opt_b.step()
    _assert_same(opt_a, opt_b, params_a, params_b)
    out["partial_hook_calls"] = len(hook_calls)
    out["partial_ops"] = partial_ops
    if device_type == "cuda":
        dist.destroy_process_group()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("device_type", [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                     reason="needs a CUDA GPU")]),
])
def test_fsdp2_shards_step_locally_like_torchs_adamw(device_type):
    from dist_utils import run_distributed

    # two ranks; on a machine with one GPU, FSDP2 over a mesh of one (its parameters are DTensors all the same)
    world_size = 2 if device_type == "cpu" else min(2, torch.cuda.device_count())
    for result in run_distributed(_fsdp_worker, world_size, device_type, init_pg=device_type == "cpu"):
        for kind in ("fused", "foreach", "for-loop"):
            ran = result[kind]
            # torch's AdamW dispatches its update through DTensor; this one hands the kernels the local shards
            assert ran["torch_ops"], kind
            assert ran["local_ops"] == [], ran["local_ops"]
            # after the first step (which builds the moments) no DTensorSpec is left behind (pytorch/pytorch#188174:
            # torch's fused AdamW over DTensors left one per parameter per step on torch 2.10 and 2.11)
            assert ran["specs"][1:] == [0, 0, 0], ran["specs"]
        assert any("adam" in op for op in result["partial_ops"]), "a Partial gradient goes through DTensor"
        assert result["partial_hook_calls"] == 1, "the step's hooks run once on torch's path too"


@pytest.mark.parametrize("loop", ["single-tensor", "for-each"])
def test_the_start_up_line_names_the_adamw_loop_that_runs(monkeypatch, loop):
    """The 'foreach' kernel gives torch neither foreach nor fused (as the trainer builds it): torch then picks its
    for-each kernels on CUDA and one tensor at a time on CPU, and the speed line says which."""
    import torch.optim.adam as torch_adam

    from meshrun.config import load_config
    from meshrun.parallel.kernels import describe_speed, resolve_adamw_kernel

    ran = []
    for name in ("_single_tensor_adam", "_multi_tensor_adam"):
        real = getattr(torch_adam, name)
        monkeypatch.setattr(torch_adam, name,
                            lambda *a, _real=real, _name=name, **k: (ran.append(_name), _real(*a, **k)))
    device = torch.device("cpu")
    if loop == "for-each":  # as on a CUDA GPU: torch's rule for the devices with for-each kernels says cpu too
        import torch.optim.optimizer as torch_optimizer

        monkeypatch.setattr(torch_optimizer, "_get_foreach_kernels_supported_devices", lambda: ["cuda", "cpu"])
    job = load_config(None, ["--train.fused_optimizer=false"])
    kernel = resolve_adamw_kernel(job, device)
    params = [nn.Parameter(torch.randn(8, 4)), nn.Parameter(torch.randn(4))]
    opt = LocalShardAdamW(params, lr=1e-2, fused=kernel != "foreach" or None)  # the trainer's arguments
    sum(p.sum() for p in params).backward()
    opt.step()
    assert ran == [{"single-tensor": "_single_tensor_adam", "for-each": "_multi_tensor_adam"}[loop]]
    assert f"| AdamW ({loop}) |" in describe_speed(job, device, None)
