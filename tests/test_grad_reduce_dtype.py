"""parallel.grad_reduce_dtype=bf16: DDP (torch's bf16 compression hook) and FSDP2 (its reduce dtype) sum gradients
in bf16, and training still follows the single process (CPU, gloo, 2 ranks).

Each layout runs the 10-step parity run of tests/test_parallel_layouts.py from the reference's initial weights.
What bf16 reduction changes is checked directly: after one forward and backward every reduced gradient element is
a bf16 value (fp32 reduction leaves values bf16 cannot hold), and each gradient tensor is within 1e-2 relative
error (its norm) of the fp32 reduction's (seen up to 2.6e-3). That check is the sharp one: a missing sync or a
wrong scale puts a tensor ~100% off. The trajectory is compared with the reference at looser tolerances than the
fp32 layouts': losses atol 2e-3 (losses are ~5.5; seen up to 2e-4), final parameters atol 2e-2 (seen up to 6.6e-3;
the weights move by up to 3e-3 per AdamW step).

The default, auto, sums in bf16 only for FSDP2 without replicas computing in bf16 on the GPUs of one node with one
micro-batch per step: which runs it picks is checked without GPUs.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from meshrun.comm.mesh import ParallelDims
from meshrun.config import ParallelConfig, load_config
from meshrun.parallel.kernels import describe_speed
from test_parallel_layouts import Layout, build, full_state, load_full, model_config, rank_share, reference_run, train

LAYOUTS = {
    "ddp2": Layout(tied=True, grad_accum=2, parallel={"dp_replicate": 2, "grad_reduce_dtype": "bf16"}),
    "fsdp2": Layout(tied=True, grad_accum=2, parallel={"dp_replicate": 1, "dp_shard": 2,
                                                       "grad_reduce_dtype": "bf16"}),
}
LOSS_ATOL, PARAM_ATOL = 2e-3, 2e-2


def _grads(engine) -> dict[str, torch.Tensor]:
    out = {}
    for part in engine.model_parts:
        for name, p in part.named_parameters():
            g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            out[name] = g.detach().clone()
    return out


def _first_grads(layout: Layout, initial: dict, reduce: str) -> dict[str, torch.Tensor]:
    parallel = layout.parallel | {"grad_reduce_dtype": reduce}
    _, engine = build(model_config(tied=layout.tied), parallel, grad_accum=1)
    load_full(engine, initial)
    inputs, targets = rank_share(0, engine.dp_rank, engine.dp_size)
    engine.forward_backward([(inputs, targets)])
    return _grads(engine)


def _worker(rank: int, world_size: int, initial: dict) -> dict:
    out = {}
    for name, layout in LAYOUTS.items():
        bf16, fp32 = _first_grads(layout, initial, "bf16"), _first_grads(layout, initial, "fp32")
        _, engine = build(model_config(tied=layout.tied), layout.parallel, grad_accum=layout.grad_accum)
        load_full(engine, initial)
        result = train(engine, grad_accum=layout.grad_accum)
        out[name] = result | {"bf16": bf16, "fp32": fp32, "state": full_state(engine)}
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def runs():
    reference = reference_run(tied=True)
    return reference, run_distributed(_worker, 2, reference["initial"], timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_bf16_gradient_reduction_sums_in_bf16_and_trains_like_one_process(name, runs):
    reference, per_rank = runs
    for rank, result in enumerate(per_rank):
        r = result[name]
        assert all(torch.equal(g, g.bfloat16().float()) for g in r["bf16"].values()), \
            f"{name} rank {rank}: a gradient was not reduced in bf16"
        assert any(not torch.equal(g, g.bfloat16().float()) for g in r["fp32"].values()), \
            f"{name} rank {rank}: fp32 reduction gave bf16 values too, so the check above would prove nothing"
        for key, g in r["fp32"].items():  # per tensor: an element summed from opposite signs may lose all digits
            error = (r["bf16"][key] - g).norm() / g.norm()
            assert error < 1e-2, f"{name} rank {rank}: {key}'s gradient is {error:.1e} off the fp32 reduction's"
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(reference["losses"]), rtol=0,
                                   atol=LOSS_ATOL)
        assert r["val"] == pytest.approx(reference["val"], abs=LOSS_ATOL)
        for key, expected in reference["state"].items():
            torch.testing.assert_close(r["state"][key], expected, rtol=0, atol=PARAM_ATOL,
                                       msg=lambda m: f"{name}: parameter {key}: {m}")


# ---- Session.prepare_model(grad_reduce_dtype=...) on a user's model ------------------------------------------------

def _session_worker(rank: int, world_size: int) -> dict:
    from mlp_lm import MLPLM

    from meshrun import Session
    from meshrun.config import ConfigError

    out = {}
    tokens = torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(3))[rank * 4:(rank + 1) * 4]
    for layout in ("ddp", "fsdp"):
        for reduce in ("bf16", "fp32"):
            session = Session(seed=0)
            model = session.prepare_model(MLPLM(), layout=layout, grad_reduce_dtype=reduce)
            logits = model(tokens[:, :-1])
            torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
            grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in model.parameters()]
            out[layout, reduce] = all(torch.equal(g, g.bfloat16().float()) for g in grads)
            out[layout, reduce, "line"] = session.layout.describe(session.device, "auto")
    try:
        Session(seed=0).prepare_model(MLPLM(), layout="ddp", grad_reduce_dtype="fp16")
    except ConfigError as exc:
        out["refused"] = str(exc)
    return out


@pytest.mark.slow
def test_session_sums_gradients_in_the_dtype_asked_and_refuses_another():
    result = run_distributed(_session_worker, 2, init_pg=False, timeout=300)[0]
    assert result["ddp", "bf16"] and result["fsdp", "bf16"], "grad_reduce_dtype='bf16' did not reach the reduction"
    assert not result["ddp", "fp32"] and not result["fsdp", "fp32"]
    assert "; gradients summed in bf16;" in result["fsdp", "bf16", "line"]
    assert "bf16" not in result["ddp", "fp32", "line"]  # the start-up line says it only when chosen
    assert "gradients summed in bf16" in result["ddp", "bf16", "line"]
    assert result["refused"].splitlines()[0].startswith("grad_reduce_dtype='fp16': choose one of fp32, bf16")


# ---- grad_reduce_dtype=auto: which runs sum in bf16 -----------------------------------------------------------------

def _dims(world: int, gpus_per_node: int, **degrees) -> ParallelDims:
    parallel = ParallelConfig(**({"dp_replicate": 1, "dp_shard": -1} | degrees))
    return ParallelDims.from_config(parallel, world_size=world, gpus_per_node=gpus_per_node)


@pytest.mark.parametrize("world, gpus_per_node, degrees, accum, compute, device, expected", [
    (2, 2, {}, 1, torch.bfloat16, "cuda", True),  # the 1b default on 2 GPUs: FSDP2 in bf16 on one node
    (8, 8, {}, 1, torch.bfloat16, "cuda", True),
    (4, 4, {"tp": 2}, 1, torch.bfloat16, "cuda", True),  # TP x FSDP2
    (2, 2, {}, 2, torch.bfloat16, "cuda", False),  # accumulation: FSDP2 would add micro-batches in bf16
    (4, 4, {"pp": 2}, 1, torch.bfloat16, "cuda", False),  # a pipeline's micro-batches, likewise
    (2, 2, {"tp": 2, "dp_shard": 1}, 1, torch.bfloat16, "cuda", False),  # no data parallelism: FSDP2 not used
    (2, 2, {"dp_replicate": 2, "dp_shard": 1}, 1, torch.bfloat16, "cuda", False),  # DDP: the hook is slower
    (4, 4, {"dp_replicate": 2, "dp_shard": 2}, 1, torch.bfloat16, "cuda", False),  # HSDP: replicas' sums stay fp32
    (4, 2, {}, 1, torch.bfloat16, "cuda", False),  # two nodes
    (2, 0, {}, 1, torch.bfloat16, "cuda", False),  # processes per node unknown
    (2, 2, {}, 1, None, "cuda", False),  # fp32 compute
    (2, 2, {}, 1, torch.bfloat16, "cpu", False),
])
def test_auto_sums_fsdp2_gradients_in_bf16_on_one_node_with_one_micro_batch(world, gpus_per_node, degrees, accum,
                                                                            compute, device, expected):
    from meshrun.parallel.checks import grad_reduce_bf16

    dims = _dims(world, gpus_per_node, **degrees)
    job = load_config(None, [])
    assert job.parallel.grad_reduce_dtype == "auto"
    assert grad_reduce_bf16(job, dims, compute, torch.device(device), grad_accum=accum) is expected
    for choice in ("fp32", "bf16"):  # an explicit choice is kept
        job = load_config(None, [f"--parallel.grad_reduce_dtype={choice}"])
        assert grad_reduce_bf16(job, dims, compute, torch.device(device), grad_accum=accum) is (choice == "bf16")


def test_speed_line_names_the_resolved_reduction():
    job = load_config(None, [])
    cpu = torch.device("cpu")
    assert "| bf16 parameters (FSDP2), bf16 gradient reduction |" in describe_speed(job, cpu, torch.bfloat16,
                                                                                     fsdp=True, reduce_bf16=True)
    assert "| bf16 parameters (FSDP2), fp32 gradient reduction |" in describe_speed(job, cpu, torch.bfloat16,
                                                                                     fsdp=True, reduce_bf16=False)
    assert "| bf16 parameters (FSDP2), fp32 gradient reduction |" in describe_speed(job, cpu, torch.bfloat16, fsdp=True)


def test_bf16_asked_for_with_accumulation_under_fsdp2_is_warned_about():
    """FSDP2 keeps an fp32 running sum of a step's micro-batches only when its reduce dtype differs from the
    gradients': bf16 asked for with several micro-batches adds them in bf16, and the start-up log says so."""
    from meshrun.parallel.checks import bf16_accumulation_note

    asked = load_config(None, ["--parallel.grad_reduce_dtype=bf16"])
    fsdp = _dims(2, 2)
    note = bf16_accumulation_note(asked, fsdp, reduce_bf16=True, grad_accum=4)
    assert note.startswith("parallel.grad_reduce_dtype=bf16 with FSDP2 and 4 micro-batches per step: FSDP2 adds their "
                           "gradients in bf16"), note
    assert "--parallel.grad_reduce_dtype=auto (or fp32)" in note
    pipeline = _dims(4, 4, pp=2)
    pipeline.resolve_pipeline_batch(8, seq_len=64)
    assert f"and {pipeline.pp_microbatches} micro-batches" in bf16_accumulation_note(asked, pipeline, reduce_bf16=True,
                                                                                    grad_accum=1)
    assert not bf16_accumulation_note(asked, fsdp, reduce_bf16=True, grad_accum=1)  # one micro-batch: nothing added
    assert not bf16_accumulation_note(asked, _dims(2, 2, dp_replicate=2, dp_shard=1), reduce_bf16=True,
                                      grad_accum=4)  # DDP's compression hook reduces every step's fp32 sum
    auto = load_config(None, [])  # auto never picks bf16 there, and says nothing
    assert not bf16_accumulation_note(auto, fsdp, reduce_bf16=False, grad_accum=4)
