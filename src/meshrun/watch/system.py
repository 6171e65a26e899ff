"""What one node's machine is doing while it trains: GPUs (NVML), CPU, host memory and network interfaces.

A :class:`SystemSampler` runs on one process per node (local rank 0) in a daemon thread, off the training thread: it
reads every ``interval_s`` seconds and keeps running sums, and :meth:`SystemSampler.take` turns what it read since the
last call into one ``system`` record (means over the interval; bytes counted over it). The GPU fields come from NVML
the way ``meshrun doctor`` reads them (:func:`meshrun.diag.gpu_health.read_nvml`); without a GPU or without
``nvidia-ml-py`` they are absent from the record, never zero. CPU, memory and network come from Linux's ``/proc``
and ``/sys`` (no dependency); elsewhere they are absent too.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshrun.diag.gpu_health import nvml_device, read_nvml

GPU_KEYS = ("util_pct", "mem_used_gib", "power_w", "sm_clock_mhz", "throttle")
"""The NVML fields sampled; util_pct, mem_used_gib and power_w are averaged, the clock and throttle are the last."""
PROC = Path("/proc")
SYS_NET = Path("/sys/class/net")
MAX_INTERFACES = 8
"""Interfaces kept per record: the one NCCL/gloo uses, then the busiest (a host may have dozens of veths)."""


def cpu_times(proc: Path = PROC) -> tuple[float, float] | None:
    """(busy, total) jiffies of all CPUs from /proc/stat; None where it is missing (not Linux)."""
    try:
        fields = [float(x) for x in (proc / "stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest is inside user)
    return total - idle, total


def host_memory_gib(proc: Path = PROC) -> tuple[float, float] | None:
    """(used, total) GiB from /proc/meminfo: used = MemTotal - MemAvailable (what `free` calls used + shared)."""
    try:
        info = {line.split(":")[0]: float(line.split()[1]) for line in (proc / "meminfo").read_text().splitlines()
                if ":" in line and len(line.split()) >= 2}
        return (info["MemTotal"] - info["MemAvailable"]) / 2**20, info["MemTotal"] / 2**20
    except (OSError, ValueError, KeyError):
        return None


def net_bytes(proc: Path = PROC) -> dict[str, tuple[int, int]]:
    """{interface: (bytes sent, bytes received)} since boot, from /proc/net/dev ({} where it is missing)."""
    try:
        lines = (proc / "net" / "dev").read_text().splitlines()[2:]
    except OSError:
        return {}
    found = {}
    for line in lines:
        name, _, rest = line.partition(":")
        numbers = rest.split()
        if len(numbers) >= 9:
            found[name.strip()] = (int(numbers[8]), int(numbers[0]))  # transmit bytes is the 9th column
    return found


def link_speed_mb_s(iface: str, sys_net: Path = SYS_NET) -> float | None:
    """The link speed of ``iface`` in MB/s (from Mb/s in /sys/class/net), or None where the kernel gives none
    (loopback, most virtual interfaces)."""
    try:
        mbit = int((sys_net / iface / "speed").read_text().strip())
    except (OSError, ValueError):
        return None
    return mbit / 8 if mbit > 0 else None


@dataclass
class _Sums:
    """Running sums between two :meth:`SystemSampler.take` calls."""

    samples: int = 0
    cpu_start: tuple[float, float] | None = None
    mem_used: float = 0.0
    mem_total: float = 0.0
    gpu: list[dict[str, Any]] = field(default_factory=list)
    """Per GPU: sums of the averaged fields, and the last clock and throttle reasons."""


class SystemSampler:
    """Reads this node's GPUs, CPU, memory and network in a daemon thread, every ``interval_s`` seconds.

    ``gpus``: the CUDA indices to read (this node's visible GPUs). ``comm_iface``: the interface NCCL and gloo use,
    named as such in the record. Thread-safe: the thread adds under a lock, :meth:`take` swaps the sums out under it.
    """

    def __init__(self, *, interval_s: float, gpus: list[int], comm_iface: str | None, proc: Path = PROC,
                 sys_net: Path = SYS_NET):
        self.interval_s, self.comm_iface, self.proc, self.sys_net = interval_s, comm_iface, proc, sys_net
        self.devices = [(index, found) for index in gpus if (found := nvml_device(index)) is not None]
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._since = time.monotonic()
        self._net_start = net_bytes(proc)
        self._sums = self._fresh()
        self.busy_s = 0.0
        """Seconds the thread spent reading (its cost; the benchmark compares it with the step time)."""

    def _fresh(self) -> _Sums:
        return _Sums(cpu_start=cpu_times(self.proc), gpu=[{} for _ in self.devices])

    def start(self) -> "SystemSampler":
        self._thread = threading.Thread(target=self._run, name="meshrun-system-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        """One reading of memory and GPUs, added to the sums (CPU and network are counters: read at take)."""
        started = time.perf_counter()
        memory = host_memory_gib(self.proc)
        gpus = [read_nvml(*found, keys=GPU_KEYS) for _, found in self.devices]
        with self._lock:
            sums = self._sums
            sums.samples += 1
            if memory is not None:
                sums.mem_used += memory[0]
                sums.mem_total = memory[1]
            for acc, state in zip(sums.gpu, gpus):
                for key, value in state.items():
                    if key in ("sm_clock_mhz", "throttle"):
                        acc[key] = value
                    else:
                        acc[key] = acc.get(key, 0.0) + value
                        acc[f"n_{key}"] = acc.get(f"n_{key}", 0) + 1
        self.busy_s += time.perf_counter() - started

    def take(self) -> dict[str, Any]:
        """The interval since the last take as record fields: ``interval_s``, ``cpu_util_pct``,
        ``host_mem_used_gib``, ``host_mem_total_gib``, ``net`` ({iface: sent/recv bytes and MB/s, ``comm``}),
        ``comm_iface`` and, with GPUs, ``gpus`` (one dict per GPU). A field that could not be read is absent."""
        if self._sums.samples == 0:
            self.sample()  # an interval shorter than the sampling period still reports memory and GPUs
        now, net_now, cpu_now = time.monotonic(), net_bytes(self.proc), cpu_times(self.proc)
        with self._lock:
            sums, self._sums = self._sums, self._fresh()
        elapsed, self._since = max(now - self._since, 1e-9), now
        net_start, self._net_start = self._net_start, net_now
        record: dict[str, Any] = {"interval_s": round(elapsed, 3)}
        if sums.cpu_start is not None and cpu_now is not None and cpu_now[1] > sums.cpu_start[1]:
            busy, total = cpu_now[0] - sums.cpu_start[0], cpu_now[1] - sums.cpu_start[1]
            record["cpu_util_pct"] = round(100 * busy / total, 2)
        if sums.mem_total:
            record["host_mem_used_gib"] = round(sums.mem_used / sums.samples, 4)
            record["host_mem_total_gib"] = round(sums.mem_total, 3)
        if net_now:
            record["net"] = self._interfaces(net_start, net_now, elapsed)
            record["comm_iface"] = self.comm_iface
        if self.devices:
            record["gpus"] = [_gpu_fields(index, acc) for (index, _), acc in zip(self.devices, sums.gpu)]
        return record

    def _interfaces(self, start: dict[str, tuple[int, int]], now: dict[str, tuple[int, int]],
                    elapsed: float) -> dict[str, dict[str, Any]]:
        rows = {}
        for name, (sent, recv) in now.items():
            sent0, recv0 = start.get(name, (sent, recv))
            rows[name] = {"sent_bytes": sent - sent0, "recv_bytes": recv - recv0,
                          "sent_mb_s": round((sent - sent0) / elapsed / 1e6, 4),
                          "recv_mb_s": round((recv - recv0) / elapsed / 1e6, 4)}
        busiest = sorted(rows, key=lambda n: (n != self.comm_iface, -(rows[n]["sent_bytes"] + rows[n]["recv_bytes"])))
        kept = {n: rows[n] for n in busiest[:MAX_INTERFACES] if n == self.comm_iface
                or rows[n]["sent_bytes"] + rows[n]["recv_bytes"] > 0}
        for name, row in kept.items():
            row["comm"] = name == self.comm_iface
            speed = link_speed_mb_s(name, self.sys_net)
            if speed is not None:
                row["speed_mb_s"] = speed
        return kept


def _gpu_fields(index: int, acc: dict[str, Any]) -> dict[str, Any]:
    row: dict[str, Any] = {"index": index}
    for key in GPU_KEYS:
        if key in ("sm_clock_mhz", "throttle"):
            if key in acc:
                row[key] = acc[key]
        elif acc.get(f"n_{key}"):
            row[key] = round(acc[key] / acc[f"n_{key}"], 3)
    return row
