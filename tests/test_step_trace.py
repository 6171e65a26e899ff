"""``meshrun trace``: the device timeline of a profiler trace split into compute, exposed communication and idle."""

import gzip
import json

import pytest

from meshrun.watch.step_trace import main, step_time


def kernel(name, start, end, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": start, "dur": end - start}


def trace(*kernels):
    steps = [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{i}", "ts": 0, "dur": 1} for i in (7, 8)]
    return {"traceEvents": [*steps, *kernels]}


# two recorded steps, in microseconds: compute 0-100 and 150-250, an all-reduce 200-300 (half of it beside compute),
# a memset 400-420; nothing runs 100-150 and 300-400
TWO_STEPS = trace(kernel("gemm", 0, 100), kernel("rms_norm", 150, 250),
                  kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 200, 300), kernel("Memset (Device)", 400, 420,
                                                                                       "gpu_memset"),
                  {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5000})


def test_the_span_splits_into_compute_exposed_communication_and_idle_per_step():
    t = step_time(TWO_STEPS)
    assert t.steps == 2
    assert t.span_ms == pytest.approx(0.210)  # 420 us over 2 steps
    assert t.compute_ms == pytest.approx(0.110)  # kernels and memsets: 100 + 100 + 20
    assert t.comm_ms == pytest.approx(0.050)
    assert t.exposed_comm_ms == pytest.approx(0.025)  # 250-300: only the all-reduce ran
    assert t.idle_ms == pytest.approx(0.075)  # 100-150 and 300-400
    assert t.compute_ms + t.exposed_comm_ms + t.idle_ms == pytest.approx(t.span_ms)
    assert dict(t.top_kernels) == pytest.approx({"gemm": 0.05, "rms_norm": 0.05, "Memset (Device)": 0.01,
                                                 "ncclDevKernel_AllReduce_Sum_f32_RING_LL": 0.05})
    assert t.verdict().startswith("host-bound: the GPU idled 36% of the span")


# kernel names as the torch profiler records them on H100s (cuBLAS, cuDNN attention, Triton, fused AdamW, copies)
NAMED = {
    "nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNN": "matmuls",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1": "matmuls",
    "triton_tem_fused_mm_0": "matmuls",
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x64x64_4x1x1": "attention",
    "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits>": "attention",
    "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0": "fused element-wise (compiled)",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>": (
        "optimizer and norms (multi-tensor)"),
    "void at::native::elementwise_kernel<128, 4, at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)>": (
        "copies and casts"),
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>": (
        "element-wise and reductions (eager)"),
    "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL": "communication",
    "Memcpy DtoD (Device -> Device)": "copies and casts",
    "some_custom_kernel": "other",
}


def test_kernel_time_is_also_split_by_what_the_kernels_are():
    names = list(NAMED)
    t = step_time(trace(*(kernel(name, 100 * i, 100 * i + 10 * (i + 1),
                                 "gpu_memcpy" if name.startswith("Memcpy") else "kernel")
                          for i, name in enumerate(names))))
    expected: dict[str, float] = {}
    for i, name in enumerate(names):  # 10 (i + 1) us each, over 2 steps
        expected[NAMED[name]] = expected.get(NAMED[name], 0.0) + 10 * (i + 1) / 2e3
    assert dict(t.by_kind) == pytest.approx(expected)
    assert [ms for _, ms in t.by_kind] == sorted((ms for _, ms in t.by_kind), reverse=True)
    from meshrun.watch.step_trace import describe_step_time

    largest, ms = t.by_kind[0]
    assert (largest, round(ms, 3)) == ("copies and casts", 0.095)  # direct_copy (8) and Memcpy (11): 190 us / 2
    assert "kernel time per step by kind (overlaps counted in each): copies and casts 0.10 ms, " in (
        describe_step_time(t))


def test_exposed_collectives_and_busy_kernels_get_their_own_verdicts():
    comm = step_time(trace(kernel("gemm", 0, 100), kernel("ncclDevKernel_AllGather", 100, 150)))
    assert comm.verdict().startswith("communication-bound: only collectives ran for 33% of the span")
    busy = step_time(trace(kernel("gemm", 0, 100), kernel("gemm", 110, 200)))
    assert busy.verdict().startswith("compute-bound: kernels kept the GPU busy 95% of the span")


def test_exposed_communication_is_split_by_collective_and_the_verdict_names_the_largest():
    """Only the part of each collective that no compute kernel covers counts as exposed; the communication-bound
    verdict then says what to try for that collective."""
    t = step_time(trace(kernel("gemm", 0, 100), kernel("ncclDevKernel_AllGather_RING_LL", 50, 150),  # 50 exposed
                        kernel("ncclDevKernel_SendRecv", 200, 400),  # 200 exposed
                        kernel("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", 300, 350)))  # beside SendRecv
    assert dict(t.exposed_by_collective) == pytest.approx({"send/receive": 0.1, "all-gather": 0.025,
                                                           "reduce-scatter": 0.025})
    assert t.exposed_by_collective[0][0] == "send/receive"
    assert t.verdict().startswith("communication-bound: only collectives ran for 62% of the span; most of "
                                  "it send/receive: the pipeline's stages wait for each other")
    from meshrun.watch.step_trace import EXPOSED_HINTS, collective, describe_step_time

    assert "exposed communication per step by collective: send/receive 0.10 ms, " in describe_step_time(t)
    assert [collective(n) for n in ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "ncclKernel_AllGather_RING_LL_Sum",
                                    "ncclDevKernel_ReduceScatter_Sum_f32", "ncclDevKernel_Broadcast_RING_LL",
                                    "ncclDevKernel_Something")] == [
        "all-reduce", "all-gather", "reduce-scatter", "broadcast", "other"]
    tp = step_time(trace(kernel("gemm", 0, 100), kernel("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 100, 150)))
    assert tp.verdict().endswith(EXPOSED_HINTS["all-reduce"]) and "fewer TP ranks" in tp.verdict()
    hidden = step_time(trace(kernel("gemm", 0, 100), kernel("ncclDevKernel_AllReduce_Sum_f32", 10, 90)))
    assert hidden.exposed_by_collective == [] and hidden.verdict().startswith("compute-bound")


def test_a_cpu_trace_has_no_device_timeline():
    assert step_time({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 9}]}) is None


def test_the_command_reads_a_run_folder_and_names_what_it_cannot_read(tmp_path, capsys):
    folder = tmp_path / "run" / "profile"
    folder.mkdir(parents=True)
    with gzip.open(folder / "rank_00001.json.gz", "wt") as f:
        json.dump(TWO_STEPS, f)
    (folder / "rank_00000.json").write_text(json.dumps({"traceEvents": []}))
    assert main([str(tmp_path / "run"), "--json"]) == 0
    out, err = capsys.readouterr()
    row = json.loads(out)
    assert row["path"].endswith("rank_00001.json.gz") and row["idle_ms"] == pytest.approx(0.075)
    assert row["verdict"].startswith("host-bound")
    assert "rank_00000.json: no GPU kernels (a CPU run)" in err
    assert main([str(tmp_path / "nothing.json")]) == 2
    assert capsys.readouterr().err.startswith(f"meshrun trace: error: no trace at {tmp_path / 'nothing.json'}; "
                                              "record one with meshrun train --profile")


def test_a_run_folder_weighs_idle_time_against_its_unprofiled_steps(tmp_path, capsys):
    """Under the profiler TWO_STEPS idles 75 of 210 us per step (host-bound); the run's unprofiled steps take
    140 us, 5 us more than the kernels' 135 us: the idle was the profiler's, and the 25 us of exposed communication
    per step bound it instead.
    Intervals holding a profiled step (14-15), the one after the window and the first after each start are left
    out of the median."""
    run = tmp_path / "run"
    (run / "profile").mkdir(parents=True)
    (run / "profile" / "rank_00000.json").write_text(json.dumps(TWO_STEPS))
    (run / "config.toml").write_text('[run]\nprofile_steps = "14-15"\n')
    records = [{"kind": "start", "step": 0}, {"kind": "train", "step": 5, "step_time_s": 9.0},  # compiling
               {"kind": "train", "step": 10, "step_time_s": 140e-6}, {"kind": "train", "step": 15, "step_time_s": 1.0},
               {"kind": "train", "step": 20, "step_time_s": 2.0}, {"kind": "train", "step": 25, "step_time_s": 141e-6},
               {"kind": "start", "step": 25}, {"kind": "train", "step": 30, "step_time_s": 5.0},  # a resume compiles
               {"kind": "train", "step": 35, "step_time_s": 139e-6}]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n{cut sho")
    assert main([str(run), "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["unprofiled_ms"] == pytest.approx(0.140)
    assert row["verdict"].startswith("communication-bound: only collectives ran for 18% of an unprofiled step")
    assert row["verdict"].endswith("(the profiler's own host time left the GPU idle 0.075 ms per recorded step; "
                                   "unprofiled steps take 0.14 ms against 0.135 ms of kernels)")
    # slower unprofiled steps: the idle is real
    records[2]["step_time_s"] = records[5]["step_time_s"] = records[8]["step_time_s"] = 200e-6
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    assert main([str(run), "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["verdict"].startswith("host-bound: the GPU idled 32% of an unprofiled step")
    assert "profiler's own" not in row["verdict"]


def test_kernels_the_host_queued_before_the_recorded_steps_are_left_out():
    """A host that runs ahead of its GPU (CUDA graphs) starts the profiler while the GPU still runs the previous
    step: the trace holds those kernels but not their launches, and they belong to no recorded step. A trace without
    launch events counts every kernel."""
    def launched(name, start, end, correlation):
        return {**kernel(name, start, end), "args": {"correlation": correlation}}

    launches = [{"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": ts, "dur": 5,
                 "args": {"correlation": c}} for ts, c in ((10, 2), (120, 3))]
    earlier = [launched("gemm", 0, 250, 1)]  # launched before the profiler started: no launch event
    recorded = [launched("gemm", 300, 380, 2), launched("rms_norm", 400, 490, 3)]
    marks = [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{i}", "ts": ts, "dur": 100}
             for i, ts in ((7, 0), (8, 100))]  # the host's two recorded steps
    t = step_time({"traceEvents": [*marks, *launches, *earlier, *recorded]})
    assert t.steps == 2
    assert t.span_ms == pytest.approx(0.095)  # 300-490, not 0-490
    assert t.compute_ms == pytest.approx(0.085)  # 80 + 90 us over 2 steps
    assert dict(t.top_kernels) == pytest.approx({"gemm": 0.04, "rms_norm": 0.045})
    assert step_time(trace(*earlier, *recorded)).compute_ms == pytest.approx(0.21)  # no launches: 250 + 80 + 90


def test_ranks_of_one_recording_with_uneven_compute_are_named(tmp_path, capsys):
    """Rank 0 computes 200 us per step, rank 1 100 us and rank 2 190 us: rank 0 sets the pace, 100% more than rank 1.
    Ranks within 5% of each other are not called uneven, nor are traces of different recordings."""
    folder = tmp_path / "run" / "profile"
    folder.mkdir(parents=True)
    for rank, busy in ((0, 400), (1, 200), (2, 380)):
        (folder / f"rank_{rank:05d}.json").write_text(json.dumps(trace(kernel("gemm", 0, busy))))
    assert main([str(tmp_path / "run")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "uneven ranks: rank 0 computes 0.2 ms per step, 100% more than rank 1 (0.1 ms)" in out
    assert "the cut is in whole blocks" in out

    for rank in (1, 2):  # 195 us per step: within 3% of rank 0's
        (folder / f"rank_{rank:05d}.json").write_text(json.dumps(trace(kernel("gemm", 0, 390))))
    assert main([str(tmp_path / "run")]) == 0
    assert "uneven" not in capsys.readouterr().out
    other = tmp_path / "other"
    other.mkdir()
    (other / "rank_00001.json").write_text(json.dumps(trace(kernel("gemm", 0, 100))))
    assert main([str(folder / "rank_00000.json"), str(other / "rank_00001.json")]) == 0
    assert "uneven" not in capsys.readouterr().out
