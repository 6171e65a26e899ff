"""The report's figures, one PNG each, every run on the same axes (matplotlib, Agg backend: no display needed).

Each ``plot_*`` takes the runs and the output folder and returns the file it wrote, or None when no run has the
data (e.g. MFU on a CPU, whose peak FLOP/s is unknown).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from meshrun.report.load import Run

DPI = 80


def _plt():
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError("meshrun report draws with matplotlib: pip install 'meshrun[report]' "
                          "(or pip install matplotlib)") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _series(run: Run, kind: str, key: str, x: str = "step") -> tuple[list[float], list[float]]:
    rows = [r for r in run.kind(kind) if isinstance(r.get(key), (int, float)) and isinstance(r.get(x), (int, float))]
    return [r[x] for r in rows], [r[key] for r in rows]


def _colors(runs: list[Run]) -> dict[str, Any]:
    cycle = _plt().rcParams["axes.prop_cycle"].by_key()["color"]
    return {run.name: cycle[i % len(cycle)] for i, run in enumerate(runs)}


def _markers(ax, run: Run, color, *, x: str = "step") -> None:
    """Restarts and resumes as dashed vertical lines; checkpoints as small triangles on the x axis."""
    for start in run.kind("start")[1:]:
        ax.axvline(start.get(x, 0) if x == "step" else (start["time"] - run.t0) / 60, color=color, ls="--", lw=0.8)
    ckpts = run.kind("checkpoint")
    xs = [c["step"] if x == "step" else (c["time"] - run.t0) / 60 for c in ckpts]
    if xs:
        ax.plot(xs, [0] * len(xs), "v", color=color, ms=6, transform=ax.get_xaxis_transform(), clip_on=False)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    _plt().close(fig)
    return path


def _eval_by_tokens(run: Run) -> tuple[list[float], list[float]]:
    """Validation loss against tokens: an eval record's step times the tokens per step of the start before it
    (the global batch is kept across resumes, so this is exact)."""
    xs, ys, per_step = [], [], 0
    for r in run.records:
        if r.get("kind") == "start":
            per_step = r.get("tokens_per_step", 0)
        elif r.get("kind") == "eval" and per_step and isinstance(r.get("loss"), (int, float)):
            xs.append(r["step"] * per_step)
            ys.append(r["loss"])
    return xs, ys


def plot_loss(runs: list[Run], out: Path) -> Path | None:
    """Training (solid) and validation (dots) loss against step and against tokens."""
    if not any(run.kind("train") for run in runs):
        return None
    plt, colors = _plt(), _colors(runs)
    fig, (by_step, by_tokens) = plt.subplots(1, 2, figsize=(10, 3.6))
    for run in runs:
        c = colors[run.name]
        by_step.plot(*_series(run, "train", "loss"), color=c, label=f"{run.name} train")
        by_step.plot(*_series(run, "eval", "loss"), "o--", color=c, ms=4, label=f"{run.name} validation")
        _markers(by_step, run, c)
        by_tokens.plot(*_series(run, "train", "loss", x="tokens_seen"), color=c, label=run.name)
        by_tokens.plot(*_eval_by_tokens(run), "o--", color=c, ms=4)
    by_step.set(xlabel="step (dashed line: restart/resume, triangle: checkpoint)", ylabel="loss", title="loss")
    by_tokens.set(xlabel="tokens seen", ylabel="loss", title="loss against tokens")
    by_step.legend(fontsize=8)
    return _save(fig, out / "loss.png")


def _one_axes(runs: list[Run], out: Path, file: str, points, *, xlabel: str, ylabel: str, title: str,
              style: str = "-", markers: bool = False) -> Path:
    """One figure, one line per run: ``points(run)`` gives (xs, ys)."""
    plt, colors = _plt(), _colors(runs)
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for run in runs:
        ax.plot(*points(run), style, ms=3, color=colors[run.name], label=run.name)
        if markers:
            _markers(ax, run, colors[run.name], x="time")
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.legend(fontsize=8)
    return _save(fig, out / file)


def plot_lr(runs: list[Run], out: Path) -> Path | None:
    if not any(run.kind("train") for run in runs):
        return None
    return _one_axes(runs, out, "lr.png", lambda run: _series(run, "train", "lr"), xlabel="step",
                     ylabel="learning rate", title="learning rate")


def plot_throughput(runs: list[Run], out: Path) -> Path | None:
    """Tokens/s over all ranks, and MFU where the device's peak is known (GPUs)."""
    if not any(run.kind("train") for run in runs):
        return None
    plt, colors = _plt(), _colors(runs)
    has_mfu = any(_series(run, "train", "mfu")[0] for run in runs)
    fig, axes = plt.subplots(1, 2 if has_mfu else 1, figsize=(10 if has_mfu else 5, 3.2), squeeze=False)
    for run in runs:
        axes[0][0].plot(*_series(run, "train", "tokens_per_s"), color=colors[run.name], label=run.name)
        _markers(axes[0][0], run, colors[run.name])
        if has_mfu:
            steps, mfu = _series(run, "train", "mfu")
            axes[0][1].plot(steps, [100 * v for v in mfu], color=colors[run.name], label=run.name)
    axes[0][0].set(xlabel="step", ylabel="tokens/s (all ranks)", title="throughput")
    axes[0][0].legend(fontsize=8)
    if has_mfu:
        axes[0][1].set(xlabel="step", ylabel="MFU %", title="model FLOPs utilisation")
    return _save(fig, out / "throughput.png")


def _peak_memory(run: Run) -> tuple[list[float], list[float]]:
    rows = [r for r in run.kind("ranks") if r.get("peak_mem_gib")]
    return [r["step"] for r in rows], [max(r["peak_mem_gib"]) for r in rows]


def _progress(run: Run) -> tuple[list[float], list[float]]:
    rows = run.kind("train")
    return [(r["time"] - run.t0) / 60 for r in rows], [r["step"] for r in rows]


def plot_memory(runs: list[Run], out: Path) -> Path | None:
    """Peak memory of the busiest rank (CUDA allocator peak on GPUs, peak resident set size on CPUs)."""
    if not any(run.kind("ranks") for run in runs):
        return None
    return _one_axes(runs, out, "memory.png", _peak_memory, xlabel="step",
                     ylabel="GiB (highest rank; host RSS on CPU)", title="peak memory")


def plot_timeline(runs: list[Run], out: Path) -> Path | None:
    """Step against wall-clock minutes: gaps are downtime, dashed lines restarts, triangles checkpoints."""
    if not any(run.kind("train") for run in runs):
        return None
    return _one_axes(runs, out, "timeline.png", _progress, xlabel="minutes since the first start", ylabel="step",
                     title="progress over time", style=".-", markers=True)


def rank_matrix(run: Run, key: str = "work_s") -> tuple[list[int], list[list[float]]]:
    """(steps, matrix[rank][interval]) of one per-rank timing field, in milliseconds per step."""
    rows = [r for r in run.kind("ranks") if isinstance(r.get(key), list)]
    if not rows:
        return [], []
    world = max(len(r[key]) for r in rows)
    matrix = [[1000 * r[key][rank] if rank < len(r[key]) else float("nan") for r in rows] for rank in range(world)]
    return [r["step"] for r in rows], matrix


def plot_rank_heatmap(run: Run, out: Path, file_name: str) -> Path | None:
    """Rank x time heatmap of each rank's own working time per step: a straggler is a bright row."""
    steps, matrix = rank_matrix(run)
    if not steps:
        return None
    plt = _plt()
    world = len(matrix)
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.35 * min(world, 64)))
    image = ax.imshow(matrix, aspect="auto", interpolation="nearest", cmap="magma",
                      extent=(steps[0] - 0.5, steps[-1] + 0.5, world - 0.5, -0.5))
    fig.colorbar(image, ax=ax, label="ms per step")
    hosts = (run.kind("start")[-1].get("hosts") if run.kind("start") else None) or []
    if world <= 32:
        ax.set_yticks(range(world))
        ax.set_yticklabels([f"rank {r}" + (f" ({hosts[r]})" if r < len(hosts) else "") for r in range(world)],
                           fontsize=8)
    ax.set(xlabel="step", title=f"{run.name}: each rank's own working time per step (data wait + forward)")
    return _save(fig, out / file_name)
