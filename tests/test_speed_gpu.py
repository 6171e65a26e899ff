"""The fast path on a GPU keeps the math (run on the GPU machine: ``pytest -m gpu tests/test_speed_gpu.py``).

* A training step makes no host-device synchronisation: with ``torch.cuda.set_sync_debug_mode("error")`` any
  synchronising call inside ``Trainer.train_step`` raises (metrics are read only at log steps).
* float8 matmuls (torchao) track bf16: over 200 steps of the small model (dim 256), every loss logged from step 100
  on is within 4% of the bf16 run's. Measured on an H100: float8 lags by 2-3% there (0.05-0.065 at a loss of about
  2.4; its tensorwise scales cost some precision at this small width, less at the 1b model's); a broken scaling
  stalls or diverges by far more.
* CUDA graphs (``train.cuda_graphs``: the whole step, or TP's and PP's blocks one by one), the chunked loss, the
  Triton cross-entropy (``train.cross_entropy``), the Triton AdamW (``train.adamw_kernel``) and the bf16 weight
  copies (``train.weight_copies``) track the plain compiled step.
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--model.name=small", "--train.log_every=10", "--train.eval_every=0", "--checkpoint.final=false",
         "--data.max_bytes=2000000", "--run.progress=lines"]


def test_train_step_makes_no_host_sync(tmp_path):
    from meshrun.config import load_config
    from meshrun.train.trainer import Trainer

    job = load_config(None, [*SMALL, "--train.steps=20", "--health.check_versions=false", f"--run.dir={tmp_path}"])
    assert job.train.compile == "auto"  # the default: on, on a GPU
    trainer = Trainer(job)
    try:
        for _ in range(3):  # compile and allocator warm-up
            trainer.train_step()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(5):
                trainer.train_step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
    finally:
        trainer.close()


def _records(run_dir: Path, *extra: str, gpus: int = 1) -> list[dict]:
    """The train records of `meshrun train` on the small model (200 steps unless ``extra`` says otherwise)."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{os.environ.get('PYTHONPATH', '')}"}
    launch = ["launch", "--standalone", f"--nproc-per-node={gpus}"] if gpus > 1 else []
    cmd = [sys.executable, "-m", "meshrun", *launch, "train", *SMALL, "--train.steps=200", f"--run.dir={run_dir}",
           *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["kind"] == "train"]


def _train(run_dir: Path, *extra: str) -> list[float]:
    return [r["loss"] for r in _records(run_dir, *extra)]


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao (the .[float8] extra) not installed")
@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                    reason="float8 matmuls need compute capability 8.9 or newer")
def test_float8_tracks_bf16_over_200_steps(tmp_path):
    bf16 = _train(tmp_path / "bf16")
    fp8 = _train(tmp_path / "fp8", "--train.float8=true")
    assert len(bf16) == len(fp8) == 20
    pairs = [(round(a, 4), round(b, 4)) for a, b in zip(bf16, fp8)]
    print("(bf16, float8) loss every 10 steps:", pairs)
    late = [abs(b - a) / a for a, b in zip(bf16[9:], fp8[9:])]  # the records of steps 100..200
    assert max(late) < 0.04, pairs
    assert fp8[-1] < fp8[0] - 1.0, pairs  # it trained


def test_chunked_loss_tracks_the_full_loss_over_200_steps(tmp_path):
    """train.loss=chunked differs from the full loss only in the order of its sums: every loss from step 100 on
    within 2% at lr 1e-3 (bf16 rounding differences between the two runs grow, as between any two bf16 runs)."""
    full = _train(tmp_path / "full", "--train.lr=1e-3")
    chunked = _train(tmp_path / "chunked", "--train.lr=1e-3", "--train.loss=chunked")
    pairs = [(round(a, 4), round(b, 4)) for a, b in zip(full, chunked)]
    print("(full, chunked) loss every 10 steps:", pairs)
    assert max(abs(b - a) / a for a, b in zip(full[9:], chunked[9:])) < 0.02, pairs


def test_cuda_graphs_train_like_launched_kernels_over_200_steps(tmp_path):
    """train.cuda_graphs replays the same compiled kernels: the same computation, so every loss from step 100 on
    within 2% at lr 1e-3 (the tolerance of two bf16 runs, as for the chunked loss); a graph replaying stale inputs
    or overwritten outputs would not train."""
    launched = _train(tmp_path / "launched", "--train.lr=1e-3")
    graphed = _train(tmp_path / "graphed", "--train.lr=1e-3", "--train.cuda_graphs=true")
    pairs = [(round(a, 4), round(b, 4)) for a, b in zip(launched, graphed)]
    print("(launched, CUDA graphs) loss every 10 steps:", pairs)
    assert len(graphed) == 20 and graphed[-1] < graphed[0] - 1.0, pairs
    assert max(abs(b - a) / a for a, b in zip(launched[9:], graphed[9:])) < 0.02, pairs


def test_bf16_residual_stream_tracks_the_fp32_stream_over_200_steps(tmp_path):
    """train.residual_dtype=bf16 (auto's choice for one process) rounds the hidden state between blocks to bf16 (the
    matmuls already run in bf16): every loss from step 100 on within 2% of the fp32 stream's at lr 1e-3 (the
    tolerance of two bf16 runs, as above), compiled as the defaults run it (one graph, CUDA graphs); a cast that cut
    the gradient would not train."""
    fp32 = _train(tmp_path / "fp32", "--train.lr=1e-3", "--train.residual_dtype=fp32")
    bf16 = _train(tmp_path / "bf16", "--train.lr=1e-3", "--train.residual_dtype=bf16")  # the default here (auto)
    pairs = [(round(a, 4), round(b, 4)) for a, b in zip(fp32, bf16)]
    print("(fp32 stream, bf16 stream) loss every 10 steps:", pairs)
    assert len(bf16) == 20 and bf16[-1] < bf16[0] - 1.0, pairs
    assert max(abs(b - a) / a for a, b in zip(fp32[9:], bf16[9:])) < 0.02, pairs


def _first_five_steps(tmp_path: Path, torchs: str, ours: str, *common: str) -> list[tuple[float, float, float, float]]:
    """(torch's loss, ours, torch's gradient norm, ours) at steps 1-5 of two runs from the same weights and batches,
    one with each option (and both with ``common``)."""
    first = [_records(tmp_path / f"short{i}", "--train.steps=5", "--train.log_every=1", *common, option)
             for i, option in enumerate((torchs, ours))]
    pairs = [(a["loss"], b["loss"], a["grad_norm"], b["grad_norm"]) for a, b in zip(*first)]
    print(f"({torchs}, {ours}) loss and gradient norm, steps 1-5:", pairs)
    assert len(pairs) == 5
    return pairs


def test_triton_cross_entropy_trains_like_torchs(tmp_path):
    """train.cross_entropy=triton (auto's choice on a GPU) computes the loss and its gradient in meshrun's Triton
    kernels instead of inductor's: the same math with fp32 sums in another order, in the whole compiled step with
    CUDA graphs. From the same weights and batch the first step's loss is within 1e-4 and its gradient norm within
    1e-3 of torch's, and the next four losses within 1e-3; over 100 steps (an evaluation every 50) every loss from
    step 50 on stays within 2%, the tolerance of two bf16 runs whose rounding differs."""
    pairs = _first_five_steps(tmp_path, "--train.cross_entropy=torch", "--train.cross_entropy=triton")
    assert abs(pairs[0][1] / pairs[0][0] - 1) < 1e-4 and abs(pairs[0][3] / pairs[0][2] - 1) < 1e-3, pairs
    assert all(abs(b / a - 1) < 1e-3 for a, b, _, _ in pairs), pairs
    runs = [_train(tmp_path / f"long{i}", "--train.steps=100", "--train.eval_every=50", "--train.lr=1e-3", option)
            for i, option in enumerate(("--train.cross_entropy=torch", "--train.cross_entropy=triton"))]
    losses = [(round(a, 4), round(b, 4)) for a, b in zip(*runs)]
    print("(torch's, Triton) loss every 10 steps:", losses)
    assert len(losses) == 10 and runs[1][-1] < runs[1][0] - 1.0, losses
    assert max(abs(b - a) / a for a, b in losses[4:]) < 0.02, losses


def test_triton_adamw_trains_like_torchs_fused_adamw(tmp_path):
    """train.adamw_kernel=triton (auto's choice on a GPU) steps through meshrun's kernel instead of torch's fused
    AdamW: the same update in fp32 with rounding that may differ in the last bit, and clipping (grad_scale) read the
    same way. From the same weights and batch the first step's loss and gradient norm agree within 1e-4 and the next
    four within 1e-3 (which a wrong update, bias correction or clipping would break at once); over 100 steps every
    loss from step 50 on stays within 2% (two bf16 runs whose rounding differs). The gradient norms of two such runs
    drift apart more than their losses (medians 1.243 and 1.111 on an H200), so they are not compared there."""
    pairs = _first_five_steps(tmp_path, "--train.adamw_kernel=torch", "--train.adamw_kernel=triton")
    assert abs(pairs[0][1] / pairs[0][0] - 1) < 1e-4 and abs(pairs[0][3] / pairs[0][2] - 1) < 1e-4, pairs
    assert all(abs(b / a - 1) < 1e-3 and abs(gb / ga - 1) < 1e-3 for a, b, ga, gb in pairs), pairs
    _runs_match(tmp_path, "AdamW", (), ("torch's fused AdamW", "--train.adamw_kernel=torch"),
                ("Triton AdamW", "--train.adamw_kernel=triton"), gpus=1, norms=False)


def test_weight_copies_train_like_autocasts_casts(tmp_path):
    """train.weight_copies (auto's choice for one process on a GPU): the linear layers read bf16 copies that the
    Triton AdamW writes, and their gradients stay bf16, in the whole compiled step with CUDA graphs. The same bf16
    values as autocast's casts, so from the same weights and batch the first step's loss is within 1e-5 and its
    gradient norm within 1e-4 (inductor fuses the two steps differently), the next four within 1e-3; over 100 steps
    the losses from step 50 on stay within 2% and the median gradient norms within 10% (a copy left stale, or a
    gradient lost on its way to the weight, would show at once)."""
    pairs = _first_five_steps(tmp_path, "--train.weight_copies=false", "--train.weight_copies=true")
    assert abs(pairs[0][1] / pairs[0][0] - 1) < 1e-5 and abs(pairs[0][3] / pairs[0][2] - 1) < 1e-4, pairs
    assert all(abs(b / a - 1) < 1e-3 and abs(gb / ga - 1) < 1e-3 for a, b, ga, gb in pairs), pairs
    _runs_match(tmp_path, "weight copies", (), ("autocast's casts", "--train.weight_copies=false"),
                ("bf16 copies", "--train.weight_copies=true"), gpus=1)


@pytest.mark.parametrize("common", [
    ("--train.grad_accum=2",),  # fp32 gradients: added over the micro-batches
    ("--model.tie_embeddings=false", "--train.loss=chunked", "--parallel.activation_checkpoint=full"),
    ("--train.cuda_graphs=false",)], ids=["accumulation", "untied-chunked-recomputed", "launched"])
def test_weight_copies_step_like_autocasts_casts_in_other_settings(tmp_path, common):
    """The copies under gradient accumulation, with an output head of its own (copied), the chunked loss and
    recomputed blocks, and without CUDA graphs: the first five steps' losses and gradient norms within 1e-3 of the
    same run without copies."""
    pairs = _first_five_steps(tmp_path, "--train.weight_copies=false", "--train.weight_copies=true", *common)
    assert all(abs(b / a - 1) < 1e-3 and abs(gb / ga - 1) < 1e-3 for a, b, ga, gb in pairs), pairs


def _blocks_as_graphs_match_launched(tmp_path: Path, name: str, *layout: str, gpus: int = 2) -> None:
    """Over 100 steps with an evaluation every 50, the mean loss of every 10 steps from step 50 on within 2% of the
    launched kernels' (lr 1e-3, as above) and the median gradient norm of steps 11-100 within 10% (a replay that
    overwrote the first micro-batch's gradients would leave a fraction of the norm, which AdamW's losses alone would
    hide); both runs exit."""
    _runs_match(tmp_path, name, layout, ("launched", "--train.cuda_graphs=false"),
                ("CUDA graphs", "--train.cuda_graphs=true"), gpus=gpus)


def _runs_match(tmp_path: Path, name: str, layout, first: tuple[str, str], second: tuple[str, str], *,
                gpus: int, norms: bool = True) -> None:
    """The checks of :func:`_blocks_as_graphs_match_launched` between two runs, each (label, option), every step
    logged: the mean loss of each 10 steps, and the median gradient norm of steps 11-100 (90 steps: the median of
    the 10 logged every 10 steps moved 14% with one early spike between two correct runs); ``norms``: compare the
    median gradient norms too."""
    common = [*layout, "--train.steps=100", "--train.eval_every=50", "--train.lr=1e-3", "--train.log_every=1"]
    runs = [_records(tmp_path / f"run{i}", *common, option, gpus=gpus) for i, (_, option) in enumerate((first, second))]
    means = [[statistics.fmean(r["loss"] for r in run[i:i + 10]) for i in range(0, len(run), 10)] for run in runs]
    losses = [(round(a, 4), round(b, 4)) for a, b in zip(*means)]
    labels = f"({first[0]}, {second[0]})"
    print(f"{name} {labels} mean loss of each 10 steps:", losses)
    assert len(runs[1]) == 100 and means[1][-1] < means[1][0] - 1.0, losses
    assert max(abs(b - a) / a for a, b in losses[4:]) < 0.02, losses
    if norms:
        medians = [statistics.median(r["grad_norm"] for r in run[10:]) for run in runs]
        print(f"{name} {labels} median gradient norm of steps 11-100:", [round(m, 4) for m in medians])
        assert abs(medians[1] / medians[0] - 1) < 0.1, f"median gradient norm {labels}: {medians}"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_tp_blocks_as_cuda_graphs_train_like_launched_kernels_and_exit(tmp_path):
    """TP alone records each compiled block, its all-reduces inside, as a CUDA graph (train.cuda_graphs), 2
    micro-batches per step; the run exits: NCCL would wait forever at destroy_process_group for graphs that still
    hold its collectives."""
    _blocks_as_graphs_match_launched(tmp_path, "TP 2", "--parallel.tp=2", "--parallel.dp_replicate=1",
                                     "--model.tie_embeddings=false", "--train.grad_accum=2")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_fsdp_whole_model_as_cuda_graphs_trains_like_launched_kernels(tmp_path):
    """FSDP2 with the whole model one unit (parallel.fsdp_unit_blocks=-1), its forward compiled as one graph and
    recorded as CUDA graphs (train.cuda_graphs=true), FSDP2's all-gather and reduce-scatter outside the graphs, 2
    micro-batches per step: a replay that read last step's gathered weights, or a gradient the reduce-scatter missed,
    would show in the losses or the gradient norm. Passed on 2 H200s (2026-11-29, round 23: losses equal to 4 digits),
    so train.cuda_graphs=auto records small models' FSDP2 (checks.whole_model_unit)."""
    _blocks_as_graphs_match_launched(tmp_path, "FSDP 2 whole model", "--parallel.dp_replicate=1",
                                     "--parallel.dp_shard=2", "--parallel.fsdp_unit_blocks=-1",
                                     "--train.grad_accum=2")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("units,accum", [("2", "1"), ("-1", "1"), ("2", "2"), ("-1", "2")])
def test_fsdp_bf16_gradient_reduction_trains_like_fp32(tmp_path, units, accum):
    """parallel.grad_reduce_dtype for FSDP2 on 2 GPUs, units of 2 blocks (as larger models run) and the whole model
    one unit as CUDA graphs (as small ones do): the gradients, computed in bf16 under FSDP2's bf16 parameters,
    reduce-scattered in bf16 instead of cast to fp32 first. With 2 ranks each element's sum is rounded once to bf16,
    the precision the gradients were computed in; a reduction that lost a rank's share or scaled it twice would show
    in the losses or the gradient norm. One micro-batch per step is the case parallel.grad_reduce_dtype=auto reduces
    in bf16 (meshrun.comm.dp_choice.reduces_in_bf16); with 2 FSDP2 also adds them in bf16 before the reduce-scatter,
    a case auto keeps in fp32 and bf16, asked for, warns about. All four passed on 2 H200s (2026-11-30,
    round 29): the mean losses of each 10 steps within 0.9% of fp32 reduction's with one micro-batch (units of 2
    blocks; 0.2% for the whole model) and 0.1% with two, the median gradient norms within 3%."""
    _runs_match(tmp_path, f"FSDP 2 units {units}, {accum} micro-batches",
                ("--parallel.dp_replicate=1", "--parallel.dp_shard=2", f"--parallel.fsdp_unit_blocks={units}",
                 f"--train.grad_accum={accum}"),
                ("fp32 reduction", "--parallel.grad_reduce_dtype=fp32"),
                ("bf16 reduction", "--parallel.grad_reduce_dtype=bf16"), gpus=2)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("accum", ["1", "2"])
def test_ddp_weight_copies_train_like_autocasts_casts(tmp_path, accum):
    """train.weight_copies under DDP on 2 GPUs, the whole step as CUDA graphs: DDP holds the linear layers' bf16
    copies as its parameters, so their gradients stay bf16 in its buckets and are summed in bf16 (each element
    rounded once on 2 ranks, the precision they were computed in), then handed to the fp32 weights for the Triton
    AdamW. A gradient handed over before its all-reduce ended, or a copy the kernel did not write, would show in the
    losses or the gradient norm. With 2 micro-batches a step (train.weight_copies=true; auto's choice only where a
    resume re-derives accumulation) each micro-batch is all-reduced and added in fp32. Both passed on 2 H200s
    (2026-11-30, round 31): the mean losses of each 10 steps within 0.1% and 0.2%, the median gradient norms within
    1.5% and 2.1%; the first made the copies auto's choice for DDP."""
    _runs_match(tmp_path, f"DDP 2, {accum} micro-batches", ("--parallel.dp_replicate=2", f"--train.grad_accum={accum}"),
                ("autocast's casts, fp32 all-reduce", "--train.weight_copies=false"),
                ("weight copies, bf16 all-reduce", "--train.weight_copies=true"), gpus=2)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_tp_with_reordered_collectives_trains_like_inductors_order(tmp_path):
    """parallel.comm_reorder (on by default for TP on GPUs): inductor moves TP's all-reduces and their waits around
    independent compute inside each compiled block (as CUDA graphs, 2 micro-batches per step); a wait moved past a
    use of its result would show in the losses or the gradient norm."""
    _runs_match(tmp_path, "TP 2", ("--parallel.tp=2", "--parallel.dp_replicate=1", "--model.tie_embeddings=false",
                                   "--train.grad_accum=2"),
                ("inductor's order", "--parallel.comm_reorder=false"),
                ("reordered", "--parallel.comm_reorder=true"), gpus=2)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_pipeline_blocks_as_cuda_graphs_train_like_launched_kernels(tmp_path, schedule):
    """PP 2 (4 micro-batches per step) records each compiled block of a stage as a CUDA graph, the pipeline's sends
    and receives between them: up to 2 micro-batches' activations are alive at once on the first stage (all 4 with
    gpipe), so each micro-batch of a step must replay graphs of its own. (interleaved1f1b, 2 stages per rank, failed
    this test on 2 H100s, loss 3.17 against 2.03 at step 100, and is refused: checks.several_stages_per_rank.)"""
    _blocks_as_graphs_match_launched(tmp_path, f"PP 2 {schedule}", "--parallel.pp=2", "--parallel.dp_replicate=1",
                                     f"--parallel.pp_schedule={schedule}", "--train.grad_accum=4",
                                     "--parallel.pp_microbatches=4")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_pipeline_weights_cast_once_per_step_train_like_casts_per_micro_batch(tmp_path):
    """parallel.pp_cast_once on PP 2 (1F1B, asked for, 4 micro-batches, the blocks as CUDA graphs by default): the linear layers
    hold bf16 copies refreshed in place once per step, the graphs' fixed inputs. On CPU it trains bitwise like
    autocast's casts (tests/test_step_weights.py); here a copy left stale by a graph, or a gradient lost between the
    copy and the fp32 parameter, would show in the losses or the gradient norm."""
    _runs_match(tmp_path, "PP 2 1f1b", ("--parallel.pp=2", "--parallel.dp_replicate=1", "--parallel.pp_schedule=1f1b",
                                        "--train.grad_accum=4", "--parallel.pp_microbatches=4"),
                ("casts per micro-batch", "--parallel.pp_cast_once=false"),
                ("cast once per step", "--parallel.pp_cast_once=true"), gpus=2)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_zero_bubble_with_compiled_blocks_trains_like_uncompiled_blocks(tmp_path):
    """interleavedzb on PP 2 (2 stages per rank, 4 micro-batches): compiled, each block keeps its linear layers eager
    so the schedule can run their weight gradients apart (apply.keep_weights_eager); a weight gradient lost or
    counted twice between the input and weight passes would show in the losses or the gradient norm."""
    _runs_match(tmp_path, "PP 2 interleavedzb", ("--parallel.pp=2", "--parallel.dp_replicate=1",
                                                 "--parallel.pp_schedule=interleavedzb", "--train.grad_accum=4",
                                                 "--parallel.pp_microbatches=4"),
                ("uncompiled", "--train.compile=false"), ("compiled, matmuls eager", "--train.compile=true"), gpus=2)


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 CUDA GPUs")
def test_four_pipeline_stages_as_cuda_graphs_train_like_launched_kernels(tmp_path):
    """PP 4, 1F1B, 8 micro-batches: up to 4 micro-batches in flight on the first stage, each replaying graphs of its
    own. It passed on 4 H100s (2026-11-28), so train.cuda_graphs=auto records 1F1B of up to 4 stages."""
    _blocks_as_graphs_match_launched(tmp_path, "PP 4 1f1b", "--parallel.pp=4", "--parallel.dp_replicate=1",
                                     "--parallel.pp_schedule=1f1b", "--train.grad_accum=8",
                                     "--parallel.pp_microbatches=8", gpus=4)


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 CUDA GPUs")
def test_tp_with_pp_blocks_as_cuda_graphs_train_like_launched_kernels(tmp_path):
    """TP 2 x PP 2: each stage's compiled blocks, TP's all-reduces inside, recorded as CUDA graphs (train.cuda_graphs
    =auto since it passed on 4 H100s, 2026-11-28: 2 stages of 1F1B, checks.untested_as_graphs)."""
    _blocks_as_graphs_match_launched(tmp_path, "TP 2 x PP 2", "--parallel.tp=2", "--parallel.pp=2",
                                     "--parallel.dp_replicate=1", "--model.tie_embeddings=false",
                                     "--train.grad_accum=4", "--parallel.pp_microbatches=4", gpus=4)
