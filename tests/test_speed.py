"""The performance choices, as resolved on this machine (CPU): what 'auto' means, what the header says, and the
refusals. The GPU side (no host sync in a step, float8 tracking bf16, DDP overlap parity) is in test_speed_gpu.py
and test_train_gpu.py."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from meshrun.config import ConfigError, ParallelConfig, load_config
from meshrun.comm.mesh import ParallelDims, choose_data_parallel
from meshrun.models.build import model_shape, model_spec
from meshrun.models.gpt import SIZES
from meshrun.models.gpt_spec import GPT_SPEC
from meshrun.parallel.apply import graphs_left_off, graphs_measured, reshard_after_forward, use_cuda_graphs
from meshrun.parallel.checks import check_cuda_graphs, check_layout, graphs_block_by_block, graphs_supported
from meshrun.parallel.engine import count_tensor, loss_function, token_loss_sum
from meshrun.parallel.async_tp import check_async_tp
from meshrun.parallel.float8 import check_float8
from meshrun.parallel.kernels import compile_enabled, describe_speed, inductor_mode, resolve_attention, select_attention
from test_train_guards import tiny_trainer

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")


def test_auto_compiles_on_gpus_only():
    assert compile_enabled("auto", torch.device("cuda", 0)) and not compile_enabled("auto", CPU)
    assert compile_enabled("true", CPU) and not compile_enabled("false", torch.device("cuda", 0))


@pytest.mark.parametrize("capability, compiles, bf16", [((9, 0), True, True), ((8, 0), True, True),
                                                         ((7, 5), True, False), ((6, 1), False, False)])
def test_auto_compile_and_dtype_follow_the_gpus_compute_capability(monkeypatch, capability, compiles, bf16):
    """A GPU without Triton support (before 7.0) is not compiled, one without bf16 (before 8.0) trains in fp32, and
    the header says why; explicit choices are kept. (This machine has no GPU: torch's answers are patched.)"""
    from meshrun.parallel.checks import compute_dtype
    from meshrun.parallel.module import layout_dims, resolve_compute_dtype

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    gpu = torch.device("cuda", 0)
    job = load_config(None, [])
    assert compile_enabled("auto", gpu) is compiles and compile_enabled("true", gpu)
    assert compute_dtype(job, gpu) is (torch.bfloat16 if bf16 else None)
    assert compute_dtype(load_config(None, ["--train.dtype=bf16"]), gpu) is torch.bfloat16
    assert resolve_compute_dtype("auto", layout_dims("fsdp", world_size=2), gpu) is (torch.bfloat16 if bf16 else None)
    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: True, raising=False)
    line = describe_speed(job, gpu, compute_dtype(job, gpu))
    major, minor = capability
    assert ("| fp32 (train.dtype=auto: no bf16 on compute capability" in line) is not bf16, line
    assert (f"compile off (train.compile=auto: Triton needs 7.0, this GPU has compute capability {major}.{minor})"
            in line) is not compiles, line


def test_attention_auto_keeps_torchs_order_on_cpu():
    assert resolve_attention("auto", CPU) == "default"
    assert resolve_attention("flash", CPU) == "flash"
    assert select_attention("auto", CPU) == "default"


def test_fsdp_reshard_choice():
    part = nn.Linear(4, 4)
    assert reshard_after_forward("auto", part, compute_dtype=torch.bfloat16, device=CPU)  # memory-lean off GPUs
    assert not reshard_after_forward("false", part, compute_dtype=torch.bfloat16, device=CPU)
    assert reshard_after_forward("true", part, compute_dtype=None, device=None)


def test_count_tensor_is_a_float_scalar():
    value = count_tensor(1024, CPU)
    assert value.shape == () and value.dtype == torch.float32 and value.item() == 1024.0


def test_uncompiled_loss_function_is_the_plain_loss():
    assert loss_function(False) is token_loss_sum


def test_float8_is_refused_on_cpu_with_the_option_named():
    with pytest.raises(ConfigError, match=r"^train.float8=true needs an NVIDIA GPU"):
        check_float8(CPU, tp=1)


def test_async_tp_needs_sequence_parallel_tp_cuda_and_compile():
    with pytest.raises(ConfigError, match="add --parallel.sequence_parallel=true"):
        load_config(None, ["--parallel.async_tp=true"])
    load_config(None, ["--parallel.async_tp=true", "--parallel.sequence_parallel=true"])  # statically fine
    gpu = torch.device("cuda", 0)
    for device, tp, compiled, message in ((gpu, 1, True, "parallel.tp >= 2"), (torch.device("cpu"), 2, True,
                                          "needs CUDA GPUs"), (gpu, 2, False, "--train.compile=true")):
        with pytest.raises(ConfigError, match=message):
            check_async_tp(device, tp=tp, compiled=compiled)
    check_async_tp(gpu, tp=2, compiled=True)  # nothing to refuse


def test_cuda_graphs_need_cuda_compile_and_a_layout_they_serve():
    gpu = torch.device("cuda", 0)
    for device, compiled, supported, message in ((CPU, True, True, "this run is on cpu. Drop --train.cuda_graphs"),
                                                  (gpu, False, True, "set --train.compile=true"),
                                                  (gpu, True, False, "not for FSDP, whose per-block hooks")):
        with pytest.raises(ConfigError, match=message):
            check_cuda_graphs(device, compiled=compiled, supported=supported, layout="FSDP")
    check_cuda_graphs(gpu, compiled=True, supported=True, layout="DDP")  # nothing to refuse
    job = load_config(None, ["--train.cuda_graphs=true", "--train.compile=true"])
    assert describe_speed(job, CPU, None, cuda_graphs=True).startswith(
        "speed: compile on with CUDA graphs (train.compile=true)")


def test_cuda_graphs_serve_whole_model_layouts_tp_and_pp():
    def dims(**degrees):
        return ParallelDims.from_config(ParallelConfig(**{"dp_replicate": 1} | degrees), world_size=4,
                                        gpus_per_node=4)

    assert graphs_supported(dims(dp_replicate=4)) and graphs_supported(dims(tp=4))  # DDP; TP block by block
    assert graphs_block_by_block(dims(tp=4)) and not graphs_block_by_block(dims(dp_replicate=4))
    assert graphs_block_by_block(dims(pp=4)) and graphs_block_by_block(dims(tp=2, pp=2))  # sends between graphs
    for schedule in ("interleaved1f1b", "interleavedzb", "loopedbfs"):  # several stages per rank: trained wrongly
        assert not graphs_supported(dims(pp=4, pp_schedule=schedule)), schedule
    assert graphs_supported(dims(pp=4, pp_schedule="gpipe"))
    assert not graphs_supported(dims(tp=4), async_tp=True)  # symmetric-memory kernels are not recorded
    for degrees in ({"tp": 2, "dp_shard": 2}, {"tp": 2, "dp_replicate": 2}, {"pp": 2, "dp_shard": 2},
                    {"pp": 2, "dp_replicate": 2}, {"tp": 2, "cp": 2}, {"dp_shard": 4}):
        assert not graphs_supported(dims(**degrees)), degrees


def test_cuda_graphs_auto_is_on_exactly_where_true_is_accepted():
    gpu = torch.device("cuda", 0)
    assert use_cuda_graphs("auto", gpu, compiled=True, supported=True)
    for device, compiled, supported in ((CPU, True, True), (gpu, False, True), (gpu, True, False)):
        assert not use_cuda_graphs("auto", device, compiled=compiled, supported=supported)  # no refusal
    assert not use_cuda_graphs("false", gpu, compiled=True, supported=True)
    assert not use_cuda_graphs("auto", gpu, compiled=True, supported=True, measured=False)  # float8...
    assert use_cuda_graphs("true", gpu, compiled=True, supported=True, measured=False)  # asked for
    job = load_config(None, ["--train.cuda_graphs=true", "--train.compile=true"])
    fsdp = ParallelDims.from_config(ParallelConfig(dp_shard=2), world_size=2, gpus_per_node=2)
    check_layout(job, GPT_SPEC, SIZES["tiny"], fsdp, device=gpu, compute_dtype=torch.bfloat16)  # the whole model
    per_block = load_config(None, ["--train.cuda_graphs=true", "--train.compile=true", "--parallel.fsdp_unit_blocks=1"])
    with pytest.raises(ConfigError, match="not for FSDP.*set --parallel.fsdp_unit_blocks=-1"):  # checked before any
        check_layout(per_block, GPT_SPEC, SIZES["tiny"], fsdp, device=gpu, compute_dtype=torch.bfloat16)  # group
    interleaved = ParallelDims.from_config(ParallelConfig(pp=2, dp_replicate=1, pp_schedule="interleaved1f1b"),
                                           world_size=2, gpus_per_node=2)
    with pytest.raises(ConfigError, match="^train.cuda_graphs=true: parallel.pp_schedule=interleaved1f1b runs several "
                                          "stages on each rank.*set --parallel.pp_schedule=1f1b"):
        check_layout(job, GPT_SPEC, SIZES["small"], interleaved, device=gpu, compute_dtype=torch.bfloat16)
    assert load_config(None, []).train.cuda_graphs == "auto"
    with pytest.raises(ConfigError, match="train.cuda_graphs='sometimes' is not one of auto, true, false"):
        load_config(None, ["--train.cuda_graphs=sometimes"])


def test_cuda_graphs_auto_only_for_steps_gpu_tests_ran_as_graphs():
    def measured(*args, **degrees):
        job = load_config(None, list(args))  # the dims from the job's own [parallel], as the trainer builds them
        dims = ParallelDims.from_config(dataclasses.replace(job.parallel, **{"dp_replicate": 1} | degrees),
                                        world_size=4, gpus_per_node=4)
        return graphs_measured(job, dims)

    assert measured(dp_replicate=4) and measured(tp=4) and measured(pp=2, dp_replicate=2)
    assert measured(pp=4)  # 1F1B of 4 stages: its 4-GPU test passed (4 H100s, 2026-11-28)
    eight = ParallelDims.from_config(ParallelConfig(pp=8, dp_replicate=1), world_size=8, gpus_per_node=8)
    assert not graphs_measured(load_config(None, []), eight)  # more micro-batches in flight than any GPU test ran
    assert measured(tp=2, pp=2)  # TP 2 x PP 2 with 1F1B: its 4-GPU test passed too
    assert not measured("--parallel.pp_schedule=gpipe", tp=2, pp=2)  # TP with GPipe: not run as graphs yet
    assert measured("--parallel.pp_schedule=gpipe", pp=2, dp_replicate=2)  # its GPU test passed (round 7)
    assert not measured("--parallel.pp_schedule=gpipe", pp=4)  # GPipe of 4 stages: not run as graphs yet
    assert not use_cuda_graphs("auto", torch.device("cuda", 0), compiled=True, measured=measured(pp=2, dp_replicate=2),
                               supported=graphs_supported(ParallelDims.from_config(
                                   ParallelConfig(pp=2, dp_replicate=1, pp_schedule="interleaved1f1b"), world_size=2)))
    assert not measured("--parallel.sequence_parallel=true", tp=4)
    assert not measured("--train.loss=chunked", dp_replicate=4)


def test_the_header_says_why_auto_left_cuda_graphs_off():
    gpu = torch.device("cuda", 0)

    def off(*args, **degrees):
        job = load_config(None, ["--train.compile=true", "--parallel.dp_replicate=1", *args,  # compile asked for
                                 *(f"--parallel.{name}={degree}" for name, degree in degrees.items())])
        return graphs_left_off(job, ParallelDims.from_config(job.parallel, world_size=4, gpus_per_node=4), gpu)

    assert off(dp_replicate=4) == off(tp=4) == ""  # auto records them
    assert off(dp_shard=4) == "FSDP's hooks or collectives run between the compiled graphs"  # block by block
    fsdp = load_config(None, ["--train.compile=true", "--parallel.dp_replicate=1", "--parallel.dp_shard=4"])
    assert graphs_left_off(fsdp, ParallelDims.from_config(fsdp.parallel, world_size=4, gpus_per_node=4), gpu,
                           whole_fsdp=True) == ""  # the whole model one unit: recorded
    assert off(pp=4) == off(tp=2, pp=2) == ""  # their 4-GPU tests passed
    assert off("--parallel.pp_schedule=gpipe", pp=4) == "PP 4 with gpipe not yet run as graphs on a GPU"
    assert off("--parallel.pp_schedule=gpipe", tp=2, pp=2) == (
        "TP with PP other than 2 stages of 1f1b not yet run as graphs on a GPU")
    assert off("--parallel.pp_schedule=interleaved1f1b", pp=2, dp_replicate=2) == (
        "parallel.pp_schedule=interleaved1f1b runs several stages per rank, which train wrongly as graphs")
    assert off("--train.float8=true", "--parallel.sequence_parallel=true", tp=4) == (
        "train.float8, sequence parallelism not yet run as graphs on a GPU")
    assert off("--train.cuda_graphs=false", dp_shard=4) == ""  # asked for: nothing to explain
    assert graphs_left_off(load_config(None, []), ParallelDims.from_config(ParallelConfig(), world_size=1), CPU) == ""
    job = load_config(None, ["--train.compile=true"])
    line = describe_speed(job, CPU, None, graphs_off="FSDP's hooks or collectives run between the compiled graphs")
    assert line.startswith("speed: compile on (train.compile=true; CUDA graphs off: FSDP's hooks or collectives ")
    assert "CUDA graphs off" not in describe_speed(job, CPU, None, cuda_graphs=True, graphs_off="x")


def test_ddp_graph_auto_splits_for_cuda_graphs_or_across_nodes():
    from meshrun.parallel.apply import ddp_graph_split

    one_node = ParallelDims.from_config(ParallelConfig(), world_size=8, gpus_per_node=8)
    two_nodes = ParallelDims.from_config(ParallelConfig(), world_size=16, gpus_per_node=8)
    unknown = ParallelDims.from_config(ParallelConfig(), world_size=2)
    assert not ddp_graph_split("auto", one_node, cuda_graphs=False)  # launched kernels within a node: one graph
    assert ddp_graph_split("auto", one_node, cuda_graphs=True)
    assert ddp_graph_split("auto", two_nodes, cuda_graphs=False) and ddp_graph_split("auto", unknown, cuda_graphs=False)
    assert ddp_graph_split("split", one_node, cuda_graphs=False)
    assert not ddp_graph_split("whole", two_nodes, cuda_graphs=True)
    from meshrun.parallel.apply import ddp_bucket_mb

    assert load_config(None, []).parallel.ddp_bucket_mb == 0  # auto
    assert ddp_bucket_mb(0, cuda_graphs=True) == 100 and ddp_bucket_mb(0, cuda_graphs=False) == 25
    assert ddp_bucket_mb(50, cuda_graphs=True) == 50
    with pytest.raises(ConfigError, match="parallel.ddp_bucket_mb"):
        load_config(None, ["--parallel.ddp_bucket_mb=-1"])


def test_ddp_graph_choices_are_checked():
    assert load_config(None, []).parallel.ddp_graph == "auto"
    assert load_config(None, ["--parallel.ddp_graph=whole"]).parallel.ddp_graph == "whole"
    with pytest.raises(ConfigError, match="parallel.ddp_graph='one' is not one of auto, split, whole"):
        load_config(None, ["--parallel.ddp_graph=one"])


def test_step_collector_freezes_after_the_first_step_and_restores_the_interpreter():
    import gc
    import weakref

    from meshrun.train.gc_control import StepCollector

    assert gc.isenabled()
    collector = StepCollector(every=3)
    try:
        assert not gc.isenabled()  # no automatic collection inside a step
        collector.step(1)
        assert gc.get_freeze_count() > 0  # what the first step left alive is frozen
        class Node:
            pass

        node = Node()
        node.me = node  # a reference cycle: only a collection frees it
        alive = weakref.ref(node)
        del node
        collector.step(2)
        assert alive() is not None  # not a collection step
        collector.step(3)
        assert alive() is None  # every 3 steps
    finally:
        collector.close()
    assert gc.isenabled() and gc.get_freeze_count() == 0
    off = StepCollector(every=0)
    off.step(1)
    assert gc.isenabled() and gc.get_freeze_count() == 0
    off.close()


def test_header_line_names_the_choices():
    job = load_config(None, ["--train.grad_clip=0"])
    line = describe_speed(job, CPU, None)
    assert line == ("speed: compile off (train.compile=auto) | fp32 | attention default | cross-entropy torch | "
                    "AdamW (single-tensor) | no grad clip")
    assert "| bf16 autocast |" in describe_speed(job, CPU, torch.bfloat16)
    assert "| bf16 parameters (FSDP2), fp32 gradient reduction |" in describe_speed(job, CPU, torch.bfloat16, fsdp=True)
    bf16 = load_config(None, ["--parallel.grad_reduce_dtype=bf16"])
    fsdp_line = describe_speed(bf16, CPU, torch.bfloat16, fsdp=True)
    assert "| bf16 parameters (FSDP2), bf16 gradient reduction |" in fsdp_line
    assert "| bf16 autocast, bf16 gradient all-reduce |" in describe_speed(bf16, CPU, torch.bfloat16)
    compiled = load_config(None, ["--train.compile=true"])
    assert describe_speed(compiled, CPU, None, split_backward=True).startswith(
        "speed: compile on, linear layers eager for the zero-bubble schedule (train.compile=true) |")


def test_train_prints_the_speed_line_and_refuses_float8_on_cpu(tmp_path):
    base = [sys.executable, "-m", "meshrun", "train", "--train.steps=2", "--train.eval_every=0",
            "--data.max_bytes=200000", "--checkpoint.final=false", f"--run.dir={tmp_path}"]
    ok = subprocess.run(base, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "speed: compile off (train.compile=auto) | fp32 | attention default" in ok.stdout
    bad = subprocess.run([*base, "--train.float8=true"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0
    assert "train.float8=true needs an NVIDIA GPU" in bad.stderr + bad.stdout
    uncompiled = subprocess.run([*base, "--train.compile_mode=max-autotune"], cwd=ROOT, capture_output=True,
                                text=True, timeout=300)
    assert uncompiled.returncode != 0
    assert ("train.compile_mode=max-autotune needs compilation, which train.compile=auto leaves off on cpu: set "
            "--train.compile=true or drop --train.compile_mode") in uncompiled.stderr.splitlines()[0]


def test_compile_mode_names_torchs_mode_and_the_header_says_it():
    assert inductor_mode("default", cuda_graphs=False) is None
    assert inductor_mode("default", cuda_graphs=True) == "reduce-overhead"
    assert inductor_mode("max-autotune", cuda_graphs=True) == "max-autotune"
    assert inductor_mode("max-autotune", cuda_graphs=False) == "max-autotune-no-cudagraphs"
    job = load_config(None, ["--train.compile=true", "--train.compile_mode=max-autotune"])
    assert describe_speed(job, CPU, None).startswith("speed: compile on, max-autotune (train.compile=true) |")
    with pytest.raises(ConfigError, match="train.compile_mode='fast' is not one of default, max-autotune"):
        load_config(None, ["--train.compile_mode=fast"])


def test_data_parallel_auto_shards_large_models_on_gpus():
    default = ParallelConfig()
    one_b_job, small_job = load_config(None, ["--model.name=1b"]), load_config(None, ["--model.name=124m"])
    one_b = model_spec(one_b_job).count_params(model_shape(one_b_job))
    small = model_spec(small_job).count_params(model_shape(small_job))
    assert one_b > 1e9 > small
    chosen, note = choose_data_parallel(default, params=one_b, on_gpu=True)
    assert (chosen.dp_replicate, chosen.dp_shard) == (1, -1) and note.startswith("data parallelism: FSDP2")
    assert choose_data_parallel(default, params=one_b, on_gpu=False) == (default, "")  # CPU: DDP
    assert choose_data_parallel(default, params=small, on_gpu=True) == (default, "")  # small: DDP
    explicit = ParallelConfig(dp_replicate=2, dp_shard=1)
    assert choose_data_parallel(explicit, params=one_b, on_gpu=True) == (explicit, "")  # explicit degrees win
    with_tp = ParallelConfig(tp=2)
    assert choose_data_parallel(with_tp, params=one_b, on_gpu=True) == (with_tp, "")
    forced, note = choose_data_parallel(ParallelConfig(data_parallel="fsdp"), params=small, on_gpu=False)
    assert (forced.dp_replicate, forced.dp_shard) == (1, -1) and "parallel.data_parallel=fsdp" in note
    assert choose_data_parallel(ParallelConfig(data_parallel="ddp"), params=one_b, on_gpu=True)[1] == ""
    # one process: nothing is sharded, and the header says so rather than "FSDP2 over every data-parallel rank"
    _, alone = choose_data_parallel(ParallelConfig(data_parallel="fsdp"), params=small, on_gpu=True, world_size=1)
    assert alone.startswith("data parallelism: one process holds the whole model, nothing to shard"), alone
    assert choose_data_parallel(default, params=one_b, on_gpu=True, world_size=1)[1] == ""  # auto: nothing to say


def test_data_parallel_choice_is_validated():
    with pytest.raises(ConfigError, match="parallel.data_parallel='zero' is not one of auto, ddp, fsdp"):
        load_config(None, ["--parallel.data_parallel=zero"])


@pytest.mark.slow
def test_launch_with_data_parallel_fsdp_trains_sharded(tmp_path):
    cmd = [sys.executable, "-m", "meshrun", "launch", "--nproc-per-node", "2", "train", "--train.steps=2",
           "--train.eval_every=0", "--data.max_bytes=200000", "--checkpoint.final=false", f"--run.dir={tmp_path}",
           "--parallel.data_parallel=fsdp", "--health.check_versions=false"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "dp_replicate 1 x dp_shard 2" in proc.stdout and "| FSDP" in proc.stdout
    assert "data parallelism: FSDP2 over every data-parallel rank (parallel.data_parallel=fsdp)" in proc.stdout
    # the header counts the parameters this rank holds: half the model's (metrics.jsonl's start record) under FSDP 2
    start = next(json.loads(line) for line in next(tmp_path.rglob("metrics.jsonl")).read_text().splitlines()
                 if json.loads(line).get("kind") == "start")
    on_rank = float(re.search(r"([\d.]+)M parameters on this rank", proc.stdout).group(1)) * 1e6
    assert abs(on_rank - start["params"] / 2) <= 0.01e6, (on_rank, start["params"])


@pytest.mark.parametrize("max_norm", [0.5, 1000.0])  # clipping active, and a limit the gradients stay under
def test_fused_adamw_clips_through_grad_scale_like_scaling_the_gradients(max_norm):
    """The trainer hands a fused AdamW the clip as its grad_scale (no pass of its own over the gradients); the
    weights after three steps equal those of clipping the gradients in place first (to float rounding)."""
    from meshrun.parallel.grad_norm import clip_divisor, clip_grad_norm, total_grad_norm

    torch.manual_seed(0)
    scaled = [nn.Parameter(torch.randn(64, 32)) for _ in range(3)]
    initial = [p.detach().clone() for p in scaled]
    folded = [nn.Parameter(p.detach().clone()) for p in scaled]
    opt_scaled = torch.optim.AdamW(scaled, lr=1e-2, weight_decay=0.1, fused=True)
    opt_folded = torch.optim.AdamW(folded, lr=1e-2, weight_decay=0.1, fused=True)
    for step in range(3):
        grads = [torch.randn(64, 32) * (step + 1) for _ in scaled]
        for p, q, g in zip(scaled, folded, grads):
            p.grad, q.grad = g.clone(), g.clone()
        before = clip_grad_norm(scaled, max_norm)
        opt_scaled.step()
        total = total_grad_norm(folded)
        opt_folded.grad_scale = clip_divisor(total, max_norm)
        opt_folded.step()
        assert float(total) == pytest.approx(float(before), rel=1e-6)
        assert (float(total) > max_norm) == (max_norm == 0.5)  # the gradients' norms are 30 to 150
    for p, q, p0 in zip(scaled, folded, initial):
        assert (p - q).abs().max() < 1e-6
        assert (p - p0).abs().max() > 1e-2  # the steps moved the weights


def test_logged_tokens_per_second_count_the_log_steps_own_work(tmp_path):
    """The work done at a log step (the straggler and system-metrics gathers, the records) is training's own cost:
    the next interval starts when the last one was measured, not after that work, so the intervals tile the
    training time and tokens/s is what the wall clock says. Here that work is made to take 0.4 s."""
    trainer = tiny_trainer(tmp_path)  # 6 steps, a log step every 2
    log_interval = trainer.system.log_interval
    trainer.system.log_interval = lambda *args: time.sleep(0.4) or log_interval(*args)
    trainer.fit()
    trainer.close()
    train = [r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]
    assert [r["step"] for r in train] == [2, 4, 6]
    for record in train[1:]:  # each interval after the first holds the 0.4 s of the log step before it
        assert record["step_time_s"] * 2 >= 0.4
