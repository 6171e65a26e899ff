"""The report's figures, one SVG each (crisp at any screen density), every run on the same axes (matplotlib, Agg
backend: no display needed).

Each ``plot_*`` takes the runs and the output folder and returns the file it wrote, or None when no run has the
data (e.g. MFU on a CPU, whose peak FLOP/s is unknown). Legends sit beside the axes, never over the curves; restarts
are grey dash-dot lines and checkpoints grey triangles, so neither looks like a run's validation curve.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from meshrun.report.load import Run

EXT = "svg"
RESTART_STYLE = {"color": "0.45", "ls": "-.", "lw": 0.9}
"""Restarts and resumes: grey dash-dot vertical lines (validation curves are coloured squares on a dotted line)."""
VALIDATION_STYLE = {"ls": ":", "marker": "s", "ms": 4}


def _plt():
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError("meshrun report draws with matplotlib: pip install 'meshrun[report]' "
                          "(or pip install matplotlib)") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams["svg.hashsalt"] = "meshrun"  # the same figure writes the same file
    return plt


def _series(run: Run, kind: str, key: str, x: str = "step") -> tuple[list[float], list[float]]:
    rows = [r for r in run.kind(kind) if isinstance(r.get(key), (int, float)) and isinstance(r.get(x), (int, float))]
    return [r[x] for r in rows], [r[key] for r in rows]


def _colors(runs: list[Run]) -> dict[str, Any]:
    cycle = _plt().rcParams["axes.prop_cycle"].by_key()["color"]
    return {run.name: cycle[i % len(cycle)] for i, run in enumerate(runs)}


def _markers(ax, run: Run, color, *, x: str = "step") -> None:
    """Restarts and resumes as grey dash-dot vertical lines; checkpoints as grey triangles on the x axis (one legend
    entry each)."""
    for i, start in enumerate(run.kind("start")[1:]):
        ax.axvline(start.get(x, 0) if x == "step" else (start["time"] - run.t0) / 60, **RESTART_STYLE,
                   label="restart/resume" if i == 0 and not _labelled(ax, "restart/resume") else None)
    ckpts = run.kind("checkpoint")
    xs = [c["step"] if x == "step" else (c["time"] - run.t0) / 60 for c in ckpts]
    if xs:
        ax.plot(xs, [0] * len(xs), "v", color="0.45", ms=5, transform=ax.get_xaxis_transform(), clip_on=False,
                label=None if _labelled(ax, "checkpoint") else "checkpoint")


def _labelled(ax, label: str) -> bool:
    return label in ax.get_legend_handles_labels()[1]


def legend_outside(ax) -> None:
    """The legend to the right of the axes, where it cannot cover a curve."""
    if ax.get_legend_handles_labels()[1]:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, frameon=False)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")
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
    fig, (by_step, by_tokens) = plt.subplots(1, 2, figsize=(11, 3.6))
    for run in runs:
        c = colors[run.name]
        by_step.plot(*_series(run, "train", "loss"), color=c, label=f"{run.name} train")
        by_step.plot(*_series(run, "eval", "loss"), color=c, **VALIDATION_STYLE, label=f"{run.name} validation")
        _markers(by_step, run, c)
        by_tokens.plot(*_series(run, "train", "loss", x="tokens_seen"), color=c)
        by_tokens.plot(*_eval_by_tokens(run), color=c, **VALIDATION_STYLE)
    by_step.set(xlabel="step", ylabel="loss", title="loss")
    by_tokens.set(xlabel="tokens seen", ylabel="loss", title="loss against tokens")
    fig.legend(*by_step.get_legend_handles_labels(), fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 0.95),
               frameon=False)
    return _save(fig, out / f"loss.{EXT}")


def _one_axes(runs: list[Run], out: Path, file: str, points, *, xlabel: str, ylabel: str, title: str,
              style: str = "-", markers: bool = False, adjust=None) -> Path:
    """One figure, one line per run: ``points(run)`` gives (xs, ys); ``adjust(ax)`` last touches (axis limits)."""
    plt, colors = _plt(), _colors(runs)
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    for run in runs:
        ax.plot(*points(run), style, ms=3, color=colors[run.name], label=run.name)
        if markers:
            _markers(ax, run, colors[run.name], x="time")
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    if adjust is not None:
        adjust(ax)
    legend_outside(ax)
    return _save(fig, out / file)


def plot_lr(runs: list[Run], out: Path) -> Path | None:
    if not any(run.kind("train") for run in runs):
        return None
    return _one_axes(runs, out, f"lr.{EXT}", lambda run: _series(run, "train", "lr"), xlabel="step",
                     ylabel="learning rate", title="learning rate")


def plot_grad_norm(runs: list[Run], out: Path) -> Path | None:
    """The gradient norm before clipping at each log step; log scale once it spans more than 20x (spikes)."""
    values = [v for run in runs for v in _series(run, "train", "grad_norm")[1] if v > 0]
    if not values:
        return None
    log_scale = max(values) / min(values) > 20
    return _one_axes(runs, out, f"grad_norm.{EXT}", lambda run: _series(run, "train", "grad_norm"), xlabel="step",
                     ylabel="gradient norm (before clipping)", title="gradient norm",
                     adjust=lambda ax: ax.set_yscale("log") if log_scale else zero_based(ax, values))


def has_mfu(runs: list[Run]) -> bool:
    """MFU exists only where the device's peak FLOP/s is known (GPUs): CPU runs show no MFU anywhere."""
    return any(_series(run, "train", "mfu")[0] for run in runs)


def plot_throughput(runs: list[Run], out: Path) -> Path | None:
    """Tokens/s over all ranks, and MFU where the device's peak is known (GPUs)."""
    if not any(run.kind("train") for run in runs):
        return None
    plt, colors, mfu_known = _plt(), _colors(runs), has_mfu(runs)
    fig, axes = plt.subplots(1, 2 if mfu_known else 1, figsize=(11 if mfu_known else 5.5, 3.2), squeeze=False)
    for run in runs:
        axes[0][0].plot(*_series(run, "train", "tokens_per_s"), color=colors[run.name], label=run.name)
        _markers(axes[0][0], run, colors[run.name])
        if mfu_known:
            steps, mfu = _series(run, "train", "mfu")
            axes[0][1].plot(steps, [100 * v for v in mfu], color=colors[run.name], label=run.name)
    axes[0][0].set(xlabel="step", ylabel="tokens/s (all ranks)", title="throughput")
    axes[0][0].set_ylim(bottom=0)
    legend_outside(axes[0][-1])
    if mfu_known:
        axes[0][1].set(xlabel="step", ylabel="MFU %", title="model FLOPs utilisation")
    return _save(fig, out / f"throughput.{EXT}")


def _peak_memory(run: Run) -> tuple[list[float], list[float]]:
    rows = [r for r in run.kind("ranks") if r.get("peak_mem_gib")]
    return [r["step"] for r in rows], [max(r["peak_mem_gib"]) for r in rows]


def _progress(run: Run) -> tuple[list[float], list[float]]:
    rows = run.kind("train")
    return [(r["time"] - run.t0) / 60 for r in rows], [r["step"] for r in rows]


def zero_based(ax, values: list[float]) -> None:
    """The y axis from 0 to a little above the highest value, without an offset: a 0.2 MiB change on a 2 GiB
    peak stays a flat line instead of filling the plot as a cliff."""
    top = max(values, default=0.0)
    ax.set_ylim(0, top * 1.15 if top > 0 else 1)
    ax.ticklabel_format(axis="y", useOffset=False, style="plain")


def plot_memory(runs: list[Run], out: Path) -> Path | None:
    """Peak memory of the busiest rank (CUDA allocator peak on GPUs, peak resident set size on CPUs), in MiB
    when every run stays under 1 GiB."""
    if not any(run.kind("ranks") for run in runs):
        return None
    highest = [v for run in runs for v in _peak_memory(run)[1]]
    scale, unit = (1024, "MiB") if max(highest, default=0) < 1 else (1, "GiB")
    points = lambda run: (_peak_memory(run)[0], [scale * v for v in _peak_memory(run)[1]])  # noqa: E731
    return _one_axes(runs, out, f"memory.{EXT}", points, xlabel="step",
                     ylabel=f"{unit} (highest rank; host RSS on CPU)", title="peak memory",
                     adjust=lambda ax: zero_based(ax, [scale * v for v in highest]))


def plot_timeline(runs: list[Run], out: Path) -> Path | None:
    """Step against wall-clock minutes: gaps are downtime, grey dash-dot lines restarts, triangles checkpoints."""
    if not any(run.kind("train") for run in runs):
        return None
    return _one_axes(runs, out, f"timeline.{EXT}", _progress, xlabel="minutes since the first start", ylabel="step",
                     title="progress over time", style=".-", markers=True)


def rank_matrix(run: Run, key: str = "work_s") -> tuple[list[int], list[list[float]]]:
    """(steps, matrix[rank][interval]) of one per-rank timing field, in milliseconds per step."""
    rows = [r for r in run.kind("ranks") if isinstance(r.get(key), list)]
    if not rows:
        return [], []
    world = max(len(r[key]) for r in rows)
    matrix = [[1000 * r[key][rank] if rank < len(r[key]) else float("nan") for r in rows] for rank in range(world)]
    return [r["step"] for r in rows], matrix


def forward_times(run: Run) -> tuple[list[int], list[float], list[float]]:
    """(steps, GPU ms, host ms) per step of the forward passes in each logged interval of a GPU run, the slowest
    rank's each: the forward on the GPU's clock (work minus data wait) and the host's time inside it. Empty
    for a CPU run, whose forward is timed on the host's clock (the two would be the same line), and for a run
    that did not record the host's time."""
    starts = run.kind("start")
    if not starts or "cuda" not in str(starts[-1].get("device", "")):
        return [], [], []
    rows = [r for r in run.kind("ranks")
            if isinstance(r.get("forward_host_s"), list) and isinstance(r.get("work_s"), list)
            and isinstance(r.get("data_s"), list)]
    gpu = [1000 * max(w - d for w, d in zip(r["work_s"], r["data_s"])) for r in rows]
    return [r["step"] for r in rows], gpu, [1000 * max(r["forward_host_s"]) for r in rows]


def plot_forward(run: Run, out: Path, file_name: str) -> Path | None:
    """The forward passes per step on the GPU and the host's time issuing them: where the host's line reaches the
    GPU's, the GPU waited on the host (larger FSDP2 units, CUDA graphs or a faster host shorten it)."""
    steps, gpu, host = forward_times(run)
    if len(steps) < 2:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    ax.plot(steps, gpu, ".-", ms=3, label="on the GPU")
    ax.plot(steps, host, ".-", ms=3, label="the host's time issuing it")
    ax.set(xlabel="step", ylabel="ms per step (slowest rank)", title=f"{run.name}: forward passes")
    zero_based(ax, gpu + host)
    legend_outside(ax)
    return _save(fig, out / file_name)


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
