"""Metrics aggregated exactly across ranks, throughput and MFU, and where they are shown and stored.

Loss is sum(loss x tokens) / sum(tokens) over every rank, never a mean of per-rank means; accuracy is summed correct
over summed total. Both come from one SUM all-reduce of a small tensor per log interval, so logging costs one
collective and one device-to-host copy every ``train.log_every`` steps, not every step.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshrun.report.trackers import START_PARAMS, TensorBoardTracker, Tracker, record_metrics

# Dense bf16 peak of one device, from the vendors' datasheets (no sparsity).
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "GH200": 989e12, "B200": 2250e12,
                   "A100": 312e12, "A800": 312e12, "L40S": 362e12, "A10G": 125e12, "L4": 121e12}


def peak_flops(device: torch.device) -> float | None:
    """bf16 dense peak of ``device`` from its name, or None when unknown (CPU, unlisted GPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_BF16_FLOPS.items():
        if key in name:
            return value
    return None


class SumMetrics:
    """Per-rank running sums that are reduced with one all-reduce when read.

    ``add`` keeps tensors on the device (no sync); ``reduce`` is a collective every rank must reach.
    """

    def __init__(self, names: tuple[str, ...], device: torch.device):
        self.names, self.device = names, device
        self.sums = torch.zeros(len(names), dtype=torch.float64, device=device)

    def add(self, **values: torch.Tensor | float) -> None:
        for name, value in values.items():
            self.sums[self.names.index(name)] += value

    def take(self, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """The sums over every rank as a device tensor, and zero for the next interval: no host sync (the
        all-reduce is queued, not waited for). Collective: every rank."""
        totals = self.sums.clone()
        if dist.is_initialized():
            dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=group)  # collective: every rank
        self.sums.zero_()
        return totals

    def reduce(self, group: dist.ProcessGroup | None = None) -> dict[str, float]:
        return dict(zip(self.names, self.take(group).tolist()))  # note: CPU-GPU sync point


class MetricsSink:
    """Rank 0's outputs: console (live bar on a terminal, lines otherwise), metrics.jsonl, and a tracker
    (TensorBoard, W&B, MLflow: :mod:`meshrun.report.trackers`) when one is given."""

    def __init__(self, run_dir: Path, *, total_steps: int, progress: str, enabled: bool, start_step: int = 0,
                 tracker: Tracker | None = None, tensorboard: bool = False):
        self.enabled, self.total_steps = enabled, total_steps
        self.start_step = start_step
        """The step this process started from (a resumed run's checkpoint): ETAs count only steps done here."""
        self.jsonl = (run_dir / "metrics.jsonl").open("a") if enabled else None
        use_bar = progress == "bar" or (progress == "auto" and sys.stdout.isatty())
        self.bar = _RichBar(total_steps, start_step) if enabled and use_bar else None
        if enabled and tensorboard and tracker is None:
            tracker = _tensorboard(run_dir)
        self.tracker = tracker if enabled else None
        self.start = time.perf_counter()

    def record(self, record: dict[str, Any]) -> dict[str, Any]:
        """Append ``record`` (stamped with the time) to metrics.jsonl and TensorBoard, without printing it.
        Lists are per-rank values: TensorBoard gets one scalar per rank (``ranks/work_s/rank_3``)."""
        record = {"time": round(time.time(), 3), **record}
        if not self.enabled:
            return record
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        if self.tracker is not None and record.get("kind") == "start":
            self.tracker.log_params({key: record[key] for key in START_PARAMS if key in record})
        elif self.tracker is not None and "step" in record:
            self.tracker.log_metrics(record_metrics(record), record["step"])
        return record

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = self.record(record)
        if self.bar is not None and record.get("kind") == "train":
            self.bar.update(record)
        else:
            print(format_record(record, self.total_steps, self.start, self.start_step), flush=True)

    def print(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.console.print(text, highlight=False)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tracker is not None:
            self.tracker.close()


def format_record(record: dict[str, Any], total_steps: int, start: float, start_step: int = 0) -> str:
    step = record["step"]
    if record.get("kind") == "eval":
        return f"eval  step {step:>6} | val loss {record['loss']:.4f} | val ppl {math.exp(min(record['loss'], 50)):.2f}"
    parts = [f"step {step:>6}/{total_steps}", f"loss {record['loss']:.4f}", f"lr {record['lr']:.2e}",
             f"{record['tokens_per_s']:,.0f} tok/s ({record['tokens_per_s_per_device']:,.0f}/dev)"]
    if record.get("mfu") is not None:
        parts.append(f"MFU {100 * record['mfu']:.1f}%")
    if record.get("grad_norm") is not None:
        parts.append(f"gnorm {record['grad_norm']:.3f}")
    elapsed, done_here = time.perf_counter() - start, step - start_step  # a resumed run's earlier steps took no time
    if done_here > 0:
        parts.append(f"ETA {_duration(elapsed / done_here * (total_steps - step))}")
    return " | ".join(parts)


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


class _RichBar:
    def __init__(self, total: int, start_step: int = 0):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.progress = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                                 TextColumn("{task.fields[info]}"))
        self.console = self.progress.console
        self.task = self.progress.add_task("train", total=total, completed=start_step, info="")  # speed from here on
        self.progress.start()

    def update(self, record: dict[str, Any]) -> None:
        info = f"loss {record['loss']:.4f} | {record['tokens_per_s']:,.0f} tok/s"
        if record.get("mfu") is not None:
            info += f" | MFU {100 * record['mfu']:.1f}%"
        self.progress.update(self.task, completed=record["step"], info=info)

    def stop(self) -> None:
        self.progress.stop()


def _tensorboard(run_dir: Path) -> Tracker:
    try:
        return TensorBoardTracker(run_dir)
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError("run.tensorboard=true needs the tensorboard package: pip install 'meshrun[tensorboard]'") \
            from exc
