"""Timing a repeated operation the same way everywhere in diagnostics: CUDA events on a GPU (device time), the wall
clock on the CPU."""

from __future__ import annotations

import time
from typing import Callable

import torch


def timed(run: Callable[[], object], iters: int, device: torch.device) -> float:
    """Seconds for ``iters`` calls of ``run`` (call it a few times first: set-up is not what this measures)."""
    if device.type == "cuda":
        with torch.cuda.device(device):  # events record on the current device's stream: make it ``device``'s
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                run()
            end.record()
            end.synchronize()  # note: CPU-GPU sync point
            return start.elapsed_time(end) / 1e3
    begin = time.perf_counter()
    for _ in range(iters):
        run()
    return time.perf_counter() - begin
