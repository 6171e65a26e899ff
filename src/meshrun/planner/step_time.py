"""``meshrun plan --tokens``: wall-clock time for a token budget, with the arithmetic shown.

Training FLOPs = 6 x N x D (N parameters, D tokens: 2 N per token forward, 4 N backward; Kaplan et al. 2020, and the
convention of PaLM's MFU). From a throughput (measured by a run, or given) the time is D / tokens-per-second and
the MFU it implies is 6 N x tokens/s / peak; from an assumed MFU the time is 6 N D / (MFU x peak).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from meshrun.config import ConfigError

DEFAULT_PEAK_TFLOPS = 989.0
"""One H100 SXM's dense bf16 peak (NVIDIA datasheet, no sparsity); the table in meshrun.train.metrics has others."""

_SUFFIX = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12, "P": 1e15}


def parse_count(text: str, option: str) -> float:
    """'1T', '100B', '2.5e11', '300M' -> a number; ConfigError naming ``option`` otherwise."""
    value = text.strip().upper()
    scale = _SUFFIX.get(value[-1:], 1.0)
    try:
        number = float(value[:-1] if value[-1:] in _SUFFIX else value) * scale
    except ValueError:
        raise ConfigError(f"{option} {text!r}: give a number, optionally with K, M, B or T (e.g. 1T, 100B)") from None
    if number <= 0:
        raise ConfigError(f"{option} {text!r}: must be above 0")
    return number


def measured_tokens_per_s(run_dir: str) -> float:
    """A finished or stopped run's steady throughput (over all its ranks) from its summary.json."""
    if not Path(run_dir).is_dir():
        raise ConfigError(f"--from-run {run_dir}: no such folder; give a run folder (`meshrun runs` lists them), "
                          "or --tokens-per-s")
    path = Path(run_dir) / "summary.json"
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        raise ConfigError(f"--from-run {run_dir}: cannot read {path}; give a run that has ended, or --tokens-per-s")
    value = summary.get("tokens_per_s") if isinstance(summary, dict) else None
    if not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"--from-run {run_dir}: {path} has no tokens_per_s above 0; give --tokens-per-s")
    return float(value)


def time_estimate(*, params: float, tokens: float, gpus: int, peak_flops: float, mfu: float,
                  tokens_per_s: float | None) -> dict[str, Any]:
    """Seconds for ``tokens`` at an assumed ``mfu``, and (given a throughput) at that throughput with its MFU."""
    if not 0 < mfu <= 1:
        raise ConfigError(f"--mfu {mfu}: give a fraction of the peak in (0, 1], e.g. 0.4")
    total_flops = 6.0 * params * tokens
    job_peak = gpus * peak_flops
    est: dict[str, Any] = {"params": params, "tokens": tokens, "flops": total_flops, "gpus": gpus,
                           "peak_flops_per_gpu": peak_flops, "peak_flops": job_peak, "mfu": mfu,
                           "seconds_at_mfu": total_flops / (mfu * job_peak)}
    if tokens_per_s:
        est.update(tokens_per_s=tokens_per_s, seconds_at_throughput=tokens / tokens_per_s,
                   implied_mfu=6.0 * params * tokens_per_s / job_peak)
    return est


def human_time(seconds: float) -> str:
    """' = 3.5 min' (hours, days) after a figure in seconds; nothing under two minutes, which seconds say best."""
    if seconds >= 2 * 86400:
        return f" = {seconds / 86400:,.1f} days"
    if seconds >= 2 * 3600:
        return f" = {seconds / 3600:,.1f} hours"
    if seconds >= 120:
        return f" = {seconds / 60:,.1f} min"
    return ""


def estimate_lines(est: dict[str, Any], *, params_from: str) -> list[str]:
    """The estimate and its arithmetic, one step per line."""
    n, d, f = est["params"], est["tokens"], est["flops"]
    lines = [f"time for {d:.3g} tokens (6 x N x tokens FLOPs, N = {n:.3g} parameters, {params_from}):",
             f"  training FLOPs = 6 x {n:.3g} x {d:.3g} = {f:.3g}",
             f"  peak = {est['gpus']} GPUs x {est['peak_flops_per_gpu'] / 1e12:.0f} TFLOP/s = {est['peak_flops']:.3g}"
             " FLOP/s (bf16 dense)",
             f"  at {100 * est['mfu']:.0f}% MFU (assumed, --mfu): {f:.3g} / ({est['mfu']:.2f} x {est['peak_flops']:.3g})"
             f" = {est['seconds_at_mfu']:.3g} s{human_time(est['seconds_at_mfu'])}"]
    if "tokens_per_s" in est:
        t = est["tokens_per_s"]
        lines += [f"  at {t:,.0f} tokens/s: {d:.3g} / {t:,.0f} = {est['seconds_at_throughput']:.3g} s"
                  f"{human_time(est['seconds_at_throughput'])}",
                  f"    which is {100 * est['implied_mfu']:.1f}% MFU (6 x {n:.3g} x {t:,.0f} / {est['peak_flops']:.3g})"]
        if est["implied_mfu"] > 1:
            lines.append("    warning: above 100% MFU, so this throughput is impossible for N parameters on "
                         f"{est['gpus']} GPUs; check --tokens-per-s, --params and the GPU count")
    return lines
