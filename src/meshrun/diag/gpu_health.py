"""Per-GPU health: bf16 GEMM TFLOP/s and device-memory bandwidth on every GPU, with clocks and temperature from
NVML where ``nvidia-ml-py`` is importable. A throttled or faulty card is the commonest straggler on real clusters;
comparing every GPU of the job with the job's median names it before training starts.

The GEMM and copy also run on the CPU (fp32, small sizes: tests and the straggler re-run of CPU ranks use them),
but ``meshrun doctor`` measures GPUs only: CPU ranks share their host's cores, and a CPU figure of 0.0002 TFLOP/s
in a GPU table would look like the measurement of something. ``meshrun doctor`` runs :func:`measure_local` on
every rank, and the trainer's straggler report re-runs :func:`gemm_tflops` on a flagged rank to tell a slow GPU
from slow data or a slow network.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import torch

from meshrun.diag.rows import PASS, WARN, CheckRow
from meshrun.diag.timing import timed

# NVML's clock-event (throttle) reason bits, nvml.h; the names say why a clock is below its maximum
_THROTTLE = {0x4: "power cap", 0x8: "hardware slowdown", 0x20: "software thermal slowdown",
             0x40: "hardware thermal slowdown", 0x80: "power brake"}


@dataclass(frozen=True)
class GpuHealth:
    rank: int
    node: int
    host: str
    device: str
    """'cuda:N' (the index this node's processes see) or 'cpu'."""
    name: str
    gemm_tflops: float
    mem_gbps: float
    nvml: dict = field(default_factory=dict)
    """sm_clock_mhz, max_sm_clock_mhz, temperature_c, power_w, throttle (where NVML answered)."""

    def label(self) -> str:
        return f"{self.device} on node {self.node} (host {self.host}, {self.name})"


def gemm_tflops(device: torch.device, *, n: int | None = None, iters: int | None = None) -> float:
    """TFLOP/s of an (n x n) @ (n x n) matmul: bf16 on a GPU (n=8192), fp32 on the CPU (n=128). 2 n^3 FLOPs each."""
    gpu = device.type == "cuda"
    n, iters = n or (8192 if gpu else 128), iters or (20 if gpu else 3)
    dtype = torch.bfloat16 if gpu else torch.float32
    a = torch.randn(n, n, dtype=dtype, device=device)  # (n, n)
    b = torch.randn(n, n, dtype=dtype, device=device)  # (n, n)
    out = torch.empty(n, n, dtype=dtype, device=device)  # (n, n)
    run = lambda: torch.mm(a, b, out=out)  # noqa: E731
    timed(run, 3, device)  # warm-up: kernel selection and clocks ramping up
    return 2 * n**3 * iters / timed(run, iters, device) / 1e12


def memory_gbps(device: torch.device, *, nbytes: int | None = None, iters: int | None = None) -> float:
    """Device-memory bandwidth of a copy (each copy reads and writes ``nbytes``): 1 GiB on a GPU, 4 MiB on CPU."""
    gpu = device.type == "cuda"
    nbytes, iters = nbytes or (2**30 if gpu else 2**22), iters or (20 if gpu else 3)
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)  # (nbytes / 4,)
    dst = torch.empty_like(src)
    run = lambda: dst.copy_(src)  # noqa: E731
    timed(run, 3, device)
    return 2 * nbytes * iters / timed(run, iters, device) / 1e9


def nvml_state(index: int) -> dict:
    """Clocks, temperature, power and throttle reasons of CUDA device ``index`` ({} without NVML). A field NVML
    does not answer for is left out."""
    found = nvml_device(index)
    return read_nvml(*found) if found is not None else {}


def nvml_device(index: int) -> tuple | None:
    """(pynvml, handle) of CUDA device ``index``, or None without nvidia-ml-py or a driver. Keep it to read the
    device again with :func:`read_nvml` (the system-metrics sampler does, every second)."""
    try:
        import pynvml  # nvidia-ml-py, optional

        pynvml.nvmlInit()
        return pynvml, _nvml_handle(pynvml, index)
    except Exception:  # noqa: BLE001 - not installed, no driver: the numbers go without
        return None


def read_nvml(pynvml, handle, *, keys: tuple[str, ...] | None = None) -> dict:
    """One reading of ``handle``: ``keys`` of sm_clock_mhz, max_sm_clock_mhz, temperature_c, power_w, throttle,
    util_pct (busy time of the last sample period) and mem_used_gib (all by default). A field NVML does not answer
    for is left out."""
    reasons = (getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
               or getattr(pynvml, "nvmlDeviceGetCurrentClocksThrottleReasons"))  # renamed in newer nvidia-ml-py
    queries = {"sm_clock_mhz": lambda: pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
               "max_sm_clock_mhz": lambda: pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM),
               "temperature_c": lambda: pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU),
               "power_w": lambda: pynvml.nvmlDeviceGetPowerUsage(handle) / 1e3,
               "throttle": lambda: ", ".join(why for bit, why in _THROTTLE.items() if reasons(handle) & bit),
               "util_pct": lambda: pynvml.nvmlDeviceGetUtilizationRates(handle).gpu,
               "mem_used_gib": lambda: pynvml.nvmlDeviceGetMemoryInfo(handle).used / 2**30}
    state = {}
    for key in keys or tuple(queries):
        try:
            state[key] = queries[key]()
        except Exception:  # noqa: BLE001 - an old driver or a field this GPU does not report
            continue
    return state


def _nvml_handle(pynvml, index: int):
    """NVML numbers all GPUs of the host; CUDA only the visible ones. The UUID ties the two together."""
    uuid = str(getattr(torch.cuda.get_device_properties(index), "uuid", ""))
    for candidate in (uuid, f"GPU-{uuid}"):
        try:
            return pynvml.nvmlDeviceGetHandleByUUID(candidate)
        except Exception:  # noqa: BLE001 - try the other spelling, then the index
            continue
    return pynvml.nvmlDeviceGetHandleByIndex(index)


def describe_nvml(state: dict) -> str:
    parts = []
    if "sm_clock_mhz" in state:
        parts.append(f"SM clock {state['sm_clock_mhz']}/{state.get('max_sm_clock_mhz', '?')} MHz")
    if "temperature_c" in state:
        parts.append(f"{state['temperature_c']} C")
    if "power_w" in state:
        parts.append(f"{state['power_w']:.0f} W")
    if state.get("throttle"):
        parts.append(f"throttled: {state['throttle']}")
    return ", ".join(parts)


def my_devices(*, local_rank: int, local_world_size: int) -> list[torch.device]:
    """The GPUs this rank tests: every visible GPU is taken by exactly one local rank (all of them under
    ``--nproc-per-node 1``); none without a GPU."""
    if not torch.cuda.is_available():
        return []
    return [torch.device("cuda", i) for i in range(local_rank, torch.cuda.device_count(), local_world_size)]


def measure_local(*, rank: int, node: int, host: str, local_rank: int, local_world_size: int) -> list[GpuHealth]:
    """GEMM, bandwidth and NVML state of this rank's GPUs (see :func:`my_devices`); none without a GPU: the CPU
    ranks of a host share its cores, so a figure of each would only say how busy the others kept them."""
    found = []
    for device in my_devices(local_rank=local_rank, local_world_size=local_world_size):
        found.append(GpuHealth(rank=rank, node=node, host=host, device=str(device),
                               name=torch.cuda.get_device_name(device), gemm_tflops=gemm_tflops(device),
                               mem_gbps=memory_gbps(device), nvml=nvml_state(device.index)))
    return found


def judge_health(results: list[GpuHealth], *, threshold: float) -> CheckRow:
    """Warn naming every device more than ``threshold`` (a fraction) below the job's median GEMM or bandwidth."""
    if not results:  # CPU ranks are not measured (measure_local says why)
        return CheckRow("GPU health", PASS, "no GPUs: nothing to measure (CPU ranks share their host's cores, so "
                                            "their speeds would not compare)")
    gemm = statistics.median(r.gemm_tflops for r in results)
    mem = statistics.median(r.mem_gbps for r in results)
    slow = []
    for r in results:
        why = [f"GEMM {r.gemm_tflops:.3g} TFLOP/s ({r.gemm_tflops / gemm:.0%} of median)"] \
            if r.gemm_tflops < (1 - threshold) * gemm else []
        why += [f"memory {r.mem_gbps:.3g} GB/s ({r.mem_gbps / mem:.0%} of median)"] \
            if r.mem_gbps < (1 - threshold) * mem else []
        if why:
            state = describe_nvml(r.nvml)
            slow.append((r, f"{r.label()}: {', '.join(why)}" + (f"; {state}" if state else "")))
    summary = f"median of {len(results)} GPUs: GEMM {gemm:.3g} TFLOP/s, memory {mem:.3g} GB/s"
    if not slow:
        return CheckRow("GPU health", PASS, f"{summary}; none more than {threshold:.0%} below it")
    hosts = tuple(dict.fromkeys(r.host for r, _ in slow))
    return CheckRow("GPU health", WARN, f"{'; '.join(text for _, text in slow)} ({summary})",
                    fix="a throttled or faulty card slows every step of the job: check its cooling and power, "
                        "or leave that node out",
                    next_command="nvidia-smi -q -d CLOCK,TEMPERATURE,POWER,PERFORMANCE on " + ", ".join(hosts),
                    hosts=hosts)
