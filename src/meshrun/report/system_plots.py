"""Per-node system plots of one run, from its ``system`` records: GPU busy time, CPU busy time, host memory and the
traffic of the interface NCCL/gloo use, one line per node (per GPU for GPU busy time)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from meshrun.report.load import Run
from meshrun.report.plots import EXT, _plt, _save, legend_outside, zero_based


def node_series(run: Run, value) -> dict[str, tuple[list[int], list[float]]]:
    """{label: (steps, values)} of ``value(record) -> {label: number}`` over the run's system records."""
    found: dict[str, tuple[list[int], list[float]]] = {}
    for record in run.kind("system"):
        for label, number in value(record).items():
            steps, values = found.setdefault(label, ([], []))
            steps.append(record["step"])
            values.append(number)
    return found


def _gpu_util(record: dict[str, Any]) -> dict[str, float]:
    return {f"node {record['node']} GPU {g['index']}": g["util_pct"] for g in record.get("gpus", [])
            if isinstance(g.get("util_pct"), (int, float))}


def _per_node(key: str):
    return lambda record: ({f"node {record['node']}": record[key]} if isinstance(record.get(key), (int, float))
                           else {})


def _comm_traffic(record: dict[str, Any]) -> dict[str, float]:
    rows = [(name, row) for name, row in record.get("net", {}).items() if row.get("comm")]
    return {f"node {record['node']} ({name})": row["sent_mb_s"] + row["recv_mb_s"] for name, row in rows}


def _all_traffic(record: dict[str, Any]) -> dict[str, float]:
    total = sum(row["sent_mb_s"] + row["recv_mb_s"] for row in record.get("net", {}).values())
    return {f"node {record['node']} (all interfaces)": total} if record.get("net") else {}


def plot_system(run: Run, out: Path, stem: str) -> Path | None:
    """One figure of up to four panels for ``run``; None when it has no system records."""
    if not run.kind("system"):
        return None
    traffic = node_series(run, _comm_traffic)
    panels = [("GPU busy %", node_series(run, _gpu_util)),
              ("CPU busy % (host)", node_series(run, _per_node("cpu_util_pct"))),
              ("host memory used, GiB", node_series(run, _per_node("host_mem_used_gib"))),
              ("NCCL/gloo interface, MB/s sent + received" if traffic else "network, MB/s sent + received",
               traffic or node_series(run, _all_traffic))]
    panels = [panel for panel in panels if panel[1]]  # no GPU: no GPU panel (absent, not zero)
    plt = _plt()
    rows = (len(panels) + 1) // 2
    fig, axes = plt.subplots(rows, 2, figsize=(11, 3.0 * rows), squeeze=False)
    for ax, (title, series) in zip(axes.flat, panels):
        for label, (steps, values) in sorted(series.items()):
            ax.plot(steps, values, ".-", ms=3, label=label)
        ax.set(xlabel="step", title=title)
        zero_based(ax, [v for _, values in series.values() for v in values])
        legend_outside(ax)
    for ax in list(axes.flat)[len(panels):]:
        ax.remove()
    fig.suptitle(f"{run.name}: system metrics per node", fontsize=10)
    return _save(fig, out / f"{stem}.{EXT}")
